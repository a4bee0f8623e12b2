"""The proof's bookkeeping (bench/drafter_runs.py): each run keyed by what its figures depend on, kept as it ends and
taken back by key, the comparisons and the scaling fit; its report section; and, under the `trainers` marker, the
whole path (data through the stages, nested budgets, runs, the draft-and-verify loop, a cut run picked up) on the
small trained target in seconds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from bench import drafter_runs as dr
from bench import report_proof

TRAINERS_PYTHON = os.environ.get("DRAFTDATA_TRAINERS_PYTHON")


def spec(**over) -> dict:
    variants = [
        {"name": "correct", "export": "all", "layers": [1, 3, 4], "final": "pre", "family": "eagle3"},
        {"name": "source_answers", "export": "source", "layers": [1, 3, 4], "final": "pre", "family": "eagle3"},
    ]
    base = {
        "hidden_size": 64,
        "max_len": 512,
        "lr": 3e-3,
        "max_anchors": 128,
        "threads": 1,
        "device": "cpu",
        "eval_layers": [1, 3, 4],
        "block_layers": [1, 2, 3, 4, 5],
        "eval": {"export": "all", "rows": [0, 5]},
        "vocab_mappings": {},
        "variants": variants,
        "seeds": [0, 1, 2],
        "steps": 100,
        "train_rows": {"all": [1, 2, 3], "source": [1, 2]},
    }
    return base | over


FPS = {"all": "fa", "source": "fs"}


def test_a_runs_key_changes_with_what_it_depends_on_and_with_nothing_else():
    runs = dr.plan(spec(), [40], FPS, {"speculators": "0.9.0"})
    assert [(r["variant"]["name"], r["seed"], r["steps"]) for r in runs] == [
        ("correct", 0, 40),  # the learning curve first: the first seed again, at its own steps
        ("correct", 0, 100),
        ("source_answers", 0, 100),
        ("correct", 1, 100),
        ("source_answers", 1, 100),
        ("correct", 2, 100),
        ("source_answers", 2, 100),
    ]
    keys = [r["key"] for r in runs]
    assert len(set(keys)) == len(keys)
    assert keys == [r["key"] for r in dr.plan(spec(), [40], dict(FPS), {"speculators": "0.9.0"})]  # the same inputs

    def changed(new: list[dict]) -> set[tuple]:
        return {(r["variant"]["name"], r["seed"], r["steps"]) for r, k in zip(new, keys) if r["key"] != k}

    every = {(r["variant"]["name"], r["seed"], r["steps"]) for r in runs}
    source = {r for r in every if r[0] == "source_answers"}
    assert changed(dr.plan(spec(), [40], FPS | {"source": "other"}, {"speculators": "0.9.0"})) == source
    assert changed(
        dr.plan(spec(train_rows={"all": [1, 2, 3], "source": [2]}), [40], FPS, {"speculators": "0.9.0"})
    ) == (source)
    assert changed(dr.plan(spec(lr=1e-3), [40], FPS, {"speculators": "0.9.0"})) == every
    assert changed(dr.plan(spec(), [40], FPS | {"all": "other"}, {"speculators": "0.9.0"})) == every  # held out: all's
    assert changed(dr.plan(spec(), [40], FPS, {"speculators": "0.9.1"})) == every
    more = dr.plan(spec(steps=200), [40], FPS, {"speculators": "0.9.0"})
    assert {r["key"] for r in more if r["steps"] == 40} == {keys[0]}  # the curve's run is not the spec's steps'


def test_runs_are_kept_and_taken_back_by_key_from_the_results_file(tmp_path):
    runs = dr.plan(spec(), [], FPS, {})
    runs_dir, other = tmp_path / "runs", tmp_path / "elsewhere"
    runs_dir.mkdir()
    other.mkdir()
    for i, run in enumerate(runs[:4]):
        (runs_dir / f"{run['key']}.json").write_text(json.dumps({"seed": run["seed"], "accepted_length": 2.0 + i}))
    (runs_dir / f"{runs[0]['key']}.verify-v1.json").write_text(json.dumps({"accepted_per_step": 2.5}))
    (runs_dir / f"{runs[0]['key']}.vllm-w1.json").write_text(json.dumps({"mean_acceptance_length": 2.4}))
    loops = {"verify": "v1", "vllm": "w1"}
    done = dr.finished(runs_dir, runs, loops)
    assert [e["key"] for e in done] == [r["key"] for r in runs[:4]]
    assert done[0]["verify"] == {"suffix": "v1", "result": {"accepted_per_step": 2.5}} and "verify" not in done[1]
    assert done[0]["vllm"]["result"] == {"mean_acceptance_length": 2.4}
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"runs": done}))
    assert dr.adopt(out, other, runs, loops) == 4  # another workdir: the four finished runs, and the served one's loops
    assert dr.finished(other, runs, loops) == done
    assert dr.adopt(out, other, runs, loops) == 0  # already there
    again = dr.finished(other, runs, {"verify": "v2", "vllm": "w1"})[0]
    assert "verify" not in again and "vllm" in again  # another loop: speculated again, vLLM's kept


def test_the_variants_figures_come_from_their_runs_at_the_specs_steps():
    entries = [
        {
            "variant": "correct",
            "seed": s,
            "steps": 100,
            "spec": {"name": "correct"},
            "result": {"seed": s, "accepted_length": a},
        }
        for s, a in ((1, 2.2), (0, 2.0), (2, 2.6))
    ]
    entries.append(
        {"variant": "correct", "seed": 0, "steps": 40, "spec": {}, "result": {"seed": 0, "accepted_length": 1.0}}
    )
    v = dr.by_variant(entries, 100)["correct"]
    assert [r["seed"] for r in v["runs"]] == [0, 1, 2]
    assert v["accepted_length"]["mean"] == pytest.approx(6.8 / 3)
    assert v["accepted_length"]["spread"] == pytest.approx(0.6)


def test_every_seed_of_ours_speculates_and_the_first_of_the_others():
    from bench import drafter

    runs = dr.plan(
        spec(variants=spec()["variants"] + [dict(spec()["variants"][0], name="no_states", final="no_states")]),
        [40],
        FPS,
        {},
    )
    chosen = drafter.verify_runs(runs, 100, ["correct", "no_states"])
    assert [(r["variant"]["name"], r["seed"]) for r in chosen] == [
        ("correct", 0),
        ("no_states", 0),
        ("correct", 1),
        ("correct", 2),
    ]
    assert [r["variant"]["name"] for r in drafter.vllm_runs(chosen)] == ["correct"] * 3  # vLLM serves no zeros


def test_the_slope_per_doubling_and_its_error_come_from_every_point():
    exact = [(x, 1.5 + 0.2 * math.log2(x / 1000)) for x in (1000, 3000, 9000)]
    fit = dr.slope_per_doubling(exact)
    assert fit["slope"] == pytest.approx(0.2) and fit["stderr"] == pytest.approx(0.0, abs=1e-12)
    noisy = exact + [(1000, 1.6), (3000, 1.7), (9000, 2.0)]
    fit = dr.slope_per_doubling(noisy)
    assert 0.1 < fit["slope"] < 0.3 and fit["stderr"] > 0 and fit["points"] == 6
    assert dr.slope_per_doubling(exact[:2])["slope"] is None  # two points give a line but no error
    assert dr.slope_per_doubling([])["slope"] is None  # none yet: a run still going on
    assert dr.slope_per_doubling([(1000, 1.5)] * 3)["slope"] is None  # one size


def test_a_comparison_is_paired_by_seed_and_judged_against_three_spreads():
    def variant(*xs):
        runs = [{"seed": s, "accepted_length": x} for s, x in enumerate(xs)]
        return {"runs": runs, "accepted_length": {"mean": sum(xs) / len(xs), "spread": max(xs) - min(xs)}}

    v = {
        "correct": variant(2.4, 2.5, 2.45),
        "source_answers": variant(2.0, 2.05, 2.1),
        "no_states": variant(2.3, 2.6, 2.4),
    }
    c = dr.compare(v, "correct", "source_answers")
    assert c["beats_by_3_spreads"] and c["every_seed"] and c["per_seed"] == [0.4, 0.45, 0.35]
    s = dr.compare(v, "correct", "no_states")
    assert not s["beats_by_3_spreads"] and not s["every_seed"]  # seed 1: 2.5 against 2.6
    assert dr.compare(v, "correct", "mid_budget") is None
    one = {"correct": variant(2.4), "source_answers": variant(2.0)}
    assert dr.compare(one, "correct", "source_answers")["beats_by_3_spreads"] is None  # one seed: no spread yet


def test_the_report_says_a_partial_run_is_partial_and_names_each_verdict():
    c = {
        "difference": 0.3,
        "larger_spread": 0.05,
        "beats_by_3_spreads": True,
        "per_seed": [0.3, 0.31],
        "every_seed": True,
    }
    assert "more than 3×" in report_proof.compare_line("x", c) and "**not**" not in report_proof.compare_line("x", c)
    assert "**not**" in report_proof.compare_line("x", c | {"beats_by_3_spreads": False})
    assert "not measured yet" in report_proof.compare_line("x", None)
    assert "one seed so far" in report_proof.compare_line("x", c | {"beats_by_3_spreads": None})
    assert "Partial: 3 of 26" in report_proof.status({"complete": False, "runs_done": 3, "runs_planned": 26})


@pytest.mark.trainers
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with speculators")
def test_the_proofs_path_runs_end_to_end_and_goes_on_where_it_stopped(tmp_path):
    """The small trained target, a few steps: every proof variant trained, the nested budgets cut from `all`'s
    export, the draft-and-verify loop's output equal to the target's greedy output; a rerun trains nothing, a lost
    run is trained again alone, and another workdir takes the runs from the results file."""
    out, work = tmp_path / "proof.json", tmp_path / "work"
    argv = [
        *("--seeds", "1", "--budgets", "3000,1500,800", "--target-steps", "100", "--steps", "10", "--curve", "5"),
        *("--variants", "correct,no_states,source_answers,matched_budget,mid_budget,small_budget"),
        *("--verify", "correct,no_states", "--verify-prompts", "3", "--verify-tokens", "16"),
        *("--out", str(out)),
    ]

    def bench(workdir: Path) -> str:
        cmd = [sys.executable, "-m", "bench.drafter", *argv, "--workdir", str(workdir)]
        env = {k: v for k, v in os.environ.items() if k != "DRAFTDATA_VLLM_PYTHON"}  # vLLM serves no head dim of 16
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    bench(work)
    r = json.loads(out.read_text())
    assert r["complete"] and r["runs_done"] == r["runs_planned"] == 7
    ds = r["datasets"]
    assert ds["small"]["trained_tokens"] < ds["mid"]["trained_tokens"] < ds["all"]["trained_tokens"]
    assert ds["mid"]["samples_outside_all"] <= 1  # the budgets nest: the smaller set is `all`'s first samples
    import pyarrow.parquet as pq

    source = pq.read_table(work / "data" / "source" / "samples.parquet", columns=["loss_mask"])["loss_mask"]
    matched = r["settings"]["dataset_params"]["matched"]["token_budget"]
    assert matched == sum(map(sum, source.to_pylist()))  # ours cut to the source's trained tokens
    assert r["proof"]["regeneration"]["better"] == "matched_budget"
    assert [p["variant"] for p in r["proof"]["scaling"]["points"]] == ["small_budget", "mid_budget", "correct"]
    assert r["proof"]["scaling"]["per_doubling"]["points"] == 3
    assert [p["steps"] for p in r["learning_curve"]] == [5, 10]
    for name in ("correct", "no_states"):
        sp = r["speculation"][name]
        assert sp["equals_greedy"], sp["mismatches"]
        assert 1 <= sp["accepted_per_step"]["mean"] <= 4 and sp["verify_steps"] > 0
    assert (
        "vllm" not in r["speculation"]["correct"]
    )  # the toy target's head dim (16) is not one vLLM's CPU build serves
    runs = sorted((work / "runs").glob("*.json"))
    stamps = {p: p.stat().st_mtime_ns for p in runs}

    log = bench(work)  # the same command again: nothing trained or verified again
    assert "accepted length" not in log and "tokens a verify step" not in log
    assert {p: p.stat().st_mtime_ns for p in runs} == stamps

    lost = next(e for e in r["runs"] if e["variant"] == "source_answers")
    (work / "runs" / f"{lost['key']}.json").unlink()
    out.write_text(json.dumps(dict(r, runs=[e for e in r["runs"] if e["key"] != lost["key"]])))
    log = bench(work)  # a run lost: trained again, alone
    assert log.count("accepted length") == 1 and "source_answers seed 0" in log

    log = bench(tmp_path / "elsewhere")  # another workdir: the data made again, every run taken from the results
    assert "7 runs taken from" in log and "accepted length" not in log and "tokens a verify step" not in log
    assert json.loads(out.read_text())["complete"]


def test_the_proof_reads_a_run_that_has_no_figure_yet():
    """The results file is written while the first runs train: nothing to compare or fit yet, and no error."""
    from bench import drafter

    p = drafter.proof({}, {})
    assert p["regeneration"] is None and p["states"] is None and p["scaling"]["points"] == []
    assert p["scaling"]["per_doubling"]["slope"] is None
    assert drafter.learning_curve([]) == [] and drafter.speculation([], {}, ["correct"], {}) == {}


VLLM_PYTHON = os.environ.get("DRAFTDATA_VLLM_PYTHON")


@pytest.mark.trainers
@pytest.mark.vllm
@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    not (TRAINERS_PYTHON and VLLM_PYTHON), reason="set DRAFTDATA_TRAINERS_PYTHON and DRAFTDATA_VLLM_PYTHON"
)
def test_on_the_real_target_vllm_counts_what_the_loop_counts(tmp_path, smollm2):
    """SmolLM2 as the target, a drafter of a few steps with a draft vocabulary: exported as speculators saves it, vLLM's
    CPU build loads it as the target's EAGLE-3 speculator (its layers, its d2t), and the draft-and-verify loop and vLLM
    both give the target's greedy output with the same accepted tokens per verify step (vLLM's own counters against
    the loop's count; a drafter this short accepts little, the bench compares them on trained ones); no_states is
    judged by the loop alone (vLLM would feed it the target's states)."""
    out = tmp_path / "proof.json"
    cmd = [
        *(sys.executable, "-m", "bench.drafter", "--target", str(smollm2), "--seeds", "1", "--steps", "3"),
        *("--budgets", "1500,800,400", "--variants", "correct,no_states", "--verify", "correct,no_states"),
        *("--verify-prompts", "2", "--verify-tokens", "12", "--draft-vocab", "512"),
        *("--workdir", str(tmp_path / "work"), "--out", str(out)),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    sp = json.loads(out.read_text())["speculation"]
    assert sp["correct"]["equals_greedy"] and sp["no_states"]["equals_greedy"], sp
    served = sp["correct"]["vllm"]
    assert served["equals_greedy"], done.stdout[-3000:]
    assert served["mean_acceptance_length"]["mean"] == pytest.approx(sp["correct"]["accepted_per_step"]["mean"])
    assert "vllm" not in sp["no_states"]
