"""The budget controller: a pure decision core, no I/O, so it can be simulated and unit-tested.

It admits another request while the tokens already committed plus the tokens expected from the requests in
flight stay under the budget. The expected length of a response is the running mean of completed ones, bounded
by max_tokens; before any response completes it assumes half of max_tokens. Once committed >= budget, what is
still in flight is cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BudgetController:
    budget: int
    max_tokens: int
    concurrency: int
    committed: int = 0  # tokens counted toward the budget (stored responses + new ones)
    in_flight: int = 0
    _n_done: int = 0
    _sum_done: int = 0

    @property
    def expected_len(self) -> float:
        if self._n_done == 0:
            return self.max_tokens / 2
        return min(float(self.max_tokens), self._sum_done / self._n_done)

    @property
    def met(self) -> bool:
        return self.committed >= self.budget

    def can_admit(self) -> bool:
        if self.met or self.in_flight >= self.concurrency:
            return False
        return self.committed + self.in_flight * self.expected_len < self.budget

    def admitted(self) -> None:
        self.in_flight += 1

    def finished(self, tokens: int, counted: bool, length: int | None = None) -> None:
        """A request left flight; `tokens` count toward the budget when `counted` (kept by the policies).

        `length` is its completion length for the running mean (defaults to `tokens`)."""
        self.in_flight -= 1
        self._n_done += 1
        self._sum_done += tokens if length is None else length
        if counted:
            self.committed += tokens

    def failed(self) -> None:
        self.in_flight -= 1
