"""The budget benchmark's simulation: accounting facts that hold for any controller (its quality is what the
benchmark itself reports, not what these tests pin)."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from bench import budget as bench
from bench import budget_live
from bench.fake_server import EOS_ID, DrawnLengthModel, FakeServer

BUDGET = 300_000


@pytest.mark.parametrize("noise_pct", [0.0, 2.0])
@pytest.mark.parametrize("model", [*bench.MODELS, "compute_bound+neighbour", "per_request_rate+neighbour"])
def test_scenario_accounting(model, noise_pct):
    names = ("check_cancel", "ours", "ours_keep_partial", "ours_exact", "exact_limit")
    cc, ours, kp, exact, limit = (bench.run_scenario(model, BUDGET, noise_pct, 0, s) for s in names)
    for m in (cc, ours, kp, exact, limit):
        assert m["generated_tokens"] >= m["kept_tokens"] > 0
        parts = ("kept_tokens", "held_tokens", "parked_tokens", "lost_tokens")
        assert m["generated_tokens"] == pytest.approx(sum(m[k] for k in parts))
        assert m["time_vs_ideal"] > 0
    # check_cancel parks nothing and keeps every response it completed: whatever it did not keep is lost (its
    # waste also counts what it kept past the budget, which nobody asked for)
    assert cc["parked_tokens"] == 0 and cc["held_tokens"] == 0
    assert cc["lost_tokens"] == pytest.approx(cc["generated_tokens"] - cc["kept_tokens"])
    useful = min(cc["kept_tokens"], BUDGET)
    assert cc["waste_pct"] == pytest.approx(100 * (cc["generated_tokens"] - useful) / cc["generated_tokens"])
    # ours lands the output on the budget: past it by less than the shortest response that crosses it
    assert ours["overshoot_pct"] < 100 * bench.MAX_TOKENS / BUDGET
    # complete responses only: the run stops once the committed tokens reach the budget, never before
    assert cc["overshoot_pct"] >= 0 and ours["overshoot_pct"] >= 0
    # ours parks its partials; only the abort's latency is lost on the spot, and continuing them later costs the
    # re-prefill of each one's prompt and partial
    assert ours["aborted_pct"] < 0.5
    charge = (ours["parked_requests"] * bench.PROMPT_TOKENS + ours["parked_tokens"]) / bench.PREFILL_SPEEDUP
    assert ours["reprefill_tokens"] == pytest.approx(charge)
    assert ours["lost_pct"] == pytest.approx(
        100 * (ours["lost_tokens"] + ours["reprefill_tokens"]) / ours["generated_tokens"]
    )
    # keep_partial keeps what streamed up to the first check past the budget
    assert 0 <= kp["overshoot_pct"] < 0.5 and kp["lost_pct"] < 0.5 and kp["parked_tokens"] == 0
    # landing exact holds the shortest run of requests from the first that reaches the budget: the very output
    # exact_limit makes by sending those requests alone (it knows the lengths), in no less time
    assert exact["output_tokens"] == limit["output_tokens"] >= BUDGET
    assert limit["generated_tokens"] == limit["kept_tokens"]
    assert exact["time_vs_ideal"] >= limit["time_vs_ideal"] - 1e-9 or model.startswith(("compute", "saturating"))


@pytest.mark.parametrize("end_early", [0.0, 0.25])
@pytest.mark.parametrize("model", bench.TURN_MODELS)
def test_turn_scenario_accounting(model, end_early):
    cc, ours, kp, exact, limit = (
        bench.run_scenario(model, BUDGET, 2.0, 0, s, end_early=end_early)
        for s in ("check_cancel", "ours", "ours_keep_partial", "ours_exact", "exact_limit")
    )
    assert 0 <= exact["overshoot_pct"] < 100 * bench.MAX_TOKENS / BUDGET
    # exact_limit starts the conversations the exact output holds, no others, and loses or parks nothing; where a
    # request's rate is fixed, each conversation's turns one after another take what they take: no controller is
    # faster
    assert limit["output_tokens"] == exact["output_tokens"] >= BUDGET
    assert limit["parked_tokens"] == 0  # the last conversation's later turns, if any in flight, are dropped
    if model == "per_request_rate":
        assert exact["time_vs_ideal"] >= limit["time_vs_ideal"] - 1e-9
    for m in (cc, ours, kp, exact):
        parts = ("kept_tokens", "held_tokens", "parked_tokens", "lost_tokens")
        assert m["generated_tokens"] == pytest.approx(sum(m[k] for k in parts)) and m["kept_tokens"] > 0
    assert cc["parked_tokens"] == 0 and cc["lost_tokens"] == pytest.approx(cc["generated_tokens"] - cc["kept_tokens"])
    assert 0 <= ours["overshoot_pct"] < 100 * bench.MAX_TOKENS / BUDGET and ours["aborted_pct"] < 0.5
    assert 0 <= kp["overshoot_pct"] < 0.5 and kp["parked_tokens"] == 0


@pytest.mark.parametrize("model", bench.TURN_MODELS)
def test_turn_scenarios_in_budget_unit_total_count_what_each_turns_prompt_adds(model):
    """budget_unit total: the output's size counts what each turn's prompt adds to its conversation's sample, so it
    holds fewer completion tokens than the budget; waste and time still count decoded tokens only."""
    runs = [
        bench.run_scenario(model, BUDGET, 2.0, 0, s, end_early=0.25, unit="total")
        for s in ("check_cancel", "ours", "ours_keep_partial")
    ]
    completion = bench.run_scenario(model, BUDGET, 2.0, 0, "check_cancel", end_early=0.25)
    for m in runs:
        parts = ("kept_tokens", "held_tokens", "parked_tokens", "lost_tokens")
        assert m["generated_tokens"] == pytest.approx(sum(m[k] for k in parts))
        assert m["output_tokens"] > 1.2 * m["kept_tokens"] > 0  # the prompts' source turns count too
        useful = m["kept_tokens"] - max(0, m["output_tokens"] - BUDGET)
        assert m["waste_pct"] == pytest.approx(100 * (m["generated_tokens"] - useful) / m["generated_tokens"])
    cc, ours, kp = runs
    # check_cancel stops once the output (prompts included) reaches the budget: far fewer answers than by completions
    assert 0 <= cc["overshoot_pct"] and cc["kept_tokens"] < 0.8 * completion["kept_tokens"]
    # the turn that lands the output passes the budget by at most one answer and what its prompt adds
    assert 0 <= ours["overshoot_pct"] < 100 * (bench.MAX_TOKENS + bench.PROMPT_TOKENS) / BUDGET
    assert ours["aborted_pct"] < 0.5
    assert 0 <= kp["overshoot_pct"] < 0.5 and kp["parked_tokens"] == 0


def test_only_runs_the_groups_it_names_and_keeps_the_others_rows(tmp_path):
    out = tmp_path / "budget.json"
    args = ["--seeds", "1", "--budgets", "1000000", "--noise", "0", "--models", "compute_bound", "--workers", "1"]
    args += ["--families", "lognormal", "--end-early", "0", "--out", str(out)]
    old = {"scenarios": [{"goals": {"kept": False}}], "turn_scenarios": [{"goals": {"kept too": True}}]}
    out.write_text(json.dumps(old))
    bench.main([*args, "--only", "turn_total_scenarios"])
    results = json.loads(out.read_text())
    (row,) = results["turn_total_scenarios"]
    assert (row["model"], row["family"], row["budget_unit"], row["end_early_pct"]) == (
        "compute_bound",
        "lognormal",
        "total",
        0.0,
    )
    assert all(results[k] == old[k] for k in old)
    assert results["all_goals_met"] is False  # over every row in the file, the kept ones too
    with pytest.raises(SystemExit):
        bench.main([*args, "--only", "turns"])


class CheckedTalks(bench.Talks):
    """Talks that fail a turn sent while another turn of its conversation runs, or before the turn before it
    completed."""

    def __init__(self, convs):
        super().__init__(convs)
        self.answered: set[tuple[int, int]] = set()

    def _send(self, s, i, t):
        assert i not in {conv for conv, _ in self.flying.values()}
        assert t == 0 or (i, t - 1) in self.answered
        super()._send(s, i, t)

    def completed(self, rid):
        key = super().completed(rid)
        self.answered.add(key)
        return key


@pytest.mark.parametrize("keep_partial", [False, True])
def test_a_conversations_turns_run_one_at_a_time_and_land_from_its_first(keep_partial):
    talks = CheckedTalks(bench.conversations(0, "lognormal", 0.25))
    s, rng = bench.Server("compute_bound", bench.CONCURRENCY), random.Random(0)
    out = bench.run_controlled(s, talks, bench.TURN_BUDGET, 0.0, rng, keep_partial=keep_partial)
    turns: dict[int, list[int]] = {}
    for i, t in sorted(out.responses):
        turns.setdefault(i, []).append(t)
    assert all(ts == list(range(len(ts))) for ts in turns.values())  # the store holds each one's turns from its first
    assert max(len(ts) for ts in turns.values()) > 2
    # the slots the controller knows are an upper bound: some conversations end early
    assert any(len(c.lengths) < c.slots for c in talks.started)
    assert 0 <= out.kept - bench.TURN_BUDGET < bench.MAX_TOKENS


def test_a_noisy_neighbour_slows_the_server_in_its_episodes_and_completions_stay_exact():
    """`+neighbour`: the rate is NEIGHBOUR_FACTOR of the model's inside each episode, its own outside; a request
    ends when the work it got (the rate integrated across the episodes' edges) reaches its length, and the ideal
    time counts the episodes too."""
    s = bench.Server("per_request_rate+neighbour", bench.CONCURRENCY, seed=3)
    (start, end), after = s.slow[0], s.slow[1][0]
    assert 10 <= end - start <= 60 and after > end
    assert bench.Server("per_request_rate", bench.CONCURRENCY, seed=3).slow == []
    s.advance(start - 1)
    length = bench.RATE * (1 + (end - start) * bench.NEIGHBOUR_FACTOR + 2)  # 1 s before, the episode, 2 s after
    s.admit(length)
    assert s.rate() == bench.RATE
    s.advance(2)
    assert s.rate() == bench.RATE * bench.NEIGHBOUR_FACTOR
    assert s.until_next_end() == pytest.approx(end + 2 - s.t)
    s.complete_next()
    assert s.t == pytest.approx(end + 2)
    full = s.full_rate()
    assert s.ideal_s(full * start) == pytest.approx(start)
    assert s.ideal_s(full * (start + 1)) == pytest.approx(start + 1 / bench.NEIGHBOUR_FACTOR)
    with pytest.raises(ValueError, match="unknown server model"):
        bench.Server("compute_bound+noisy", bench.CONCURRENCY)


def test_server_models_share_the_full_batch_rate():
    full = bench.RATE * bench.CONCURRENCY
    for model in bench.MODELS:
        assert bench.per_request_rate(model, bench.CONCURRENCY, bench.CONCURRENCY) * bench.CONCURRENCY == (
            pytest.approx(full)
        )
    # below the full batch: fixed per request, flat above the knee, and in between
    n = 40
    aggregate = {m: bench.per_request_rate(m, n, bench.CONCURRENCY) * n for m in bench.MODELS}
    assert aggregate["per_request_rate"] < aggregate["saturating"] < aggregate["compute_bound"] == pytest.approx(full)


def test_knees_and_saturation_shape_the_aggregate():
    full = bench.RATE * bench.CONCURRENCY

    def aggregate(model, n):
        return bench.per_request_rate(model, n, bench.CONCURRENCY) * n

    for knee in (8, 32, 64, 150):
        model = f"compute_bound_k{knee}"
        assert aggregate(model, bench.CONCURRENCY) == pytest.approx(full)
        assert aggregate(model, knee) == pytest.approx(full)  # flat down to the knee
        assert aggregate(model, knee - 1) < full  # and falling below it
    assert aggregate("compute_bound_k150", 40) == pytest.approx(aggregate("per_request_rate", 40))
    # the smaller h, the flatter: a step's fixed cost dominates small batches less
    assert aggregate("saturating_h128", 40) < aggregate("saturating", 40) < aggregate("saturating_h8", 40) < full


def test_length_families_differ_where_they_claim():
    def draws(family):
        gen = bench.lengths(0, family)
        return sorted(next(gen) for _ in range(4000))

    lognormal, heavy, bimodal, narrow = (draws(f) for f in bench.FAMILIES)
    assert all(0 < x <= bench.MAX_TOKENS for d in (lognormal, heavy, bimodal, narrow) for x in d)
    # heavy_tail: most answers short, yet one in thirty reaches max_tokens
    assert heavy[len(heavy) // 2] < lognormal[len(lognormal) // 2] / 2
    assert heavy.count(bench.MAX_TOKENS) / len(heavy) > 0.025
    # bimodal: seven in ten are short chat answers, the rest long reasoning, and next to nothing in between
    assert 0.65 < sum(x < 2000 for x in bimodal) / len(bimodal) < 0.75
    assert sum(2000 <= x < 4000 for x in bimodal) / len(bimodal) < 0.02
    assert narrow[len(narrow) // 20] > 2400 and narrow[-len(narrow) // 20] < 3600  # 90 % within ±20 %


@pytest.mark.parametrize("family", bench.FAMILIES)
def test_every_family_reaches_the_budget(family):
    """A controller that drains a batch to nothing short of the budget must still reach it (complete responses
    only: the overshoot is never negative)."""
    for model in ("compute_bound", "compute_bound_k64", "per_request_rate"):
        assert bench.run_scenario(model, BUDGET, 2.0, 0, "ours", family=family)["overshoot_pct"] >= 0, model


def test_noise_changes_readings_not_lengths():
    a = bench.run_scenario("per_request_rate", BUDGET, 0.0, 1, "check_cancel")
    b = bench.run_scenario("per_request_rate", BUDGET, 2.0, 1, "check_cancel")
    assert a == b  # check_cancel never reads the rate, so only the length draw matters


def test_cli_writes_a_row_per_scenario(tmp_path, capsys):
    out = tmp_path / "budget.json"
    bench.main(
        [
            *("--seeds", "1", "--budgets", "200000", "--noise", "0,2", "--models", "compute_bound,per_request_rate"),
            *("--families", "lognormal,bimodal", "--workers", "2", "--out", str(out)),
        ]
    )
    results = json.loads(out.read_text())
    rows = results["scenarios"]
    assert [(r["model"], r["family"], r["budget"], r["noise_pct"]) for r in results["scenarios"]] == [
        (model, family, 200_000, noise)
        for model in ("compute_bound", "per_request_rate")
        for family in ("lognormal", "bimodal")
        for noise in (0.0, 2.0)
    ]
    # the halved waste is a goal on every compute-bound row (noise or not), never on the fixed-rate server
    assert all(("ours_waste_le_half_check_cancel" in r["goals"]) == (r["model"] == "compute_bound") for r in rows)
    assert "models" not in results  # the noise-free 10M side-by-side is not in this grid
    assert isinstance(results["all_goals_met"], bool)
    assert "compute_bound" in capsys.readouterr().out


def test_the_bench_server_draws_a_length_per_prompt_and_continues_a_cut_answer():
    model = DrawnLengthModel(lambda rng: bench.draw("lognormal", rng) / 10)
    prompts = [[3 + (7 * i + j) % 990 for j in range(16)] for i in range(50)]
    answers = [model.answer(p, 10_000) for p in prompts]
    assert all(finish == "stop" and out[-1] == EOS_ID for out, finish in answers)
    assert len({len(out) for out, _ in answers}) > 20  # drawn, not fixed
    assert [model.answer(p, 10_000) for p in prompts] == answers  # the same prompt, the same answer
    out, _ = answers[0]
    cut = len(out) // 2
    assert model.answer(prompts[0], cut) == (out[:cut], "length")
    assert model.answer(prompts[0] + out[:cut], 10_000) == (out[cut:], "stop")  # the rest of the uncut answer


def test_the_server_counts_every_token_it_produces():
    """What the live bench reads as generated: an answer cut by /abort_request (its last chunk carries every token
    produced, as SGLang's does) and a complete one."""

    async def go(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            for rid, n in (("cut", 100_000), ("whole", 40)):
                body = {"rid": rid, "input_ids": [5] * 8, "sampling_params": {"max_new_tokens": n}, "stream": True}
                async with session.post(url + "/generate", json=body) as resp:
                    async for line in resp.content:
                        if rid == "cut" and line.startswith(b"data: {"):
                            await session.post(url + "/abort_request", json={"rid": rid})

    srv = FakeServer(token_delay_s=0.001, stream_interval=16).start()
    try:
        asyncio.run(go(srv.url))
    finally:
        srv.stop()
    cut, whole = srv.log
    assert cut.outcome == "aborted" and 16 <= cut.produced == len(cut.sent) < 100_000
    assert whole.outcome == "complete" and whole.produced == len(whole.sent) == 40


def test_the_live_bench_measures_generation_on_the_server_side(tmp_path):
    out = tmp_path / "live.json"
    budget_live.main(
        [
            *("--repeats", "1", "--budget", "4000", "--concurrency", "12", "--knee", "3", "--max-tokens", "256"),
            *("--token-delay-s", "0.002", "--stream-interval", "4", "--out", str(out)),
        ]
    )
    r = json.loads(out.read_text())
    (cc,), (ours,) = r["runs"]["check_cancel"], r["runs"]["ours"]
    for m in (cc, ours):
        assert m["kept_tokens"] >= 4000 and m["generated_tokens"] >= m["streamed_tokens"] >= m["kept_tokens"]
    # check_cancel drops what was in flight; ours parks in the store all the server made for the requests it stopped
    assert cc["stopped_in_flight"] > 0 and cc["lost_pct"] > 0 and cc["parked_tokens"] == 0
    assert ours["parked_tokens"] == ours["stopped_tokens"]
    assert set(r["goals"]) == {"ours_waste_le_half_check_cancel", "ours_time_le_check_cancel"}


def test_the_live_benchs_neighbour_slows_the_server_in_its_episodes_only():
    import time

    srv = FakeServer(token_delay_s=0.01)  # not started: its token delay alone
    now = time.monotonic()
    srv.slow, srv.slow_factor = [(now - 100, now - 50), (now - 1, now + 100)], 0.5
    assert srv._delay() == pytest.approx(0.02)  # in an episode: half the rate
    srv.slow = [(now - 100, now - 50), (now + 50, now + 100)]
    assert srv._delay() == pytest.approx(0.01)  # between two


def test_the_ideal_time_goes_through_the_neighbours_episodes():
    # 1,000 tokens/s; halved from 2 s to 4 s: 2,000 tokens by 2 s, 1,000 more by 4 s, the rest at the full rate
    episodes = [(2.0, 4.0)]
    assert bench.ideal_through(1_500, 1_000, 0.5, episodes, 0.0) == pytest.approx(1.5)
    assert bench.ideal_through(2_500, 1_000, 0.5, episodes, 0.0) == pytest.approx(3.0)
    assert bench.ideal_through(4_000, 1_000, 0.5, episodes, 0.0) == pytest.approx(5.0)
    assert bench.ideal_through(1_000, 1_000, 0.5, episodes, 3.0) == pytest.approx(1.5)  # started inside it
    assert bench.ideal_through(1_000, 1_000, 0.5, episodes, 5.0) == pytest.approx(1.0)  # after it
