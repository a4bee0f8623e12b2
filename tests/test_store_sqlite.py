"""The stores' SQLite side: both stores opened at the same moment by several processes after an upgrade
(torchrun's ranks, or `dvc exp run --jobs N`, meet a store of an older schema, and each must find it migrated once,
none failing on a column another added: "duplicate column name"; the old stores are made by hand with sqlite3, as the
older versions wrote them), lookups of more keys than SQLite binds in one statement, and torn shards forgotten once
when two ranks find them."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import traceback
from pathlib import Path

import pytest

from draftdata.generate import store as response_store
from draftdata.hidden import state_store

PROCESSES = 6
ROUNDS = 20  # fresh old stores, each raced by every process: the window between the check and the ALTER is small

# the responses table before `reasoning`, `tool_calls` and the later ADDED_COLUMNS (draftdata/generate/store.py)
OLD_RESPONSES = """
CREATE TABLE responses (
    key TEXT PRIMARY KEY, dataset TEXT NOT NULL, prompt_id TEXT NOT NULL, prompt_ids TEXT, output_ids TEXT,
    text TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    finish_reason TEXT NOT NULL, server TEXT NOT NULL, latency_s REAL NOT NULL, created_at REAL NOT NULL
);
INSERT INTO responses VALUES ('k1', 'D', 'p1', '[1,2]', '[3]', 'hi', 2, 1, 'stop', 's', 0.1, 0.0);
"""
# the state store's shards table before `engine` (draftdata/hidden/state_store.py ADDED_COLUMNS)
OLD_STATES = """
CREATE TABLE states (key TEXT PRIMARY KEY, shard TEXT NOT NULL, row INTEGER NOT NULL, n_tokens INTEGER NOT NULL);
CREATE TABLE shards (
    name TEXT PRIMARY KEY, settings TEXT NOT NULL, n_samples INTEGER NOT NULL, n_tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL, created_at REAL NOT NULL
);
INSERT INTO shards VALUES ('h/a.safetensors', 'h', 1, 3, 10, 0.0);
INSERT INTO states VALUES ('k1', 'h/a.safetensors', 0, 3);
"""


def old_store(path: Path, schema: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")  # as the older versions opened it
    db.executescript(schema)
    db.close()
    return path


def open_store(kind: str, path: Path) -> None:
    if kind == "responses":
        from draftdata.generate.store import ResponseStore

        ResponseStore(path).close()
    else:
        from draftdata.hidden.state_store import StateStore

        StateStore(path.parent).close()


def racer(kind: str, paths: list[Path], barrier, errors) -> None:
    """Opens each old store the moment every other process does."""
    for path in paths:
        barrier.wait(timeout=120)
        try:
            open_store(kind, path)
        except Exception:
            errors.put(traceback.format_exc(limit=3))


@pytest.mark.parametrize(
    "kind, schema, table, added",
    [
        ("responses", OLD_RESPONSES, "responses", set(response_store.ADDED_COLUMNS)),
        ("states", OLD_STATES, "shards", set(state_store.ADDED_COLUMNS)),
    ],
)
def test_processes_opening_an_old_store_at_once_migrate_it_once(tmp_path, kind, schema, table, added):
    name = "store.sqlite" if kind == "responses" else "index.sqlite"
    paths = [old_store(tmp_path / str(r) / name, schema) for r in range(ROUNDS)]
    ctx = mp.get_context("fork")  # the racers start in milliseconds, draftdata already imported
    barrier, errors = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=racer, args=(kind, paths, barrier, errors)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, failures[0]
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    for path in paths:  # every store migrated, its rows kept
        db = sqlite3.connect(path)
        columns = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        assert added <= columns and db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] == 1
        db.close()


def test_lookups_of_more_keys_than_sqlite_binds_find_every_one(tmp_path):
    from draftdata.hidden.state_store import StateStore
    from draftdata.util.sqlite import IN_CHUNK, rows_in

    store = StateStore(tmp_path / "states")
    keys = [f"k{i}" for i in range(2 * IN_CHUNK + 7)]
    store.add_shard("h/a.safetensors", "h", keys, [3] * len(keys), 10, "hf")
    store.add_shard("h/b.safetensors", "h", ["other"], [5], 20, "vllm:hook")
    found = store.lookup([*keys, "missing"])
    assert set(found) == set(keys) and found[keys[-1]].row == len(keys) - 1
    shards = ["h/a.safetensors", "h/b.safetensors", "h/gone.safetensors"]
    assert store.sizes(shards) == (30, 3 * len(keys) + 5)
    assert store.engines(shards) == {"h/a.safetensors": "hf", "h/b.safetensors": "vllm:hook"}
    sql = "SELECT key FROM states WHERE shard = ? AND key IN ({marks})"  # a parameter bound ahead of the list
    assert sorted(k for (k,) in rows_in(store.db, sql, [*keys, "other"], "h/a.safetensors")) == sorted(keys)
    store.close()


def test_a_torn_shard_found_by_two_ranks_is_forgotten_once(tmp_path):
    """Each rank checks every shard it finds, the other ranks' samples' too: both find a torn shard torn, both
    recompute what they own of it, and one of them counts it."""
    from draftdata.hidden.state_store import StateStore

    ranks = [StateStore(tmp_path / "states") for _ in range(2)]
    ranks[0].add_shard("h/a.safetensors", "h", ["k1", "k2"], [3, 4], 10, "hf")
    ranks[0].path("h/a.safetensors").parent.mkdir(parents=True, exist_ok=True)
    ranks[0].path("h/a.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # cut short
    found = [store.drop_torn({loc.shard for loc in store.lookup(["k1", "k2"]).values()}) for store in ranks]
    assert found == [(["h/a.safetensors"], 1), ([], 0)]  # the second looked after the first forgot it
    assert ranks[1].drop_torn(["h/a.safetensors"]) == (["h/a.safetensors"], 0)  # or looked before: not counted
    assert not ranks[1].lookup(["k1", "k2"]) and not ranks[0].path("h/a.safetensors").exists()
    for store in ranks:
        store.close()


@pytest.mark.parametrize("layout", ["local", "shared"])
def test_a_state_store_that_cannot_open_names_the_key_that_places_it(tmp_path, layout):
    """run.states_path where a folder cannot be made (under a file), or whose index is not a database: one line
    naming run.states_path (it named run.store_path, or was a traceback from mkdir); without run.states_path the
    store sits beside the response store, and run.store_path is named."""
    from draftdata.config.schema import RunConfig
    from draftdata.errors import ConfigError
    from draftdata.hidden.shared_store import check_states_path, open_state_store

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for run, key in (
        (RunConfig(states_path=str(a_file / "states"), states_layout=layout), "run.states_path"),
        (RunConfig(store_path=str(a_file / "store.sqlite"), states_layout=layout), "run.store_path"),
    ):
        for attempt in (open_state_store, check_states_path):  # the stage's refusal and check_params' twin
            with pytest.raises(ConfigError, match=rf"^{key}: cannot open the hidden-state store at "):
                attempt(run)
    if layout == "local":
        (tmp_path / "states" / "index.sqlite").mkdir(parents=True)  # a directory where the index should be
        run = RunConfig(states_path=str(tmp_path / "states"))
        for attempt in (open_state_store, check_states_path):
            with pytest.raises(ConfigError, match=r"^run\.states_path: cannot open the hidden-state store at .*index"):
                attempt(run)
