"""The response store (real SQLite) and the pure budget controller."""

from __future__ import annotations

import sqlite3

from stages.budget import BudgetController
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


def test_controller_admits_by_expected_tokens():
    c = BudgetController(budget=1000, max_tokens=200, concurrency=100)
    admitted = 0
    while c.can_admit():
        c.admitted()
        admitted += 1
    assert admitted == 10  # 10 × (200 / 2) expected tokens fill the budget
    for _ in range(10):
        c.finished(20, counted=True)  # responses much shorter than feared
    assert c.committed == 200 and c.expected_len == 20
    while c.can_admit():
        c.admitted()
    assert c.in_flight == 40  # (1000 - 200) / 20


def test_controller_caps_concurrency_and_stops_when_met():
    c = BudgetController(budget=10_000, max_tokens=100, concurrency=3)
    for _ in range(3):
        c.admitted()
    assert not c.can_admit()
    c.finished(50, counted=False)  # not kept (e.g. dropped truncation): counts for the mean only
    assert c.committed == 0 and c.can_admit()
    c.committed = 10_000
    assert c.met and not c.can_admit()
