"""Every assistant turn regenerated on-policy (`turns: all`): a conversation replayed over stored answers, with the
demo's tiny tokenizer and the shipped chat templates on the golden tokenizer; what a turn does (actions) and when
a regenerated turn diverges from the source's."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from draftdata.generate.plan.actions import CALLS, COMMAND, TEXT, Action, action, diverged
from draftdata.generate.plan.conversation import (
    KEEP_SOURCE,
    SOURCE_EXHAUSTED,
    TOOL_CALL_DIVERGED,
    TRUNCATED,
    TurnRendering,
    TurnRenders,
    prefix_stable,
    replay,
)
from draftdata.generate.store import StoredResponse
from draftdata.model.tokenizer import render_prompt_ids

_spec = importlib.util.spec_from_file_location("make_golden", ROOT / "tests" / "golden" / "make_golden.py")
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)

SAMPLING = {"temperature": 0.8, "top_p": 0.95}
WEATHER = make_golden.TOOLS[:1]


def target(tok, **kwargs) -> TurnRendering:
    return TurnRendering(tok, kwargs, "model-fp", SAMPLING, 48)


def golden(template: str) -> TurnRendering:
    return target(make_golden.load_tokenizer(template))


def chat_conv(*turns: str) -> dict:
    """User and assistant turns alternating, as a prompt record of `turns: all`."""
    conversation = [{"role": "system", "content": "You are a concise assistant."}]
    conversation += [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(turns)]
    slots = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    return {"id": "conv-1", "conversation": conversation, "slots": slots, "where": "demo.jsonl:1"}


def call(name: str, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_conv() -> dict:
    """A call, its result, an answer in text, a second question and its answer (glaive's shape)."""
    source_call = call("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}), "call_1")
    conversation = [
        {"role": "system", "content": "You are a helpful assistant with access to tools."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [source_call]},
        {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is 18 degrees in Paris."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    return {"id": "conv-2", "conversation": conversation, "slots": [2, 4, 6], "tools": copy.deepcopy(WEATHER)}


def stored(p, t: TurnRendering, text: str, *, finish: str = "stop", **parsed) -> StoredResponse:
    """The target's answer to planned turn `p`: ids as a model may write them (words and spaces apart: not what
    encoding the whole text gives, so re-tokenisation would show; markers as their special tokens), its end-of-turn
    id last."""
    tok = t.tok
    ids = [
        i
        for piece in re.split(r"(\s+)", text)
        if piece
        for i in tok.backend_tokenizer.encode(piece, add_special_tokens=False).ids
    ]
    ids += [tok.eos_token_id] if finish == "stop" else []
    return StoredResponse(
        key=p.key,
        dataset="D",
        prompt_id=p.prompt["id"],
        text=tok.decode(ids, skip_special_tokens=True),
        prompt_tokens=len(p.prompt_ids),
        completion_tokens=len(ids),
        finish_reason=finish,
        server="s",
        latency_s=0.0,
        prompt_ids=p.prompt_ids,
        output_ids=ids,
        **parsed,
    )


def drive(conv: dict, t: TurnRendering, answers: list, store: dict | None = None, **options):
    """Answer each next turn with answers[turn] (a text, or a dict of `stored` keywords) until the conversation
    ends; returns the last replay and the store."""
    store = {} if store is None else store
    while (r := replay(conv, store.get, t, **options)).next is not None:
        a = answers[r.next.prompt["turn"]]
        store[r.next.key] = stored(r.next, t, **({"text": a} if isinstance(a, str) else a))
    return r, store


def turn_ids(r) -> list[tuple[list[int], list[int]]]:
    return [(p.prompt_ids, s.output_ids) for p, s in r.done]


# ---------------------------------------------------------------------------------------------------------------
# Replay


@pytest.fixture(params=["tiny", "chatml", "hermes_tools", "llama3"])
def stable_target(request) -> TurnRendering:
    if request.param == "tiny":
        from transformers import AutoTokenizer

        return target(AutoTokenizer.from_pretrained(request.getfixturevalue("tiny_model")))
    return golden(request.param)


def test_three_turns_on_policy_with_the_target_ids_exactly(stable_target):
    t = stable_target
    conv = chat_conv("What is the capital of France?", "Paris.", "And Spain?", "Madrid.", "Italy?", "Rome.")
    answers = ["It is Paris, of course.", "Madrid is.", "Rome, the eternal city."]
    r, _ = drive(conv, t, answers)
    assert r.ended == SOURCE_EXHAUSTED and r.next is None and len(r.done) == 3
    for turn, (p, _) in enumerate(r.done):
        assert p.prompt["turn"] == turn and p.prompt["conversation"] == "conv-1"
        # every earlier source answer replaced by the target's, the source's user turns kept
        assistant = [m["content"] for m in p.prompt["messages"] if m["role"] == "assistant"]
        assert assistant == answers[:turn]
        users = [m["content"] for m in p.prompt["messages"] if m["role"] == "user"]
        assert users == [m["content"] for m in conv["conversation"][1::2]][: turn + 1]
        # the ids hold exactly the rendered prompt's text
        rendered = t.tok.apply_chat_template(p.prompt["messages"], add_generation_prompt=True, tokenize=False)
        assert t.tok.decode(p.prompt_ids, skip_special_tokens=False) == rendered
    for (prev, out), (ids, _) in zip(turn_ids(r), turn_ids(r)[1:]):
        assert ids[: len(prev) + len(out)] == prev + out
    assert prefix_stable(turn_ids(r))
    # re-rendering would have re-tokenised the answers: the ids above are the target's own
    last = r.done[-1][0]
    assert render_prompt_ids(t.tok, last.prompt["messages"], None, {}) != last.prompt_ids


def test_resume_in_a_fresh_process_gives_the_same_next_turn(tmp_path):
    t = golden("chatml")
    conv = chat_conv("Hi.", "Hello.", "How are you?", "Fine.", "Bye.", "Bye!")
    r, store = drive(conv, t, ["Hello there.", "Very well.", "Goodbye."])
    first_two = {p.key: store[p.key] for p, _ in r.done[:2]}
    resumed = replay(conv, first_two.get, t)
    assert [p.key for p, _ in resumed.done] == [p.key for p, _ in r.done[:2]]
    assert resumed.next.key == r.done[2][0].key and resumed.ended is None
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"conv": conv, "stored": [vars(s) for s in first_two.values()]}))
    script = (
        "import json, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_conversation import golden\n"
        "from draftdata.generate.plan.conversation import replay\n"
        "from draftdata.generate.store import StoredResponse\n"
        f"state = json.load(open({str(state)!r}))\n"
        "store = {s['key']: StoredResponse(**s) for s in reversed(state['stored'])}\n"
        "r = replay(state['conv'], store.get, golden('chatml'))\n"
        "print(r.next.key, r.next.prompt['turn'], r.next.prompt['id'])\n"
    )
    for seed in ("0", "123"):
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.split()
        assert out == [resumed.next.key, "2", resumed.next.prompt["id"]]


def test_a_matching_call_gets_the_source_result():
    t = golden("hermes_tools")
    # the same call, its arguments in another key order and spacing, under the server's own call id
    same = [call("get_weather", '{"unit":"celsius",  "city":"Paris"}', "call_srv_9")]
    answers = [{"text": "", "tool_calls": same}, "18 degrees.", "Any time."]
    r, _ = drive(tool_conv(), t, answers)
    assert r.ended == SOURCE_EXHAUSTED and len(r.done) == 3
    turn1 = r.done[1][0].prompt["messages"]
    assert turn1[-2]["tool_calls"] == same
    assert turn1[-1] == {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call_srv_9"}
    assert r.done[1][0].prompt["tools"] == WEATHER


def test_a_call_written_in_the_text_matches_too():
    """Ids in, ids out (no parser): the call is read from the tokens the target wrote, markers included."""
    t = golden("hermes_tools")
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}\n</tool_call>'
    r, _ = drive(tool_conv(), t, [written, "18 degrees.", "Any time."], on_tool_divergence="stop")
    assert r.ended == SOURCE_EXHAUSTED
    turn1 = r.done[1][0].prompt["messages"]
    assert turn1[-2] == {"role": "assistant", "content": written}
    assert turn1[-1] == {"role": "tool", "content": '{"temp": 18}'}  # no call id to point at
    assert prefix_stable(turn_ids(r))


@pytest.mark.parametrize(
    "first",
    [
        {"text": "", "tool_calls": [call("get_forecast", '{"city": "Paris", "unit": "celsius"}', "c")]},  # name
        {"text": "", "tool_calls": [call("get_weather", '{"city": "Lyon", "unit": "celsius"}', "c")]},  # arguments
        {"text": "I cannot look that up."},  # kind: text where the source called
        {  # two calls where the source made one
            "text": "",
            "tool_calls": [call("get_weather", '{"city": "Paris", "unit": "celsius"}', f"c{i}") for i in (1, 2)],
        },
    ],
)
def test_a_diverging_turn_ends_the_conversation(first):
    t = golden("hermes_tools")
    r, _ = drive(tool_conv(), t, [first, "unused", "unused"])
    assert r.ended == TOOL_CALL_DIVERGED and r.next is None
    assert len(r.done) == 1  # the diverging answer is kept: the sample holds every turn up to it


def test_a_call_where_the_source_answered_in_text_diverges():
    t = golden("hermes_tools")
    conv = tool_conv()
    answers = [
        {"text": "", "tool_calls": [call("get_weather", '{"city": "Paris", "unit": "celsius"}', "c")]},
        {"text": "", "tool_calls": [call("get_weather", '{"city": "Paris"}', "d")]},
    ]
    r, _ = drive(conv, t, answers)
    assert r.ended == TOOL_CALL_DIVERGED and len(r.done) == 2


def test_keep_source_splices_the_source_result_and_goes_on():
    t = golden("hermes_tools")
    other = [call("get_weather", '{"city": "Lyon", "unit": "celsius"}', "call_srv_2")]
    r, _ = drive(
        tool_conv(), t, [{"text": "", "tool_calls": other}, "18 degrees.", "Any time."], on_tool_divergence=KEEP_SOURCE
    )
    assert r.ended == SOURCE_EXHAUSTED and len(r.done) == 3
    turn1 = r.done[1][0].prompt["messages"]
    assert turn1[-2]["tool_calls"] == other
    assert turn1[-1] == {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "call_srv_2"}


def test_keep_source_still_ends_where_results_cannot_be_paired():
    t = golden("hermes_tools")
    r, _ = drive(tool_conv(), t, ["I cannot look that up.", "unused", "unused"], on_tool_divergence=KEEP_SOURCE)
    assert r.ended == TOOL_CALL_DIVERGED and len(r.done) == 1


def test_a_truncated_answer_ends_the_conversation():
    t = golden("chatml")
    conv = chat_conv("Hi.", "Hello.", "How are you?", "Fine.")
    r, _ = drive(conv, t, [{"text": "Hello, I am a long answer", "finish": "length"}, "unused"])
    assert r.ended == TRUNCATED and len(r.done) == 1 and r.next is None


def test_a_parked_answer_is_the_next_turn_again():
    t = golden("chatml")
    conv = chat_conv("Hi.", "Hello.", "How are you?", "Fine.")
    r, store = drive(conv, t, ["Hello there.", "Fine, thanks."])
    key = r.done[1][0].key
    store[key] = StoredResponse(**{**vars(store[key]), "finish_reason": "budget_cut"})
    again = replay(conv, store.get, t)
    assert again.next.key == key and len(again.done) == 1 and again.ended is None


def test_swe_agent_commands_diverge_on_the_command_only():
    t = golden("chatml")
    conv = chat_conv("Fix the bug.", "Look first.\n```\nls -la\n```", "a.py", "Done.\n```\nsubmit\n```")
    r, _ = drive(conv, t, ["Let me list.\n```\nls   -la\n```", "Submitting.\n```\nsubmit\n```"], commands=True)
    assert r.ended == SOURCE_EXHAUSTED and len(r.done) == 2
    r, _ = drive(conv, t, ["Let me read.\n```\ncat a.py\n```", "unused"], commands=True)
    assert r.ended == TOOL_CALL_DIVERGED and len(r.done) == 1


@pytest.mark.parametrize("path", ["conf/templates/qwen3_thinking.jinja", "bench/templates/qwen3.jinja"])
def test_a_template_that_drops_earlier_reasoning_is_not_prefix_stable(path):
    tok = make_golden.load_tokenizer("qwen3_thinking")
    tok.chat_template = (ROOT / path).read_text()
    t = target(tok)
    conv = chat_conv("What is 2+2?", "4.", "And 3+3?", "6.")
    answers = ["<think>\nAdd them.\n</think>\n\nIt is 4.", "<think>\nAgain.\n</think>\n\nIt is 6."]
    r, _ = drive(conv, t, answers)
    assert r.ended == SOURCE_EXHAUSTED and len(r.done) == 2
    assert not prefix_stable(turn_ids(r))
    turn1 = r.done[1][0]
    # the history holds the whole answer; the template drops its reasoning, as a chat server would render it
    assert turn1.prompt["messages"][2] == {"role": "assistant", "content": answers[0]}
    assert turn1.prompt_ids == render_prompt_ids(tok, turn1.prompt["messages"], None, {})
    assert "Add them." not in tok.decode(turn1.prompt_ids)


# ---------------------------------------------------------------------------------------------------------------
# Actions


def test_action_of_parsed_and_written_calls():
    parsed = {"content": "", "tool_calls": [call("f", '{"a": 1, "b": [1, 2]}', "x")]}
    assert action(parsed) == Action(CALLS, (("f", {"a": 1, "b": [1, 2]}),))
    hermes = '<tool_call>\n{"name": "f", "arguments": {"b": [1, 2], "a": 1}}\n</tool_call>'
    assert action({"content": hermes}) == action(parsed)
    thinking = '<think>\nmaybe <tool_call>{"name": "g", "arguments": {}}</tool_call>\n</think>\n\n' + hermes
    assert action({"content": thinking}) == action(parsed)
    llama3 = 'Let me check.\n{"name": "f", "parameters": {"a": 1, "b": [1, 2]}}'
    assert action({"content": llama3}) == action(parsed)
    assert action({"content": 'The record is {"name": "Bob"}.'}) == Action(TEXT)
    assert action({"content": "Paris."}) == Action(TEXT)


def test_action_of_commands():
    act = action({"content": "Look.\n```\nls   -la\n```\nthen\n```bash\nfind  .  -name x\n```"}, commands=True)
    assert act == Action(COMMAND, (("find . -name x", None),))
    assert action({"content": "No command here."}, commands=True) == Action(TEXT)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"content": "", "tool_calls": [call("f", '{"b":2,"a":1}', "y")]}, False),
        ({"content": "", "tool_calls": [call("f", '{"a": 1, "b": 3}', "y")]}, True),
        ({"content": "", "tool_calls": [call("g", '{"a": 1, "b": 2}', "y")]}, True),
        ({"content": "Here you are."}, True),
        ({"content": "", "tool_calls": [call("f", '{"a": 1, "b": 2}', "y")] * 2}, True),
        ({"content": "", "tool_calls": [call("f", "not json", "y")]}, True),
    ],
)
def test_diverged(answer, expected):
    source = {"role": "assistant", "content": "", "tool_calls": [call("f", json.dumps({"a": 1, "b": 2}), "x")]}
    assert diverged(source, answer) is expected


def test_text_answers_to_text_turns_match():
    assert not diverged({"content": "Paris."}, {"content": "It is Paris."})


def test_on_tool_divergence_is_checked():
    with pytest.raises(ValueError, match="on_tool_divergence is 'Stop'"):
        replay(chat_conv("Hi.", "Hello."), {}.get, golden("chatml"), on_tool_divergence="Stop")


# ---------------------------------------------------------------------------------------------------------------
# Renders held from an earlier run


def thinking_target() -> TurnRendering:
    tok = make_golden.load_tokenizer("qwen3_thinking")
    tok.chat_template = (ROOT / "conf" / "templates" / "qwen3_thinking.jinja").read_text()
    return target(tok)


# a target, a conversation, and which of its turns' renders go on from the previous turn and its answer: where the
# template writes the history as it was (the hermes call was parsed out of the ids, so the template writes it anew)
HELD_CASES = {
    "chatml": (
        lambda: golden("chatml"),
        lambda: chat_conv("Hi.", "Hello.", "And you?", "Fine.", "Bye.", "Bye!"),
        [False, True, True],
    ),
    "hermes_tools": (lambda: golden("hermes_tools"), tool_conv, [False, False, True]),
    "qwen3_thinking": (
        thinking_target,
        lambda: chat_conv("What is 2+2?", "4.", "And 3+3?", "6.", "4+4?", "8."),
        [False, False, False],
    ),
}
HELD_ANSWERS = {
    "chatml": ["Hello there.", "Very well.", "Goodbye."],
    "hermes_tools": [
        {"text": "", "tool_calls": [call("get_weather", '{"city": "Paris", "unit": "celsius"}', "c1")]},
        "18 degrees.",
        "Any time.",
    ],
    "qwen3_thinking": [
        "<think>\nAdd.\n</think>\n\n4.",
        "<think>\nAgain.\n</think>\n\n6.",
        "<think>\nOnce more.\n</think>\n\n8.",
    ],
}


def renders_counted(monkeypatch, tok) -> list:
    """Every call of the chat template on `tok` from here on."""
    calls: list = []
    render = tok.apply_chat_template

    def counted(*args, **kwargs):
        calls.append(args)
        return render(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    return calls


def planned(r) -> list[tuple]:
    return [(p.key, p.prompt, p.prompt_ids) for p, _ in r.done] + [(r.next and r.next.key, r.ended)]


@pytest.mark.parametrize("case", sorted(HELD_CASES))
def test_held_renders_replay_stored_turns_without_the_template(case, monkeypatch):
    make_target, make_conv, grown = HELD_CASES[case]
    t, conv = make_target(), make_conv()
    cold, store = drive(conv, t, HELD_ANSWERS[case])  # no renders held: every turn rendered
    renders = TurnRenders()
    first = replay(conv, store.get, dataclasses.replace(t, renders=renders))
    assert planned(first) == planned(cold) and len(first.done) == 3
    # such a turn holds only what it adds to the previous turn and its answer
    assert [ids.startswith("+") for ids in renders.take_new().values()] == grown
    calls = renders_counted(monkeypatch, t.tok)
    again = replay(conv, store.get, dataclasses.replace(t, renders=TurnRenders(dict(renders.cached))))
    assert calls == []
    assert planned(again) == planned(cold)


def test_a_changed_answer_or_an_unreadable_render_is_rendered_again(monkeypatch):
    t, conv = golden("chatml"), chat_conv("Hi.", "Hello.", "And you?", "Fine.", "Bye.", "Bye!")
    renders = TurnRenders()
    drive(conv, dataclasses.replace(t, renders=renders), ["Hello there.", "Very well.", "Goodbye."])
    held = dict(renders.cached)
    # the store answered anew (another run after the store was emptied): turn 0 is held, turns 1 and 2 grow from
    # another answer
    cold, store = drive(conv, t, ["Hi!", "Very well.", "Goodbye."])
    calls = renders_counted(monkeypatch, t.tok)
    again = replay(conv, store.get, dataclasses.replace(t, renders=TurnRenders(dict(held))))
    assert planned(again) == planned(cold)
    assert len(calls) == 3  # turns 1 and 2, and the text of turn 0 that turn 1 goes on from
    for bad in ("[1,2", "+[1,x]", "[]]", ""):  # cut or mangled rows: every turn rendered, nothing else
        calls.clear()
        unreadable = {k: bad for k in held}
        again = replay(conv, store.get, dataclasses.replace(t, renders=TurnRenders(unreadable)))
        assert planned(again) == planned(cold) and len(calls) > 3
