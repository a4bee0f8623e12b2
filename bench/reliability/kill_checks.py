"""The checks of the kill suite: each returns the problems it found, as counts of a kind.

Kinds (the suite's figures):
- lost: something that was there (a committed response, a delivered answer, a row of the clean run's output) is not;
- duplicated: something is there twice (a store key, an output row, a response generated again after it was
  stored);
- stale: something is there but wrong (a half-written file at a final name, an index entry for a torn shard, an
  output that differs from the clean run's or from the store it was written from).

The checks read files with their own code (SQLite, JSON, Parquet, the safetensors header) rather than the stages'
helpers, so a defect in those helpers cannot hide itself.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

KINDS = ("lost", "duplicated", "stale")
COMPLETE = ("stop", "length")  # a response; anything else in the store is a parked partial
# What to compare of a stored response (latency, server and timestamps differ between runs by nature).
RESPONSE_FIELDS = ("text", "output_ids", "prompt_ids", "prompt_tokens", "completion_tokens", "finish_reason")


@dataclass
class Problem:
    kind: str  # one of KINDS
    count: int
    what: str

    def __str__(self) -> str:
        return f"{self.kind} {self.count}: {self.what}"


def tally(problems: Iterable[Problem]) -> dict[str, int]:
    counts = dict.fromkeys(KINDS, 0)
    for p in problems:
        counts[p.kind] += p.count
    return counts


# ---- SQLite ---------------------------------------------------------------------------------------------------- #


def sqlite_problems(path: Path, unique: dict[str, str]) -> list[Problem]:
    """PRAGMA integrity_check, and no value of `unique` ({table: column}) twice. A store that fails the integrity
    check has lost what it held."""
    if not path.exists():
        return []
    try:
        con = sqlite3.connect(path)
        try:
            verdict = [row[0] for row in con.execute("PRAGMA integrity_check")]
            if verdict != ["ok"]:
                return [Problem("lost", 1, f"{path.name}: integrity_check: {'; '.join(verdict)[:200]}")]
            problems = []
            for table, column in unique.items():
                if not has_table(con, table):  # killed before the schema was created: nothing stored yet
                    continue
                dups = con.execute(
                    f"SELECT {column}, COUNT(*) FROM {table} GROUP BY {column} HAVING COUNT(*) > 1"
                ).fetchall()
                if dups:
                    problems.append(
                        Problem(
                            "duplicated",
                            sum(n - 1 for _, n in dups),
                            f"{path.name}: {table}.{column} {dups[0][0]!r} x{dups[0][1]}",
                        )
                    )
            return problems
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        return [Problem("lost", 1, f"{path.name}: unreadable: {e}")]


def has_table(con: sqlite3.Connection, table: str) -> bool:
    return con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is not None


def stored_responses(path: Path) -> dict[str, dict]:
    """key -> the response store's row (ids decoded)."""
    if not path.exists():
        return {}
    con = sqlite3.connect(path)
    try:
        if not has_table(con, "responses"):
            return {}
        cur = con.execute("SELECT * FROM responses")
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, values)) for values in cur]
    finally:
        con.close()
    for r in rows:
        for f in ("prompt_ids", "output_ids"):
            r[f] = json.loads(r[f]) if r[f] is not None else None
    return {r["key"]: r for r in rows}


def usable(r: dict) -> bool:
    """A stored response that enters the output (under on_budget: cancel, on_truncation: keep)."""
    return r["finish_reason"] in COMPLETE and r["completion_tokens"] > 0 and bool(r["text"].strip())


# ---- files: complete or absent ------------------------------------------------------------------------------- #


def torn_safetensors(path: Path) -> str | None:
    """Why a safetensors file is not whole (None: it is): its header says how long the data must be."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        size = path.stat().st_size
        return None if size == 8 + n + end else f"{size} bytes, header says {8 + n + end}"
    except (OSError, ValueError, KeyError) as e:
        return f"{type(e).__name__}: {e}"


def unparseable(path: Path) -> str | None:
    """Why a final output file does not read completely (None: it does)."""
    try:
        if path.suffix == ".jsonl":
            text = path.read_text(encoding="utf-8")
            if text and not text.endswith("\n"):
                return "last line cut"
            for line in text.splitlines():
                json.loads(line)
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.read_table(path)
        elif path.suffix == ".safetensors":
            return torn_safetensors(path)
    except (OSError, ValueError) as e:  # pyarrow's errors are ValueErrors (ArrowInvalid) or OSErrors
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def final_files(out: Path) -> list[Path]:
    """Every file at a final name under `out` (a file or a directory); temp files (`.<name>.<random>.tmp`) are the
    writer's business, never read as outputs."""
    if out.is_file():
        return [out]
    if not out.is_dir():
        return []
    return sorted(p for p in out.rglob("*") if p.is_file() and not p.name.startswith("."))


def file_problems(outputs: Iterable[Path]) -> list[Problem]:
    """Every output present at its final name reads completely: a half-written one would be taken as done."""
    problems = []
    for out in outputs:
        for path in final_files(out):
            why = unparseable(path)
            if why:
                problems.append(Problem("stale", 1, f"{path.name} half-written: {why}"))
    return problems


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".*.tmp") if p.is_file())


# ---- the hidden-state store: no index entry for a shard that is not whole ----------------------------------- #


def state_store_problems(root: Path) -> list[Problem]:
    """Every indexed sample points at a whole shard that holds that sample at that row."""
    index = root / "index.sqlite"
    if not index.exists():
        return []
    con = sqlite3.connect(index)
    try:
        rows = con.execute("SELECT key, shard, row FROM states").fetchall() if has_table(con, "states") else []
    finally:
        con.close()
    problems, keys_of = [], {}
    for key, shard, row in rows:
        if shard not in keys_of:
            why = torn_safetensors(root / shard)
            keys_of[shard] = None if why else _shard_keys(root / shard)
            if why:
                problems.append(Problem("stale", 1, f"indexed shard {shard} not whole: {why}"))
        keys = keys_of[shard]
        if keys is not None and (row >= len(keys) or keys[row] != key):
            problems.append(Problem("stale", 1, f"index says {key} is row {row} of {shard}; the shard disagrees"))
    return problems


def _shard_keys(path: Path) -> list[str]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return json.loads(header["__metadata__"]["draftdata"])["keys"]


# ---- outputs against the clean run's ------------------------------------------------------------------------- #


def compare_rows(what: str, got: list[dict], want: list[dict], key: str) -> list[Problem]:
    """Rows of an output against the clean run's: each missing one is lost, each extra copy duplicated, and any
    other difference (content, order, a row the clean run has not) stale."""
    problems = []
    counts = Counter(r[key] for r in got)
    wanted = {r[key] for r in want}
    missing = [r[key] for r in want if r[key] not in counts]
    if missing:
        problems.append(
            Problem("lost", len(missing), f"{what}: {len(missing)} rows of the clean run missing (first {missing[0]})")
        )
    extra = sum(n - 1 for n in counts.values() if n > 1)
    if extra:
        problems.append(Problem("duplicated", extra, f"{what}: {extra} rows twice"))
    if not missing and not extra and got != want:
        strange = sum(1 for r in got if r[key] not in wanted)
        differ = sum(1 for a, b in zip(got, want) if a != b)
        problems.append(
            Problem(
                "stale",
                max(1, strange, differ),
                f"{what}: differs from the clean run ({differ} rows differ, {strange} unknown ids)",
            )
        )
    return problems


def compare_common(what: str, got: list[dict], want: list[dict], key: str) -> list[Problem]:
    """Rows that both outputs hold (by key) are equal; which rows each holds is another check's business."""
    clean = {r[key]: r for r in want}
    differ = [r[key] for r in got if r[key] in clean and r != clean[r[key]]]
    if not differ:
        return []
    return [
        Problem("stale", len(differ), f"{what}: {len(differ)} rows differ from the clean run's (first {differ[0]})")
    ]


def compare_json(what: str, got: dict, want: dict, ignore: tuple[str, ...] = ()) -> list[Problem]:
    a = {k: v for k, v in got.items() if k not in ignore}
    b = {k: v for k, v in want.items() if k not in ignore}
    if a == b:
        return []
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return [Problem("stale", 1, f"{what}: differs from the clean run in {keys}")]


def compare_states(got_dir: Path, want_dir: Path) -> list[Problem]:
    """The states themselves, sample by sample through the reader API, against the clean run's: exactly equal (a
    sample is computed alone or with samples of its own length, so its batch does not change its arithmetic)."""
    import torch

    from draftdata.hidden.reader import HiddenStates

    got, want = HiddenStates(got_dir), HiddenStates(want_dir)
    clean = {s.id: s for s in want}
    differ = []
    for s in got:
        w = clean.get(s.id)
        if w is None:
            continue  # told by compare_rows over the sample lists
        same = (
            torch.equal(s.input_ids, w.input_ids)
            and torch.equal(s.loss_mask, w.loss_mask)
            and torch.equal(s.aux, w.aux)
            and torch.equal(s.final_pre_norm, w.final_pre_norm)
        )
        if not same:
            differ.append(s.id)
    if not differ:
        return []
    return [
        Problem(
            "stale",
            len(differ),
            f"hidden states of {len(differ)} samples differ from the clean run's (first {differ[0]})",
        )
    ]


# ---- generate: the output against the store it was written from --------------------------------------------- #


def expected_selection(prompts: list[dict], store: dict[str, dict], dataset: str, budget: int) -> list[str]:
    """The keys responses.jsonl must hold (the budget counted in completion tokens, `landing: exact`, the stage's
    default): the usable stored responses in prompt order, the shortest run of them from the first that reaches
    the budget."""
    by_prompt = {r["prompt_id"]: r for r in store.values() if r["dataset"] == dataset}
    found = [by_prompt.get(p["id"]) for p in prompts]
    keys, total = [], 0
    for r in found:
        if total >= budget:
            break
        if r is not None and usable(r):
            keys.append(r["key"])
            total += r["completion_tokens"]
    return keys


def output_vs_store(
    rows: list[dict], prompts: list[dict], store: dict[str, dict], dataset: str, budget: int
) -> list[Problem]:
    """responses.jsonl is exactly what the store holds now, selected as the stage selects: not an older state of
    it, not a half-finished one."""
    problems = []
    want = expected_selection(prompts, store, dataset, budget)
    got = [r["key"] for r in rows]
    if got != want:
        missing = len(set(want) - set(got))
        extra = len(got) - len(set(got))
        if missing:
            problems.append(Problem("lost", missing, f"responses.jsonl lacks {missing} stored responses it selects"))
        if extra:
            problems.append(Problem("duplicated", extra, f"responses.jsonl holds {extra} keys twice"))
        if not missing and not extra:
            problems.append(Problem("stale", 1, "responses.jsonl is not the store's selection (order or extra rows)"))
    differ = [r["key"] for r in rows if r["key"] in store and _fields(r) != _fields(store[r["key"]])]
    if differ:
        problems.append(
            Problem(
                "stale", len(differ), f"{len(differ)} rows of responses.jsonl differ from the store (first {differ[0]})"
            )
        )
    return problems


def _fields(r: dict) -> tuple:
    return tuple(r.get(f) for f in RESPONSE_FIELDS)


def committed_kept(before: dict[str, dict], after: dict[str, dict]) -> list[Problem]:
    """Every response committed before the kill is still in the store after the restart, unchanged."""
    gone = [k for k, r in before.items() if r["finish_reason"] in COMPLETE and k not in after]
    changed = [
        k
        for k, r in before.items()
        if r["finish_reason"] in COMPLETE and k in after and _fields(r) != _fields(after[k])
    ]
    problems = []
    if gone:
        problems.append(Problem("lost", len(gone), f"{len(gone)} responses committed before the kill are gone"))
    if changed:
        problems.append(
            Problem("stale", len(changed), f"{len(changed)} responses committed before the kill were rewritten")
        )
    return problems


def same_as_clean(store: dict[str, dict], clean: dict[str, dict]) -> list[Problem]:
    """Sampling is seeded per request and position: a response (or the part of it a parked partial holds) has the
    same tokens as the clean run's for the same key."""
    differ = []
    for key, r in store.items():
        c = clean.get(key)
        if c is None or r["output_ids"] is None or c["output_ids"] is None:
            continue
        if r["finish_reason"] in COMPLETE and c["finish_reason"] in COMPLETE:
            same = r["output_ids"] == c["output_ids"]
        else:
            n = min(len(r["output_ids"]), len(c["output_ids"]))
            same = r["output_ids"][:n] == c["output_ids"][:n]
        if not same:
            differ.append(key)
    if not differ:
        return []
    return [
        Problem("stale", len(differ), f"{len(differ)} stored responses differ from the clean run's (first {differ[0]})")
    ]


def accounting(before: dict[str, dict], after: dict[str, dict], metrics: dict) -> list[Problem]:
    """The restart's generate_metrics.json against the store: it reused every usable response committed before the
    kill (sending one again would generate it twice), and every response it says it generated landed."""
    problems = []
    reusable = sum(1 for r in before.values() if usable(r))
    if metrics["reused_from_store"] < reusable:
        n = reusable - metrics["reused_from_store"]
        problems.append(
            Problem(
                "duplicated", n, f"the restart reused {metrics['reused_from_store']} of {reusable} stored responses"
            )
        )
    elif metrics["reused_from_store"] > reusable:
        problems.append(
            Problem(
                "stale",
                1,
                f"the restart says it reused {metrics['reused_from_store']} responses; the store held {reusable}",
            )
        )
    landed = sum(1 for k, r in after.items() if k not in before or _fields(r) != _fields(before[k]))
    if metrics["newly_generated"] > landed:
        problems.append(
            Problem(
                "lost",
                metrics["newly_generated"] - landed,
                f"the restart generated {metrics['newly_generated']} responses, {landed} landed in the store",
            )
        )
    elif metrics["newly_generated"] < landed:
        problems.append(
            Problem(
                "stale",
                landed - metrics["newly_generated"],
                f"{landed} responses landed, the restart says it generated {metrics['newly_generated']}",
            )
        )
    return problems


# ---- generate on a server: the wire against the store ------------------------------------------------------- #


@dataclass(frozen=True)
class Delivery:
    """One request a server saw, named by the store key it asks for (None: a request the run did not plan)."""

    key: str | None
    complete: bool  # the whole answer left the server
    at: float | None = None  # when it had (time.time()), where known


def deliveries(exchanges: list, key_of_seed: dict[int, str]) -> list[Delivery]:
    """The logging proxy's exchanges as deliveries: the seed a request carries names its response."""
    return [Delivery(key_of_seed.get(e.seed), e.complete, e.delivered) for e in exchanges if e.seed is not None]


def wire_problems(
    killed: list[Delivery], restart: list[Delivery], snapshot: dict[str, dict], final: dict[str, dict]
) -> list[Problem]:
    """What the logging proxy saw (`deliveries`) against the store after the kill (`snapshot`) and after the
    restart (`final`): `delivery_problems`, and

    - lost: an answer delivered before the kill that is not in the snapshot, although an answer delivered after it
      is (so it was no longer in flight: the client had committed later ones).
    """
    return _lost_at_kill(killed, snapshot) + delivery_problems(killed, restart, snapshot, final)


def delivery_problems(
    killed: list[Delivery], restart: list[Delivery], snapshot: dict[str, dict], final: dict[str, dict]
) -> list[Problem]:
    """The requests a server saw before the kill (`killed`) and during the restart, against the store after each:

    - lost: an answer delivered during the restart that is not in the final store;
    - duplicated: a request sent again for a response already stored (a turn of a conversation regenerated), or
      one answer delivered twice in a run;
    - stale: a stored response that no server ever delivered.
    """
    problems = []
    dropped = [d.key for d in restart if d.complete and not _stored(final, d.key)]
    if dropped:
        problems.append(
            Problem("lost", len(dropped), f"{len(dropped)} answers delivered during the restart are not in the store")
        )
    again = [d.key for d in restart if _stored(snapshot, d.key)]
    if again:
        problems.append(
            Problem(
                "duplicated",
                len(again),
                f"{len(again)} requests sent again for responses stored before the kill (first {again[0]})",
            )
        )
    twice = 0
    for phase in (killed, restart):
        counts = Counter(d.key for d in phase if d.complete)
        twice += sum(n - 1 for n in counts.values() if n > 1)
    if twice:
        problems.append(Problem("duplicated", twice, f"{twice} answers delivered twice for one response"))
    delivered = {d.key for d in killed + restart if d.complete}
    unknown = [k for k, r in final.items() if r["finish_reason"] in COMPLETE and k not in delivered]
    if unknown:
        problems.append(Problem("stale", len(unknown), f"{len(unknown)} stored responses were never delivered"))
    return problems


def _stored(store: dict[str, dict], key: str | None) -> bool:
    return key in store and store[key]["finish_reason"] in COMPLETE


def _lost_at_kill(killed: list[Delivery], snapshot: dict[str, dict]) -> list[Problem]:
    delivered = sorted((d.at, d.key) for d in killed if d.complete)
    last_commit = max((t for t, k in delivered if _stored(snapshot, k)), default=float("-inf"))
    # delivered before the last answer the client committed, yet not committed itself
    lost = [k for t, k in delivered if t < last_commit and not _stored(snapshot, k)]
    if not lost:
        return []
    return [
        Problem(
            "lost", len(lost), f"{len(lost)} answers delivered before the kill are not in the store (first {lost[0]})"
        )
    ]


# ---- generate, turns: all: conversations against the clean run's ------------------------------------------- #


def unknown_keys(store: dict[str, dict], clean: dict[str, dict]) -> list[Problem]:
    """Every response stored is one the clean run stored: a turn built on another history (an answer lost, or
    taken twice) has a key of its own."""
    unknown = [k for k in store if k not in clean]
    if not unknown:
        return []
    return [Problem("stale", len(unknown), f"{len(unknown)} stored responses the clean run never asked for")]


def resumed_conversations(rows: list[dict], snapshot: dict[str, dict]) -> int:
    """Conversations of responses.jsonl the kill cut between turns: their first turns stored before it, the rest
    after (a turn is asked only once the one before is stored)."""
    stored: dict[str, list[bool]] = {}
    for r in rows:
        stored.setdefault(r["conversation"], []).append(_stored(snapshot, r["key"]))
    return sum(any(s) and not all(s) for s in stored.values())
