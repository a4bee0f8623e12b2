"""generate@D end to end on the embedded backend: keep_partial, kills, signals, and the store's guarantees."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from conftest import DEMO, ROOT, target_for

from draftdata.util.files import read_jsonl


def metrics(project) -> dict:
    return json.loads((project.data("B3") / "generate_metrics.json").read_text())


def store_keys(project) -> list[str]:
    with sqlite3.connect(project.path / "store.sqlite") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return [k for (k,) in db.execute("SELECT key FROM responses")]


def stored_rows(project) -> dict[str, tuple[str, list[int]]]:
    with sqlite3.connect(project.path / "store.sqlite") as db:
        return {
            k: (f, json.loads(ids) if ids else None)
            for k, f, ids in db.execute("SELECT key, finish_reason, output_ids FROM responses")
        }


def test_keep_partial_keeps_every_token_and_cancel_continues_cuts(project):
    project.set("datasets.B3.on_budget", "keep_partial")
    project.run("prompts", "B3")
    project.run("generate", "B3")
    m = metrics(project)
    rows = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert m["budget_met"] and m["lost_tokens"] == 0 and m["parked_tokens"] > 0
    assert m["cut_by_budget"] == sum(r["finish_reason"] == "budget_cut" for r in rows) > 0
    # what streamed past the budget in one check interval is all the overshoot (and all that is not in the output)
    assert m["overshoot_tokens"] <= 8 * 48 and m["wasted_tokens"] <= 8 * 48
    for r in rows:  # a cut response is what the model produced, token for token
        assert len(r["output_ids"]) == r["completion_tokens"] > 0
    cut = {k: ids for k, (f, ids) in stored_rows(project).items() if f == "budget_cut"}

    # Back to complete responses only: the cut responses are continued from their tokens, not started over.
    project.set("datasets.B3.on_budget", "cancel")
    project.run("generate", "B3")
    m = metrics(project)
    rows = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    after = stored_rows(project)
    continued = {k: ids for k, ids in cut.items() if after[k][0] in ("stop", "length")}
    assert continued and m["continued"] >= len(continued)
    for k, ids in continued.items():  # the whole response starts with the parked tokens
        assert after[k][1][: len(ids)] == ids and len(after[k][1]) > len(ids)
    assert m["continued_tokens"] >= sum(len(ids) for ids in continued.values())
    keys = store_keys(project)
    assert len(keys) == len(set(keys))


def usable_rows(project, keys: list[str]) -> int:
    with sqlite3.connect(project.path / "store.sqlite") as db:
        rows = db.execute(
            f"SELECT text, completion_tokens, finish_reason FROM responses WHERE key IN ({','.join('?' * len(keys))})",
            keys,
        ).fetchall()
    return sum(1 for text, n, finish in rows if n > 0 and text.strip() and finish in ("stop", "length"))


def start_generate(project, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "stages.generate", "dataset=B3", *overrides],
        cwd=project.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_rows(project, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        if (project.path / "store.sqlite").exists():
            try:
                if len(store_keys(project)) >= n:
                    return
            except sqlite3.OperationalError:  # the writer holds a lock for a moment
                pass
        time.sleep(0.1)
    raise AssertionError("generation did not progress")


@pytest.mark.parametrize("how", ["kill9", "sigint"])
def test_killed_run_loses_nothing_committed_and_resumes(backend_project, how):
    project = backend_project
    project.set("datasets.B3.token_budget", 900)
    project.set("datasets.B3.max_prompts", None)
    project.set("datasets.B3.concurrency", 4)
    project.run("prompts", "B3")
    proc = start_generate(project)
    wait_for_rows(project, 15, proc)
    proc.send_signal(signal.SIGKILL if how == "kill9" else signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    if how == "sigint":
        assert proc.returncode == 130 and "interrupted" in out
    else:
        assert proc.returncode == -signal.SIGKILL
    before = store_keys(project)
    assert len(before) >= 15 and not (project.data("B3") / "responses.jsonl").exists()
    parked = {k: v for k, v in stored_rows(project).items() if v[0] not in ("stop", "length")}
    continuable = project.params.get("backend", {}).get("kind", "embedded") == "embedded"
    if how == "sigint":  # Ctrl-C parks what was in flight, where the backend streams its token ids to go on from
        # (whether anything was in flight with a token yet is the signal's timing: requests still in their prefill
        # have nothing to park; test_dispatcher's interrupt test parks them deterministically)
        assert all(f == "interrupted" for f, _ in parked.values()) and (continuable or not parked)
    reusable = usable_rows(project, before)

    project.run("generate", "B3")
    m = metrics(project)
    after = store_keys(project)
    assert set(before) <= set(after) and len(after) == len(set(after))  # nothing lost, nothing twice
    assert m["reused_from_store"] == reusable  # empty or parked ones are not reused as they are
    rows_after = stored_rows(project)
    redone = sum(rows_after[k] != v for k, v in parked.items())  # parked rows completed (or extended) by this run
    assert m["newly_generated"] == len(after) - len(before) + redone
    assert m["budget_met"]
    # a text-only server's partials cannot be continued: cancelled at the budget, they are lost (and counted), never
    # parked; with token ids every cancelled partial is parked and nothing is lost
    assert m["lost_tokens"] == 0 if continuable else m["parked_tokens"] == 0
    rows = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert len({r["id"] for r in rows}) == len(rows)


def test_progress_lines_when_not_on_a_terminal(project, capsys):
    project.params["run"]["log_every_s"] = 0.0  # a line at every wake-up
    project.save()
    project.run("prompts", "B3")
    project.run("generate", "B3")
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("generate B3: ")]
    assert len(lines) > 2, "no progress lines"
    m = metrics(project)
    # the last line is the final count (every token counted toward the budget, past it when the last responses
    # crossed it), not a throttled earlier one
    counts = [int(line.split()[2].split("/")[0].replace(",", "")) for line in lines]
    assert counts[-1] == max(counts) >= m["budget_tokens"] >= 400 and lines[-1].split()[2].endswith("/400")
    assert " resp (0 err)" in lines[-1] and "avg_comp=" in lines[-1]
    # no ETA and no rate before there is one: the first line comes before any token
    assert "ETA" not in lines[0] and "tok/s" not in lines[0]
    # the requests in flight and what they streamed, before the answers are complete; none at the end
    streamed = [
        int(line.split(" generating (")[1].split(" tok)")[0].replace(",", ""))
        for line in lines
        if " generating (" in line
    ]
    assert streamed and max(streamed) > 0 and " generating" not in lines[-1]
    # the closing line says where the run's tokens went, as the metrics count them
    closing = next(line for line in out if line.startswith("generate dataset=B3 responses="))
    assert f"generated={m['new_tokens']} kept={m['new_in_output_tokens']} parked={m['parked_tokens']}" in closing


def test_progress_eta_comes_from_the_recent_rate_and_what_is_left_to_decode():
    from types import SimpleNamespace

    from draftdata.generate.run.dispatcher import Figures, RunStats
    from draftdata.generate.run.progress import Progress

    cfg = SimpleNamespace(ds=SimpleNamespace(token_budget=10_000), dataset="D", run=SimpleNamespace(progress=False))
    prog = Progress(cfg, 0)
    stats = RunStats(new=10, kept=400, completed_len=1_000)  # 600 of their tokens continued from parked partials
    prog._mark(100.0, 0, 0)  # loading: no tokens yet, no mark
    prog._mark(101.0, 1_000, 5)
    assert prog.rates() is None and "ETA" not in prog.line(Figures(1_000, 1_000, 4, 0, stats, 9_000))
    prog._mark(111.0, 2_000, 10)  # 100 tok/s; 0.5 req/s since the first token
    line = prog.line(Figures(2_000, 2_000, 4, 0, stats, 8_000, 100))
    assert "100 tok/s" in line and "0.5 req/s" in line and "ETA 80s" in line and "avg_comp=100tok" in line
    assert line.startswith("2,000/10,000 tok (20%) | 4 generating (0 tok) | 10 resp (0 err)")
    # the run's last request decodes at a request's share of the rate: 4 in flight, 300 tokens left to one of them
    assert "ETA 12s" in prog.line(Figures(9_000, 9_000, 4, 1_500, stats, 400, 300))
    # tokens streamed past what the budget needs are not the budget's until their request ends: no ETA 0s
    line = prog.line(Figures(9_000, 9_000, 1, 1_500, stats, 250, 250))
    assert "1 generating (1,500 tok)" in line and "ETA 2s" in line
    assert "generating" not in prog.line(Figures(2_000, 2_000, 0, 0, stats))
    assert "ETA" not in prog.line(Figures(2_000, 2_000, 0, 0, stats, 8_000), final=True)  # an ended run's last line
    # answers far between read in the unit that shows them, not 0.0 req/s
    prog._mark(161.0, 7_000, 11)
    assert "0.1 req/s" in prog.line(Figures(7_000, 7_000, 4, 0, stats, 1_000))
    prog._mark(1_101.0, 9_000, 12)  # 7 answers in 1,000 s
    assert "0.4 req/min" in prog.line(Figures(9_000, 9_000, 4, 0, stats, 1_000))


def test_the_eta_of_a_run_is_within_a_factor_of_the_time_that_really_remained(project, monkeypatch, tmp_path):
    """Every ETA a tiny-target run prints, against the time from its line to the run's last line: within ETA_FACTOR
    of it, or ETA_SLACK_S (it is shown in whole seconds). The target answers at length (each answer is cut at
    max_tokens, 1,200; the budget of 3,000 takes three), so the request in flight holds more than the budget still
    needs: an ETA that counted its tokens as the budget's said 0s with seconds to go."""
    import io
    import re
    import sys
    import time

    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import build_target

    ETA_FACTOR, ETA_SLACK_S = 2.0, 1.0
    build_target(TinyModelConfig(path=str(tmp_path / "long"), corpus_dir=str(DEMO), mean_response_tokens=20_000))
    project.params["model"]["path"] = str(tmp_path / "long")
    project.params["run"]["log_every_s"] = 0.0
    project.params["datasets"]["B3"].update(token_budget=3_000, max_tokens=1_200, concurrency=1)
    project.save()
    project.run("prompts", "B3")

    class Stamped(io.StringIO):  # stdout, each line with the time it was written
        def write(self, text: str) -> int:
            written.extend((time.monotonic(), line) for line in text.splitlines() if line)
            return len(text)

    written: list[tuple[float, str]] = []
    monkeypatch.setattr(sys, "stdout", Stamped())
    project.run("generate", "B3")
    lines = [(t, line) for t, line in written if line.startswith("generate B3: ")]
    end = lines[-1][0]
    units = {"s": 1, "min": 60, "h": 3600}
    etas = [
        (t, float(m[1]) * units[m[2]], line) for t, line in lines if (m := re.search(r"ETA ([\d.]+)(s|min|h)", line))
    ]
    assert len(etas) > 20, f"{len(etas)} lines with an ETA in a run of {end - lines[0][0]:.1f} s"
    for t, eta, line in etas:
        left = end - t
        assert left / ETA_FACTOR - ETA_SLACK_S <= eta <= left * ETA_FACTOR + ETA_SLACK_S, f"{left:.1f} s left: {line}"


def test_progress_shows_the_last_figures_of_a_run_that_ends_before_it_looked(capsys):
    """The display reads the figures its dispatcher posts; a run that ends before the display first looked still
    gets its last line."""
    import asyncio
    from types import SimpleNamespace

    from draftdata.generate.run.dispatcher import Figures, RunStats
    from draftdata.generate.run.progress import Progress

    run = SimpleNamespace(progress=False, log_every_s=3600)
    cfg = SimpleNamespace(ds=SimpleNamespace(token_budget=10_000), dataset="D", run=run)
    prog = Progress(cfg, 0)
    figures, ended = Figures(7_000, 7_000, 0, 0, RunStats(new=70, completed_len=7_000)), asyncio.Event()
    ended.set()  # the run ended before the display's first look
    asyncio.run(prog.follow(figures, ended))
    line = "generate D: 7,000/10,000 tok (70%) | 70 resp (0 err) | avg_comp=100tok"
    assert capsys.readouterr().out.splitlines() == [line]


def test_embedded_sampling_is_reproducible(project, monkeypatch):
    """Each request samples from its own seed, so two fresh stores get the same response for every prompt both
    answered (which prompts a run reaches before its budget depends on timing); without the seeded sampler
    (transformers' shared generator) they differ, which is what this guards against."""
    import draftdata.generate.embedded.backend as embedded

    project.run("prompts", "B3")

    def outputs(store: str) -> dict:
        project.params["run"]["store_path"] = str(project.path / store)
        project.save()
        project.run("generate", "B3")
        return {r["id"]: r["output_ids"] for r in read_jsonl(project.data("B3") / "responses.jsonl")}

    first, second = outputs("a.sqlite"), outputs("b.sqlite")
    common = set(first) & set(second)
    assert len(common) >= 8 and all(first[i] == second[i] for i in common)
    add = embedded.SlotBatching.add_request  # the same engine, its requests sent without their seeds

    def unseeded(self, ids, request_id, max_new_tokens, streaming=False, seed=None):
        return add(self, ids, request_id, max_new_tokens, streaming)

    monkeypatch.setattr(embedded.SlotBatching, "add_request", unseeded)
    third = outputs("c.sqlite")
    assert any(first[i] != third[i] for i in set(first) & set(third))


def test_exact_landing_gives_the_same_output_for_the_same_params_and_nests_budgets(project):
    """landing exact (the default): two fresh stores give the same responses.jsonl byte for byte; a raised budget's
    output starts with the smaller one's; lowering it back gives the first again, although the store now holds
    answers the first run never had (the finished rule lands on what the store holds)."""
    project.run("prompts", "B3")
    budget = project.params["datasets"]["B3"]["token_budget"]

    def output(store: str, tokens: int) -> bytes:
        project.params["run"]["store_path"] = str(project.path / store)
        project.params["datasets"]["B3"]["token_budget"] = tokens
        project.save()
        project.run("generate", "B3")
        return (project.data("B3") / "responses.jsonl").read_bytes()

    first = output("a.sqlite", budget)
    assert output("b.sqlite", budget) == first  # timing (two runs, two stores) does not enter
    m = metrics(project)
    assert m["landing"] == "exact" and m["budget_met"]
    lines = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert sum(r["completion_tokens"] for r in lines[:-1]) < budget  # the shortest run of prompts that reaches it
    raised = output("a.sqlite", budget * 3)
    assert raised.startswith(first) and len(raised) > len(first)
    assert output("a.sqlite", budget) == first


def test_a_request_that_fails_for_good_stops_the_exact_output_before_it_with_exit_status_3(
    project, monkeypatch, capsys
):
    """The stage's side of a failure under landing exact: a prompt whose request fails twice in the run ends the
    output before it (the start of the clean run's output, written), `stopped_before` names it, and the stage ends
    with one line and exit status 3; the next run, the fault gone, writes the clean output."""
    from draftdata.config.load import cli
    from draftdata.generate.backends.protocol import GenResult
    from draftdata.generate.embedded.backend import EmbeddedBackend
    from stages.generate import main as generate_main

    project.run("prompts", "B3")
    prompts = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
    clean_store = project.params["run"]["store_path"]
    project.run("generate", "B3")
    clean = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert len(clean) > 3
    bad = clean[2]["messages"]  # the third line's prompt fails for good
    answer = EmbeddedBackend.generate

    async def failing(self, req):
        if req.messages == bad:
            return GenResult(req.rid, error="bad_response", detail="injected", server=self.name)
        return await answer(self, req)

    monkeypatch.setattr(EmbeddedBackend, "generate", failing)
    project.params["run"]["store_path"] = str(project.path / "faulty.sqlite")
    project.save()
    with pytest.raises(SystemExit) as stopped:
        cli(generate_main, argv=["dataset=B3"])  # as `python -m stages.generate` ends, in the project's directory
    assert stopped.value.code == 3
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and f"prompt {clean[2]['id']} (bad_response)" in errors[0] and "not met" in errors[0]
    out = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert [r["key"] for r in out] == [r["key"] for r in clean[:2]]
    m = metrics(project)
    assert not m["budget_met"] and m["stopped_before"] == clean[2]["id"] and m["failed"] == {"bad_response": 2}
    assert len(prompts) > len(clean)

    monkeypatch.setattr(EmbeddedBackend, "generate", answer)
    project.run("generate", "B3")
    assert list(read_jsonl(project.data("B3") / "responses.jsonl")) == clean
    assert clean_store != project.params["run"]["store_path"]  # the clean output came from a store of its own


def test_an_embedded_continuation_draws_what_the_uninterrupted_answer_drew(tiny_model):
    """The contract for a parked answer continued later: the embedded engine draws the token at sequence position
    p from (seed + p), so prompt + the first tokens, continued, give the uninterrupted answer exactly. (A server's
    generator restarts with the continuation: `attempt_seed` offsets the seed there, so a continuation samples the
    same distribution without replaying the first draws, but not the same tokens; docs/generation.md.)"""
    import asyncio

    from draftdata.config.schema import BackendConfig, Config, DatasetConfig, ModelConfig, SamplingConfig
    from draftdata.generate.backends.protocol import GenRequest, Partial
    from draftdata.generate.run.connect import make_backend
    from draftdata.model.tokenizer import load_tokenizer, render_prompt_ids

    cfg = Config(
        model=ModelConfig(path=str(tiny_model)),
        datasets={"d": DatasetConfig(token_budget=1, max_tokens=40, sampling=SamplingConfig(0.8, 0.95))},
        dataset="d",
        backend=BackendConfig(),
    )
    tok = load_tokenizer(cfg.model)
    prompt = render_prompt_ids(tok, [{"role": "user", "content": "Write a haiku."}], None, {})
    sampling = {"temperature": 0.8, "top_p": 0.95, "top_k": -1}
    # the tiny target often ends an answer within a few tokens: the longest of a few seeds' answers is the one cut.
    # Seeds far apart: seed s + 1 draws at position p what seed s draws at p + 1, the same answer shifted by one
    seeds = [1234 + 10_007 * i for i in range(8)]

    def request(seed: int, parked: Partial | None = None) -> GenRequest:
        return GenRequest(f"a{seed}", list(prompt), [], None, 40, sampling, partial=parked or Partial(), seed=seed)

    async def go():
        backend = make_backend(cfg, target_for(cfg, tok))
        await backend.start()
        try:
            wholes = await asyncio.gather(*(backend.generate(request(s)) for s in seeds))
            assert all(w.error is None for w in wholes), [w.detail for w in wholes]
            whole, seed = max(zip(wholes, seeds), key=lambda ws: len(ws[0].output_ids))
            cut = whole.output_ids[: len(whole.output_ids) // 2]
            rest = await backend.generate(request(seed, Partial(output_ids=list(cut), completion_tokens=len(cut))))
            return whole, rest
        finally:
            await backend.close()

    whole, rest = asyncio.run(go())
    assert len(whole.output_ids) > 15 and rest.continued_from == len(whole.output_ids) // 2
    assert rest.output_ids == whole.output_ids and rest.finish_reason == whole.finish_reason


def test_two_generate_processes_on_one_store_share_it_safely(project, tiny_model):
    """Two datasets with the same prompts, generated at the same time by two processes on one store: the store
    stays intact with one row per key, and both outputs hold the same answers."""
    from conftest import dataset_params

    for name in ("A", "B"):
        project.params["datasets"][name] = dataset_params("B3_magicoder", "magicoder_oss", token_budget=600)
    project.save()
    for name in ("A", "B"):
        project.run("prompts", name)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "stages.generate", f"dataset={name}"],
            cwd=project.path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("A", "B")
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    with sqlite3.connect(project.params["run"]["store_path"]) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows, keys = db.execute("SELECT COUNT(*), COUNT(DISTINCT key) FROM responses").fetchone()
    assert rows == keys > 0
    a, b = ([(r["key"], r["text"]) for r in read_jsonl(project.data(n) / "responses.jsonl")] for n in ("A", "B"))
    assert a == b and len(a) > 0


def test_prompts_that_cannot_fit_the_context_are_refused_before_any_request(project, tiny_model):
    from draftdata.errors import ConfigError, UserError

    project.run("prompts", "B3")
    context = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    project.set("datasets.B3.max_tokens", context)
    with pytest.raises(ConfigError) as err:
        project.run("generate", "B3")
    assert err.value.key == "datasets.B3.max_tokens"
    longest = max(r["prompt_tokens"] for r in read_jsonl(project.data("B3") / "prompts.jsonl"))
    project.set("datasets.B3.max_tokens", context - longest + 1)  # the longest prompt no longer fits
    with pytest.raises(UserError) as err:
        project.run("generate", "B3")
    message = str(err.value)
    assert ".jsonl" in message and f"{longest:,} tokens" in message and "datasets.B3.max_prompt_tokens" in message
    assert not (project.data("B3") / "responses.jsonl").exists()


def test_a_tokenizer_from_another_model_is_refused(project, tiny_model, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from draftdata.errors import ConfigError

    model = tmp_path / "mixed"
    shutil.copytree(tiny_model, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens([f"extra{i}" for i in range(4000)])  # more ids than the model has embeddings
    tok.save_pretrained(model)
    project.set("model.path", str(model))
    project.run("prompts", "B3")
    from draftdata.config.load import load_config
    from draftdata.hidden.compute import n_layers_of

    cfg = load_config("B3", [], params_path=project.path / "params.yaml")
    for check in (lambda: project.run("generate", "B3"), lambda: n_layers_of(cfg)):  # hidden_states' first look
        with pytest.raises(ConfigError) as err:
            check()
        assert err.value.key == "model.path" and "not a pair" in str(err.value)


def test_prompts_the_template_renders_alike_are_one_sample(project, tmp_path, monkeypatch):
    """The prompts stage dedups by message JSON; a template that trims the content renders "Hello" and "Hello\\n" to
    the same ids, hence one store key. Generate asks it once and outputs it once, the first prompt's, with its
    tokens counted once toward the budget, and says how many it dropped."""
    import draftdata.model.target as target
    from draftdata.model.tiny import CHAT_TEMPLATE

    # the tiny target may end an answer at its first token, an empty answer the output skips (and a later run asks
    # again): without a stop token every answer runs to max_tokens, so each of the three keys has one in the output
    monkeypatch.setattr(target, "end_of_turn_ids", lambda *args, **kwargs: set())

    untrimmed = "(message.content or '')"
    assert untrimmed in CHAT_TEMPLATE
    template = tmp_path / "trimming.jinja"
    template.write_text(CHAT_TEMPLATE.replace(untrimmed, f"({untrimmed} | trim)"))
    source = tmp_path / "twins.jsonl"
    contents = ["Hello", "Hello\n", "Write a function that adds two numbers.", "Sort a list of words."]
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}]}) + "\n" for c in contents))
    project.set("model.chat_template", str(template))
    project.set("datasets.B3.source", {"shape": "messages", "path": str(source)})
    project.set("datasets.B3.max_prompts", None)
    project.set("datasets.B3.token_budget", 100_000)  # every prompt is answered: the source runs out first
    project.run("prompts", "B3")
    prompts = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
    assert len(prompts) == 4  # different messages: both survive the prompts stage
    hello = [p["id"] for p in prompts if p["messages"][0]["content"].strip() == "Hello"]

    project.run("generate", "B3")
    m = metrics(project)
    rows = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert len(rows) == len({r["key"] for r in rows}) == m["responses"] == 3
    assert m["duplicate_after_template"] == 1
    assert [r["id"] for r in rows if r["id"] in hello] == hello[:1]  # the first in prompt order wins
    assert m["budget_tokens"] == sum(r["completion_tokens"] for r in rows)  # each response counted once
    assert sorted(store_keys(project)) == sorted(r["key"] for r in rows)


def test_no_duplicates_after_template_is_said_too(project):
    project.run("prompts", "B3")
    project.run("generate", "B3")
    assert metrics(project)["duplicate_after_template"] == 0


def _count_renders(monkeypatch) -> list[int]:
    import draftdata.generate.plan.planning as planning

    calls = [0]
    render = planning.render_prompt_ids

    def counted(*args, **kwargs):
        calls[0] += 1
        return render(*args, **kwargs)

    monkeypatch.setattr(planning, "render_prompt_ids", counted)
    return calls


def test_a_rerun_with_the_budget_met_renders_no_prompt(project, monkeypatch):
    project.run("prompts", "B3")
    project.run("generate", "B3")
    before = (project.data("B3") / "responses.jsonl").read_text()
    renders = _count_renders(monkeypatch)
    project.run("generate", "B3")
    assert renders[0] == 0  # every prompt's ids came from the store's cache
    assert (project.data("B3") / "responses.jsonl").read_text() == before


def test_a_changed_template_kwargs_or_tokenizer_file_renders_again(project, tiny_model, tmp_path, monkeypatch):
    import shutil

    from draftdata.config.load import load_config
    from draftdata.generate.plan.planning import plan_requests
    from draftdata.generate.store import ResponseStore
    from draftdata.model.tokenizer import load_tokenizer

    project.run("prompts", "B3")
    prompts = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
    store = ResponseStore(tmp_path / "cache.sqlite")
    renders = _count_renders(monkeypatch)

    def planned(*overrides: str, cached: bool = True):
        cfg = load_config("B3", list(overrides), params_path=project.path / "params.yaml")
        plan = plan_requests(cfg, prompts, target_for(cfg), store if cached else None)
        return [(p.key, p.prompt_ids) for p in plan]

    def renders_of(*overrides: str) -> int:
        start = renders[0]
        got = planned(*overrides)
        assert got == planned(*overrides, cached=False)  # the cache gives what rendering gives
        return renders[0] - start - len(prompts)  # less the uncached check's own renders

    n = len(prompts)
    assert renders_of() == n and renders_of() == 0  # rendered once, then cached
    template = tmp_path / "template.jinja"  # another template: other ids
    template.write_text("System says hi.\n" + load_tokenizer(load_config("B3", []).model).chat_template)
    assert renders_of(f"model.chat_template={template}") == n and renders_of(f"model.chat_template={template}") == 0
    assert planned(f"model.chat_template={template}")[0][1] != planned()[0][1]  # not the first template's ids
    assert renders_of("+model.template_kwargs.enable_thinking=false") == n
    # a dataset's own kwargs render again too, and under a template that reads them they are other ids: other keys
    thinking = f"model.chat_template={ROOT / 'conf' / 'templates' / 'qwen3_thinking.jinja'}"
    off = "+datasets.B3.template_kwargs.enable_thinking=false"
    assert renders_of(thinking) == n and renders_of(thinking, off) == n and renders_of(thinking, off) == 0
    assert all(a[0] != b[0] and a[1] != b[1] for a, b in zip(planned(thinking), planned(thinking, off)))
    edited = tmp_path / "edited"  # the same model with one tokenizer file changed
    shutil.copytree(tiny_model, edited)
    conf = json.loads((edited / "tokenizer_config.json").read_text())
    (edited / "tokenizer_config.json").write_text(json.dumps({**conf, "model_max_length": 12345}))
    assert renders_of(f"model.path={edited}") == n and renders_of(f"model.path={edited}") == 0
    store.close()


def test_a_plan_from_the_cache_neither_decodes_nor_encodes_prompt_ids(project, tmp_path, monkeypatch):
    """A rerun over 100k prompts whose budget is met spent most of its time turning cached ids to lists and the
    lists back to JSON for their keys: from the cache, the key is hashed from the stored text itself."""
    from draftdata.config.load import load_config
    from draftdata.generate.plan.planning import plan_requests
    from draftdata.generate.store import ResponseStore
    from draftdata.model.tokenizer import load_tokenizer

    project.run("prompts", "B3")
    prompts = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
    cfg = load_config("B3", [], params_path=project.path / "params.yaml")
    tok = load_tokenizer(cfg.model)
    store = ResponseStore(tmp_path / "cache.sqlite")
    target = target_for(cfg, tok)
    expected = [(p.key, p.prompt_ids) for p in plan_requests(cfg, prompts, target, None)]
    plan_requests(cfg, prompts, target, store)  # renders and caches
    with sqlite3.connect(tmp_path / "cache.sqlite") as db:  # the text earlier versions stored too: still read as is
        stored = {json.dumps(ids, separators=(",", ":")) for _, ids in expected}
        assert {ids for (ids,) in db.execute("SELECT ids FROM rendered")} == stored

    decoded, encoded = [0], [0]
    loads, dumps = json.loads, json.dumps

    def counted_loads(s, *args, **kwargs):
        out = loads(s, *args, **kwargs)
        decoded[0] += isinstance(out, list) and all(isinstance(i, int) for i in out)
        return out

    def counted_dumps(obj, *args, **kwargs):
        encoded[0] += isinstance(obj, dict) and "prompt_ids" in obj
        return dumps(obj, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counted_loads)
    monkeypatch.setattr(json, "dumps", counted_dumps)
    cached = plan_requests(cfg, prompts, target, store)
    assert decoded[0] == 0 and encoded[0] <= 1  # one template of the key's JSON, none per prompt
    assert [(p.key, p.prompt_ids) for p in cached] == expected  # decoded when asked for
    assert [p.prompt_tokens for p in cached] == [len(ids) for _, ids in expected]
    store.close()


def test_a_dataset_with_fewer_in_flight_than_servers_is_named_in_the_first_line(project, capsys):
    """Params copied from one server to a fleet: a dataset's own `concurrency` below the number of servers would
    leave most of them idle, without a word. The stage's first line names it, with the key to change."""
    from conftest import free_port

    from draftdata.config.load import load_config
    from draftdata.errors import UserError

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]  # nobody listens: the run stops after the line
    project.params["backend"] = {"kind": "openai", "urls": urls, "prompt_format": "chat", "startup_timeout_s": 0.5}
    project.set("datasets.B3.concurrency", 2)
    project.run("prompts", "B3")
    capsys.readouterr()
    with pytest.raises(UserError, match="no healthy server"):
        project.run("generate", "B3")
    assert capsys.readouterr().out.splitlines()[0] == (
        "generate warning=datasets.B3.concurrency is 2 over 3 servers (0.67 in flight a server): most of them will "
        "idle; remove it to keep backend.concurrency_per_server (64) in flight for each server (192), or raise it"
    )
    params = project.path / "params.yaml"
    for own, said in ((3, False), (None, False), (1, True)):
        cfg = load_config("B3", [f"datasets.B3.concurrency={'null' if own is None else own}"], params_path=params)
        assert (cfg.concurrency_note() is not None) == said, own
