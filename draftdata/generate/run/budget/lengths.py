"""The running distribution of completed response lengths: what the budget controller expects of a request in flight
and of one admitted now (draftdata/generate/run/budget/controller.py)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Before this many responses have completed, lengths are assumed to be max_tokens / 2.
MIN_OBSERVED = 16


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
    _ends: object = None  # _snapshot as a float64 array
    prior: float | None = None  # landing exact's length before MIN_OBSERVED are seen (add_stored; max_tokens / 2)

    def add_stored(self, lengths: Sequence[int]) -> None:
        """The store's answers of the dataset, before the run: lengths seen, and where fewer than MIN_OBSERVED, the
        prior `censored` starts from (them, filled up with max_tokens / 2), so a raised budget starts from what a
        smaller one measured. Not the run's own first answers: those are its shortest."""
        for length in lengths:
            self.add(length)
        if lengths and len(lengths) < MIN_OBSERVED:
            self.prior = (sum(lengths) + (MIN_OBSERVED - len(lengths)) * self.max_tokens / 2) / MIN_OBSERVED

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

    def expected_end(self, progress: int) -> float:
        """`expected_final` read from the first length seen on (the progress line's ETA): the admission's prior of
        max_tokens / 2 holds a request past it about to end, and a run of long answers would read "ETA 0s" for as
        long as its first sixteen take. Before any length, the uniform prior's: halfway from where it is to
        max_tokens."""
        if self.n == 0:
            return (progress + self.max_tokens) / 2
        self._fresh()
        i = bisect.bisect_right(self._snapshot, progress)
        if i == len(self._snapshot):
            return (progress + self.max_tokens) / 2
        return self._suffix[i] / (len(self._snapshot) - i)

    def censored(self, running: Sequence[int]) -> tuple[float, float, float]:
        """The mean length of a new request and the expected final lengths of the `running` requests (their
        progress), summed, with the running requests counted as lengths not yet known (Kaplan-Meier, read as far as
        enough requests were at risk (`_supported`), held as far as a running request got; past that, the survival
        falling linearly to 0 at max_tokens, as `expected_final` assumes past the longest length seen): the responses
        that complete first are the short ones, so the lengths seen alone understate what is in flight, and a
        controller that admits by them admits past the budget (bench/budget.py, landing exact). Before
        MIN_OBSERVED responses, the prior (`add_stored`). Also the lengths' standard deviation (the uniform one of
        0 to max_tokens before MIN_OBSERVED)."""
        if self.n < MIN_OBSERVED:
            prior = self.prior if self.prior is not None else self.max_tokens / 2
            return prior, sum(max(float(p), prior) for p in running), self.max_tokens / 12**0.5
        self._fresh()
        ends = self._ends
        alive = np.sort(np.asarray(running, dtype=np.float64))
        # at risk at each completion (in order): the completions not yet passed, and the running ones that got there
        at_risk = (len(ends) - np.arange(len(ends))) + (len(alive) - np.searchsorted(alive, ends, side="left"))
        kept = _supported(ends, at_risk, len(ends) + len(alive))
        top = float(self.max_tokens)
        # S after the last completion kept holds as far as a running request got (none of them ended on the way), and
        # past that nothing says where the rest end: S falls linearly to 0 at max_tokens there
        reached = ends[kept - 1] if kept < len(ends) or not len(alive) else max(ends[-1], alive[-1])
        ends, at_risk = ends[:kept], at_risk[:kept]
        survival = np.cumprod(1.0 - 1.0 / at_risk)
        survival = np.concatenate(([1.0], survival, survival[-1:]))  # S on [0, ends[0]), [ends[i], ...), the fall
        bounds = np.concatenate(([0.0], np.minimum(ends, top), [min(float(reached), top), top]))
        last = float(bounds[-2])
        pieces = survival * np.diff(bounds)
        pieces[-1] /= 2
        area = np.concatenate(([0.0], np.cumsum(pieces)))  # the integral of S up to each bound
        mean = float(area[-1])
        squares = survival * np.diff(bounds**2)  # E[L^2] = the integral of 2x S(x)
        squares[-1] = survival[-1] * (top - last) * (top + 2 * last) / 3
        square = float(np.sum(squares))
        sd = max(0.0, square - mean * mean) ** 0.5
        if not len(alive):
            return mean, 0.0, sd
        seg = np.clip(np.searchsorted(bounds, alive, side="right") - 1, 0, len(survival) - 1)
        left = np.clip(alive, 0.0, self.max_tokens)
        s_at = survival[seg]
        beyond = area[-1] - (area[seg] + s_at * (left - bounds[seg]))
        tail = np.where(s_at > 0, left + beyond / np.where(s_at > 0, s_at, 1.0), (left + self.max_tokens) / 2)
        tail = np.where(seg == len(survival) - 1, (left + self.max_tokens) / 2, tail)  # on the linear stretch
        return mean, float(np.maximum(tail, alive).sum()), sd

    def quantile(self, q: float, running: int = 0) -> float:
        """The q-quantile of the lengths, counting the `running` requests not yet complete as max_tokens long: the
        responses that complete first are the short ones, so the lengths seen alone understate the long tail
        (in a heavy-tailed family, by a factor of several until late in a short run)."""
        if self.n < MIN_OBSERVED:
            return float(self.max_tokens)
        self._fresh()
        i = int(q * (len(self._snapshot) + running))
        return float(self._snapshot[i]) if i < len(self._snapshot) else float(self.max_tokens)

    def share_within(self, length: float) -> float:
        """The share of responses no longer than `length` (0.5 before enough have been seen: no opinion)."""
        if self.n < MIN_OBSERVED:
            return 0.5
        self._fresh()
        return bisect.bisect_right(self._snapshot, length) / len(self._snapshot)

    def useful_share(self, reach: float, running: int = 0) -> float:
        """Of the tokens a new request decodes in its first `reach`, the expected share in a complete response:
        the ones that end within `reach` bring their length, the longer ones (the `running` counted among them, see
        `quantile`) decode `reach` tokens and are cancelled. 0.5 before enough have been seen: no opinion."""
        if self.n < MIN_OBSERVED:
            return 0.5
        self._fresh()
        i = bisect.bisect_right(self._snapshot, reach)
        useful = (self._suffix[0] if self._snapshot else 0) - (self._suffix[i] if i < len(self._suffix) else 0)
        cut = reach * (len(self._snapshot) - i + running)
        return useful / (useful + cut) if useful + cut else 0.5

    def _fresh(self) -> None:
        if not self._snapshot or self.n - len(self._snapshot) > len(self._snapshot) // 50:
            self._rebuild()

    def _rebuild(self) -> None:
        self._snapshot = sorted(self._lengths)
        self._ends = np.asarray(self._snapshot, dtype=np.float64)  # `censored` reads it on every admission
        suffix = list(itertools.accumulate(reversed(self._snapshot)))
        suffix.reverse()
        self._suffix = suffix


def _supported(ends: np.ndarray, at_risk: np.ndarray, total: int) -> int:
    """How many of the completions (sorted) to read: those before the first that few requests were at risk of,
    where the requests still running took most of them out. At the front of a wave the longest completions are the
    few that got there before the running ones did, the last of them takes the survival to 0, and every running
    request would be expected to end by the longest length seen. Past that point the lengths are unknown
    (`LengthModel.censored` lets the survival fall linearly to max_tokens). With nothing running every completion
    is read: the lengths seen are all there is."""
    survival_before = np.concatenate(([1.0], np.cumprod(1.0 - 1.0 / at_risk)[:-1]))
    thin = (at_risk < MIN_OBSERVED) & (at_risk < survival_before * total / 2)
    return int(np.argmax(thin)) if thin.any() else len(ends)
