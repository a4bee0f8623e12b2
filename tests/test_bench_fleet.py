"""The fleet benchmark's simulated servers and its accounting: the generate stage's client reads them as SGLang, the
dying server dies and comes back, and the figures add up (the fleet's figures are what the benchmark reports)."""

from __future__ import annotations

import json

import aiohttp
import pytest

from bench import fleet


def test_a_simulated_server_speaks_sglangs_stream_and_abort():
    """What the sglang backend reads: /model_info, a chunked event stream of incremental ids with the running
    completion_tokens, a finish_reason on the last chunk, `data: [DONE]`; /abort_request ends a stream with type
    abort at its next step; a continued context (prompt + partial) gets the rest of the same answer."""
    import asyncio

    # a prompt whose answer takes several chunks, so that the abort comes mid-answer
    prompt = next(
        p for i in range(100) if fleet.answer_length(p := list(range(i, i + fleet.PROMPT_LEN)), "lognormal", 512) > 64
    )
    length = fleet.answer_length(prompt, "lognormal", 512)
    f = fleet.Fleet(
        [fleet.Spec(rate=2_000.0, knee=16, noise=0.0)], {"interval": 8, "family": "lognormal", "max_tokens": 512}
    )

    async def read(session, body: dict, abort: bool = False) -> list[dict]:
        events = []
        async with session.post(f.urls[0] + "/generate", json=body) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
            async for line in resp.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if abort and len(events) == 1:
                        await session.post(f.urls[0] + "/abort_request", json={"rid": body["rid"]})
        return events

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.get(f.urls[0] + "/model_info") as resp:
                assert (await resp.json())["model_path"] == fleet.MODEL
            whole = await read(session, {"rid": "a", "input_ids": prompt, "sampling_params": {"max_new_tokens": 512}})
            cut = await read(
                session, {"rid": "b", "input_ids": prompt, "sampling_params": {"max_new_tokens": 512}}, True
            )
            done = sum((e["output_ids"] for e in cut), [])
            rest = await read(
                session,
                {"rid": "c", "input_ids": prompt + done, "sampling_params": {"max_new_tokens": 512 - len(done)}},
            )
            return whole, cut, done, rest

    try:
        whole, cut, done, rest = asyncio.run(go())
        report = f.report()
    finally:
        f.close()
    ids = sum((e["output_ids"] for e in whole), [])
    assert all(len(e["output_ids"]) <= 8 for e in whole)
    assert [e["meta_info"]["completion_tokens"] for e in whole] == [
        min(8 * (i + 1), len(ids)) for i in range(len(whole))
    ]
    assert whole[-1]["meta_info"]["finish_reason"]["type"] == ("stop" if length <= 512 else "length")
    assert all(e["meta_info"]["finish_reason"] is None for e in whole[:-1]) and len(ids) == min(length, 512)
    assert cut[-1]["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(done) < len(ids)
    assert done + sum((e["output_ids"] for e in rest), []) == ids  # continued: the rest of the same answer
    (t,) = report["servers"]  # every token decoded reached the client: the cut one's and its rest make one answer
    assert (t["requests"], t["complete"], t["aborted"], t["produced"]) == (3, 2, 1, 2 * len(ids))


def test_a_small_fleet_lands_the_budget_through_a_death_and_the_figures_add_up(tmp_path):
    out = tmp_path / "fleet.json"
    fleet.main(
        ["--servers", "3", "--intervals", "8", "--families", "bimodal", "--long-max-tokens", "0", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    # landing exact through the stage's own client: past the budget by less than one answer, nothing failed
    assert 0 <= run["kept_tokens"] - run["budget"] < 512 and not run["failed"]
    assert run["generated_tokens"] >= run["kept_tokens"]
    assert run["waste_pct"] == pytest.approx(
        100 * (run["generated_tokens"] - min(run["kept_tokens"], run["budget"])) / run["generated_tokens"], abs=1e-3
    )
    # server 0 died mid-run (its streams cut, retried elsewhere from their partials) and its tally says so
    assert run["server0"]["cut"] > 0
    assert run["time_vs_limit"] >= 1.0 and run["limit_s"] >= run["budget"] / run["fleet_tok_s"]
    assert run["client_cpu_s"] > 0 and run["servers_cpu_s"] > 0
    assert set(result["goals"]) >= {"every_run_lands_within_one_answer", "no_request_failed"}
