"""The response store (real SQLite) and the pure budget controller."""

from __future__ import annotations

import sqlite3

from stages.budget import BudgetController, LengthModel
from stages.store import ResponseStore, StoredResponse


def resp(key: str, n: int = 5) -> StoredResponse:
    return StoredResponse(key=key, dataset="D", prompt_id="p" + key, text="hi", prompt_tokens=3, completion_tokens=n,
                          finish_reason="stop", server="s", latency_s=0.1, prompt_ids=[1, 2, 3],
                          output_ids=list(range(n)))


def test_store_round_trip_survives_reopen_and_never_duplicates(tmp_path):
    path = tmp_path / "s.sqlite"
    store = ResponseStore(path)
    store.put(resp("a"))
    store.put(resp("b", 7))
    store.put(resp("a", 99))  # a second answer for the same key is ignored, not duplicated
    store.close()
    store = ResponseStore(path)
    got = store.get_many(["a", "b", "missing"])
    assert set(got) == {"a", "b"}
    assert got["a"].completion_tokens == 5 and got["a"].output_ids == [0, 1, 2, 3, 4]
    assert got["b"].prompt_ids == [1, 2, 3]
    assert store.count() == 2
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_store_get_many_handles_more_keys_than_sqlite_binds(tmp_path):
    store = ResponseStore(tmp_path / "s.sqlite")
    for i in range(1200):
        store.put(resp(f"k{i}"))
    assert len(store.get_many(f"k{i}" for i in range(1300))) == 1200


def fill(c: BudgetController, progress: list[int]) -> list[int]:
    """Admit until the controller holds; returns the in-flight progress list."""
    while c.can_admit(progress):
        progress.append(0)
    return progress


def test_length_model_prior_and_conditional_mean():
    m = LengthModel(max_tokens=1000)
    assert m.mean() == 500 and m.expected_final(700) == 700  # prior until 16 lengths are seen
    for n in [100] * 12 + [900] * 4:
        m.add(n)
    assert m.mean() == 300
    assert m.expected_final(0) == 300  # nothing known about a request that has not started
    assert m.expected_final(150) == 900  # past 100 tokens, only the long ones are left
    assert m.expected_final(950) == 975  # past everything seen: halfway to max_tokens


def test_blind_controller_admits_expected_fit_plus_slack():
    c = BudgetController(budget=10_000, max_tokens=200, concurrency=1000, admit_slack=0.0)
    assert len(fill(c, [])) == 100  # 100 in flight × 100 expected tokens = the budget
    c = BudgetController(budget=10_000, max_tokens=200, concurrency=50, admit_slack=1.0)
    assert len(fill(c, [])) == 50  # capped by concurrency, well inside one batch of slack


def test_controller_refills_below_the_knee_it_observed():
    c = BudgetController(budget=1_000, max_tokens=200, concurrency=20, observes_rate=True)
    progress = fill(c, [])
    assert len(progress) == 10  # expected fit: 10 × 100 = the budget
    c.observe_rate(2000.0, 20)  # a full batch: 2,000 tok/s
    progress.pop()
    c.finished(100, counted=True)  # one completes: 100 + 9 × 100 expected + 100 more > 1,000
    assert not c.can_admit(progress)  # draining, and no loss seen yet: hold
    c.observe_rate(1999.0, 9)  # compute-bound: 9 running keep the throughput
    assert not c.can_admit(progress)
    c.observe_rate(900.0, 9)  # fixed-rate server: 9 running lose throughput, so refill at 9 and below
    assert c.can_admit(progress)
    c.observe_rate(800.0, 3)  # a lower observation does not lower the knee
    assert c.can_admit(progress)


def test_controller_stops_when_met_and_counts_only_kept_tokens():
    c = BudgetController(budget=100, max_tokens=50, concurrency=3)
    c.finished(60, counted=False)  # not kept (e.g. dropped truncation): statistics only
    assert c.committed == 0 and c.lengths.n == 1
    c.finished(100, counted=True)
    assert c.reached() and not c.can_admit([])


def test_keep_partial_keeps_the_server_full_until_tokens_in_flight_reach_the_budget():
    c = BudgetController(budget=1_000, max_tokens=200, concurrency=8, keep_partial=True)
    assert len(fill(c, [])) == 8
    assert not c.reached([100] * 8)
    assert c.reached([100] * 8 + [200]) and not c.can_admit([100] * 8 + [200])
    c.cut(400)
    assert c.committed == 400 and c.reached([600])
