"""Budget strategies on a simulated server, with and without noise in the throughput the client measures.

    python -m bench.budget [--seeds 1] [--budgets 1000000,10000000] [--noise 0,2] [--models ...] [--families ...]
                           [--workers N] [--out PATH]
                           [--only scenarios,turn_scenarios,turn_total_scenarios,neighbour_scenarios]

An exact event simulation in virtual time (so 10M tokens take seconds, not GPU-hours) of a server with
`concurrency` slots. Completion lengths come from a family (FAMILIES; lognormal, mean 3.5k, sigma 0.8, is the one
the controller was tuned on) capped at max_tokens 10,240; prompts arrive in a fixed order. A server model is its
aggregate throughput R(n) with n requests running; each running request decodes at R(n) / n, and every model gives
the same full-batch rate R(concurrency) = RATE * concurrency:

- per_request_rate: every request decodes at RATE whatever runs beside it (R grows linearly with n), so an idle
  slot costs as much GPU time as a cancelled request's tokens;
- compute_bound: R is flat above a knee of 16 running requests (linear below), so a draining batch speeds up and
  keeps the throughput: draining is free down to the knee; compute_bound_kN has its knee at N (k150: the full
  batch, per_request_rate again);
- saturating: R(n) = A n / (n + h), h = 32: a decode step costs a + b n (memory-bound small batches, compute-bound
  large ones), the server that is neither; A = RATE (concurrency + h) so that R(concurrency) matches the others;
  saturating_hN has h = N.

Between two events every running request advances at the same rate, so a request finishes when a shared "work
clock" passes its start + length: completions come off a heap, exactly.

What the client sees, as the streaming generate loop does:
- a throughput reading every READING_S of virtual time (not only at completions): the true tokens generated over
  the last interval divided by its length, times (1 + N(0, noise)) from a seeded generator independent of the
  lengths, with the time-averaged number of requests in flight over that interval (n changes at completions
  and admissions). Real servers' readings wander by 1-2 % per second at a full batch; the noise-free case is
  what a controller tuned on a simulation alone would see;
- decisions (`admit_count`) at every completion and after every reading: the real loop ticks every 50 ms, but n
  changes only at completions and the controller's view of the server only at readings (and the expected
  final length of a request only grows with its progress, so a tick in between would admit nothing more);
- a cancel reaches the server ABORT_LATENCY_S after the decision, whichever strategy cancels, and what the
  in-flight requests generate meanwhile (with each one's token in progress at the decision) is never streamed:
  it is lost, and the server is busy for it (it counts in the wall time).

Strategies: `cap` (7,000 samples), `check_cancel` (keep the server full; when the committed tokens reach the budget
cancel everything in flight and throw it away), `let_finish` (stop admitting at the budget, let the batch finish),
`ours` (draftdata.generate.run.budget, complete responses only: at the budget the in-flight requests are cancelled and
their partial outputs parked for a later run, so they are not in this run's output but not lost either),
`ours_keep_partial` (draftdata.generate.run.budget with keep_partial: stop when committed + streamed progress reaches
the budget, looked at every CHECK_EVERY_S, and keep the partial responses; what streamed between the crossing and the
check is its overshoot) and `ours_slack_*` (ours blind to the server's rate, as with a backend that does not stream, at
several admit_slack values). The controller is the production one through its public API; the simulator only
replaces the server and the client's clock. What ours keeps is what the generate stage outputs: the stored responses
in prompt order (requests are admitted in it), landed on the budget (`landing`: while they fit, then the shortest
of the rest that reaches it); the complete responses it leaves out are `held` in the store, not lost.

Metrics per run: overshoot_pct = (kept - budget) / budget; waste_pct = (generated - min(kept, budget)) / generated
(every token not in the output: cancelled, parked, held or lost, and those kept past the budget, which nobody asked
for: counted as useful they would reward an overshoot); aborted_pct = lost / generated (neither output nor stored);
lost_pct adds to it the re-prefill a later run pays to continue the parked requests (prompt + partial, at
1 / PREFILL_SPEEDUP of a decode token of the full batch: the same GPU time, so it counts as tokens lost);
time_vs_ideal = wall time / (min(kept, budget) / R(concurrency)). Each is averaged over length draws (and noise
draws): `--seeds` at 10M tokens, proportionally more at smaller budgets (`seeds_for`).

Conversations (`turns: all`, `turn_scenarios`): 1 to MAX_TURNS source turns each (uniform), each turn's completion
length the family's next draw, a conversation's turns one after another (turn t+1 is sent when turn t completes),
and after each turn with a source turn left a chance (`--end-early`, 0 and 25 %) that the conversation ends there, as
a diverging tool call ends it; the controller knows only the source's turns. The budget counts completions
(budget_unit completion): prompts, whose history grows with each turn, only cost a parked turn's re-prefill (500
tokens of source turns per turn and the answers before it).
check_cancel keeps the server full with turns of conversations (started ones' next turns first) and cancels
everything at the budget; ours sends a started conversation's next turn as the controller lets the batch hold
(`turn_count`) and admits new conversations against the budget less what the started ones will still ask
(`Pending`, as the generate stage's work queue tells it); the output lands on the budget in prompt order, a
conversation's turns in order, a later turn never without the turns before it. On the two classic servers at 1M.
`turn_total_scenarios`: the same under budget_unit total, on TURN_TOTAL_FAMILIES: what each turn's prompt adds to its
conversation's sample (its PROMPT_TOKENS of source turns; the answers before it count once, as theirs) counts toward
the budget, and the controller is told so as the generate stage tells it (`prompt_mean`, the prompts in flight, what
each turn to come adds); waste and time ÷ ideal count decoded tokens, those past the budget taken off the answers,
and overshoot counts prompts and answers.

`neighbour_scenarios`: a server that shares its machine (`<model>+neighbour`): another job halves its rate for 10 to
60 s at a time, a minute apart on average, at random (NEIGHBOUR_*), on each kind of server, the tuned family and
the bimodal one, with the readings' noise; the controller sees it only through the readings, as a client does. Time
÷ ideal is over that server's own ideal (a full batch through the same slow episodes); the goals are the grid's.

Output (bench/results/budget.json): `scenarios`, one row per (model, family, budget, noise) with check_cancel, ours
and ours_keep_partial and the row's goals (on a compute-bound server with a knee below the full batch: waste at
most half of check_cancel's, in no more time, whatever the family, the knee and the noise); `models` / `goals` /
`settings`, the noise-free 10M comparison of every strategy (cap, let_finish and the slack sweep only there) on the
per_request_rate and compute_bound servers; `all_goals_met`, over every goal in the file. `--only` runs some of the
groups of rows (GROUPS) and keeps the others' rows from the file it writes.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from draftdata.generate.accounting import continuation
from draftdata.generate.land.selection import exact_landing, landing
from draftdata.generate.run.budget.controller import BudgetController, Pending

RESULTS = Path(__file__).parent / "results"
RATE = 50.0  # tokens/s of one request at full batch (virtual time; the ratios do not depend on it)
CONCURRENCY = 150
KNEE = 16  # compute_bound: the smallest batch that keeps the full throughput
SATURATION_H = 32.0  # saturating: the batch at which a step's fixed cost equals its per-request cost
CAP_SAMPLES = 7000
MAX_TOKENS = 10_240
MEAN_LEN, SIGMA = 3500.0, 0.8
# Continuing a parked request later re-prefills its prompt and its partial response. A prefill token costs
# 1 / PREFILL_SPEEDUP of a decode token of the full batch (an assumed ratio: prefill processes tokens several times
# faster than a full batch decodes them); the prompts are PROMPT_TOKENS long.
PREFILL_SPEEDUP = 5.0
PROMPT_TOKENS = 500
MAX_TURNS = 8  # conversations (`turns: all`) have 1 to MAX_TURNS source turns
READING_S = 1.0  # interval of the throughput readings the streaming client feeds the controller
CHECK_EVERY_S = 0.05  # how often the client loop looks at streamed progress (its tick)
ABORT_LATENCY_S = 0.05  # from the cancel decision to the server stopping the requests

# compute_bound is flat above KNEE; compute_bound_kN above N (k150: the full batch, which is per_request_rate);
# saturating_hN has h = N.
MODELS = (
    "per_request_rate",
    "compute_bound",
    "saturating",
    "compute_bound_k8",
    "compute_bound_k32",
    "compute_bound_k64",
    "compute_bound_k150",
    "saturating_h8",
    "saturating_h128",
)
# Length families: `lognormal` (mean 3.5k, sigma 0.8) is the one the controller's constants were tuned on; the others
# test it out of sample: heavy_tail (lognormal mean 2k, sigma 1.6: most answers short, one in thirty reaches
# max_tokens), bimodal (70 % short chat answers, mean 500, and 30 % long reasoning, mean 7k) and narrow (mean 3k,
# sigma 0.1).
FAMILIES = ("lognormal", "heavy_tail", "bimodal", "narrow")
BUDGETS = (1_000_000, 10_000_000)
NOISE_PCT = (0.0, 2.0)
SCENARIO_STRATEGIES = ("check_cancel", "ours", "ours_exact", "ours_keep_partial", "exact_limit")
TURN_STRATEGIES = SCENARIO_STRATEGIES
# landing exact may pass the budget by its last response (prompt included under budget_unit total), no more
EXACT_OVERSHOOT_TOKENS = MAX_TOKENS + PROMPT_TOKENS
# ... and take at most this much more time ÷ ideal than exact_limit, which knows the lengths to come (it sends
# exactly the requests the exact output holds, the server kept full: for conversations, it starts those the output
# holds, each turn sent as the one before it completes)
EXACT_TIME_MARGIN = 0.02
# Multi-turn rows (`turns: all`): conversations of 1 to MAX_TURNS turns on the two classic servers at 1M tokens, with
# no early ends and with a quarter of the turns that have a source turn after them ending their conversation.
TURN_MODELS, TURN_BUDGET, TURN_END_EARLY_PCT = ("per_request_rate", "compute_bound"), 1_000_000, (0.0, 25.0)
# ... and the same under budget_unit total (`turn_total_scenarios`), where a conversation's sample counts, each token
# once: on two families, the tuned one and the one of short answers among long ones.
TURN_TOTAL_FAMILIES = ("lognormal", "bimodal")
# A noisy neighbour (`neighbour_scenarios`): another job on the server's machine halves its rate for 10 to 60 s at a
# time, a minute apart on average (exponential gaps), at random: on the servers of each kind, the tuned family and the
# bimodal one, with the readings' noise.
NEIGHBOUR_FACTOR, NEIGHBOUR_SLOW_S, NEIGHBOUR_GAP_S = 0.5, (10.0, 60.0), 60.0
NEIGHBOUR_MODELS, NEIGHBOUR_FAMILIES = ("per_request_rate", "compute_bound", "saturating"), ("lognormal", "bimodal")
# The groups of rows `--only` picks from: the single-turn grid (with the side-by-side), the multi-turn rows per unit,
# the noisy neighbour's rows.
GROUPS = ("scenarios", "turn_scenarios", "turn_total_scenarios", "neighbour_scenarios")
# The side-by-side of every strategy, on the noise-free 10M case and the two classic server models.
LEGACY_BUDGET, LEGACY_MODELS = 10_000_000, ("per_request_rate", "compute_bound")
LEGACY_STRATEGIES = ("cap", "check_cancel", "let_finish", "ours", "ours_keep_partial")
SLACK_SWEEP = {"ours_slack_0": 0.0, "ours_slack_1": 1.0, "ours_slack_2": 2.0}
LEGACY_KEYS = ("kept_tokens", "generated_tokens", "overshoot_pct", "waste_pct", "time_vs_ideal")


def lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)


def draw(family: str, rng: random.Random) -> float:
    if family == "lognormal":
        return lognormal(rng, MEAN_LEN, SIGMA)
    if family == "heavy_tail":
        return lognormal(rng, 2000.0, 1.6)
    if family == "bimodal":
        return lognormal(rng, 500.0, 0.5) if rng.random() < 0.7 else lognormal(rng, 7000.0, 0.3)
    if family == "narrow":
        return lognormal(rng, 3000.0, 0.1)
    raise ValueError(f"unknown length family {family!r}")


def lengths(seed: int, family: str = "lognormal") -> Iterator[int]:
    """Completion lengths in prompt order; endless, so no strategy runs out of prompts."""
    rng = random.Random(seed)
    while True:
        yield max(1, min(MAX_TOKENS, round(draw(family, rng))))


def server_param(model: str, prefix: str, default: float) -> float:
    """The N of `<prefix>_kN` / `<prefix>_hN`, or the default of the bare name."""
    return float(model.rsplit("_", 1)[1][1:]) if model != prefix else default


def per_request_rate(model: str, n: int, concurrency: int) -> float:
    """Tokens per second of each of n running requests: R(n) / n."""
    if model == "per_request_rate":
        return RATE
    if model.startswith("compute_bound"):
        knee = min(server_param(model, "compute_bound", KNEE), concurrency)
        return RATE * concurrency / max(n, knee)
    if model.startswith("saturating"):
        h = server_param(model, "saturating", SATURATION_H)
        return RATE * (concurrency + h) / (n + h)
    raise ValueError(f"unknown server model {model!r}")


def slow_episodes(seed: int, horizon: float) -> list[tuple[float, float]]:
    """A noisy neighbour's episodes up to `horizon` s: (start, end), each NEIGHBOUR_SLOW_S long (uniform), the gaps
    between them exponential with mean NEIGHBOUR_GAP_S; from their own generator (the lengths and the readings'
    noise stay as they were)."""
    rng = random.Random(f"neighbour/{seed}")
    out, t = [], rng.expovariate(1 / NEIGHBOUR_GAP_S)
    while t < horizon:
        end = t + rng.uniform(*NEIGHBOUR_SLOW_S)
        out.append((t, end))
        t = end + rng.expovariate(1 / NEIGHBOUR_GAP_S)
    return out


def episode_at(slow: list[tuple[float, float]], factor: float, t: float) -> tuple[float, float]:
    """A noisy neighbour's effect at time t: (the rate's factor then, 1 or `factor`; when that next changes), for
    `slow` episodes (start, end) in order."""
    i = bisect.bisect_right(slow, (t, math.inf))  # episodes starting at or before t
    if i and t < slow[i - 1][1]:
        return factor, slow[i - 1][1]
    return 1.0, slow[i][0] if i < len(slow) else math.inf


def ideal_through(tokens: float, rate: float, factor: float, slow: list[tuple[float, float]], t: float = 0.0) -> float:
    """Seconds a full batch at `rate` takes for `tokens` from time t on, at `factor` of it during the `slow`
    episodes (what no strategy can beat)."""
    start = t
    while True:
        f, change = episode_at(slow, factor, t)
        r = rate * f
        if tokens <= r * (change - t):
            return t + tokens / r - start
        tokens -= r * (change - t)
        t = change


def idle_costs(model: str) -> bool:
    """Servers on which a batch below the full one loses throughput right away (no flat part to drain into)."""
    return model in ("per_request_rate", "compute_bound_k150")


@dataclass
class Server:
    """`model` is a server model's name, with `+neighbour` a server that shares its machine: its rate drops to
    NEIGHBOUR_FACTOR during `slow` episodes (slow_episodes). The rate is constant between events and episode edges,
    so completions stay exact."""

    model: str
    concurrency: int
    seed: int = 0
    t: float = 0.0
    work: float = 0.0  # shared work clock: tokens each running request has advanced since t=0
    heap: list = field(default_factory=list)  # (work at which it ends, id)
    start: dict = field(default_factory=dict)  # id -> work clock at admission
    length: dict = field(default_factory=dict)
    start_sum: float = 0.0  # so the streamed total is O(1): n * work - sum of starts
    ids: Iterator[int] = field(default_factory=itertools.count)
    window_tokens: float = 0.0  # generated since the last reading
    window_n_s: float = 0.0  # integral of n dt since the last reading
    window_start: float = 0.0  # when the current reading interval began
    slow: list = field(default_factory=list)  # the noisy neighbour's episodes, (start, end), in order

    def __post_init__(self) -> None:
        self.base, _, neighbour = self.model.partition("+")
        if neighbour and neighbour != "neighbour":
            raise ValueError(f"unknown server model {self.model!r}")
        if neighbour:  # far past any run's end: a run of 10M tokens lasts about 1,400 s at full rate
            self.slow = slow_episodes(self.seed, horizon=1e6)

    @property
    def n(self) -> int:
        return len(self.start)

    def _episode(self, t: float) -> tuple[float, float]:
        """(the rate's factor at t, when it next changes)."""
        return episode_at(self.slow, NEIGHBOUR_FACTOR, t)

    def rate(self) -> float:
        return per_request_rate(self.base, self.n, self.concurrency) * self._episode(self.t)[0]

    def until_next_change(self) -> float:
        return self._episode(self.t)[1] - self.t

    def full_rate(self) -> float:
        return RATE * self.concurrency

    def ideal_s(self, tokens: float) -> float:
        """Seconds a full batch would take for `tokens` from t = 0 on this server, the neighbour's episodes included
        (what no strategy can beat)."""
        return ideal_through(tokens, self.full_rate(), NEIGHBOUR_FACTOR, self.slow)

    def admit(self, length: int) -> int:
        rid = next(self.ids)
        self.start[rid] = self.work
        self.length[rid] = length
        self.start_sum += self.work
        heapq.heappush(self.heap, (self.work + length, rid))
        return rid

    def progress(self) -> list[int]:
        """Whole tokens streamed so far by each request in flight (what the client can count)."""
        return [int(self.work - s) for s in self.start.values()]

    def progress_by_id(self) -> dict[int, int]:
        return {rid: int(self.work - s) for rid, s in self.start.items()}

    def streamed(self) -> float:
        return self.n * self.work - self.start_sum

    def until_next_end(self) -> float:
        """Seconds to the next completion, across the episodes' edges."""
        if not self.heap:
            return math.inf
        need, t = self.heap[0][0] - self.work, self.t
        while True:
            factor, change = self._episode(t)
            r = per_request_rate(self.base, self.n, self.concurrency) * factor
            if need <= r * (change - t):
                return t + need / r - self.t
            need -= r * (change - t)
            t = change

    def advance(self, dt: float) -> None:
        """Run dt seconds with no completion in between (the caller picks dt no later than the next one)."""
        end = self.t + dt
        while True:
            step = min(end - self.t, self.until_next_change())
            if self.n:
                r = self.rate()
                self.work += step * r
                self.window_tokens += self.n * r * step
                self.window_n_s += self.n * step
            if self.t + step >= end:
                self.t = end
                return
            self.t += step

    def complete_next(self) -> tuple[int, int]:
        """Run to the next completion and retire it; returns its id (prompt order) and length."""
        end, rid = self.heap[0]
        self.advance(self.until_next_end())
        self.work = end  # no float drift between the heap and the clock
        heapq.heappop(self.heap)
        self.start_sum -= self.start.pop(rid)
        return rid, self.length.pop(rid)

    def reading(self, noise: float, rng: random.Random) -> tuple[float, float]:
        """(tokens/s, time-averaged in flight) over the interval since the last reading, then a new interval."""
        interval = self.t - self.window_start
        tokens_per_s = self.window_tokens / interval
        if noise:
            tokens_per_s *= 1 + rng.gauss(0.0, noise)
        # Rounded: summing n * dt over the interval's segments leaves float error, and a full batch read as
        # 149.9999999 in flight would pass for a drained one.
        in_flight = round(self.window_n_s / interval, 6)
        self.window_tokens = self.window_n_s = 0.0
        self.window_start = self.t
        return tokens_per_s, in_flight

    def abort_all(self, streamed: int) -> float:
        """Cancel everything in flight, of which the client has seen `streamed` whole tokens. The server goes on
        for ABORT_LATENCY_S (requests that end meanwhile end on the server, unseen by the client, which has
        already let go); returns the tokens generated and never streamed: the tokens in progress at the
        decision and those of the latency."""
        unstreamed = self.streamed() - streamed
        before, left = self.window_tokens, ABORT_LATENCY_S
        while self.n and self.until_next_end() <= left:
            left -= self.until_next_end()
            self.complete_next()
        self.advance(left)
        self.heap.clear()
        self.start.clear()
        self.length.clear()
        self.start_sum = 0.0
        return unstreamed + self.window_tokens - before


@dataclass
class Outcome:
    kept: int = 0  # the output's tokens in the budget's unit (budget_unit total: prompts included)
    kept_completion: int = 0  # the output's completion tokens (what was decoded for it)
    parked: float = 0.0  # partial outputs set aside for a later run: not in the output, not lost
    held: int = 0  # complete responses the output leaves out (draftdata.generate.run.budget.landing), kept in the store
    lost: float = 0.0  # generated and neither kept nor parked
    # what continuing the parked requests will cost: re-prefilling each one's prompt and partial, in decode tokens
    # of the full batch (the same GPU time)
    reprefill: float = 0.0
    parked_requests: int = 0
    t: float = 0.0
    responses: dict = field(default_factory=dict)  # id (prompt order) -> completion tokens of each one the store keeps
    prompts: dict = field(default_factory=dict)  # id -> its prompt tokens where they count (budget_unit total)

    def keep(self, length: int, prompt: int) -> None:
        """A complete response kept as it came (check_cancel, let_finish, cap: no landing)."""
        self.kept += length + prompt
        self.kept_completion += length

    def land(self, budget: int, exact: bool = False) -> None:
        """The output the generate stage selects from the responses: landed on the budget, in prompt order (a
        conversation's turns, keyed (conversation, turn), in order: a later turn only after the turns before it);
        `exact`: landing exact, the shortest run from the first that reaches it (the run settled it)."""
        keys = sorted(self.responses)
        sizes = [self.responses[k] + self.prompts.get(k, 0) for k in keys]
        heads = [k[1] == 0 for k in keys] if keys and isinstance(keys[0], tuple) else None
        chosen = exact_landing(sizes, budget) if exact else landing(sizes, budget, heads)
        self.kept = sum(sizes[i] for i in chosen)
        self.kept_completion = sum(self.responses[keys[i]] for i in chosen)
        self.held = sum(self.responses.values()) - self.kept_completion

    def metrics(self, budget: int, ideal_s) -> dict:
        """`ideal_s(tokens)`: the server's time for that many tokens at full batch (Server.ideal_s)."""
        generated = self.kept_completion + self.held + self.parked + self.lost
        # Tokens past the budget were not asked for: counted as useful they would reward overshooting, and a run
        # that leaves them out of its output (landing) would look worse than the same run keeping them. Under
        # budget_unit total they are taken off the completions (a prompt's tokens cost no decode).
        useful = self.kept_completion - max(0, self.kept - budget)
        return {
            "kept_tokens": self.kept_completion,
            "output_tokens": self.kept,
            "generated_tokens": generated,
            "held_tokens": self.held,
            "parked_tokens": self.parked,
            "lost_tokens": self.lost,
            "reprefill_tokens": self.reprefill,
            "parked_requests": self.parked_requests,
            "overshoot_pct": 100.0 * (self.kept - budget) / budget,
            "waste_pct": 100.0 * (generated - useful) / generated,
            "lost_pct": 100.0 * (self.lost + self.reprefill) / generated,
            "aborted_pct": 100.0 * self.lost / generated,
            "time_vs_ideal": self.t / ideal_s(useful),
        }


class Prompts:
    """Single requests in prompt order (`turns: last`): a response is keyed by its request's id."""

    def __init__(self, lens: Iterator[int]):
        self.lens = lens

    def send_next(self, s: Server) -> None:
        s.admit(next(self.lens))

    def admit(self, s: Server, ctrl: BudgetController, progress: list[int]) -> None:
        # A controller fed time-averaged in_flight may learn a fractional knee, and then allow a fractional count:
        # only whole requests can be sent.
        for _ in range(int(ctrl.admit_count(progress))):
            s.admit(next(self.lens))

    def completed(self, rid: int) -> int:
        return rid

    def key(self, rid: int) -> int:
        return rid

    def prompt(self, rid: int) -> int:
        return PROMPT_TOKENS

    def counted_prompt(self, rid: int) -> int:
        """Prompt tokens that count toward the budget: none, the single-turn rows count completions."""
        return 0

    def in_flight_prompts(self) -> list[int]:
        return []


@dataclass
class Conversation:
    slots: int  # its source's assistant turns: what the generate stage knows of it
    lengths: list[int]  # each regenerated turn's completion length, as far as it goes (it may end early)


def conversations(seed: int, family: str, end_early: float) -> Iterator[Conversation]:
    """Conversations in prompt order, endless: 1 to MAX_TURNS source turns (uniform), each turn's length from the
    family, and after each turn with a source turn left a chance `end_early` that the conversation ends there (a
    call that diverges from the source's). Slots and ends come from their own generator, so the lengths are the
    family's draws in order, as in the single-turn rows."""
    lens, rng = lengths(seed, family), random.Random(f"turns/{seed}")
    while True:
        slots, turns = rng.randint(1, MAX_TURNS), 1
        while turns < slots and rng.random() >= end_early:
            turns += 1
        yield Conversation(slots, [next(lens) for _ in range(turns)])


class Talks:
    """Conversations (`turns: all`) as the generate stage sends them: a started conversation's next turn once its
    previous one completes, ahead of new conversations, as the controller lets the batch hold (`turn_count`); new
    ones as it admits them, told what the started ones will still ask (`Pending`). A response is keyed
    (conversation, turn). `prompts_count` (budget_unit total): what every turn's prompt adds to its conversation's
    sample (PROMPT_TOKENS of source turns: the answers before it are counted already) counts toward the budget, and
    the controller is told so as the generate stage tells it."""

    def __init__(self, convs: Iterator[Conversation], prompts_count: bool = False):
        self.convs = convs
        self.prompts_count = prompts_count
        self.started: list[Conversation] = []  # by index: prompt order
        self.upcoming: deque[Conversation] = deque()  # drawn to be priced, not started yet
        self.ready: deque[tuple[int, int]] = deque()  # (conversation, turn) whose previous turn completed
        self.flying: dict[int, tuple[int, int]] = {}  # request id -> (conversation, turn)
        self.went_on = self.could_go_on = 0  # completed turns with a source turn after: went on to it, all

    def _send(self, s: Server, i: int, t: int) -> None:
        self.flying[s.admit(self.started[i].lengths[t])] = (i, t)

    def _start(self, s: Server) -> None:
        self.started.append(self.upcoming.popleft() if self.upcoming else next(self.convs))
        self._send(s, len(self.started) - 1, 0)

    def send_next(self, s: Server) -> None:
        """Keep the server full (check_cancel): a started conversation's next turn, else a new conversation."""
        if self.ready:
            self._send(s, *self.ready.popleft())
        else:
            self._start(s)

    def admit(self, s: Server, ctrl: BudgetController, progress: list[int]) -> None:
        for _ in range(min(len(self.ready), ctrl.turn_count(progress, self.in_flight_prompts()))):
            self._send(s, *self.ready.popleft())
        progress = s.progress()
        room = s.concurrency - s.n
        if room > 0:
            for _ in range(int(ctrl.admit_count(progress, self.in_flight_prompts(), self.pending(room)))):
                self._start(s)

    def pending(self, room: int) -> Pending:
        """What the work queue tells the controller: each conversation's source turns left and, where prompts count,
        what each turn's prompt adds to the sample (PROMPT_TOKENS of source turns, its first turn's included)."""
        step = PROMPT_TOKENS if self.prompts_count else 0
        started = [(1, self.started[i].slots - t - 1, step) for i, t in self.flying.values()]
        started += [(0, self.started[i].slots - t, step) for i, t in self.ready]
        while len(self.upcoming) < room:
            self.upcoming.append(next(self.convs))
        upcoming = [(0, c.slots, step) for c in itertools.islice(self.upcoming, room)]
        carry = continuation(self.went_on, self.could_go_on)
        return Pending(started, upcoming, growth=step, prompts=self.prompts_count, carry=carry)

    def completed(self, rid: int) -> tuple[int, int]:
        i, t = self.flying.pop(rid)
        conv = self.started[i]
        if t + 1 < conv.slots:  # as the generate stage counts them (ConversationQueue.settled)
            self.could_go_on += 1
            self.went_on += t + 1 < len(conv.lengths)
        if t + 1 < len(conv.lengths):
            self.ready.appendleft((i, t + 1))  # ahead of the others: its history is warm
        return i, t

    def key(self, rid: int) -> tuple[int, int]:
        return self.flying[rid]

    def prompt(self, rid: int) -> int:
        """A turn's prompt is the conversation so far: PROMPT_TOKENS of source turns per turn and the answers
        before it (what a parked turn's continuation re-prefills)."""
        return self._prompt(*self.flying[rid])

    def _prompt(self, i: int, t: int) -> int:
        return PROMPT_TOKENS * (t + 1) + sum(self.started[i].lengths[:t])

    def counted_prompt(self, rid: int) -> int:
        """What the turn's prompt adds to its conversation's sample: its source turns (the answers before it count
        as theirs), as the generate stage counts budget_unit total."""
        return PROMPT_TOKENS if self.prompts_count else 0

    def in_flight_prompts(self) -> list[int]:
        return [self.counted_prompt(rid) for rid in self.flying]


Work = Prompts | Talks


class Frontier:
    """landing exact as the loop sees it (draftdata.generate.land.selection.Landed): what the settled run of responses
    from the first counts. Requests are keyed in prompt order; a conversation is settled once its last turn is in,
    and the first one not settled adds the turns it has (they start it)."""

    def __init__(self, work: Work):
        self.work, self.at, self.total = work, 0, 0

    def landed(self, out: Outcome) -> int:
        if isinstance(self.work, Prompts):
            while self.at in out.responses:
                self.total += out.responses[self.at] + out.prompts.get(self.at, 0)
                self.at += 1
            return self.total
        started = self.work.started
        while self.at < len(started) and all(
            (self.at, t) in out.responses for t in range(len(started[self.at].lengths))
        ):
            self.total += self._turns(out, self.at, len(started[self.at].lengths))
            self.at += 1
        if self.at == len(started):
            return self.total
        answered = next(t for t in itertools.count() if (self.at, t) not in out.responses)
        return self.total + self._turns(out, self.at, answered)

    @staticmethod
    def _turns(out: Outcome, i: int, n: int) -> int:
        return sum(out.responses[(i, t)] + out.prompts.get((i, t), 0) for t in range(n))


def run_simple(strategy: str, s: Server, work: Work, budget: int) -> Outcome:
    """cap, check_cancel, let_finish and exact_limit: the server is kept full until their stop rule fires. They
    neither read the server's rate nor look at partial progress, so only completions matter."""
    out = Outcome()
    admitting, admitted = True, 0
    limit = CAP_SAMPLES if strategy == "cap" else math.inf
    frontier = None
    if strategy == "exact_limit":
        limit, frontier = exact_cut(work, budget), Frontier(work)
    while True:
        while admitting and s.n < s.concurrency and (admitted < limit or isinstance(work, Talks) and work.ready):
            started = isinstance(work, Talks) and not work.ready  # send_next starts a conversation
            work.send_next(s)
            admitted += started or isinstance(work, Prompts)
        if not s.n:
            break
        rid, length = s.complete_next()
        out.keep(length, work.counted_prompt(rid))
        if frontier is not None:  # landed as landing exact lands
            out.responses[work.key(rid)] = length
            if prompt := work.counted_prompt(rid):
                out.prompts[work.key(rid)] = prompt
        work.completed(rid)
        if frontier is not None and frontier.landed(out) >= budget:  # settled: the last conversation's later turns
            streamed = sum(s.progress())  # are not the output's (their tokens lost, as check_cancel's)
            out.lost += streamed + s.abort_all(streamed)
            break
        # exact_limit ends with the conversations it started (a later one's turn may cross the budget first)
        if strategy not in ("cap", "exact_limit") and out.kept >= budget:
            admitting = False
            if strategy == "check_cancel":
                streamed = sum(s.progress())
                out.lost += streamed + s.abort_all(streamed)  # nothing parked: every cancelled token is lost
                break
    out.t = s.t
    if strategy == "exact_limit":
        out.land(budget, exact=True)
    return out


def exact_cut(work: Work, budget: int) -> int:
    """How many requests (conversations), in prompt order, the exact rule's output holds: known here from the
    lengths to come, which no controller knows (`exact_limit`)."""
    if isinstance(work, Prompts):
        ahead, work.lens = itertools.tee(work.lens)
        sizes: Iterator[int] = ahead
    else:
        ahead, work.convs = itertools.tee(work.convs)
        step = PROMPT_TOKENS if work.prompts_count else 0
        sizes = (sum(c.lengths) + step * len(c.lengths) for c in ahead)
    total = 0
    for n, size in enumerate(sizes, 1):
        total += size
        if total >= budget:
            return n
    raise AssertionError("lengths are endless")


def next_check(s: Server, ctrl: BudgetController, budget: int, prompts: int = 0) -> float:
    """The first tick of the client loop at which committed + streamed (+ the `prompts` in flight, where they
    count) can have reached the budget (ticks are on a fixed CHECK_EVERY_S grid; readings fall on it too). The
    batch streams at a constant rate until the next event, so the crossing is exact and the ticks before it,
    which would change nothing, are skipped."""
    after = math.floor(s.t / CHECK_EVERY_S + 1e-9) + 1  # the tick strictly after now
    rate = s.n * s.rate()
    crossing = s.t + max(0.0, budget - ctrl.committed - s.streamed() - prompts) / rate if rate else math.inf
    return max(after, math.ceil(crossing / CHECK_EVERY_S - 1e-9)) * CHECK_EVERY_S


def run_controlled(
    s: Server,
    work: Work,
    budget: int,
    noise: float,
    rng: random.Random,
    keep_partial: bool,
    slack: float | None = None,
    exact: bool = False,
) -> Outcome:
    """The generate loop around BudgetController: wake at completions, readings and (keep_partial) ticks. A
    controller that stalls (nothing in flight, nothing admitted) ends the run short of the budget: a negative
    overshoot says so."""
    out = Outcome()
    ctrl = BudgetController(budget=budget, max_tokens=MAX_TOKENS, concurrency=s.concurrency, keep_partial=keep_partial)
    ctrl.observes_rate = slack is None
    if slack is not None:
        ctrl.admit_slack = slack
    if isinstance(work, Talks) and work.prompts_count:
        ctrl.prompt_mean = PROMPT_TOKENS  # the generate stage's: the mean prompt of the turns it plans, all first
    frontier = Frontier(work) if exact else None
    if frontier is not None:
        ctrl.landed = 0
    work.admit(s, ctrl, [])
    readings = itertools.count(1)
    next_reading = next(readings) * READING_S  # a multiple of READING_S, so no drift over thousands
    while s.n:
        until_check = next_check(s, ctrl, budget, sum(work.in_flight_prompts())) - s.t if keep_partial else math.inf
        until_check = min(until_check, s.until_next_change())  # next_check assumes the rate holds until then
        until_reading = next_reading - s.t
        if s.until_next_end() <= min(until_reading, until_check):
            rid, length = s.complete_next()
            prompt = work.counted_prompt(rid)
            ctrl.finished(length + prompt, counted=True, length=length)
            key = work.completed(rid)
            out.responses[key] = length
            if prompt:
                out.prompts[key] = prompt
            if frontier is not None:
                ctrl.landed = frontier.landed(out)
        elif until_reading <= until_check:
            s.advance(until_reading)
            next_reading = next(readings) * READING_S
            tokens_per_s, in_flight = s.reading(noise, rng)
            if ctrl.observes_rate:
                ctrl.observe_rate(tokens_per_s, in_flight)
        else:
            s.advance(until_check)
        progress = s.progress()
        if ctrl.reached(progress, work.in_flight_prompts()):
            stop(s, ctrl, out, progress, work)
            break
        work.admit(s, ctrl, progress)
    out.t = s.t
    out.land(budget, exact)
    return out


def stop(s: Server, ctrl: BudgetController, out: Outcome, progress: list[int], work: Work) -> None:
    """At the budget: keep_partial keeps what has streamed, ours parks it; the abort's latency is lost."""
    streamed = sum(progress)
    if ctrl.keep_partial:
        ctrl.cut(streamed + sum(work.in_flight_prompts()))
        for rid, n in s.progress_by_id().items():
            out.responses[work.key(rid)] = n
            if prompt := work.counted_prompt(rid):
                out.prompts[work.key(rid)] = prompt
    else:
        out.parked += streamed
        out.parked_requests += s.n
        out.reprefill += (sum(work.prompt(rid) for rid in s.start) + streamed) / PREFILL_SPEEDUP
    out.lost += s.abort_all(streamed)


def run_scenario(
    model: str,
    budget: int,
    noise_pct: float,
    seed: int,
    strategy: str,
    concurrency: int = CONCURRENCY,
    family: str = "lognormal",
    end_early: float | None = None,
    unit: str = "completion",
) -> dict:
    """Metrics of one run. The noise draws come from their own generator, so a noise level changes the
    readings, never the lengths. `end_early`: conversations of 1 to MAX_TURNS turns (`conversations`), a turn
    ending its conversation with that chance, in the budget's `unit` (completion or total); None: single
    requests."""
    s = Server(model, concurrency, seed)
    if end_early is None:
        work: Work = Prompts(lengths(seed, family))
    else:
        work = Talks(conversations(seed, family, end_early), prompts_count=unit == "total")
    rng = random.Random(f"noise/{seed}")
    noise = noise_pct / 100.0
    if strategy in SLACK_SWEEP:
        out = run_controlled(s, work, budget, noise, rng, keep_partial=False, slack=SLACK_SWEEP[strategy])
    elif strategy in ("ours", "ours_exact", "ours_keep_partial"):
        keep_partial, exact = strategy == "ours_keep_partial", strategy == "ours_exact"
        out = run_controlled(s, work, budget, noise, rng, keep_partial=keep_partial, exact=exact)
    elif strategy in ("cap", "check_cancel", "let_finish", "exact_limit"):
        out = run_simple(strategy, s, work, budget)
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    return out.metrics(budget, s.ideal_s)


def _run(job: tuple) -> dict:
    model, family, budget, noise_pct, seed, strategy, *turns = job  # turns: (end_early[, unit])
    end_early, unit = (*turns, "completion")[:2] if turns else (None, "completion")
    return run_scenario(model, budget, noise_pct, seed, strategy, family=family, end_early=end_early, unit=unit)


def averaged_many(jobs: list[tuple], seeds: list[int], workers: int) -> list[dict]:
    """The metrics of each (model, family, budget, noise, strategy[, end_early]) job averaged over its seeds, run
    in parallel."""
    flat = [(*job[:4], seed, *job[4:]) for job, n in zip(jobs, seeds) for seed in range(n)]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            runs = list(pool.map(_run, flat, chunksize=8))
    else:
        runs = [_run(job) for job in flat]
    out, it = [], iter(runs)
    for n in seeds:
        mine = [next(it) for _ in range(n)]
        out.append({k: round(statistics.fmean(r[k] for r in mine), 4) for k in mine[0]})
    return out


def averaged(model: str, budget: int, noise_pct: float, strategy: str, seeds: int, family: str = "lognormal") -> dict:
    return averaged_many([(model, family, budget, noise_pct, strategy)], [seeds], workers=1)[0]


def drains_free(model: str) -> bool:
    """Compute-bound servers with a knee below the full batch: a draining batch keeps the throughput."""
    return model.startswith("compute_bound") and not idle_costs(model)


def scenario_goals(model: str, noise_pct: float, r: dict, budget: int) -> dict:
    ours, kp, cc, exact = r["ours"], r["ours_keep_partial"], r["check_cancel"], r["ours_exact"]
    out = {
        "ours_overshoot_le_0.5pct": ours["overshoot_pct"] <= 0.5,
        # where both keep the batch full they tie, up to which completion happens to cross the budget
        "ours_time_le_check_cancel_plus_0.002": ours["time_vs_ideal"] <= cc["time_vs_ideal"] + 0.002,
        "ours_waste_le_check_cancel": ours["waste_pct"] <= cc["waste_pct"],
        "ours_aborted_le_0.5pct": ours["aborted_pct"] <= 0.5,
        "keep_partial_time_le_1.01": kp["time_vs_ideal"] <= 1.01,
    }
    if drains_free(model):
        # draining is free there (down to the knee), whatever the noise, the lengths or where the knee is
        out["ours_waste_le_half_check_cancel"] = ours["waste_pct"] <= 0.5 * cc["waste_pct"]
        out["ours_time_le_check_cancel"] = ours["time_vs_ideal"] <= cc["time_vs_ideal"]
    out["exact_overshoot_le_one_response"] = exact["overshoot_pct"] <= 100.0 * EXACT_OVERSHOOT_TOKENS / budget
    if limit := r.get("exact_limit"):
        out["exact_time_le_limit_plus_0.02"] = exact["time_vs_ideal"] <= limit["time_vs_ideal"] + EXACT_TIME_MARGIN
    return out


def legacy_goals(models: dict) -> dict:
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


def seeds_for(budget: int, seeds: int) -> int:
    """Draws for one scenario: `seeds` at 10M tokens and proportionally more below, so every scenario averages
    over about the same number of completions. A small budget's outcome turns on a few completions near the end
    (which request crosses the budget first), so one draw says little and strategies compared draw by draw
    differ by more than the goals' margins."""
    return max(seeds, round(seeds * LEGACY_BUDGET / budget))


def grid(models, families, budgets, noises) -> list[tuple]:
    """(model, family, budget, noise) cases: every family at the budgets below LEGACY_BUDGET, the tuned family
    alone at LEGACY_BUDGET and above (a long run averages the families' differences out)."""
    return [
        (m, f, b, n)
        for m, f, b, n in itertools.product(models, families, budgets, noises)
        if b < LEGACY_BUDGET or f == "lognormal"
    ]


def run_scenarios(models, budgets, noises, seeds: int, families=("lognormal",), workers: int = 1) -> list[dict]:
    names = ("model", "family", "budget", "noise_pct")
    cases = [dict(zip(names, case)) for case in grid(models, families, budgets, noises)]
    return run_rows(cases, seeds, workers)


def turn_grid(models, families, budgets, noises, end_early, unit: str = "completion") -> list[dict]:
    """The multi-turn cases: conversations of 1 to MAX_TURNS turns on TURN_MODELS at TURN_BUDGET, every family,
    noise and chance of ending early. Rows in budget_unit total say so (`budget_unit`); the others are as before."""
    if TURN_BUDGET not in budgets:
        return []
    total = {"budget_unit": unit} if unit == "total" else {}
    return [
        {"model": m, "family": f, "budget": TURN_BUDGET, "noise_pct": n, "turns": f"1-{MAX_TURNS}", "end_early_pct": e}
        | total
        for m, f, n, e in itertools.product([m for m in TURN_MODELS if m in models], families, noises, end_early)
    ]


def run_rows(cases: list[dict], seeds: int, workers: int) -> list[dict]:
    """A row per case: each scenario strategy averaged over its draws, and the row's goals."""
    jobs = []
    for c in cases:
        turns = (c["end_early_pct"] / 100, c.get("budget_unit", "completion")) if "turns" in c else ()
        names = TURN_STRATEGIES if turns else SCENARIO_STRATEGIES
        jobs += [(c["model"], c["family"], c["budget"], c["noise_pct"], name, *turns) for name in names]
    results = iter(averaged_many(jobs, [seeds_for(job[2], seeds) for job in jobs], workers))
    rows = []
    for c in cases:
        strategies = {name: next(results) for name in (TURN_STRATEGIES if "turns" in c else SCENARIO_STRATEGIES)}
        goals = scenario_goals(c["model"], c["noise_pct"], strategies, c["budget"])
        rows.append({**c, "seeds": seeds_for(c["budget"], seeds), "strategies": strategies, "goals": goals})
    return rows


def run_legacy(rows: list[dict], models, seeds: int) -> dict:
    """Every strategy on the noise-free 10M case; the scenario rows already hold three of them."""
    out = {}
    for model in models:
        case = (model, "lognormal", LEGACY_BUDGET, 0.0)
        row = next(r for r in rows if (r["model"], r["family"], r["budget"], r["noise_pct"]) == case)
        out[model] = {}
        for name in (*LEGACY_STRATEGIES, *SLACK_SWEEP):
            m = row["strategies"].get(name) or averaged(model, LEGACY_BUDGET, 0.0, name, seeds)
            out[model][name] = {k: m[k] for k in LEGACY_KEYS}
    return out


def settings(args) -> dict:
    return {
        "budget": LEGACY_BUDGET,
        "concurrency": CONCURRENCY,
        "seeds": args.seeds,
        "mean_len": MEAN_LEN,
        "sigma": SIGMA,
        "max_tokens": MAX_TOKENS,
        "knee": KNEE,
        "cap_samples": CAP_SAMPLES,
        "check_every_s": CHECK_EVERY_S,
        "rate_per_request": RATE,
        "reading_s": READING_S,
        "abort_latency_s": ABORT_LATENCY_S,
        "saturation_h": SATURATION_H,
        "scenario_models": list(args.models),
        "families": list(args.families),
        "prompt_tokens": PROMPT_TOKENS,
        "prefill_speedup": PREFILL_SPEEDUP,
        "budgets": list(args.budgets),
        "noise_pct": list(args.noise),
        "max_turns": MAX_TURNS,
        "turn_end_early_pct": list(args.end_early),
        "turn_total_families": [f for f in TURN_TOTAL_FAMILIES if f in args.families],
    }


def fmt_budget(budget: int) -> str:
    return f"{budget / 1e6:g}M" if budget >= 1_000_000 else f"{budget / 1e3:g}k"


def print_scenarios(rows: list[dict]) -> None:
    cols = "  over waste  lost   time"
    print(f"{'':<19}{'':<11}{'':>7}{'':>6}   " + " ".join(f"{name:<25}" for name in SCENARIO_STRATEGIES))
    print(f"{'model':<19}{'family':<11}{'budget':>7}{'noise':>6}   " + " ".join([cols] * len(SCENARIO_STRATEGIES)))
    for r in rows:
        cells = []
        for name in SCENARIO_STRATEGIES:
            if (m := r["strategies"].get(name)) is None:
                cells.append(f"{'-':>25}")
                continue
            cells.append(
                f"{m['overshoot_pct']:>6.2f}{m['waste_pct']:>6.2f}{m['lost_pct']:>6.2f}{m['time_vs_ideal']:>7.4f}"
            )
        missed = ", ".join(k for k, ok in r["goals"].items() if not ok) or "-"
        case = f"{r['model']:<19}{r['family']:<11}{fmt_budget(r['budget']):>7}{r['noise_pct']:>5g}%"
        if "turns" in r:
            case += f"  turns {r['turns']}, {r['end_early_pct']:g}% end early"
            case += ", budget_unit total" if r.get("budget_unit") == "total" else ""
        print(f"{case}   {' '.join(cells)}  {missed}")


def print_legacy(models: dict, goals: dict) -> None:
    print(f"\nnoise-free, budget {fmt_budget(LEGACY_BUDGET)}: overshoot % / waste % / time vs ideal")
    for model, rows in models.items():
        line = "  ".join(
            f"{name} {m['overshoot_pct']:.2f}/{m['waste_pct']:.2f}/{m['time_vs_ideal']:.4f}" for name, m in rows.items()
        )
        missed = ", ".join(k for k, ok in goals[model].items() if not ok) or "-"
        print(f"  {model}: {line}\n    missed goals: {missed}")


def comma_list(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 1 at 10M (10 at 1M, see seeds_for): the grid of servers and length families is large enough as it is
    ap.add_argument("--seeds", type=int, default=1, help="length and noise draws to average over, at 10M")
    ap.add_argument("--budgets", type=comma_list(int), default=BUDGETS)
    ap.add_argument("--noise", type=comma_list(float), default=NOISE_PCT, help="reading noise, in %%")
    ap.add_argument("--models", type=comma_list(str), default=MODELS)
    ap.add_argument("--families", type=comma_list(str), default=FAMILIES, help="length families")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes running the draws")
    ap.add_argument("--out", type=Path, default=RESULTS / "budget.json")
    ap.add_argument(
        "--end-early", type=comma_list(float), default=TURN_END_EARLY_PCT, help="multi-turn rows: turns ending early %%"
    )
    ap.add_argument(
        "--only",
        type=comma_list(str),
        default=GROUPS,
        help=f"groups of rows to run ({', '.join(GROUPS)}); the others' rows are kept from --out",
    )
    args = ap.parse_args(argv)
    if unknown := set(args.only) - set(GROUPS):
        ap.error(f"unknown groups: {', '.join(sorted(unknown))}")
    if unknown := set(args.models) - set(MODELS):
        ap.error(f"unknown models: {', '.join(sorted(unknown))}")
    if unknown := set(args.families) - set(FAMILIES):
        ap.error(f"unknown families: {', '.join(sorted(unknown))}")
    return args


def run_groups(args) -> dict:
    """The rows of the groups in `--only`, under their keys in the results."""
    out: dict = {}
    if "scenarios" in args.only:
        out["scenarios"] = run_scenarios(args.models, args.budgets, args.noise, args.seeds, args.families, args.workers)
        legacy_models = [m for m in LEGACY_MODELS if m in args.models]
        # the side-by-side needs its own case in the grid; a quick subset without it leaves it out
        if legacy_models and LEGACY_BUDGET in args.budgets and 0.0 in args.noise and "lognormal" in args.families:
            out["models"] = run_legacy(out["scenarios"], legacy_models, args.seeds)
            out["goals"] = legacy_goals(out["models"])
    if "turn_scenarios" in args.only:
        cases = turn_grid(args.models, args.families, args.budgets, args.noise, args.end_early)
        out["turn_scenarios"] = run_rows(cases, args.seeds, args.workers)
    if "neighbour_scenarios" in args.only:
        models = [f"{m}+neighbour" for m in NEIGHBOUR_MODELS if m in args.models]
        families = [f for f in NEIGHBOUR_FAMILIES if f in args.families]
        noises = [n for n in args.noise if n] or args.noise  # with the readings' noise, as a real server reads
        out["neighbour_scenarios"] = run_scenarios(models, args.budgets, noises, args.seeds, families, args.workers)
    if "turn_total_scenarios" in args.only:
        families = [f for f in TURN_TOTAL_FAMILIES if f in args.families]
        cases = turn_grid(args.models, families, args.budgets, args.noise, args.end_early, unit="total")
        out["turn_total_scenarios"] = run_rows(cases, args.seeds, args.workers)
    return out


def kept_from(path: Path, only) -> dict:
    """What `path` holds of the groups not run this time (`--only`), so a partial run does not drop them."""
    if set(only) == set(GROUPS) or not path.exists():
        return {}
    old = json.loads(path.read_text())
    keys = [g for g in GROUPS if g not in only] + (["models", "goals"] if "scenarios" not in only else [])
    return {k: old[k] for k in keys if k in old}


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    ran = run_groups(args)
    results: dict = kept_from(args.out, args.only) | ran | {"settings": settings(args)}
    rows = [r for g in GROUPS for r in results.get(g, [])]
    met = [ok for r in rows for ok in r["goals"].values()]
    met += [ok for g in results.get("goals", {}).values() for ok in g.values()]
    results["all_goals_met"] = all(met)
    print_scenarios([r for g in GROUPS for r in ran.get(g, [])])
    if "models" in ran:
        print_legacy(ran["models"], ran["goals"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\nall goals met: {results['all_goals_met']}; wrote {args.out} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
