"""The budget controller: a pure decision core, no I/O, so the benchmark can simulate it (bench/budget.py).

Inputs: the budget, the tokens committed so far, and the progress (tokens generated so far) of each request in
flight. Decisions: admit another request or hold, and whether the budget is reached (then the caller cancels what
is in flight).

- `on_budget=cancel` (complete responses only): admit while committed + the expected final length of every
  request in flight (given how far it has got) + one more response stays under the budget; past that point the
  batch drains, and what is still running when the budget is reached is cancelled. The expectation uses the
  lengths of responses completed so far, bounded by max_tokens.
  Whether draining pays depends on the server, so a streaming client lets the controller watch it
  (`observe_rate`): on a compute-bound server a draining batch speeds up and keeps the aggregate throughput, so
  the drain is free and wastes nothing; on a server whose requests decode at a fixed rate an idle slot costs as
  much GPU time as a cancelled request's tokens. The controller learns the smallest batch that still keeps the
  full throughput (the knee) and drains only down to it, refilling below it; the tokens of requests admitted to
  refill are what the budget may cancel. Without rate observations (a backend that does not stream) it allows
  `admit_slack` batches of slack, a middle course. bench/budget.py measures all of this on both server models.
- `on_budget=keep_partial`: keep the server full until committed + tokens in flight reach the budget, then stop
  everything and keep each partial response, cut at the budget: nothing generated is thrown away.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Sequence

# Before this many responses have completed, lengths are assumed to be max_tokens / 2.
_MIN_OBSERVED = 16


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
        if self.n < _MIN_OBSERVED:
            return self.max_tokens / 2
        return self._sum / self.n

    def expected_final(self, progress: int) -> float:
        """Mean of the observed lengths longer than `progress`; a request past every observed length is assumed
        to end halfway between where it is and max_tokens."""
        if self.n < _MIN_OBSERVED:
            return max(float(progress), self.max_tokens / 2)
        if not self._snapshot or self.n - len(self._snapshot) > len(self._snapshot) // 50:
            self._rebuild()
        i = bisect.bisect_right(self._snapshot, progress)
        if i == len(self._snapshot):
            return (progress + self.max_tokens) / 2
        return self._suffix[i] / (len(self._snapshot) - i)

    def _rebuild(self) -> None:
        self._snapshot = sorted(self._lengths)
        suffix = list(itertools.accumulate(reversed(self._snapshot)))
        suffix.reverse()
        self._suffix = suffix


@dataclass
class BudgetController:
    budget: int
    max_tokens: int
    concurrency: int
    keep_partial: bool = False
    admit_slack: float = 1.0  # in full batches of mean-length responses, used while the server is unobserved
    rate_tolerance: float = 0.005  # a drain that loses more than this share of the full-batch throughput costs
    observes_rate: bool = False  # True when the caller feeds observe_rate (streaming backends)
    committed: int = 0  # tokens counted toward the budget: stored responses + new ones
    lengths: LengthModel = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = LengthModel(self.max_tokens)
        self._full_rate = 0.0  # aggregate tokens/s seen with a full batch
        self._knee = 0  # the largest batch seen to lose throughput against a full one

    def observe_rate(self, tokens_per_s: float, in_flight: int) -> None:
        """The aggregate decode rate the server kept while `in_flight` requests ran."""
        if in_flight >= self.concurrency:
            self._full_rate = max(self._full_rate, tokens_per_s)
        elif self._full_rate > 0 and tokens_per_s < (1 - self.rate_tolerance) * self._full_rate:
            self._knee = max(self._knee, in_flight)

    def reached(self, progress: Sequence[int] = ()) -> bool:
        """True once the budget is met; with keep_partial the tokens in flight count too."""
        in_flight = sum(progress) if self.keep_partial else 0
        return self.committed + in_flight >= self.budget

    def can_admit(self, progress: Sequence[int] = ()) -> bool:
        """`progress`: tokens generated so far by each request in flight (zeros when the backend does not stream)."""
        return self.admit_count(progress) > 0

    def admit_count(self, progress: Sequence[int] = ()) -> int:
        """How many requests may be admitted now. One pass over the requests in flight per call, so a loop that
        admits a batch at once does not pay for it once per request."""
        room = self.concurrency - len(progress)
        if room <= 0 or self.reached(progress):
            return 0
        if self.keep_partial:
            return room
        mean = self.lengths.mean()
        expected = self.committed + sum(self.lengths.expected_final(p) for p in progress)
        fit = int((self.budget - expected) // mean) if expected < self.budget else 0  # each new one adds `mean`
        if fit > 0:
            return min(room, fit)
        if not self.observes_rate:
            return min(room, max(0, int((self.budget + self.admit_slack * self.concurrency * mean - expected) // mean)))
        return max(0, min(room, self._knee + 1 - len(progress)))  # drain while it is free, refill up to the knee

    def finished(self, tokens: int, counted: bool, length: int | None = None) -> None:
        """A response completed. `tokens` (in the budget's unit) count when the policies keep it; `length` is its
        completion length for the running statistics (defaults to `tokens`)."""
        self.lengths.add(tokens if length is None else length)
        if counted:
            self.committed += tokens

    def cut(self, tokens: int) -> None:
        """A partial response kept at the budget (keep_partial)."""
        self.committed += tokens
