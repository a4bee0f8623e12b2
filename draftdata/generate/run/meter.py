"""The throughput meter: readings of a server's aggregate decode rate and the batch it ran with, for the budget
controller (draftdata/generate/run/budget.py: ThroughputModel learns from them how throughput scales with the batch)."""

from __future__ import annotations

from collections.abc import Callable

READING_S = 1.0  # the interval of one reading


class ThroughputMeter:
    """One reading per `interval_s`: the tokens generated over the interval divided by its length, and the batch as
    its time average (∫ requests in flight dt / interval), since the batch changes between wake-ups. Fed by the
    dispatcher's loop at every wake-up with the time and the number of requests in flight."""

    def __init__(self, now: float, interval_s: float = READING_S):
        self.interval_s = interval_s
        self._t_last, self._area = now, 0.0  # ∫ in-flight dt so far
        self._mark = (now, 0, 0.0)  # (time, tokens generated, area) at the last reading

    def observe(self, now: float, in_flight: int, tokens: Callable[[], int]) -> tuple[float, float] | None:
        """`in_flight` requests ran since the last call. Returns (tokens/s, mean batch) once the interval since the
        last reading is complete, else None. `tokens()`: the tokens generated so far, asked only when a reading is
        due (it sums over every request in flight)."""
        self._area += in_flight * (now - self._t_last)
        self._t_last = now
        t0, tokens0, area0 = self._mark
        if now - t0 < self.interval_s:
            return None
        total = tokens()
        self._mark = (now, total, self._area)
        return (total - tokens0) / (now - t0), (self._area - area0) / (now - t0)
