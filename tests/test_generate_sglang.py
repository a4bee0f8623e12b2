"""generate@D end to end against the protocol-faithful SGLang fake (bench/fake_server.py): nothing wrong kept (a
server-side abort is retried from its tokens), nothing generated lost (partials parked at the budget and continued
by a later run, even across a kill), fail-fast on one repeated cause, per-request seeds."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from conftest import ROOT

from bench.fake_server import FakeServer, Faults, fake_output_ids
from draftdata.generate.backends.protocol import seed_of
from draftdata.generate.run.dispatcher import RunFailed
from draftdata.util.files import read_jsonl

MAX_TOKENS = 48  # the fake never stops early: every complete answer is exactly this long (finish "length")


@pytest.fixture
def sglang_project(project, tiny_model):
    servers: list[FakeServer] = []

    def start(**kw) -> FakeServer:
        srv = FakeServer(model_path=str(tiny_model), **kw).start()
        servers.append(srv)
        project.params["backend"] = {
            "kind": "sglang",
            "urls": [srv.url],
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            "request_timeout_s": 30.0,
        }
        project.save()
        return srv

    project.set("datasets.B3.max_tokens", MAX_TOKENS)
    project.set("datasets.B3.concurrency", 8)
    project.run("prompts", "B3")
    yield project, start
    for srv in servers:
        srv.stop()


def metrics(project) -> dict:
    return json.loads((project.data("B3") / "generate_metrics.json").read_text())


def rows(project) -> dict[str, dict]:
    with sqlite3.connect(project.path / "store.sqlite") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        db.row_factory = sqlite3.Row
        found = [dict(r) for r in db.execute("SELECT * FROM responses")]
    out = {
        r["key"]: dict(r, output_ids=json.loads(r["output_ids"]), prompt_ids=json.loads(r["prompt_ids"])) for r in found
    }
    assert len(out) == len(found)  # one row per key
    return out


def calls_for(srv: FakeServer, key: str) -> list[dict]:
    """The /generate bodies of every attempt for one store key (attempt rids are `<key>-<suffix>`)."""
    return [c for c in srv.generate_calls if c["rid"].rsplit("-", 1)[0] == key]


def test_server_abort_all_mid_run_is_retried_from_the_aborted_tokens(sglang_project):
    project, start = sglang_project
    srv = start(token_delay_s=0.01)
    project.set("datasets.B3.token_budget", 1000)

    def abort_all_once_streaming() -> None:
        deadline = time.monotonic() + 30
        while len(srv.generate_calls) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.15)  # some tokens into the first batch
        req = urllib.request.Request(
            srv.url + "/abort_request",
            data=json.dumps({"abort_all": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=5).read()

    operator = threading.Thread(target=abort_all_once_streaming)
    operator.start()
    project.run("generate", "B3")
    operator.join()

    m = metrics(project)
    out = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert m["budget_met"] and m["attempt_failures"].get("aborted", 0) >= 1 and not m["failed"]
    assert all(r["finish_reason"] == "length" and r["completion_tokens"] == MAX_TOKENS for r in out)
    # aborted by the operator's abort_all, not by the run's own cancel at the budget (which names its rids)
    aborted = [rid for rid, how in srv.finished.items() if how == "abort" and rid not in srv.aborts]
    assert len(aborted) == 8
    stored = rows(project)
    for rid in aborted:  # the next attempt went on from exactly what the aborted one had produced
        key = rid.rsplit("-", 1)[0]
        first, second = calls_for(srv, key)[:2]
        prompt = first["input_ids"]
        partial = second["input_ids"][len(prompt) :]
        assert second["input_ids"][: len(prompt)] == prompt and 0 < len(partial) < MAX_TOKENS
        assert partial == fake_output_ids(prompt, len(partial))
        assert second["sampling_params"]["max_new_tokens"] == MAX_TOKENS - len(partial)
        r = stored[key]
        assert r["finish_reason"] == "length" and r["output_ids"] == partial + fake_output_ids(
            prompt + partial, MAX_TOKENS - len(partial)
        )
        assert len(r["prompt_ids"]) + r["completion_tokens"] == len(prompt) + len(partial) + (MAX_TOKENS - len(partial))
    # every first attempt carried the sampling seed derived from its key
    firsts = {}
    for c in srv.generate_calls:
        firsts.setdefault(c["rid"].rsplit("-", 1)[0], c)
    assert all(c["sampling_params"]["sampling_seed"] == seed_of(key) for key, c in firsts.items())


def run_cut_at_budget(project) -> None:
    """Generate B3 to a budget of 600 under landing finished, which fills the batch and cancels what is in flight at
    the budget (exact admits only what its landing needs: whether anything is in flight at the end would be timing)."""
    project.set("datasets.B3.landing", "finished")
    project.set("datasets.B3.token_budget", 600)
    project.run("generate", "B3")


def parked(project) -> dict[str, dict]:
    return {k: r for k, r in rows(project).items() if r["finish_reason"] == "budget_cut"}


def test_partials_cut_at_the_budget_are_parked_then_continued(sglang_project):
    project, start = sglang_project
    srv = start(token_delay_s=0.004, noise=0.5)  # requests progress unevenly: some are mid-way at the budget
    run_cut_at_budget(project)
    m1 = metrics(project)
    cut = parked(project)
    # cancel mode: complete responses only in the output, every cut request parked with all its token ids
    assert cut and m1["lost_tokens"] == 0 and m1["parked_tokens"] == sum(r["completion_tokens"] for r in cut.values())
    assert all(0 < len(r["output_ids"]) == r["completion_tokens"] < MAX_TOKENS for r in cut.values())
    assert all(r["finish_reason"] == "length" for r in read_jsonl(project.data("B3") / "responses.jsonl"))

    project.set("datasets.B3.token_budget", 2000)
    project.run("generate", "B3")
    m2 = metrics(project)
    after = rows(project)
    continued = [k for k in cut if after[k]["finish_reason"] == "length"]
    assert continued and m2["continued"] >= len(continued)
    assert m2["continued_tokens"] >= sum(cut[k]["completion_tokens"] for k in continued)
    for k in continued:
        ids = cut[k]["output_ids"]
        body = calls_for(srv, k)[-1]
        prompt = after[k]["prompt_ids"]
        assert body["input_ids"] == prompt + ids and body["sampling_params"]["max_new_tokens"] == MAX_TOKENS - len(ids)
        assert body["sampling_params"]["sampling_seed"] == (seed_of(k) + len(ids)) & 0x7FFFFFFF
        # prompt + partial + rest: the response is as long as one never interrupted
        assert after[k]["output_ids"] == ids + fake_output_ids(prompt + ids, MAX_TOKENS - len(ids))
        assert after[k]["completion_tokens"] == MAX_TOKENS


def test_kill_during_continuation_loses_nothing(sglang_project):
    project, start = sglang_project
    srv = start(token_delay_s=0.004, noise=0.5)
    run_cut_at_budget(project)
    cut = parked(project)
    assert cut

    srv.token_delay_s = 0.05  # slow, so continuations are in flight when the kill lands
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.generate", "dataset=B3", "datasets.B3.token_budget=2000"],
        cwd=project.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not any(len(calls_for(srv, k)) >= 2 for k in cut):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        time.sleep(0.02)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)

    between = rows(project)
    for k, r in cut.items():  # a parked partial is never shortened or lost: still parked, or completed
        assert between[k]["output_ids"][: len(r["output_ids"])] == r["output_ids"]

    srv.token_delay_s = 0.004
    project.set("datasets.B3.token_budget", 2000)
    project.run("generate", "B3")
    m = metrics(project)
    final = rows(project)
    out = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert m["budget_met"] and all(r["completion_tokens"] == MAX_TOKENS for r in out)
    assert len({r["id"] for r in out}) == len(out)
    for k, r in cut.items():
        if final[k]["finish_reason"] == "length":
            assert final[k]["output_ids"][: len(r["output_ids"])] == r["output_ids"]
            assert len(final[k]["output_ids"]) == MAX_TOKENS


def test_one_cause_failing_every_request_stops_the_run(sglang_project):
    project, start = sglang_project
    srv = start()
    srv.faults = Faults(status=400, status_times=10**6)
    project.set("datasets.B3.token_budget", 2000)
    with pytest.raises(RunFailed) as err:
        project.run("generate", "B3")
    message = str(err.value)
    assert "http_400" in message and "16 requests" in message and "\n" not in message
    assert 16 <= len(srv.generate_calls) <= 16 + 8  # the failing ones, and at most a batch already in flight


def test_plain_requests_without_an_abort_answer_report_estimated_loss(sglang_project, tiny_model):
    """Over the OpenAI API with plain (non-streamed) requests, a request cancelled at the budget tells nothing of
    what it had generated: the loss is estimated and flagged as such, never reported as 0."""
    project, start = sglang_project
    srv = start(token_delay_s=0.004, noise=0.5)  # uneven progress: requests are mid-way at the budget
    project.params["backend"].update(kind="openai", prompt_format="ids", return_token_ids=True, stream=False)
    project.save()
    run_cut_at_budget(project)
    m = metrics(project)
    assert m["budget_met"] and m["cancelled_in_flight"] > 0
    assert m["lost_estimated"] and m["lost_tokens"] > 0 and m["parked_tokens"] == 0
    assert srv.disconnects  # cancelling closed the connections: the OpenAI-style abort


def test_the_controller_reads_the_servers_throughput(sglang_project):
    """The loop feeds the controller one reading a second: tokens streamed per second and the time-averaged batch.
    On a server decoding 8 × 200 tokens/s, the full-batch rate it learns is that rate, give or take the test
    machine's own load."""
    project, start = sglang_project
    start(token_delay_s=0.005, noise=0.02)
    project.set("datasets.B3.token_budget", 9_000)
    project.set("datasets.B3.max_prompts", None)
    project.run("prompts", "B3")
    project.run("generate", "B3")
    server = metrics(project)["server"]
    assert server["full_readings"] >= 4
    assert 0.5 * 1600 <= server["full_batch_tok_s"] <= 1.1 * 1600


def test_answers_with_ids_and_no_text_are_judged_by_their_ids(sglang_project, tiny_model):
    """SGLang started with --skip-tokenizer-init streams `output_ids` and no `text`: each answer's text is decoded
    from its ids, and the answers enter the output (they went in as `empty`, every prompt of the source sent)."""
    from transformers import AutoTokenizer

    from bench.fake_server import GreedyModel

    project, start = sglang_project
    tok = AutoTokenizer.from_pretrained(tiny_model)
    start(model=GreedyModel(tok), skip_tokenizer_init=True)
    project.set("datasets.B3.token_budget", 200)
    project.run("generate", "B3")
    m = metrics(project)
    assert m["budget_met"] and "empty" not in m["skipped"]
    out = list(read_jsonl(project.data("B3") / "responses.jsonl"))
    assert out and all(r["text"].strip() for r in out)
    assert all(r["text"] == tok.decode(r["output_ids"], skip_special_tokens=True) for r in out)


def test_a_run_whose_answers_are_all_unusable_stops_early_and_fails(sglang_project):
    """Every answer cut at max_tokens under on_truncation: drop: none can enter the output. The run stops after
    fail_fast_after answers with one line naming the reason and fails, rather than send the whole source and exit
    as a success with an empty output."""
    project, start = sglang_project
    srv = start()  # the fake never stops early: every answer is cut at max_tokens
    project.set("datasets.B3.on_truncation", "drop")
    project.set("datasets.B3.token_budget", 2000)
    with pytest.raises(RunFailed) as err:
        project.run("generate", "B3")
    message = str(err.value)
    assert "truncated_dropped" in message and "max_tokens" in message and "\n" not in message
    assert 16 <= len(srv.generate_calls) <= 16 + 8  # at most a batch past the window, not the 150 prompts
