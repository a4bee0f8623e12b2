"""The response store: every generated response, committed as it arrives, outside DVC's outputs.

DVC deletes a stage's outputs before rerunning it and `dvc exp run` rolls persisted outputs back, so responses
kept there would be lost on the next run. SQLite (WAL) in a git- and dvc-ignored file survives both, and a kill
loses at most the requests in flight. Keyed by a content hash of (model, exact prompt, sampling), so any run,
experiment or dataset that asks the same question reuses the answer.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterable, Optional

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    dataset TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    prompt_ids TEXT,                -- JSON list, when the prompt was sent as token ids
    output_ids TEXT,                -- JSON list, when the server returned ids
    text TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,    -- stop | length, or a parked partial: budget_cut | interrupted
    server TEXT NOT NULL,
    latency_s REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS failures (
    key TEXT NOT NULL,
    dataset TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    detail TEXT NOT NULL,
    server TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS failures_key ON failures(key);
"""


# Parked partial responses: what a request had produced when it was stopped, kept so that a later run continues it
# (prompt ids + these ids) instead of starting over.
CUT = "budget_cut"  # stopped by the budget: usable as it is under on_budget: keep_partial
INTERRUPTED = "interrupted"  # stopped by anything else (server abort, failure, Ctrl-C): never usable as it is
PARTIAL = (CUT, INTERRUPTED, "abort")  # "abort": aborted answers stored by earlier versions, continued like the rest


@dataclass
class StoredResponse:
    key: str
    dataset: str
    prompt_id: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    server: str
    latency_s: float
    prompt_ids: Optional[list[int]] = None
    output_ids: Optional[list[int]] = None
    created_at: float = field(default_factory=time.time)

    @property
    def partial(self) -> bool:
        return self.finish_reason in PARTIAL

    def continuable(self) -> bool:
        """A parked partial whose token ids are all known: a continuation can start from it."""
        return self.partial and self.output_ids is not None and len(self.output_ids) == self.completion_tokens > 0


_COLS = [f.name for f in fields(StoredResponse)]
_PARTIAL_SQL = "(" + ", ".join(f"'{r}'" for r in PARTIAL) + ")"
# One row per key, never duplicated: a complete response already stored (another run got there first) is kept. A
# parked partial (or an empty answer stored by an earlier version) gives way to a complete response or to a longer
# partial (its continuation, cut again).
_PUT = (
    f"INSERT INTO responses ({', '.join(_COLS)}) VALUES ({', '.join(':' + c for c in _COLS)}) "
    f"ON CONFLICT(key) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in _COLS if c != 'key')} "
    f"WHERE (responses.finish_reason IN {_PARTIAL_SQL} OR responses.completion_tokens = 0) "
    f"AND (excluded.finish_reason NOT IN {_PARTIAL_SQL} "
    f"OR excluded.completion_tokens > responses.completion_tokens)"
)


# File systems where SQLite's WAL is unsafe: its index lives in shared memory that only processes on one host share,
# and these mounts may be written from several (SQLite's docs: "WAL does not work over a network filesystem").
NETWORK_FS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "afs",
    "ceph",
    "glusterfs",
    "lustre",
    "gpfs",
    "beegfs",
    "9p",
    "panfs",
    "wekafs",
    "fuse.sshfs",
    "fuse.glusterfs",
    "fuse.ceph",
    "fuse.s3fs",
    "fuse.gcsfuse",
)


def fs_type(path: Path) -> str:
    """The type of the file system `path` is on, from the kernel's mount table ("" where it cannot tell)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    target = str(Path(path).resolve())
    best, kind = "", ""
    for line in mounts:
        fields_ = line.split()
        if len(fields_) < 3:
            continue
        point = fields_[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields_[2]
    return kind


def open_db(path: Path, what: str, schema: str) -> sqlite3.Connection:
    """A store's SQLite database with its `schema`: WAL on a local disk; a rollback journal, with a warning, on a
    network file system. A busy timeout lets several processes (torchrun ranks, two generate runs on one store)
    commit side by side. isolation_level=None: no implicit transactions; writers open and commit their own."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=600)
        db.execute("PRAGMA schema_version").fetchall()  # opens the file: a directory or a non-database fails here
    except (OSError, sqlite3.Error) as e:
        from stages.config import ConfigError

        raise ConfigError("run.store_path", f"cannot open the {what} at {path}: {e}") from None
    kind = fs_type(path.parent)
    network = kind in NETWORK_FS
    if network:
        from stages.artifacts import log

        log(
            what,
            warning=f"{path} is on a network file system ({kind}), where SQLite's WAL is not safe: using a "
            "rollback journal (slower, and one machine at a time). Put run.store_path on a local disk.",
        )
    _setup(db, network, schema)
    return db


def _setup(db: sqlite3.Connection, network: bool, schema: str, attempts: int = 50) -> None:
    """Journal mode and schema. Processes that open a new store at the same moment (torchrun ranks) can meet
    SQLITE_BUSY where SQLite does not wait on the busy timeout (a journal-mode change on a file another is creating,
    a lock upgrade that would deadlock): such a step is retried after a short pause."""
    for attempt in range(attempts):
        try:
            if network:
                db.execute("PRAGMA journal_mode=DELETE")
                db.execute("PRAGMA synchronous=FULL")
            else:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(
                    "PRAGMA synchronous=NORMAL"
                )  # WAL + NORMAL: a crash never corrupts, may lose the last commit
            db.executescript(schema)
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == attempts - 1:
                raise
            time.sleep(0.05 + random.random() * 0.1)


class ResponseStore:
    def __init__(self, path: Path | str):
        path = Path(path)
        self.db = open_db(path, "response store", SCHEMA)

    def close(self) -> None:
        self.db.close()

    def put(self, r: StoredResponse) -> None:
        self.put_many([r])

    def put_many(self, responses: list[StoredResponse]) -> None:
        """Commit responses that arrived together in one transaction (group commit: the commit, not the row, is
        what costs; a kill still loses nothing that was handed to this call once it returns)."""
        rows = []
        for r in responses:
            row = dict(vars(r))  # shallow: dataclasses.asdict would deep-copy every token id
            row["prompt_ids"] = _ids(r.prompt_ids)
            row["output_ids"] = _ids(r.output_ids)
            rows.append(row)
        self.db.execute("BEGIN")
        try:
            self.db.executemany(_PUT, rows)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def put_failure(self, key: str, dataset: str, prompt_id: str, reason: str, detail: str, server: str) -> None:
        self.db.execute(
            "INSERT INTO failures VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key, dataset, prompt_id, reason, detail[:2000], server, time.time()),
        )

    def get_many(self, keys: Iterable[str]) -> dict[str, StoredResponse]:
        keys = list(keys)
        out: dict[str, StoredResponse] = {}
        for i in range(0, len(keys), 500):  # SQLite caps the number of bound parameters
            chunk = keys[i : i + 500]
            marks = ",".join("?" * len(chunk))
            cur = self.db.execute(f"SELECT * FROM responses WHERE key IN ({marks})", chunk)
            names = [d[0] for d in cur.description]
            for values in cur:
                row = dict(zip(names, values))
                row["prompt_ids"] = _unids(row["prompt_ids"])
                row["output_ids"] = _unids(row["output_ids"])
                out[row["key"]] = StoredResponse(**row)
        return out

    def count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]


def _ids(ids: Optional[list[int]]) -> Optional[str]:
    return None if ids is None else "[" + ",".join(map(str, ids)) + "]"  # JSON, at a third of json.dumps' cost


def _unids(blob: Optional[str]) -> Optional[list[int]]:
    return None if blob is None else json.loads(blob)


def hash_cache_path(store_path: str) -> Path:
    """Where file hashes of the model are cached between runs (stages.target.model_fingerprint): beside the store,
    so experiments that share the store share the cache."""
    return resolve_store_path(store_path).parent / "file_hashes.json"


def resolve_store_path(configured: str, cwd: Optional[Path] = None) -> Path:
    """Where the store lives. `DRAFTDATA_STORE` wins; an absolute path stays; a relative one is taken from the
    project root. `dvc exp run --temp` and `--queue` run in a copy of the workspace under
    `<root>/.dvc/tmp/exps/`: the root is then the original workspace, so experiments share one store and every
    response they generate is there for the next run."""
    env = os.environ.get("DRAFTDATA_STORE")
    if env:
        return Path(env)
    path = Path(configured)
    if path.is_absolute():
        return path
    cwd = (cwd or Path.cwd()).resolve()
    parts = cwd.parts
    for i in range(len(parts) - 3):
        if parts[i : i + 4] == (".dvc", "tmp", "exps", parts[i + 3]) and i > 0:
            return Path(*parts[:i]) / path
    return cwd / path
