"""`turns: all` through the prompts and generate stages: every assistant turn regenerated on-policy against the
SGLang fake (which returns ids), resumed at the first turn the store lacks, tool calls matched to the source's
results or ending the conversation, and each next turn sent to the server that answered the previous one."""

from __future__ import annotations

import gzip
import hashlib
import json
import sqlite3
from collections import Counter

import pytest
from conftest import ROOT, target_for
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.fake_server import FakeServer, GreedyModel
from draftdata.cli.plan import main as plan
from draftdata.config.load import load_config
from draftdata.generate.backends.http import ServerPool
from draftdata.util.files import read_jsonl

MAX_TOKENS = 256  # GreedyModel ends an answer after 12 tokens on average: none is cut
# sha256 of prompts.jsonl written by the prompts stage before `turns` existed (max_prompts 20, no token limit):
# `turns: last` must write the very same bytes
LAST_PROMPTS = {
    "B1_glaive": "2220a2339f7a1b620dd15186ea4dbf4f1e40b475077a09e83847a8d8d23d0170",
    "B6_ultrachat": "66edff20f88bc20d5f66be7e8b0de6f1325df947f0545cf8c69baff9e3a7dc1e",
    "B8_sweagent": "930962bb32f1c378713cfa300060ead4460b5216fb0450b9cc7b56072538f36b",
}
SHAPES = {"B1_glaive": "glaive", "B6_ultrachat": "messages", "B8_sweagent": "swe_agent"}

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chat(*turns: str) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(turns)]


def weather_row(city: str) -> dict:
    """A call, its result, an answer, a thanks and its answer: three assistant turns, the first a tool call."""
    source_call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    source_call["function"]["arguments"] = json.dumps({"city": city, "unit": "celsius"})
    messages = [
        {"role": "user", "content": f"What's the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [source_call]},
        {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call_1"},
        {"role": "assistant", "content": f"It is 18 degrees in {city}."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    return {"messages": messages, "tools": WEATHER}


class ScriptedModel(GreedyModel):
    """GreedyModel, except that a first turn asking for the weather answers with a call: Paris's as the source
    made it (its arguments in another key order), any other city's for Lyon (a call the source did not make); and
    "Say nothing." gets whitespace."""

    def answer(self, context: list[int], max_new: int) -> tuple[list[int], str]:
        text = self.tok.decode(context)
        if text.count("<|im_start|>assistant") == 1 and "weather in" in text:
            city = "Paris" if "weather in Paris" in text else "Lyon"
            call = json.dumps({"name": "get_weather", "arguments": {"unit": "celsius", "city": city}})
            return self.encode(f"<tool_call>\n{call}\n</tool_call>") + [self.eos], "stop"
        if text.endswith("Say nothing.<|im_end|>\n<|im_start|>assistant\n"):
            return self.encode("\n\n") + [self.eos], "stop"  # an answer with nothing in it
        return super().answer(context, max_new)


def write_source(path, rows: list[dict]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.fixture
def conv_project(project, tiny_model, tmp_path):
    """B3 reading a `messages` source of multi-turn conversations, every turn regenerated, on SGLang fakes."""
    servers: list[FakeServer] = []
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def start(rows: list[dict], n_servers: int = 1, **ds) -> list[FakeServer]:
        path = tmp_path / "convs.jsonl.gz"
        write_source(path, rows)
        b3 = project.params["datasets"]["B3"]
        b3.update(source={"shape": "messages", "path": str(path)}, max_tokens=MAX_TOKENS, turns="all")
        b3.update(**{"max_prompt_tokens": None, "token_budget": 100_000, **ds})
        new = [FakeServer(model=ScriptedModel(tok), model_path=str(tiny_model)).start() for _ in range(n_servers)]
        servers.extend(new)
        project.params["backend"] = {"kind": "sglang", "urls": [s.url for s in new], "request_timeout_s": 30.0}
        project.save()
        project.run("prompts", "B3")
        return new

    yield project, start
    for srv in servers:
        srv.stop()


def three_turn_rows() -> list[dict]:
    return [
        {"messages": chat(f"Tell me about topic {i}.", "Sure.", "More, please.", "Here.", "And the rest?", "Done.")}
        for i in range(4)
    ]


def responses(project) -> list[dict]:
    return list(read_jsonl(project.data("B3") / "responses.jsonl"))


def metrics(project) -> dict:
    return json.loads((project.data("B3") / "generate_metrics.json").read_text())


def sent_ids(srv: FakeServer) -> dict[str, list[int]]:
    """Store key -> the input_ids of its (one) /generate call."""
    calls = {c["rid"].rsplit("-", 1)[0]: c["input_ids"] for c in srv.generate_calls}
    assert len(calls) == len(srv.generate_calls)  # no key asked twice
    return calls


# ---------------------------------------------------------------------------------------------------------------
# prompts


@pytest.mark.parametrize("name", sorted(LAST_PROMPTS))
def test_turns_last_writes_the_prompts_it_always_wrote(project, name):
    from conftest import DEMO

    project.params["datasets"]["B3"].update(
        source={"shape": SHAPES[name], "path": str(DEMO / f"{name}.jsonl.gz")}, max_prompts=20, max_prompt_tokens=None
    )
    project.save()
    project.run("prompts", "B3")
    # each record's `where` names the source file by its path on this machine: hashed as DEMO, wherever the checkout
    written = (project.data("B3") / "prompts.jsonl").read_bytes().replace(str(DEMO).encode(), b"DEMO")
    assert hashlib.sha256(written).hexdigest() == LAST_PROMPTS[name]


def test_turns_all_keeps_conversations_that_share_their_first_prompt_apart(project, tmp_path):
    rows = [{"messages": chat("Hi.", "Hello!", "Tell me a joke.", "No.")}]
    rows.append({"messages": chat("Hi.", "Hello!", "Tell me a poem.", "No.")})
    write_source(tmp_path / "two.jsonl.gz", rows)
    b3 = project.params["datasets"]["B3"]
    b3.update(source={"shape": "messages", "path": str(tmp_path / "two.jsonl.gz")}, max_prompt_tokens=None)
    for turns, kept in (("last", 2), ("all", 2)):
        b3["turns"] = turns
        project.save()
        project.run("prompts", "B3")
        out = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
        assert len(out) == kept and len({r["id"] for r in out}) == kept
    assert sorted(len(r["conversation"]) for r in out) == [4, 4]
    assert [r["slots"] for r in out] == [[1, 3], [1, 3]]


# ---------------------------------------------------------------------------------------------------------------
# generate


def test_every_turn_is_regenerated_on_the_target_own_ids(conv_project):
    project, start = conv_project
    (srv,) = start(three_turn_rows())
    project.run("generate", "B3")
    lines = responses(project)
    sent = sent_ids(srv)
    assert len(sent) == len(lines) == 12  # 4 conversations x 3 turns, each asked once
    by_conv: dict[str, list[dict]] = {}
    for line in lines:
        by_conv.setdefault(line["conversation"], []).append(line)
    for turns in by_conv.values():
        assert [t["turn"] for t in turns] == [0, 1, 2]
        for prev, cur in zip(turns, turns[1:]):
            # turn t's request holds turn t-1's request and the ids the target answered, exactly
            head = sent[prev["key"]] + prev["output_ids"]
            assert sent[cur["key"]][: len(head)] == head
            assert cur["messages"][-2] == {"role": "assistant", "content": prev["text"]}
        assert [t.get("end_reason") for t in turns] == [None, None, "source_exhausted"]
    m = metrics(project)
    assert m["turns_regenerated"] == 12 and m["conversations"] == 4
    assert m["conversations_ended"] == {"source_exhausted": 4} and m["turns_kept_share"] == 1.0


def test_a_turn_another_conversation_answered_in_the_run_is_not_sent_again(conv_project):
    """Two conversations that share their first turn, one after the other: the second steps over the first's
    stored answer, as a rerun's plan does, so each prompt is sent once and a rerun writes the same output."""
    rows = [
        {"messages": chat("Hi.", "Hello!", "Tell me a joke.", "No.")},
        {"messages": chat("Topic 1?", "A.", "More?", "B.")},
        {"messages": chat("Hi.", "Hello!", "Tell me a poem.", "No.")},
    ]
    project, start = conv_project
    (srv,) = start(rows, concurrency=1)
    project.run("generate", "B3")
    keys = [c["rid"].rsplit("-", 1)[0] for c in srv.generate_calls]
    assert len(keys) == 5 == len(set(keys))  # six turns, the shared one sent once
    first = (project.data("B3") / "responses.jsonl").read_bytes()
    project.run("generate", "B3")
    assert (project.data("B3") / "responses.jsonl").read_bytes() == first


@pytest.mark.parametrize("budget", [40, 60, 80, 100])
def test_a_turn_stepped_over_in_the_run_counts_toward_the_budget(conv_project, budget):
    """Conversations that share their first turn each hold its answer in the output, so each counts it. One at a
    time, the run goes turn 0 (sent), turn 1, then each next conversation's turn 0 (stepped over) and turn 1 (sent):
    it must stop sending once what the output holds reaches the budget (a turn stepped over went uncounted, and the
    run asked for answers past it)."""
    rows = [{"messages": chat("Hi.", "Hello!", f"Tell me about topic {i}.", "No.")} for i in range(6)]
    project, start = conv_project
    (srv,) = start(rows, concurrency=1, token_budget=budget)
    project.run("generate", "B3")
    m = metrics(project)
    sent = [c["rid"].rsplit("-", 1)[0] for c in srv.generate_calls]
    with sqlite3.connect(project.path / "store.sqlite") as db:
        length = dict(db.execute("SELECT key, completion_tokens FROM responses"))
    in_output = {line["key"] for line in responses(project)}  # the shared turn's answer is generated once
    assert m["budget_met"] and m["new_in_output_tokens"] == sum(length[k] for k in in_output)
    assert m["wasted_tokens"] == sum(length[k] for k in set(sent) - in_output)
    first, seconds = length[sent[0]], [length[k] for k in sent[1:]]
    held, needed = first, 1
    for i, n in enumerate(seconds):
        held += first if i else 0  # conversation i's turn 0, stepped over
        if held >= budget:
            break
        held, needed = held + n, needed + 1
    assert len(sent) == needed


def test_a_rerun_sends_only_the_turns_the_store_lacks(conv_project, tiny_model):
    project, start = conv_project
    start(three_turn_rows())
    project.run("generate", "B3")
    first = responses(project)
    # as if the run had been killed after each conversation's first turn (and one's second) was committed
    lost = {line["key"] for line in first if line["turn"] >= 1}
    lost -= {first[1]["key"]}
    with sqlite3.connect(project.path / "store.sqlite") as db:
        db.executemany("DELETE FROM responses WHERE key = ?", [(k,) for k in lost])
    (srv,) = start(three_turn_rows())
    project.run("generate", "B3")
    assert set(sent_ids(srv)) == lost  # exactly the missing turns, each once
    assert responses(project) == first
    with sqlite3.connect(project.path / "store.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 12


@pytest.mark.parametrize("divergence", ["stop", "keep_source"])
def test_a_matching_call_gets_the_source_result_and_a_diverging_one_ends(conv_project, divergence):
    project, start = conv_project
    (srv,) = start([weather_row("Paris"), weather_row("Rome")], on_tool_divergence=divergence)
    project.run("generate", "B3")
    by_conv: dict[str, list[dict]] = {}
    for line in responses(project):
        by_conv.setdefault(line["messages"][0]["content"], []).append(line)
    paris, rome = by_conv["What's the weather in Paris?"], by_conv["What's the weather in Rome?"]
    assert len(paris) == 3 and paris[-1]["end_reason"] == "source_exhausted"
    # the source's result follows the call, pointed at it
    assert paris[1]["messages"][-1]["role"] == "tool" and paris[1]["messages"][-1]["content"] == '{"temp": 18}'
    assert "<tool_response>" in AutoTokenizer.from_pretrained(project.params["model"]["path"]).decode(
        sent_ids(srv)[paris[1]["key"]]
    )
    if divergence == "stop":
        assert len(rome) == 1 and rome[0]["end_reason"] == "tool_call_diverged"
        assert metrics(project)["conversations_ended"] == {"source_exhausted": 1, "tool_call_diverged": 1}
        assert metrics(project)["turns_kept_share"] == round(4 / 6, 3)  # Rome's first turn of its three
    else:  # the source's result for Rome follows the call for Lyon
        assert len(rome) == 3 and rome[1]["messages"][-1]["content"] == '{"temp": 18}'
        assert metrics(project)["conversations_ended"] == {"source_exhausted": 2}
        assert metrics(project)["turns_kept_share"] == 1.0


def test_next_turns_go_to_the_server_that_answered_the_previous_one(conv_project):
    project, start = conv_project
    servers = start(three_turn_rows(), n_servers=2, concurrency=1)
    project.run("generate", "B3")
    served = {}
    for i, srv in enumerate(servers):
        served.update((key, i) for key in sent_ids(srv))
    by_conv: dict[str, set] = {}
    for line in responses(project):
        by_conv.setdefault(line["conversation"], set()).add(served[line["key"]])
    assert all(len(s) == 1 for s in by_conv.values())
    assert {next(iter(s)) for s in by_conv.values()} == {0, 1}  # conversations spread over both
    assert metrics(project)["same_server_share"] == 1.0


@pytest.mark.parametrize("kind", ["sglang", "openai"])
@pytest.mark.parametrize("turns", ["all", "last"])
def test_every_request_names_its_conversation_in_the_session_header(conv_project, kind, turns):
    """backend.session_header, for one URL behind a router that routes by a header: every turn of a conversation
    carries the conversation's id (the prompt record's, a hash of its content: the same on every rerun), so the
    router sends them all to the server whose prefix cache holds it. A single-turn request carries its prompt's id:
    its retries and a parked answer's continuation then go to the server that holds its prefix."""
    project, start = conv_project
    (srv,) = start(three_turn_rows(), turns=turns)
    project.params["backend"].update(kind=kind, session_header="X-Session-Id", prompt_format="ids")
    if kind == "openai":
        project.params["backend"]["return_token_ids"] = True
    project.save()
    project.run("generate", "B3")
    lines = responses(project)
    owner = {tuple(line["prompt_ids"]): line.get("conversation", line["id"]) for line in lines}
    sent = [(tuple(a.body.get("input_ids") or a.body["prompt"]), a.headers.get("X-Session-Id")) for a in srv.log]
    assert len(sent) == len(lines) == 4 * (3 if turns == "all" else 1)
    assert sorted(sent) == sorted(owner.items())
    records = [rec["id"] for rec in read_jsonl(project.data("B3") / "prompts.jsonl")]
    assert sorted(set(owner.values())) == sorted(records)


def test_no_session_header_unless_one_is_named(conv_project):
    project, start = conv_project
    (srv,) = start(three_turn_rows())
    project.run("generate", "B3")
    assert len(srv.log) == 12 and not any("session" in h.lower() for a in srv.log for h in a.headers)


def test_a_dead_or_busy_preferred_server_is_passed_over():
    async def healthy(url):
        return None

    pool = ServerPool(["http://a", "http://b"], healthy, 1.0)
    a, b = pool.servers
    assert pool.pick("http://b").url == "http://b"
    b.outstanding = 2
    assert pool.pick("http://b", slack=2).url == "http://b"
    assert pool.pick("http://b", slack=1).url == "http://a"  # busier than the least busy by more than the slack
    b.outstanding, b.alive = 0, False
    assert pool.pick("http://b").url == "http://a"


def test_turns_all_on_real_backends(backend_project, tmp_path):
    """The tiny target in-process (ids), and behind `transformers serve` (chat messages in, text out): each turn
    holds the target's own earlier answers, and a rerun finds every turn stored."""
    project = backend_project
    write_source(tmp_path / "convs.jsonl.gz", three_turn_rows())
    b3 = project.params["datasets"]["B3"]
    b3.update(source={"shape": "messages", "path": str(tmp_path / "convs.jsonl.gz")}, max_prompt_tokens=None)
    b3.update(turns="all", token_budget=100_000, max_tokens=128)
    project.save()
    project.run("prompts", "B3")
    project.run("generate", "B3")
    lines = responses(project)
    by_conv: dict[str, list[dict]] = {}
    for line in lines:
        by_conv.setdefault(line["conversation"], []).append(line)
    # the tiny model answers with nothing but whitespace now and then: its conversation ends before that turn
    assert 0 < len(by_conv) <= 4 and any(len(turns) > 1 for turns in by_conv.values())
    for turns in by_conv.values():
        assert [t["turn"] for t in turns] == list(range(len(turns)))
        for prev, cur in zip(turns, turns[1:]):
            if prev["output_ids"] is None:  # text back: the answer is the history's assistant turn
                assert cur["messages"][-2] == {"role": "assistant", "content": prev["text"]}
            else:  # ids back: the next prompt goes on from them, exactly
                head = prev["prompt_ids"] + prev["output_ids"]
                assert cur["prompt_ids"][: len(head)] == head
        assert turns[-1]["end_reason"] in ("source_exhausted", "truncated", "empty")
    project.run("generate", "B3")
    assert responses(project) == lines and metrics(project)["newly_generated"] == 0


def test_a_budget_met_mid_conversation_keeps_its_turns_and_a_raised_one_goes_on(conv_project):
    project, start = conv_project
    rows = three_turn_rows() + [{"messages": chat(f"Topic {i}?", "A.", "More?", "B.")} for i in range(4)]
    # landing: finished stops as soon as the answers reach the budget, whatever is in flight (exact waits for the
    # turns before its end, and may find nothing in flight to park then)
    (slow,) = start(rows, token_budget=60, concurrency=2, landing="finished")
    # tokens far enough apart that a busy machine still reads the budget's token mid-answer, not in one read
    slow.token_delay_s = 0.02
    project.run("generate", "B3")
    first = responses(project)
    assert metrics(project)["budget_met"] and "budget" in {line.get("end_reason") for line in first}
    m = metrics(project)  # the conversations cut at the budget say nothing of what the source's turns kept
    assert m["turns_kept_share"] == (1.0 if m["conversations_ended"].get("source_exhausted") else None)
    for conv in {line["conversation"] for line in first}:  # each one's turns from turn 0, none skipped
        assert [line["turn"] for line in first if line["conversation"] == conv] == list(
            range(sum(line["conversation"] == conv for line in first))
        )
    with sqlite3.connect(project.path / "store.sqlite") as db:
        answered = {k for (k,) in db.execute("SELECT key FROM responses WHERE finish_reason IN ('stop', 'length')")}
        parked = dict(db.execute("SELECT key, prompt_ids FROM responses WHERE finish_reason = 'budget_cut'"))
    assert parked  # the turns in flight at the budget, parked
    (srv,) = start(rows, token_budget=100_000, concurrency=2, landing="finished")
    project.run("generate", "B3")
    sent = sent_ids(srv)
    assert not set(sent) & answered  # nothing answered before is asked again
    assert set(parked) <= set(sent) and metrics(project)["continued"] == len(parked)  # the cut turns go on
    for key, prompt_ids in parked.items():
        assert sent[key][: len(json.loads(prompt_ids))] == json.loads(prompt_ids)
    lines = responses(project)
    assert len(lines) == 4 * 3 + 4 * 2

    def answers(out):
        return {line["id"]: {k: v for k, v in line.items() if k != "end_reason"} for line in out}

    assert answers(first).items() <= answers(lines).items()  # the turns kept at the budget, as they were
    assert metrics(project)["conversations_ended"] == {"source_exhausted": 8}


def test_a_plan_holds_the_store_rows_of_the_turns_its_conversations_stop_at(conv_project, tiny_model):
    """Planning takes the rows of the turns each conversation stops at (a parked partial, an empty answer) from its
    walk over the stored turns, without a query of its own: they are the store's rows for those turns."""
    from draftdata.generate.plan.planning import Plan
    from draftdata.generate.store import ResponseStore

    project, start = conv_project
    rows = three_turn_rows() + [{"messages": chat(f"Topic {i}?", "A.", "More?", "B.")} for i in range(4)]
    (slow,) = start(rows, token_budget=60, concurrency=2, landing="finished")
    slow.token_delay_s = 0.02  # the budget is read mid-answer: the turns in flight are parked
    project.run("generate", "B3")
    cfg = load_config("B3", [], params_path=project.path / "params.yaml")
    prompts = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
    store = ResponseStore(project.path / "store.sqlite")
    try:
        plan = Plan.make(cfg, prompts, target_for(cfg, AutoTokenizer.from_pretrained(tiny_model)), store)
        nexts = store.get_many(c.next.key for c in plan.convs if c.next is not None)
    finally:
        store.close()
    assert any(r.partial for r in nexts.values())  # the turns parked at the budget are among them
    assert plan.stored == {p.key: r for c in plan.convs for p, r in c.done} | nexts


def planned_in_process(project, tiny_model):
    """B3's config, prompts and target as the generate stage loads them, to drive a run from the test."""
    cfg = load_config("B3", [], params_path=project.path / "params.yaml")
    prompts = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
    return cfg, prompts, target_for(cfg, AutoTokenizer.from_pretrained(tiny_model))


def test_a_run_ends_holding_the_store_rows_of_its_turns_without_reading_them_back(conv_project, tiny_model):
    """After generation the run's result holds what the store holds for every turn it names (the answers, and the
    rows of the turns the conversations stop at: parked at the budget), from the store's answer to each commit."""
    from draftdata.generate.plan.planning import Plan
    from draftdata.generate.run.generation import run_generation
    from draftdata.generate.store import ResponseStore

    project, start = conv_project
    rows = three_turn_rows() + [{"messages": chat(f"Topic {i}?", "A.", "More?", "B.")} for i in range(4)]
    (slow,) = start(rows, token_budget=60, concurrency=2, landing="finished")
    slow.token_delay_s = 0.02  # the budget is read mid-answer: the turns in flight are parked
    cfg, prompts, target = planned_in_process(project, tiny_model)
    store = ResponseStore(project.path / "store.sqlite")
    try:
        result = run_generation(cfg, target, Plan.make(cfg, prompts, target, store), store)
        held = store.get_many([p.key for p in result.requests])
    finally:
        store.close()
    assert any(r.partial for r in held.values())  # parked by this run
    assert result.stored == held and len(result.requests) > len(prompts)  # every turn named, answered or stopped at


def test_a_conversation_goes_on_from_the_answer_the_store_kept_where_another_run_committed_first(
    conv_project, tiny_model
):
    """Another run commits a turn's answer while this one asks for it: the store keeps the first, and this run's
    conversation goes on from that one, as a rerun walking the store does (same params, same data)."""
    from draftdata.generate.plan.planning import Plan
    from draftdata.generate.run.generation import run_generation
    from draftdata.generate.store import ResponseStore, StoredResponse

    project, start = conv_project
    start(three_turn_rows()[:1])
    cfg, prompts, target = planned_in_process(project, tiny_model)
    store, other = ResponseStore(project.path / "store.sqlite"), ResponseStore(project.path / "store.sqlite")
    try:
        plan = Plan.make(cfg, prompts, target, store)
        (conv,) = plan.convs
        turn = conv.next
        ids = target.tok.encode("Another answer.", add_special_tokens=False)
        theirs = StoredResponse(
            turn.key,
            cfg.dataset,
            turn.prompt["id"],
            "Another answer.",
            turn.prompt_tokens,
            len(ids),
            "stop",
            "other",
            0.1,
            turn.prompt_ids,
            ids,
        )
        other.put(theirs)  # committed after this run planned turn 0, before its answer came
        result = run_generation(cfg, target, plan, store)
        rerun = Plan.make(cfg, prompts, target, store)
    finally:
        store.close()
        other.close()
    assert conv.done[0][1].text == "Another answer." and len(conv.done) == 3
    assert [p.key for p in result.requests] == [p.key for p in rerun.requests]  # the rerun steps over the same turns
    assert result.stored == rerun.stored


def test_exact_landing_gives_nested_conversations_whatever_the_store_holds(conv_project):
    """landing exact: whole conversations in prompt order, the last cut at a turn; a raised budget's output starts
    with the smaller one's, and lowering it back gives the first output byte for byte, although the store now
    holds every answer (the finished rule lands on what the store holds)."""
    project, start = conv_project
    rows = three_turn_rows() + [{"messages": chat(f"Topic {i}?", "A.", "More?", "B.")} for i in range(4)]
    start(rows, token_budget=60, concurrency=4)
    project.run("generate", "B3")
    small = (project.data("B3") / "responses.jsonl").read_bytes()
    lines = responses(project)
    assert metrics(project)["landing"] == "exact" and metrics(project)["budget_met"]
    convs = [line["conversation"] for line in lines]
    assert convs == sorted(convs, key=convs.index)  # conversation after conversation
    before_last = sum(line["completion_tokens"] for line in lines[:-1])
    assert before_last < 60 <= before_last + lines[-1]["completion_tokens"]  # the shortest run that reaches it
    start(rows, token_budget=100_000, concurrency=4)
    project.run("generate", "B3")
    large = (project.data("B3") / "responses.jsonl").read_bytes()
    assert len(large) > len(small)
    first_lines = small.splitlines()
    assert [json.loads(x) | {"end_reason": None} for x in large.splitlines()[: len(first_lines)]] == [
        json.loads(x) | {"end_reason": None} for x in first_lines
    ]  # nested (a conversation's last line says why it ends there)
    start(rows, token_budget=60, concurrency=4)
    project.run("generate", "B3")
    assert (project.data("B3") / "responses.jsonl").read_bytes() == small


def test_a_later_turn_past_the_context_ends_its_conversation(conv_project, tiny_model):
    from draftdata.config.load import load_config
    from draftdata.generate.plan.planning import plan_conversations
    from draftdata.generate.store import ResponseStore

    project, start = conv_project
    start(three_turn_rows())
    project.run("generate", "B3")
    lines = responses(project)
    cfg = load_config("B3", [], params_path=project.path / "params.yaml")
    prompts = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    store = ResponseStore(project.path / "store.sqlite")
    try:
        room = max(len(line["prompt_ids"]) for line in lines if line["turn"] == 1)  # every turn 1 fits
        convs, _, _ = plan_conversations(cfg, prompts, target_for(cfg, tok), store, room + MAX_TOKENS)
    finally:
        store.close()
    turn2 = {line["conversation"]: len(line["prompt_ids"]) for line in lines if line["turn"] == 2}
    expected = {conv: ("context", 2) if n > room else ("source_exhausted", 3) for conv, n in turn2.items()}
    assert {c.rec["id"]: (c.ended, len(c.done)) for c in convs} == expected
    assert "context" in {reason for reason, _ in expected.values()}


def test_an_empty_answer_ends_its_conversation_before_it(conv_project):
    project, start = conv_project
    start([{"messages": chat("Hi.", "Hello.", "Say nothing.", ".", "Bye.", "Bye.")}])
    project.run("generate", "B3")
    (line,) = responses(project)
    assert line["turn"] == 0 and line["end_reason"] == "empty"
    assert metrics(project)["conversations_ended"] == {"empty": 1}


def test_a_conversation_whose_first_answer_is_empty_is_counted_though_it_has_no_line(conv_project):
    """Nothing to train on, so no line in responses.jsonl; still a conversation the run took and ended, counted as
    the others are (its source's turns, none kept, in turns_kept_share) where the output reaches it, and one
    `draftdata plan` has nothing left to send for."""
    project, start = conv_project
    start([{"messages": chat(first, ".", "Bye.", "Bye.")} for first in ("Hi.", "Say nothing.")])
    # prompt order is prompts.jsonl's (seeded by content): the empty conversation after the other
    path = project.data("B3") / "prompts.jsonl"
    records = sorted(path.read_text().splitlines(), key=lambda line: "Say nothing." in line)
    path.write_text("\n".join(records) + "\n")
    project.run("generate", "B3")
    lines = responses(project)
    assert [(line["turn"], line.get("end_reason")) for line in lines] == [(0, None), (1, "source_exhausted")]
    m = metrics(project)
    assert m["conversations"] == 2 and m["conversations_ended"] == {"empty": 1, "source_exhausted": 1}
    assert m["turns_kept_share"] == 0.5  # 2 of the 4 source turns: none of the empty one's 2
    (p,) = plan(load_config(None, [], params_path=project.path / "params.yaml", need_dataset=False))
    assert (p.prompts, p.turns, p.prompts_left) == (m["conversations"], 4, 0)

    # a budget that the first turn meets: the output stops before the empty conversation, which it no longer counts
    project.run("generate", "B3", f"datasets.B3.token_budget={lines[0]['completion_tokens']}")
    m = metrics(project)
    assert [line["turn"] for line in responses(project)] == [0]
    assert m["conversations"] == 1 and m["conversations_ended"] == {"budget": 1}


# ---------------------------------------------------------------------------------------------------------------
# the turns' render cache


def turn_renders_counted(monkeypatch) -> Counter:
    """The chat template's renders of three_turn_rows' conversations from here on (not the probes of a tokenizer
    being loaded), by the conversation's first user turn."""
    counts: Counter = Counter()
    render = PreTrainedTokenizerBase.apply_chat_template

    def counted(self, conversation, *args, **kwargs):
        first = next((m["content"] for m in conversation if m["role"] == "user"), "")
        if first.startswith("Tell me about topic"):
            counts[first] += 1
        return render(self, conversation, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", counted)
    return counts


def held_renders(project, forget: bool = False) -> int:
    """The turns' renders the store holds (`forget`: none from now on)."""
    with sqlite3.connect(project.path / "store.sqlite") as db:
        if forget:
            db.execute("DELETE FROM turn_rendered")
        return db.execute("SELECT COUNT(*) FROM turn_rendered").fetchone()[0]


def rendered_cold(conv_project, rows: list[dict], renders: Counter) -> None:
    """A rerun with no render held renders every turn again and writes the output the last run wrote, byte for
    byte, sending nothing."""
    project, start = conv_project
    before = (project.data("B3") / "responses.jsonl").read_bytes()
    held_renders(project, forget=True)
    renders.clear()
    (srv,) = start(rows)
    project.run("generate", "B3")
    assert srv.generate_calls == [] and sum(renders.values()) >= 12
    assert (project.data("B3") / "responses.jsonl").read_bytes() == before


def test_a_rerun_over_stored_turns_renders_none_of_them_and_sends_nothing(conv_project, monkeypatch):
    project, start = conv_project
    start(three_turn_rows())
    project.run("generate", "B3")
    before = (project.data("B3") / "responses.jsonl").read_bytes()
    assert held_renders(project) == 12
    (srv,) = start(three_turn_rows())
    renders = turn_renders_counted(monkeypatch)
    project.run("generate", "B3")
    assert sum(renders.values()) == 0 and srv.generate_calls == []
    assert (project.data("B3") / "responses.jsonl").read_bytes() == before
    rendered_cold(conv_project, three_turn_rows(), renders)
    assert held_renders(project) == 12  # kept again


def test_a_changed_template_kwargs_misses_the_held_renders(conv_project, tiny_model, monkeypatch):
    project, start = conv_project
    project.params["model"]["chat_template"] = str(ROOT / "conf" / "templates" / "qwen3_thinking.jinja")
    start(three_turn_rows())
    project.run("generate", "B3")
    thinking = (project.data("B3") / "responses.jsonl").read_bytes()
    renders = turn_renders_counted(monkeypatch)
    (srv,) = start(three_turn_rows(), template_kwargs={"enable_thinking": False})
    project.run("generate", "B3")
    assert len(sent_ids(srv)) == 12 and sum(renders.values()) > 0  # every turn anew: its prompt ids changed
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert all("<think>\n\n</think>" in tok.decode(line["prompt_ids"]) for line in responses(project))
    off = (project.data("B3") / "responses.jsonl").read_bytes()
    # either kwargs again: their renders are both held
    for kwargs, before in (({}, thinking), ({"enable_thinking": False}, off)):
        renders.clear()
        (srv,) = start(three_turn_rows(), template_kwargs=kwargs)
        project.run("generate", "B3")
        assert sum(renders.values()) == 0 and srv.generate_calls == []
        assert (project.data("B3") / "responses.jsonl").read_bytes() == before
    rendered_cold(conv_project, three_turn_rows(), renders)  # the very ids a cold render gives


def test_a_changed_later_user_turn_misses_the_held_renders(conv_project, monkeypatch):
    project, start = conv_project
    rows = three_turn_rows()
    start(rows)
    project.run("generate", "B3")
    rows[1]["messages"][2]["content"] = "Go on, please."
    renders = turn_renders_counted(monkeypatch)
    (srv,) = start(rows)
    project.run("generate", "B3")
    assert set(renders) == {"Tell me about topic 1."}  # the other conversations are held as they were
    changed = [line for line in responses(project) if line["messages"][0]["content"] == "Tell me about topic 1."]
    assert set(sent_ids(srv)) == {line["key"] for line in changed if line["turn"] >= 1}
    assert changed[1]["messages"][-1]["content"] == "Go on, please."
    rendered_cold(conv_project, rows, renders)


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE turn_rendered SET ids = substr(ids, 1, 9)",  # cut rows
        "DROP TABLE turn_rendered; CREATE TABLE turn_rendered (x)",  # a table of another shape
    ],
)
def test_an_unreadable_render_cache_costs_renders_only(conv_project, monkeypatch, damage):
    project, start = conv_project
    start(three_turn_rows())
    project.run("generate", "B3")
    before = (project.data("B3") / "responses.jsonl").read_bytes()
    with sqlite3.connect(project.path / "store.sqlite") as db:
        db.executescript(damage)
    renders = turn_renders_counted(monkeypatch)
    (srv,) = start(three_turn_rows())
    project.run("generate", "B3")
    assert srv.generate_calls == [] and sum(renders.values()) >= 12
    assert (project.data("B3") / "responses.jsonl").read_bytes() == before


def test_budget_unit_total_counts_each_token_a_conversations_sample_holds_once(conv_project):
    """budget_unit total: a conversation counts its sample's tokens (its last turn's prompt and answer), not each
    turn's whole history again; the tokenize stage's samples hold exactly what the budget counted."""
    project, start = conv_project
    start(three_turn_rows(), budget_unit="total")
    project.run("generate", "B3")
    lines = responses(project)
    last = {line["conversation"]: line for line in lines}  # in turn order: each conversation's last turn
    sample_tokens = sum(line["prompt_tokens"] + line["completion_tokens"] for line in last.values())
    every_history = sum(line["prompt_tokens"] + line["completion_tokens"] for line in lines)
    m = metrics(project)
    assert m["budget_tokens"] == sample_tokens < every_history
    project.run("tokenize", "B3")
    tm = json.loads((project.data("B3") / "tokenize_metrics.json").read_text())
    assert tm["samples"] == len(last) and tm["tokens"] == sample_tokens
    # a budget met mid-way (the stored turns, selected again) lands on it by the same counts, which the samples hold
    start(three_turn_rows(), budget_unit="total", token_budget=sample_tokens // 2)
    project.run("generate", "B3")
    half = metrics(project)["budget_tokens"]
    assert sample_tokens // 2 <= half < sample_tokens
    project.run("tokenize", "B3")
    assert json.loads((project.data("B3") / "tokenize_metrics.json").read_text())["tokens"] == half


@pytest.mark.parametrize("train_on", ["all_turns", "last_turn"])
def test_budget_unit_total_counts_per_turn_samples_where_the_template_rewrites_history(conv_project, train_on):
    """Qwen3's template with thinking off writes an empty think block into the turn it opens and drops it from the
    turns before: a later turn's prompt does not start with the turn before's prompt and answer, so tokenize makes
    each turn a sample of its own, its whole prompt (`all_turns`), or keeps the last turn's alone (`last_turn`).
    Generate counts what those samples hold, token for token, at a budget met in full and at one met mid-way."""
    project, start = conv_project
    project.params["model"].update(chat_template="qwen3_thinking", template_kwargs={"enable_thinking": False})
    project.params["tokenize"]["train_on"] = train_on
    start(three_turn_rows(), budget_unit="total")
    project.run("generate", "B3")
    lines = responses(project)
    assert len(lines) == 12  # four conversations of three turns, each answered
    project.run("tokenize", "B3")
    tm = json.loads((project.data("B3") / "tokenize_metrics.json").read_text())
    assert tm["conversations_per_turn_samples"] == 4  # the ids decided it: no conversation is one sample
    every = train_on == "all_turns"
    kept = lines if every else [line for line in lines if line["turn"] == 2]
    assert tm["samples"] == len(kept) and tm["tokens"] == sum(r["prompt_tokens"] + r["completion_tokens"] for r in kept)
    assert metrics(project)["budget_tokens"] == tm["tokens"]
    start(three_turn_rows(), budget_unit="total", token_budget=tm["tokens"] // 2)
    project.run("generate", "B3")
    project.run("tokenize", "B3")
    half = json.loads((project.data("B3") / "tokenize_metrics.json").read_text())["tokens"]
    assert metrics(project)["budget_tokens"] == half < tm["tokens"]


@pytest.mark.parametrize(("written", "asked"), [("all", "last"), ("last", "all")])
def test_prompts_written_for_the_other_turns_are_refused_before_any_request(conv_project, written, asked):
    """A hand run of generate with `datasets.B3.turns=...` that the prompts stage did not get: one line naming the
    file and the command that writes its prompts, before any request (it crashed writing its output, its answers
    generated)."""
    from draftdata.errors import UserError

    project, start = conv_project
    (srv,) = start(three_turn_rows(), turns=written)
    with pytest.raises(UserError) as err:
        project.run("generate", "B3", f"datasets.B3.turns={asked}")
    assert str(err.value).startswith(
        f"data/B3/prompts.jsonl: written for turns: {written}, but datasets.B3.turns is {asked}; run the prompts stage"
    )
    assert f"python -m stages.prompts dataset=B3 datasets.B3.turns={asked}" in str(err.value)
    assert not srv.generate_calls
