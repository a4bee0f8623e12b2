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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

from draftdata.util.hashing import ids_json
from draftdata.util.log import log
from draftdata.util.sqlite import add_columns, open_db, rows_in, transaction

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
    created_at REAL NOT NULL,
    reasoning TEXT,                 -- a chat answer's thinking, moved out of `text` by a server's reasoning parser
    tool_calls TEXT,                -- JSON list of OpenAI tool calls, moved out of `text` by a tool-call parser
    compute_dtype TEXT,             -- the dtype an in-process engine computed it in (NULL: a server's answer)
    attention TEXT                  -- the in-process engine's decode attention: kernel | reference | transformers
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
CREATE TABLE IF NOT EXISTS rendered (   -- prompt ids under a chat template, so a rerun does not render them again
    tokenizer TEXT NOT NULL,            -- fingerprint of the model, tokenizer files, template and its kwargs
    prompt_id TEXT NOT NULL,
    ids TEXT NOT NULL,                  -- JSON list
    PRIMARY KEY (tokenizer, prompt_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS turn_rendered (  -- `turns: all`: each turn's ids, so a rerun does not render stored turns
    tokenizer TEXT NOT NULL,                -- as in `rendered`
    conversation TEXT NOT NULL,             -- the prompt record's id
    turn TEXT NOT NULL,                     -- hash of the answers before the turn (generate/plan/conversation.py)
    ids TEXT NOT NULL,                      -- JSON list, or "+" and what follows the previous turn and its answer
    PRIMARY KEY (tokenizer, conversation, turn)
) WITHOUT ROWID;
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
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    created_at: float = field(default_factory=time.time)
    reasoning: str | None = None
    tool_calls: list[dict] | None = None
    # the dtype an in-process engine computed the answer in (model.compute_dtype, resolved); None: a server's
    compute_dtype: str | None = None
    # the in-process engine's decode-attention path (kernel, its float32 SDPA reference, or transformers' batching):
    # they round differently, so a seeded answer can differ by machine under one key; None: a server's
    attention: str | None = None

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


class ResponseStore:
    def __init__(self, path: Path | str):
        path = Path(path)
        self.db = open_db(path, "response store", SCHEMA)
        add_columns(self.db, "responses", ADDED_COLUMNS)  # an older store gets the columns added since

    def close(self) -> None:
        self.db.close()

    def put(self, r: StoredResponse) -> StoredResponse:
        return self.put_many([r])[0]

    def put_many(self, responses: list[StoredResponse]) -> list[StoredResponse]:
        """Commit responses that arrived together in one transaction (group commit: the commit, not the row, is
        what costs; a kill still loses nothing that was handed to this call once it returns). Returns the row the
        store holds for each once committed: the response itself, or the row `_PUT` kept instead (a complete answer
        another run committed first, a longer partial), which is what every later run will read."""
        rows = []
        for r in responses:
            row = dict(vars(r))  # shallow: dataclasses.asdict would deep-copy every token id
            row["prompt_ids"] = _ids(r.prompt_ids)
            row["output_ids"] = _ids(r.output_ids)
            row["tool_calls"] = json.dumps(r.tool_calls) if r.tool_calls else None
            rows.append(row)
        with transaction(self.db):
            if self.db.executemany(_PUT, rows).rowcount == len(rows):  # every row inserted or replaced: ours
                return responses
            kept = self.get_many(r.key for r in responses)  # read only on a conflict
        return [r if (k := kept.get(r.key, r)) == r else k for r in responses]  # ours where taken

    def put_failure(self, key: str, dataset: str, prompt_id: str, reason: str, detail: str, server: str) -> None:
        self.db.execute(
            "INSERT INTO failures VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key, dataset, prompt_id, reason, detail[:2000], server, time.time()),
        )

    def get_many(self, keys: Iterable[str]) -> dict[str, StoredResponse]:
        out: dict[str, StoredResponse] = {}
        # the columns in the dataclass's order: a row becomes a response by position, with no dict in between
        for values in rows_in(self.db, f"SELECT {', '.join(_COLS)} FROM responses WHERE key IN ({{marks}})", keys):
            r = StoredResponse(*values)
            r.prompt_ids = _unids(r.prompt_ids)
            r.output_ids = _unids(r.output_ids)
            r.tool_calls = _unids(r.tool_calls)
            out[r.key] = r
        return out

    def answered_prompts(self, dataset: str) -> Iterator[tuple[str, str]]:
        """(prompt id, key) of every complete answer stored for `dataset`: one pass over the table, once per run."""
        sql = f"SELECT prompt_id, key FROM responses WHERE dataset = ? AND finish_reason NOT IN {_PARTIAL_SQL}"
        return self.db.execute(sql, (dataset,))

    def failures(self, keys: Iterable[str]) -> dict[str, str]:
        """Key -> the reason its latest failed request ended with, for the keys with a failure on record."""
        sql = "SELECT key, reason FROM failures WHERE key IN ({marks}) ORDER BY created_at"
        return dict(rows_in(self.db, sql, keys))

    def get_rendered(self, tokenizer: str, prompt_ids: Iterable[str]) -> dict[str, str]:
        """Prompt id -> its rendered token ids as JSON text (`ids_json`'s), for those rendered earlier under this
        tokenizer fingerprint. Left undecoded: the request key hashes this text, and only the prompts a run sends
        need the ids themselves."""
        wanted = set(prompt_ids)
        return dict(self._select("rendered", "prompt_id", "ids", tokenizer, wanted, len(wanted)))

    def put_rendered(self, tokenizer: str, rendered: dict[str, str]) -> None:
        """Prompt id -> its rendered ids as `ids_json` text."""
        rows = [(tokenizer, pid, ids) for pid, ids in rendered.items()]
        self._commit_many("INSERT OR REPLACE INTO rendered VALUES (?, ?, ?)", rows)

    def get_turn_renders(self, tokenizer: str, conversations: Iterable[str], turns: int) -> dict[tuple[str, str], str]:
        """(conversation id, turn key) -> the turn's cached render (plan/conversation.py `TurnRenders`), for the
        turns of these conversations rendered earlier under this tokenizer fingerprint; `turns`: about how many
        they have. A table that cannot be read holds none: every turn is rendered again."""
        try:
            rows = self._select("turn_rendered", "conversation", "turn, ids", tokenizer, set(conversations), turns)
            return {(conv, turn): ids for conv, turn, ids in rows}
        except sqlite3.DatabaseError as e:
            log("response store", warning=f"the turns' render cache cannot be read ({e}): rendering every turn")
            return {}

    def put_turn_renders(self, tokenizer: str, renders: dict[tuple[str, str], str]) -> None:
        """Keep turns' renders for the next run; one that cannot be kept costs that run the renders, nothing else."""
        rows = [(tokenizer, conv, turn, ids) for (conv, turn), ids in renders.items()]
        try:
            self._commit_many("INSERT OR REPLACE INTO turn_rendered VALUES (?, ?, ?, ?)", rows)
        except sqlite3.DatabaseError as e:
            log("response store", warning=f"the turns' render cache cannot be written ({e})")

    def _select(self, table: str, column: str, rest: str, tokenizer: str, wanted: set[str], rows: int) -> list:
        """`column` and `rest` of `table`'s rows under `tokenizer` whose `column` is in `wanted` (about `rows`)."""
        kept = self.db.execute(f"SELECT COUNT(*) FROM {table} WHERE tokenizer = ?", (tokenizer,)).fetchone()[0]
        if kept <= 2 * rows:  # reading them all in key order costs less than looking each one up
            found = self.db.execute(f"SELECT {column}, {rest} FROM {table} WHERE tokenizer = ?", (tokenizer,))
            return [row for row in found if row[0] in wanted]
        sql = f"SELECT {column}, {rest} FROM {table} WHERE tokenizer = ? AND {column} IN ({{marks}})"
        return list(rows_in(self.db, sql, sorted(wanted), tokenizer))  # in key order: the table's pages walked once

    def _commit_many(self, sql: str, rows: list) -> None:
        with transaction(self.db):
            self.db.executemany(sql, rows)

    def count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]


# Columns added after the first stores were written: an older store gets them (empty) when it is opened.
ADDED_COLUMNS = {"reasoning": "TEXT", "tool_calls": "TEXT", "compute_dtype": "TEXT", "attention": "TEXT"}


def _ids(ids: list[int] | None) -> str | None:
    return None if ids is None else ids_json(ids)


def _unids(blob: str | None) -> list[int] | None:
    return None if blob is None else json.loads(blob)
