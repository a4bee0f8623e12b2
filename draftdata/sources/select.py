"""Stage `prompts@D`: a prompt source → `data/<D>/prompts.jsonl`.

Each row is normalised to OpenAI-style `messages` (+ `tools`) ending at the last user/tool turn (the original
answer is dropped: we regenerate it). Ids are content hashes, exact duplicates are removed, the order is a seeded
shuffle, and prompts longer than `max_prompt_tokens` under the target's chat template are dropped. Every drop is
counted by reason in `data/<D>/prompts_metrics.json`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from draftdata.config.schema import DatasetConfig, OnBadRecord, Turns
from draftdata.errors import UserError
from draftdata.sources.files import Row
from draftdata.sources.shapes import BadRecord, Prompt, SourceOptions, to_prompt, turn_slots
from draftdata.util.hashing import content_hash
from draftdata.util.rejected import Tally


class BadInput(UserError):
    """A malformed source row under `on_bad_record: fail`."""


def prompt_id(messages: list[dict], tools: list[dict] | None) -> str:
    return content_hash({"messages": messages, "tools": tools})


def adapt_rows(rows: Iterable[Row], ds: DatasetConfig, drops: Tally) -> Iterator[dict]:
    """Rows → prompt records; bad rows fail with their file:line, or are counted (and listed) when the user chose
    `skip`."""
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
            drops.add(e.reason, where=row.where)
            continue
        yield _record(p, row.where, ds.turns == Turns.all)


def _record(p: Prompt, where: str, all_turns: bool) -> dict:
    """A prompt record. With every turn regenerated it holds the whole conversation and where the target answers
    in it, and its id covers them (two sources that share a first prompt and differ later are two conversations,
    not duplicates); else it is the last turn's prompt alone, as it always was."""
    if not all_turns:
        rec = {"id": prompt_id(p.messages, p.tools), "messages": p.messages}
    else:
        rec = {"id": content_hash({"conversation": p.conversation, "tools": p.tools}), "messages": p.messages}
        rec.update(conversation=p.conversation, slots=turn_slots(p.conversation))
    if p.tools:
        rec["tools"] = p.tools
    rec["where"] = where
    return rec


def dedup(records: Iterable[dict], drops: Tally) -> Iterator[dict]:
    """The first record of each id, as a stream: only the ids seen are held."""
    seen: set[str] = set()
    for rec in records:
        if rec["id"] in seen:
            drops.add("duplicate", where=rec.get("where"), id=rec["id"])
            continue
        seen.add(rec["id"])
        yield rec


def select_prompts(
    records: Iterable[dict],
    seed: int,
    max_prompts: int | None,
    max_prompt_tokens: int | None,
    count_tokens: Callable[[dict], int],
    drops: Tally,
) -> list[dict]:
    """Seeded shuffle, then keep prompts within the token limit until `max_prompts` are kept.

    Shuffling by a sort on (hash of seed and id) makes the order independent of the source's row order, so
    appending rows to a source keeps the earlier prompts' relative order. The prompts kept are the `max_prompts`
    first in that order that fit `max_prompt_tokens`; they are chosen as the records stream by, holding at most
    `max_prompts` of them (5M source rows to keep 100k must not all sit in memory and be sorted).
    """
    fits = _fits(max_prompt_tokens, count_tokens)
    if max_prompts is None:
        kept = []
        for _, rec in sorted(((_order(seed, rec), rec) for rec in records), key=lambda e: e[0]):
            if fits(rec):
                kept.append(rec)
            else:
                _drop(drops, "over_max_prompt_tokens", rec)
        return kept
    return _first_in_order(records, seed, max_prompts, fits, drops)


def _order(seed: int, rec: dict) -> str:
    return content_hash([seed, rec["id"]])


def _fits(max_prompt_tokens: int | None, count_tokens: Callable[[dict], int]) -> Callable[[dict], bool]:
    """Whether a prompt is within the token limit; one that is records its count (`prompt_tokens`)."""

    def fits(rec: dict) -> bool:
        if max_prompt_tokens is None:
            return True
        n = count_tokens(rec)
        if n > max_prompt_tokens:
            return False
        rec["prompt_tokens"] = n
        return True

    return fits


def _first_in_order(
    records: Iterable[dict], seed: int, limit: int, fits: Callable[[dict], bool], drops: Tally
) -> list[dict]:
    """The `limit` records first in the seeded order that fit, and the drops counted as if every record had been
    sorted and walked in that order: too long if before the last one kept, else over max_prompts.

    `kept` is a max-heap (entries negated) of the records that fit; a record after its last one once it is full can
    never be kept, so its tokens are not counted. `too_long` holds the order of the records that did not fit while
    they were ahead of the last one kept (their order keys and where they are: no records)."""
    kept: list[tuple[tuple[int, int], dict]] = []  # (negated (order, arrival), record): the last one kept on top
    too_long: list[tuple[tuple[int, int], dict]] = []  # (negated (order, arrival), where and id)
    for seq, rec in enumerate(records):
        at = (-int(_order(seed, rec), 16), -seq)  # ties in the order (none for distinct ids) go by arrival, as sorted
        if len(kept) == limit and at < kept[0][0]:
            _drop(drops, "over_max_prompts", rec)
            continue
        if not fits(rec):
            heapq.heappush(too_long, (at, _place(rec)))
            continue
        heapq.heappush(kept, (at, rec))
        if len(kept) > limit:
            _drop(drops, "over_max_prompts", heapq.heappop(kept)[1])
        while too_long and len(kept) == limit and too_long[0][0] < kept[0][0]:
            drops.add("over_max_prompts", **heapq.heappop(too_long)[1])
    for _, place in sorted(too_long, reverse=True):
        drops.add("over_max_prompt_tokens", **place)
    return [rec for _, rec in sorted(kept, key=lambda e: e[0], reverse=True)]


def _place(rec: dict) -> dict:
    """What finds a prompt record again in its source: where it was read, and its id."""
    return {"where": rec.get("where"), "id": rec["id"]}


def _drop(drops: Tally, reason: str, rec: dict) -> None:
    drops.add(reason, **_place(rec))
