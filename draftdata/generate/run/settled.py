"""The exact rule as a run goes (`landing: exact`): the settled run of requests from the first, which alone says the
budget is met. The dispatcher tells it each request's final answer (`answered`); a request that failed is not
settled, so the run cannot count past it (land/selection.py ends the output there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from draftdata.config.schema import DatasetConfig
from draftdata.generate.accounting import counted, lands_exact, needs_request, unusable_reason
from draftdata.generate.plan.conversations import Conversation
from draftdata.generate.request import Planned
from draftdata.generate.store import StoredResponse

if TYPE_CHECKING:
    from draftdata.generate.plan.planning import Plan


class SettledRun(Protocol):
    """The exact rule as a run goes: the dispatcher tells it each request's final answer, and it says what the
    settled run from the first request counts, which alone says the budget is met (`Landed`, `LandedConversations`)."""

    def answered(self, p: Planned, r: StoredResponse, ds: DatasetConfig) -> None: ...

    def total(self) -> int: ...


class Landed:
    """The exact rule as a run goes (`turns: last`): what the settled run of requests from the first counts. A
    request is settled once it has its final answer (counted if usable, else 0); one that failed is not (the output
    cannot pass it: the dispatcher asks it again); the budget is met once `total()` reaches it."""

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self._counts: dict[str, int] = {}
        self._at, self._total = 0, 0

    @classmethod
    def of(cls, plan: Sequence[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig) -> Landed:
        """The run's requests in prompt order, those the store answers settled."""
        landed = cls([p.key for p in plan])
        for p in plan:
            if not needs_request(r := stored.get(p.key)):
                landed.answered(p, r, ds)
        return landed

    def answered(self, p: Planned, r: StoredResponse, ds: DatasetConfig) -> None:
        """Request `p` has its final answer `r`."""
        self._counts[p.key] = counted(p, r, ds.budget_unit) if unusable_reason(r, ds) is None else 0

    def total(self) -> int:
        while self._at < len(self.keys) and (n := self._counts.get(self.keys[self._at])) is not None:
            self._total += n
            self._at += 1
        return self._total


class LandedConversations:
    """The exact rule as a run goes (`turns: all`): conversations in prompt order, each one's turns in order. A
    conversation is settled once it ended; the first one not settled adds the turns it has answered (they start it,
    so they start the output's share of it)."""

    def __init__(self, convs: Sequence[Conversation], ds: DatasetConfig):
        self.convs, self.ds = list(convs), ds
        self._at, self._total = 0, 0  # the conversations settled, and what they count

    def answered(self, p: Planned, r: StoredResponse, ds: DatasetConfig) -> None:
        """Nothing to do: the conversations hold their answers."""

    def total(self) -> int:
        while self._at < len(self.convs) and _settled(c := self.convs[self._at]):
            self._total += self._counts_of(c)
            self._at += 1
        return self._total + (self._counts_of(self.convs[self._at]) if self._at < len(self.convs) else 0)

    def _counts_of(self, c: Conversation) -> int:
        return sum(counted(p, r, self.ds.budget_unit) for p, r in c.done if unusable_reason(r, self.ds) is None)


def _settled(c: Conversation) -> bool:
    return c.next is None


def settled_run(plan: Plan) -> SettledRun | None:
    """landing exact: the settled run a plan starts from; None: the finished rule, where the controller counts
    complete answers alone."""
    if not lands_exact(plan.ds):
        return None
    if plan.convs is None:
        return Landed.of(plan.requests, plan.stored, plan.ds)
    return LandedConversations(plan.convs, plan.ds)


def output_tokens(plan: Plan) -> int:
    """What the output would count before the run sends anything: the settled run's total under exact, every usable
    answer's under finished."""
    landed = settled_run(plan)
    return landed.total() if landed is not None else plan.standing.counted
