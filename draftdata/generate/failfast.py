"""Fail fast: when the last `run.fail_fast_after` requests all failed with one cause, the next ones would too, so
the run stops with that cause rather than spend the whole prompt list on it."""

from __future__ import annotations

from collections import deque


class FailFastWindow:
    """The outcomes of the last `after` requests that ended by themselves (None: a response; else the error code).
    `after` <= 0 turns the check off."""

    def __init__(self, after: int):
        self.after = after
        self._recent: deque[str | None] = deque(maxlen=max(1, after))

    def record(self, error: str | None) -> None:
        self._recent.append(error)

    def cause(self) -> str | None:
        """The one cause every request of a full window failed with; None while the window is not full, a response
        is in it or causes differ. The newest outcome is looked at first: a response, the common case, settles it."""
        if self.after <= 0 or len(self._recent) < self.after or self._recent[-1] is None:
            return None
        causes = set(self._recent)
        return causes.pop() if len(causes) == 1 else None

    def message(self, cause: str, detail: str, committed: int) -> str:
        """The one line the run stops with: the cause, an example of it, and that nothing committed is lost."""
        return (
            f"the last {self.after} requests all failed with {cause}: {detail} "
            f"({committed} responses committed this run are in the store)"
        )
