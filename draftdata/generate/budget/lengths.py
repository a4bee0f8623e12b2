"""The running distribution of completed response lengths: what the budget controller expects of a request in flight
and of one admitted now (draftdata/generate/budget/controller.py)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

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
        suffix = list(itertools.accumulate(reversed(self._snapshot)))
        suffix.reverse()
        self._suffix = suffix
