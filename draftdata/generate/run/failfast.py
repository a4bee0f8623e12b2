"""Fail fast: when the last `run.fail_fast_after` requests all failed with one cause, or the run's first ones all
failed whatever their causes, the next ones would too, so the run stops with that cause rather than spend the whole
prompt list on it. An answer the output cannot use (empty, truncated and dropped) counts as a failure with its
reason: a run of such answers is no more a success than a run of errors."""

from __future__ import annotations

from collections import Counter, deque


class FailFastWindow:
    """The outcomes of the last `after` requests that ended by themselves (None: a usable response; else the error
    code or the unusable answer's reason). `after` <= 0 turns the check off."""

    def __init__(self, after: int):
        self.after = after
        self._recent: deque[str | None] = deque(maxlen=max(1, after))
        self._usable = False  # a usable response has come: the run's start is no longer judged alone

    def record(self, outcome: str | None) -> None:
        self._recent.append(outcome)
        self._usable = self._usable or outcome is None

    def cause(self) -> str | None:
        """The one cause every request of a full window failed with, or the commonest where the run's first
        requests all failed; None while the window is not full or a response is in it. The newest outcome is looked
        at first: a response, the common case, settles it."""
        if self.after <= 0 or len(self._recent) < self.after or self._recent[-1] is None:
            return None
        causes = Counter(self._recent)
        if len(causes) == 1 or not self._usable:
            return causes.most_common(1)[0][0]
        return None

    def message(self, cause: str, detail: str, committed: int) -> str:
        """The one line the run stops with: the cause, an example of it, and that nothing committed is lost."""
        causes = Counter(self._recent)
        if len(causes) <= 1:
            what = f"the last {self.after} requests all failed with {cause}"
        else:
            mix = ", ".join(f"{c} {n}" for c, n in causes.most_common())
            what = f"no request of this run gave a usable answer (the last {self.after}: {mix}); the commonest, {cause}"
        return f"{what}: {detail} ({committed} responses committed this run are in the store)"
