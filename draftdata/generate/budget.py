"""The budget controller: a pure decision core, no I/O, so the benchmark can simulate it (bench/budget.py).

Inputs: the budget, the tokens committed so far, the progress (tokens generated so far) of each request in flight
and, from a streaming client, readings of the server's aggregate throughput. Decisions: admit another request or
hold, and whether the budget is reached (then the caller stops what is in flight and parks it).

- `on_budget=cancel` (complete responses only): admit while committed + the expected final length of every
  request in flight (given how far it has got) + one more response stays under the budget; past that point the
  batch drains, and what is still running when the budget is reached is cancelled. The expectation uses the
  lengths of responses completed so far, bounded by max_tokens.
  Whether draining pays depends on the server. On a compute-bound server a draining batch speeds up and keeps
  the aggregate throughput, so the drain is free and wastes nothing; on a server whose requests decode at a fixed
  rate an idle slot costs as much GPU time as a cancelled request's tokens, so the batch must stay full. The
  controller learns which from the drain itself (`ThroughputModel`): it drains, compares the throughput of the
  shrinking batch with the full batch's, and as soon as a loss is statistically established it refills up to the
  smallest batch that still keeps the full throughput. Readings are noisy (1-2 % per second on real servers), so
  the full-batch rate is a median, the noise is measured, and a loss counts only when the readings of the whole
  drain fit "throughput falls below a knee" far better than "flat" (a single low reading moves nothing).
  Without rate readings (a backend that does not stream) it allows `admit_slack` batches of slack instead.
- `on_budget=keep_partial`: keep the server full until committed + tokens in flight reach the budget, then stop
  everything and keep each partial response, cut at the budget: nothing generated is thrown away.

bench/budget.py measures all of this on three server models, with and without noise, at 1M and 10M tokens.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# Before this many responses have completed, lengths are assumed to be max_tokens / 2.
MIN_OBSERVED = 16
# Throughput readings (ThroughputModel): how many recent full-batch readings make the reference, how many it needs
# at least, the smallest relative noise assumed (a noise-free simulation must not divide by zero), how strong the
# evidence of a loss must be (in noise standard deviations) and how wide the knee's confidence interval is.
FULL_WINDOW = 60
MIN_FULL_READINGS = 5
MIN_NOISE = 0.005
DETECT_SIGMAS = 4.0
DETECT_SIGMAS_NEAR_FULL = 2.5
CI_SIGMAS = 3.0
CLIP_SIGMAS = 3.0
FULL_SNAP = 0.95
# A refill request is admitted near the end only if at least this share of responses is short enough to complete
# before the budget is reached (BudgetController._can_finish).
MIN_FINISH_CHANCE = 0.05


@dataclass
class LengthModel:
    """Running distribution of completed response lengths, for E[final length | already generated p].

    Queries read a sorted snapshot with suffix sums (a bisect each); the snapshot is rebuilt only once the
    lengths seen have grown by 2 %, so a busy loop does not re-sort thousands of lengths per completion."""

    max_tokens: int
    _lengths: list[int] = field(default_factory=list)
    _sum: int = 0
    _snapshot: list[int] = field(default_factory=list)
    _suffix: list[int] = field(default_factory=list)  # _suffix[i] = sum(_snapshot[i:])

    def add(self, length: int) -> None:
        self._lengths.append(length)
        self._sum += length

    @property
    def n(self) -> int:
        return len(self._lengths)

    def mean(self) -> float:
        if self.n < MIN_OBSERVED:
            return self.max_tokens / 2
        return self._sum / self.n

    def expected_final(self, progress: int) -> float:
        """Mean of the observed lengths longer than `progress`; a request past every observed length is assumed
        to end halfway between where it is and max_tokens."""
        if self.n < MIN_OBSERVED:
            return max(float(progress), self.max_tokens / 2)
        if not self._snapshot or self.n - len(self._snapshot) > len(self._snapshot) // 50:  # inline: a hot path
            self._rebuild()
        i = bisect.bisect_right(self._snapshot, progress)
        if i == len(self._snapshot):
            return (progress + self.max_tokens) / 2
        return self._suffix[i] / (len(self._snapshot) - i)

    def share_within(self, length: float) -> float:
        """The share of responses no longer than `length` (0.5 before enough have been seen: no opinion)."""
        if self.n < MIN_OBSERVED:
            return 0.5
        self._fresh()
        return bisect.bisect_right(self._snapshot, length) / len(self._snapshot)

    def _fresh(self) -> None:
        if not self._snapshot or self.n - len(self._snapshot) > len(self._snapshot) // 50:
            self._rebuild()

    def _rebuild(self) -> None:
        self._snapshot = sorted(self._lengths)
        suffix = list(itertools.accumulate(reversed(self._snapshot)))
        suffix.reverse()
        self._suffix = suffix


@dataclass
class ThroughputModel:
    """How the server's aggregate throughput depends on the batch, learned from noisy readings.

    Model: throughput(n) = full × min(1, n / K), a roofline with an unknown knee K in [1, concurrency]: K =
    concurrency for a server whose requests decode at a fixed rate, a small K for a compute-bound one; a server in
    between fits a K in between. `full` is the median of recent full-batch readings and the noise their relative
    spread (median absolute deviation), so one outlier moves neither. Readings of a smaller batch (the drain) are
    fitted by least squares over every K, and `floor` says how far the batch may drain: all the way while no loss
    shows (a drain that keeps the throughput is free); once a loss is established (the best K explains the readings
    better than "flat" by DETECT_SIGMAS² noise variances), down to the largest K the readings still allow (within
    CI_SIGMAS), so an uncertain fit errs toward keeping the server fuller. A server whose requests decode at a fixed
    rate shows its loss within seconds of the drain: the deficit grows with every idle slot."""

    concurrency: int
    _full: deque = field(default_factory=lambda: deque(maxlen=FULL_WINDOW))
    _drain_n: list[float] = field(default_factory=list)
    _drain_rate: list[float] = field(default_factory=list)
    _floor: float = 0.0
    _dirty: bool = True

    def observe(self, tokens_per_s: float, in_flight: float) -> None:
        if in_flight >= self.concurrency - 0.5:
            self._full.append(tokens_per_s)
        elif in_flight > 0:
            self._drain_n.append(in_flight)
            self._drain_rate.append(tokens_per_s)
        self._dirty = True

    @property
    def known(self) -> bool:
        """Enough full-batch readings to compare a drain against."""
        return len(self._full) >= MIN_FULL_READINGS

    @property
    def full_rate(self) -> float:
        """The median full-batch throughput (tokens/s); 0 while unknown."""
        return float(statistics.median(self._full)) if self.known else 0.0

    def summary(self) -> dict:
        """What was learned of the server, for the run's metrics."""
        full = self.full_rate
        noise = statistics.median(abs(r - full) for r in self._full) * 1.4826 / full if full else 0.0
        return {
            "full_batch_tok_s": round(full, 1),
            "noise_pct": round(100 * noise, 2),
            "full_readings": len(self._full),
            "drain_readings": len(self._drain_n),
            "floor": self.floor(),
        }

    def floor(self) -> float:
        """The smallest batch to keep the server at while the batch drains (refill below it)."""
        if self._dirty:
            self._dirty = False
            self._floor = self._fit()
        return self._floor

    def _fit(self) -> float:
        import numpy as np

        c = self.concurrency
        full = self.full_rate
        if not self._drain_n or full <= 0:
            return 0.0
        mad = float(np.median(np.abs(np.asarray(self._full) - full)))
        var = max(1.4826 * mad / full, MIN_NOISE) ** 2
        n = np.asarray(self._drain_n)
        q = np.asarray(self._drain_rate) / full
        knees = np.arange(1, c + 1, dtype=float)
        # squared residuals capped at CLIP_SIGMAS noise deviations: one wild reading (a stall, a hiccup) weighs no
        # more than a few ordinary ones, so only a loss that persists across readings is taken for one
        cap = CLIP_SIGMAS**2 * var
        sse = np.minimum((q[None, :] - np.minimum(1.0, n[None, :] / knees[:, None])) ** 2, cap).sum(axis=1)
        best = float(sse.min())
        # A loss right below the full batch asks less evidence: it shows within seconds of the drain and missing it
        # costs GPU time on every idle slot; a knee deep in the drain costs little to find a reading later.
        detect = DETECT_SIGMAS_NEAR_FULL if knees[int(sse.argmin())] >= FULL_SNAP * c else DETECT_SIGMAS
        if float(np.minimum((q - 1.0) ** 2, cap).sum()) - best < detect**2 * var:  # "flat" fits about as well
            return 0.0
        knee = float(knees[sse <= best + CI_SIGMAS**2 * var].max())
        # within a few percent of the full batch a slot or two is below what the readings can tell: keep it full
        return float(c) if knee >= FULL_SNAP * c else knee


@dataclass
class BudgetController:
    budget: int
    max_tokens: int
    concurrency: int
    keep_partial: bool = False
    admit_slack: float = 1.0  # in full batches of mean-length responses, used while the server is unobserved
    observes_rate: bool = False  # True when the caller feeds observe_rate (streaming backends)
    committed: int = 0  # tokens counted toward the budget: stored responses + new ones
    lengths: LengthModel = None  # type: ignore[assignment]  # completion lengths, whatever the budget's unit
    # budget_unit total: the prompt tokens a new request adds to the budget, on average (0 when only completions
    # count); prompts and completions are kept apart, as only completions are bounded by max_tokens
    prompt_mean: float = 0.0

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = LengthModel(self.max_tokens)
        self.throughput = ThroughputModel(self.concurrency)

    def observe_rate(self, tokens_per_s: float, in_flight: float) -> None:
        """The aggregate decode rate the server kept while `in_flight` requests ran (time-averaged over the
        reading's interval)."""
        self.throughput.observe(tokens_per_s, in_flight)

    def reached(self, progress: Sequence[int] = (), prompts: Sequence[int] = ()) -> bool:
        """True once the budget is met; with keep_partial the tokens in flight count too."""
        in_flight = sum(progress) + sum(prompts) if self.keep_partial else 0
        return self.committed + in_flight >= self.budget

    def can_admit(self, progress: Sequence[int] = (), prompts: Sequence[int] = ()) -> bool:
        """`progress`: completion tokens generated so far by each request in flight (zeros when the backend does not
        stream); `prompts`: the prompt tokens each one counts toward the budget (budget_unit total; else none)."""
        return self.admit_count(progress, prompts) > 0

    def admit_count(self, progress: Sequence[int] = (), prompts: Sequence[int] = ()) -> int:
        """How many requests may be admitted now. One pass over the requests in flight per call, so a loop that
        admits a batch at once does not pay for it once per request."""
        room = self.concurrency - len(progress)
        if room <= 0 or self.reached(progress, prompts):
            return 0
        if self.keep_partial:
            return room
        mean = self.lengths.mean() + self.prompt_mean  # what a new request adds to the budget
        expected = self.committed + sum(prompts) + sum(self.lengths.expected_final(p) for p in progress)
        fit = int((self.budget - expected) // mean) if expected < self.budget else 0  # each new one adds `mean`
        if fit > 0:
            return min(room, fit)
        if not self.observes_rate or not self.throughput.known:
            return min(room, max(0, int((self.budget + self.admit_slack * self.concurrency * mean - expected) // mean)))
        floor = math.ceil(self.throughput.floor())  # how far the batch may drain (see ThroughputModel)
        want = max(0, min(room, floor - len(progress)))
        return want if want and self._can_finish(floor) else 0

    def _can_finish(self, batch: int) -> bool:
        """Whether a request admitted now to refill the batch has a fair chance to complete before the budget is
        reached. Near the end it has none: the batch commits about `full` tokens per second, so the budget is
        (budget - committed) / full seconds away, in which a new request decodes full / batch tokens per second.
        A refill that cannot finish would only be cancelled, its tokens wasted, at no gain in time."""
        left = self.budget - self.committed
        if self.prompt_mean:  # budget_unit total: only the completions' share of what is left is decoded
            completion = self.lengths.mean()
            left *= completion / (completion + self.prompt_mean)
        reach = left / max(batch, 1)  # tokens a new request decodes before the budget
        return self.lengths.share_within(reach) >= MIN_FINISH_CHANCE

    def finished(self, tokens: int, counted: bool, length: int | None = None) -> None:
        """A response completed. `tokens` (in the budget's unit) count when the policies keep it; `length` is its
        completion length for the running statistics (defaults to `tokens`, as when only completions count)."""
        self.lengths.add(tokens if length is None else length)
        if counted:
            self.committed += tokens

    def cut(self, tokens: int) -> None:
        """A partial response kept at the budget (keep_partial)."""
        self.committed += tokens
