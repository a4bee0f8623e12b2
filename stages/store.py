"""The response store: every generated response, committed as it arrives, outside DVC's outputs.

DVC deletes a stage's outputs before rerunning it and `dvc exp run` rolls persisted outputs back, so responses
kept there would be lost on the next run. SQLite (WAL) in a git- and dvc-ignored file survives both, and a kill
loses at most the requests in flight. Keyed by a content hash of (model, exact prompt, sampling), so any run,
experiment or dataset that asks the same question reuses the answer.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass, field
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
    finish_reason TEXT NOT NULL,    -- stop | length | budget_cut
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


class ResponseStore:
    def __init__(self, path: Path | str):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we commit explicitly, one response per transaction.
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a crash never corrupts, may lose the last commit
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def put(self, r: StoredResponse) -> None:
        row = asdict(r)
        row["prompt_ids"] = _ids(r.prompt_ids)
        row["output_ids"] = _ids(r.output_ids)
        cols = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        # OR IGNORE: a response already stored for this key (another run got there first) is kept, never duplicated.
        self.db.execute(f"INSERT OR IGNORE INTO responses ({cols}) VALUES ({marks})", row)

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
    return None if ids is None else json.dumps(ids, separators=(",", ":"))


def _unids(blob: Optional[str]) -> Optional[list[int]]:
    return None if blob is None else json.loads(blob)
