"""Stage `prompts@D`: a prompt source → `data/<D>/prompts.jsonl`.

Each row is normalised to OpenAI-style `messages` (+ `tools`) ending at the last user/tool turn (the original
answer is dropped: we regenerate it). Ids are content hashes, exact duplicates are removed, the order is a seeded
shuffle, and prompts longer than `max_prompt_tokens` under the target's chat template are dropped. Every drop is
counted by reason in `data/<D>/prompts_metrics.json`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from draftdata.config.schema import DatasetConfig, OnBadRecord
from draftdata.errors import UserError
from draftdata.sources.files import Row
from draftdata.sources.shapes import BadRecord, SourceOptions, to_prompt
from draftdata.util.hashing import content_hash


class BadInput(UserError):
    """A malformed source row under `on_bad_record: fail`."""


def prompt_id(messages: list[dict], tools: list[dict] | None) -> str:
    return content_hash({"messages": messages, "tools": tools})


def adapt_rows(rows: Iterable[Row], ds: DatasetConfig, drops: Counter) -> Iterator[dict]:
    """Rows → prompt records; bad rows fail with their file:line, or are counted when the user chose `skip`."""
    options = SourceOptions(keep_system=ds.source.keep_system, user_template=ds.source.user_template)
    for row in rows:
        try:
            if row.error is not None:
                raise BadRecord(row.reason, row.error)
            p = to_prompt(ds.source.shape, row.value, options)
        except BadRecord as e:
            if ds.on_bad_record == OnBadRecord.fail:
                raise BadInput(
                    f"{row.where}: {e} (reason={e.reason}; set on_bad_record: skip to count and skip)"
                ) from e
            drops[e.reason] += 1
            continue
        rec = {"id": prompt_id(p.messages, p.tools), "messages": p.messages}
        if p.tools:
            rec["tools"] = p.tools
        rec["where"] = row.where
        yield rec


def dedup(records: Iterable[dict], drops: Counter) -> list[dict]:
    seen: set[str] = set()
    out = []
    for rec in records:
        if rec["id"] in seen:
            drops["duplicate"] += 1
            continue
        seen.add(rec["id"])
        out.append(rec)
    return out


def select_prompts(
    records: list[dict],
    seed: int,
    max_prompts: int | None,
    max_prompt_tokens: int | None,
    count_tokens: Callable[[dict], int],
    drops: Counter,
) -> list[dict]:
    """Seeded shuffle, then keep prompts within the token limit until `max_prompts` are kept.

    Shuffling by a sort on (hash of seed and id) makes the order independent of the source's row order, so
    appending rows to a source keeps the earlier prompts' relative order.
    """
    order = sorted(records, key=lambda r: content_hash([seed, r["id"]]))
    kept = []
    for rec in order:
        if max_prompts is not None and len(kept) >= max_prompts:
            drops["over_max_prompts"] += 1
            continue
        if max_prompt_tokens is not None:
            n = count_tokens(rec)
            if n > max_prompt_tokens:
                drops["over_max_prompt_tokens"] += 1
                continue
            rec["prompt_tokens"] = n
        kept.append(rec)
    return kept
