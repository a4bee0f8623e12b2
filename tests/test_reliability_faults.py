"""The fault suite's fast subset (bench/reliability/faults.py runs them all): generate@D against the fault server,
each run checked against the server's log; and proof that those checks catch what they are there to catch (a
planted malformed row, a lost response, a miscounted failure, a traceback)."""

from __future__ import annotations

import copy
import json
import shutil
import sqlite3

import pytest

from bench.reliability import fault_checks as fc
from bench.reliability import faults

pytestmark = pytest.mark.timeout(120)

BY_NAME = {s.name: s for s in faults.SCENARIOS}
# one per kind of outcome: a retried status (SGLang), a reset of a text-only stream (its tokens lost and counted),
# a broken stream line (tokens parked, continued by a rerun), a stream without usage, all servers dead mid-run and
# at start (one line, the store kept)
FAST = [
    "http_503",
    "reset_mid_stream_text",
    "malformed_stream_line",
    "missing_usage_stream",
    "all_dead_mid_run",
    "all_dead_at_start",
]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> faults.Context:
    return faults.prepare(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def results(ctx):
    done: dict[str, faults.Result] = {}

    def get(name: str) -> faults.Result:
        if name not in done:
            done[name] = faults.run_scenario(BY_NAME[name], ctx)
        return done[name]

    return get


@pytest.mark.parametrize("name", FAST)
def test_scenario(results, name):
    row = results(name).row
    assert row["ok"], row["detail"]
    assert row["outcome"] == row["expected"]


# ---- the checks can fail ---------------------------------------------------------------------------------------- #


def _clean(results) -> tuple[faults.Result, fc.Evidence]:
    res = results("http_503")
    ev = res.evidence
    assert ev is not None and ev.metrics["attempt_failures"] == {"http_503": 3}  # the run the plants start from
    return res, ev


def test_a_planted_malformed_row_is_caught(results, ctx, tmp_path):
    """A complete-looking row cut one token short, planted in a copy of the real store, read back as the suite
    reads it: the row check and the backing check both name it."""
    res, ev = _clean(results)
    store = tmp_path / "store.sqlite"
    shutil.copyfile(ctx.work / "http_503" / "store.sqlite", store)
    rows = fc.read_store(store)
    assert fc.check_rows(rows, ctx.model, faults.MAX_TOKENS) == [] and fc.check_backing(rows, ev.log, ctx.model) == []

    key, row = next((k, r) for k, r in rows.items() if r["completion_tokens"] > 2)
    with sqlite3.connect(store) as db:
        db.execute(
            "UPDATE responses SET output_ids = ?, completion_tokens = ? WHERE key = ?",
            (json.dumps(row["output_ids"][:-1]), row["completion_tokens"] - 1, key),
        )
    planted = fc.read_store(store)
    assert any(key[:8] in p and "not the answer" in p for p in fc.check_rows(planted, ctx.model, faults.MAX_TOKENS))
    assert any(key[:8] in p for p in fc.check_backing(planted, ev.log, ctx.model))


def test_an_error_body_stored_as_a_response_is_caught(results, ctx):
    res, ev = _clean(results)
    rows = copy.deepcopy(ev.rows)
    key = next(iter(rows))
    rows[key]["text"] = '{"object": "error", "message": "injected failure", "type": "503", "code": 503}'
    assert any("text is not the answer" in p for p in fc.check_rows(rows, ctx.model, faults.MAX_TOKENS))


def test_a_lost_response_and_miscounted_metrics_are_caught(results, ctx):
    res, ev = _clean(results)
    assert fc.check_metrics(ev, res.prompts, text_only=False, unseen_connections=False) == []

    lost = copy.deepcopy(ev)
    key = next(iter(lost.rows))
    del lost.rows[key]
    assert any("not in the store" in p for p in fc.check_backing(lost.rows, lost.log, ctx.model))
    assert any(
        "is not the stored complete response" in p
        for p in fc.check_metrics(lost, res.prompts, text_only=False, unseen_connections=False)
    )

    miscounted = copy.deepcopy(ev)
    miscounted.metrics["attempt_failures"]["http_503"] = 2
    miscounted.metrics["lost_tokens"] = 1
    problems = fc.check_metrics(miscounted, res.prompts, text_only=False, unseen_connections=False)
    assert any(p.startswith("attempt_failures") for p in problems)
    assert any(p.startswith("lost_tokens") for p in problems)

    short = copy.deepcopy(ev)
    short.responses.pop()
    assert any(p.startswith("responses") for p in fc.check_metrics(short, res.prompts, False, False))


def test_a_traceback_or_a_second_line_is_caught(results):
    res, ev = _clean(results)
    crashed = copy.deepcopy(ev)
    crashed.rc, crashed.stderr = 1, 'Traceback (most recent call last):\n  File "x.py"\nKeyError: "usage"\n'
    assert len(fc.check_process(crashed, "complete")) == 2
    chatty = copy.deepcopy(ev)
    chatty.rc, chatty.stderr = 2, "error: backend: no healthy server\nwarning: something else\n"
    assert any("2 lines" in p for p in fc.check_process(chatty, "stopped", "no healthy server"))
    vague = copy.deepcopy(ev)
    vague.rc, vague.stderr = 2, "error: the last 8 requests all failed with retries_exhausted:  (6 responses)\n"
    assert any("does not name" in p for p in fc.check_process(vague, "stopped", "retries_exhausted: connection"))
