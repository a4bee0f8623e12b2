"""Where a loop's time goes: wall seconds summed per named step."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class Timers:
    """`with timers("writes"): ...` adds the block's wall time to `timers.seconds["writes"]`. A step timed on
    another thread (a background writer) is summed the same way: its seconds overlap the caller's."""

    def __init__(self):
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, step: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[step] += time.perf_counter() - t0

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)
