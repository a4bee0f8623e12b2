"""The dispatcher's small parts alone: the throughput meter (draftdata/generate/run/meter.py) and the fail-fast window
(draftdata/generate/run/failfast.py). Plain calls with set times and counts; no event loop."""

from __future__ import annotations

import pytest

from draftdata.generate.run.failfast import FailFastWindow
from draftdata.generate.run.meter import ThroughputMeter


class Tokens:
    """The tokens generated so far, and how often the meter asked (it must ask only when a reading is due)."""

    def __init__(self, n: int = 0):
        self.n, self.asked = n, 0

    def __call__(self) -> int:
        self.asked += 1
        return self.n


# ---- the throughput meter -------------------------------------------------------------------------------------- #


def test_no_reading_before_an_interval_has_passed_and_no_count_asked():
    meter = ThroughputMeter(now=10.0)
    tokens = Tokens(500)
    assert meter.observe(10.4, 8, tokens) is None and meter.observe(10.99, 8, tokens) is None
    assert tokens.asked == 0


def test_a_reading_is_the_rate_and_the_time_averaged_batch():
    meter = ThroughputMeter(now=10.0)
    tokens = Tokens()
    tokens.n = 300
    assert meter.observe(10.5, 8, tokens) is None  # 8 requests ran for 0.5 s
    tokens.n = 900
    rate, batch = meter.observe(11.5, 2, tokens)  # then 2 for 1.0 s
    assert rate == pytest.approx(900 / 1.5) and batch == pytest.approx((8 * 0.5 + 2 * 1.0) / 1.5)
    assert tokens.asked == 1


def test_each_reading_covers_only_the_interval_since_the_last():
    meter = ThroughputMeter(now=0.0, interval_s=2.0)
    tokens = Tokens(1000)
    assert meter.observe(2.0, 4, tokens) == (pytest.approx(500.0), pytest.approx(4.0))
    tokens.n = 1300
    assert meter.observe(3.0, 6, tokens) is None
    tokens.n = 1600
    rate, batch = meter.observe(4.0, 2, tokens)
    assert rate == pytest.approx(600 / 2.0) and batch == pytest.approx((6 + 2) / 2.0)


def test_an_idle_interval_reads_zero():
    meter = ThroughputMeter(now=0.0)
    tokens = Tokens(0)
    assert meter.observe(1.0, 0, tokens) == (0.0, 0.0)


# ---- the fail-fast window -------------------------------------------------------------------------------------- #


def test_one_cause_filling_the_window_is_the_cause():
    w = FailFastWindow(3)
    w.record("http_400")
    w.record("http_400")
    assert w.cause() is None  # not full yet
    w.record("http_400")
    assert w.cause() == "http_400"


def test_a_run_whose_first_requests_all_fail_stops_whatever_their_causes():
    """No usable answer yet: a full window of mixed causes (empty answers, truncated ones dropped, a timeout) stops
    the run, naming the commonest; once one answer was usable, only one cause filling the window does."""
    w = FailFastWindow(3)
    for outcome in ("empty", "truncated_dropped", "empty"):
        w.record(outcome)
    assert w.cause() == "empty"
    assert "no request of this run gave a usable answer" in w.message("empty", "", 0)


def test_a_response_or_a_second_cause_in_the_window_clears_it():
    w = FailFastWindow(3)
    for error in ("http_400", "http_400", None):
        w.record(error)
    assert w.cause() is None
    for error in ("http_400", "http_400"):
        w.record(error)
    assert w.cause() is None  # the response is still in the window
    w.record("timeout")
    assert w.cause() is None  # two causes
    for _ in range(2):
        w.record("timeout")
    assert w.cause() == "timeout"  # the window moved past the others


def test_a_response_last_settles_it_even_in_a_full_window():
    w = FailFastWindow(2)
    w.record("http_400")
    w.record(None)
    assert w.cause() is None


def test_zero_turns_the_check_off():
    w = FailFastWindow(0)
    for _ in range(100):
        w.record("http_400")
    assert w.cause() is None


def test_the_message_names_the_count_the_cause_its_detail_and_what_was_kept():
    message = FailFastWindow(16).message("http_400", "HTTP 400: bad request", 7)
    assert message == (
        "the last 16 requests all failed with http_400: HTTP 400: bad request "
        "(7 responses committed this run are in the store)"
    )
