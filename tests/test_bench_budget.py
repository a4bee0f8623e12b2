"""The budget benchmark's simulation: accounting facts that hold for any controller (its quality is what the
benchmark itself reports, not what these tests pin)."""

from __future__ import annotations

import json

import pytest

from bench import budget as bench

BUDGET = 300_000


@pytest.mark.parametrize("noise_pct", [0.0, 2.0])
@pytest.mark.parametrize("model", bench.MODELS)
def test_scenario_accounting(model, noise_pct):
    cc, ours, kp = (bench.run_scenario(model, BUDGET, noise_pct, 0, s) for s in bench.SCENARIO_STRATEGIES)
    for m in (cc, ours, kp):
        assert m["generated_tokens"] >= m["kept_tokens"] > 0
        assert m["generated_tokens"] == pytest.approx(m["kept_tokens"] + m["parked_tokens"] + m["lost_tokens"])
        assert m["time_vs_ideal"] > 0
    # check_cancel parks nothing: whatever it did not keep is lost
    assert cc["parked_tokens"] == 0 and cc["lost_pct"] == pytest.approx(cc["waste_pct"])
    # complete responses only: the run stops once the committed tokens reach the budget, never before
    assert cc["overshoot_pct"] >= 0 and ours["overshoot_pct"] >= 0
    # ours parks its partials; only the abort's latency is lost
    assert ours["lost_pct"] < 0.5
    # keep_partial keeps what streamed up to the first check past the budget
    assert 0 <= kp["overshoot_pct"] < 0.5 and kp["lost_pct"] < 0.5 and kp["parked_tokens"] == 0


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


def test_noise_changes_readings_not_lengths():
    a = bench.run_scenario("per_request_rate", BUDGET, 0.0, 1, "check_cancel")
    b = bench.run_scenario("per_request_rate", BUDGET, 2.0, 1, "check_cancel")
    assert a == b  # check_cancel never reads the rate, so only the length draw matters


def test_cli_writes_a_row_per_scenario(tmp_path, capsys):
    out = tmp_path / "budget.json"
    bench.main(
        ["--seeds", "1", "--budgets", "200000", "--noise", "0,2", "--models", "compute_bound", "--out", str(out)]
    )
    results = json.loads(out.read_text())
    assert [(r["model"], r["budget"], r["noise_pct"]) for r in results["scenarios"]] == [
        ("compute_bound", 200_000, 0.0),
        ("compute_bound", 200_000, 2.0),
    ]
    assert "ours_waste_le_half_check_cancel" in results["scenarios"][1]["goals"]
    assert "models" not in results  # the noise-free 10M side-by-side is not in this grid
    assert isinstance(results["all_goals_met"], bool)
    assert "compute_bound" in capsys.readouterr().out
