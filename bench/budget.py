"""Budget strategies on a simulated server: overshoot, waste and GPU time per kept token, side by side.

    python -m bench.budget [--budget 10000000] [--concurrency 150] [--seeds 3]

An exact event simulation in virtual time (so 10M tokens take seconds, not GPU-hours). Completion lengths are
lognormal (mean 3.5k, sigma 0.8) capped at max_tokens 10,240; prompts arrive in a fixed order. Two server models:

- per_request_rate: every running request decodes at the same fixed rate (throughput grows with the batch);
- compute_bound: aggregate throughput is flat above a knee of 16 running requests, so each request slows as
  more run (and a draining batch speeds up).

Between two events every running request advances at the same rate, so a request finishes when a shared
"work clock" passes its start + length: completions come off a heap, exactly.

Strategies: `cap` (7,000 samples), `check_cancel` (check the budget as responses complete, cancel the rest),
`let_finish` (stop admitting at the budget, let in-flight requests finish), `ours` (stages.budget, complete
responses only) and `ours_keep_partial` (stages.budget with keep_partial: stop at the budget and keep the
partial responses, cut). The controller is the production one; the simulator only replaces the server.

Metrics per model and strategy: overshoot_pct = (kept - budget) / budget; waste_pct = (generated - kept) /
generated; time_vs_ideal = wall time / (kept tokens / full-batch throughput).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from stages.budget import BudgetController

RESULTS = Path(__file__).parent / "results"
RATE = 50.0  # tokens/s of one request at full batch (virtual time; the ratios do not depend on it)
KNEE = 16
CAP_SAMPLES = 7000
MAX_TOKENS = 10_240
MEAN_LEN, SIGMA = 3500.0, 0.8
CHECK_EVERY_S = 0.1  # how often the keep_partial loop looks at streamed progress (virtual seconds)


def lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(MEAN_LEN) - SIGMA**2 / 2
    return [max(1, min(MAX_TOKENS, round(rng.lognormvariate(mu, SIGMA)))) for _ in range(n)]


@dataclass
class Server:
    model: str
    concurrency: int
    t: float = 0.0
    work: float = 0.0  # shared work clock: tokens each running request has advanced since t=0
    heap: list = field(default_factory=list)  # (work at which it ends, id)
    start: dict = field(default_factory=dict)  # id -> work clock at admission
    length: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.start)

    def aggregate_rate(self) -> float:
        return self.rate() * self.n

    def rate(self) -> float:
        """Tokens per second of each running request."""
        if self.model == "per_request_rate":
            return RATE
        return RATE * self.concurrency / max(self.n, KNEE)

    def admit(self, rid: int, length: int) -> None:
        self.start[rid] = self.work
        self.length[rid] = length
        heapq.heappush(self.heap, (self.work + length, rid))

    def progress(self) -> list[int]:
        return [int(self.work - s) for s in self.start.values()]

    def next_end(self) -> float:
        return self.heap[0][0]

    def advance_to_work(self, work: float) -> None:
        self.t += (work - self.work) / self.rate()
        self.work = work

    def pop_finished(self) -> tuple[int, int]:
        _, rid = heapq.heappop(self.heap)
        del self.start[rid]
        return rid, self.length.pop(rid)

    def cancel_all(self) -> int:
        """Abort everything in flight; returns the tokens those requests had generated."""
        generated = sum(self.progress())
        self.heap.clear()
        self.start.clear()
        self.length.clear()
        return generated


@dataclass
class Outcome:
    kept: int = 0
    generated: int = 0
    t: float = 0.0

    def metrics(self, budget: int, concurrency: int) -> dict:
        ideal = self.kept / (RATE * concurrency)
        return {
            "kept_tokens": self.kept,
            "generated_tokens": self.generated,
            "overshoot_pct": 100.0 * (self.kept - budget) / budget,
            "waste_pct": 100.0 * (self.generated - self.kept) / self.generated,
            "time_vs_ideal": self.t / ideal,
        }


def run_simple(strategy: str, model: str, lens: list[int], budget: int, conc: int) -> Outcome:
    """cap, check_cancel and let_finish: the server is kept full until their stop rule fires."""
    s, out = Server(model, conc), Outcome()
    queue = iter(enumerate(lens))
    admitting = True
    limit = CAP_SAMPLES if strategy == "cap" else len(lens)
    admitted = 0
    while True:
        while admitting and s.n < conc and admitted < limit:
            rid, n = next(queue)
            s.admit(rid, n)
            admitted += 1
        if not s.n:
            break
        s.advance_to_work(s.next_end())
        _, n = s.pop_finished()
        out.generated += n
        out.kept += n
        if strategy != "cap" and out.kept >= budget:
            admitting = False
            if strategy == "check_cancel":
                out.generated += s.cancel_all()
                break
    out.t = s.t
    return out


def run_ours(model: str, lens: list[int], budget: int, conc: int, keep_partial: bool,
             slack: float | None = None) -> Outcome:
    s, out = Server(model, conc), Outcome()
    ctrl = BudgetController(budget=budget, max_tokens=MAX_TOKENS, concurrency=conc, keep_partial=keep_partial)
    observe = slack is None
    ctrl.observes_rate = observe
    if slack is not None:
        ctrl.admit_slack = slack
    queue = iter(enumerate(lens))
    while True:
        for _ in range(ctrl.admit_count(s.progress())):
            rid, n = next(queue)
            s.admit(rid, n)
        if not s.n:
            break
        next_work = s.next_end()
        if keep_partial:
            # The loop checks streamed progress every CHECK_EVERY_S; stop at the first check past the budget.
            crossing = (budget - ctrl.committed + sum(s.start.values())) / s.n
            if crossing < next_work:
                step = CHECK_EVERY_S * s.rate()
                checks = math.ceil(max(0.0, crossing - s.work) / step)
                s.advance_to_work(min(next_work, s.work + checks * step))
                if ctrl.reached(s.progress()):
                    cut = s.cancel_all()  # aborted on the server, but every token is kept
                    ctrl.cut(cut)
                    out.generated += cut
                    out.kept += cut
                    break
                continue
        s.advance_to_work(next_work)
        if observe:  # what a streaming client measures: the rate over the interval that just ended
            ctrl.observe_rate(s.aggregate_rate(), s.n)
        _, n = s.pop_finished()
        out.generated += n
        ctrl.finished(n, counted=True)
        out.kept += n
        if ctrl.reached(s.progress()):
            out.generated += s.cancel_all()  # complete responses only: in-flight work is lost
            break
    out.t = s.t
    return out


STRATEGIES = ("cap", "check_cancel", "let_finish", "ours", "ours_keep_partial")
# `ours` blind to the server's rate (a backend that does not stream), at several admit_slack values
SLACK_SWEEP = {"ours_slack_0": 0.0, "ours_slack_1": 1.0, "ours_slack_2": 2.0}
MODELS = ("per_request_rate", "compute_bound")


def run(strategy: str, model: str, lens: list[int], budget: int, conc: int) -> Outcome:
    if strategy in SLACK_SWEEP:
        return run_ours(model, lens, budget, conc, keep_partial=False, slack=SLACK_SWEEP[strategy])
    if strategy.startswith("ours"):
        return run_ours(model, lens, budget, conc, keep_partial=strategy == "ours_keep_partial")
    return run_simple(strategy, model, lens, budget, conc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=10_000_000)
    ap.add_argument("--concurrency", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3, help="length draws to average over")
    ap.add_argument("--prompts", type=int, default=8000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    results: dict = {"models": {}}
    for model in MODELS:
        results["models"][model] = {}
        for strategy in (*STRATEGIES, *SLACK_SWEEP):
            runs = [run(strategy, model, lengths(args.prompts, seed), args.budget, args.concurrency).metrics(
                args.budget, args.concurrency) for seed in range(args.seeds)]
            results["models"][model][strategy] = {k: round(statistics.fmean(r[k] for r in runs), 4) for k in runs[0]}
    results["settings"] = {"budget": args.budget, "concurrency": args.concurrency, "seeds": args.seeds,
                           "mean_len": MEAN_LEN, "sigma": SIGMA, "max_tokens": MAX_TOKENS, "knee": KNEE,
                           "cap_samples": CAP_SAMPLES, "check_every_s": CHECK_EVERY_S, "rate_per_request": RATE}
    results["goals"] = goals(results["models"])
    print_table(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "budget.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {RESULTS / 'budget.json'} in {time.perf_counter() - t0:.1f}s")


def goals(models: dict) -> dict:
    out = {}
    for model, r in models.items():
        ours, kp, cc = r["ours"], r["ours_keep_partial"], r["check_cancel"]
        out[model] = {
            "ours_overshoot_le_0.5pct": ours["overshoot_pct"] <= 0.5,
            "ours_time_le_check_cancel": ours["time_vs_ideal"] <= cc["time_vs_ideal"],
            "ours_waste_le_check_cancel": ours["waste_pct"] <= cc["waste_pct"],
            "keep_partial_overshoot_le_0.5pct": kp["overshoot_pct"] <= 0.5,
            "keep_partial_waste_le_0.1pct": kp["waste_pct"] <= 0.1,
            "keep_partial_time_le_1.01": kp["time_vs_ideal"] <= 1.01,
        }
    return out


def print_table(results: dict) -> None:
    for model, rows in results["models"].items():
        print(f"\n{model}")
        print(f"  {'strategy':<18} {'overshoot %':>12} {'waste %':>9} {'time/ideal':>11}")
        for strategy, m in rows.items():
            print(f"  {strategy:<18} {m['overshoot_pct']:>12.3f} {m['waste_pct']:>9.3f} {m['time_vs_ideal']:>11.4f}")
        met = results["goals"][model]
        print("  goals: " + ", ".join(f"{k}={'ok' if v else 'MISSED'}" for k, v in met.items()))


if __name__ == "__main__":
    main()
