"""The no-op benchmark times what it says: a generate run that sends nothing, its rendered ids from the store's
cache, then none of them (the cache emptied, every prompt rendered again and cached anew)."""

from __future__ import annotations

import json
import sqlite3

from bench import noop


def test_the_runs_are_no_ops_and_the_uncached_one_starts_from_an_empty_cache(tmp_path, monkeypatch):
    emptied = []
    forget = noop.forget_renders

    def counted(work):
        forget(work)
        with sqlite3.connect(work / "store.sqlite") as db:
            emptied.append(db.execute("SELECT COUNT(*) FROM rendered").fetchone()[0])

    monkeypatch.setattr(noop, "forget_renders", counted)
    out = tmp_path / "noop.json"
    noop.main(["--prompts", "200", "--runs", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    assert emptied == [0]  # the uncached run found no render to reuse
    assert r["settings"] == {"prompts": 200, "runs": 1, "reused": 200}  # all stored, none sent (asserted inside)
    assert {k: len(v) for k, v in r["wall_s"].items()} == {"cached": 1, "uncached": 1, "floor": 1}


def test_the_conversation_runs_are_no_ops_over_every_turn_and_the_uncached_one_renders_them_all(tmp_path, monkeypatch):
    held = []
    forget = noop.forget_renders

    def counted(work):
        with sqlite3.connect(work / "store.sqlite") as db:
            held.append(db.execute("SELECT COUNT(*) FROM turn_rendered").fetchone()[0])
        forget(work)
        with sqlite3.connect(work / "store.sqlite") as db:
            held.append(db.execute("SELECT COUNT(*) FROM turn_rendered").fetchone()[0])

    monkeypatch.setattr(noop, "forget_renders", counted)
    out = tmp_path / "noop_turns.json"
    noop.main(["--turns", "3", "--prompts", "40", "--runs", "1", "--out", str(out)])  # 480 tokens: over the budget
    r = json.loads(out.read_text())
    assert held == [120, 0]  # every turn of every conversation held, then none
    assert r["settings"] == {"prompts": 40, "runs": 1, "reused": 120, "turns": 3}  # every turn stored, none sent
