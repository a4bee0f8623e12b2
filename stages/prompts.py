"""Stage `prompts@D`: a prompt source → `data/<D>/prompts.jsonl`.

Each row is normalised to OpenAI-style `messages` (+ `tools`) ending at the last user/tool turn (the original
answer is dropped: we regenerate it). Ids are content hashes, exact duplicates are removed, the order is a seeded
shuffle, and prompts longer than `max_prompt_tokens` under the target's chat template are dropped. Every drop is
counted by reason in `data/<D>/prompts_metrics.json`.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Iterator, Optional

from stages.artifacts import data_dir, log, write_json, write_jsonl
from stages.config import Config, DatasetConfig, OnBadRecord, UserError, cli
from stages.readers import Row, iter_rows
from stages.sources import BadRecord, SourceOptions, to_prompt
from stages.target import content_hash


class BadInput(UserError):
    """A malformed source row under `on_bad_record: fail`."""


def prompt_id(messages: list[dict], tools: Optional[list[dict]]) -> str:
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
                raise BadInput(f"{row.where}: {e} (reason={e.reason}; set on_bad_record: skip to count and skip)")
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


def select(
    records: list[dict],
    seed: int,
    max_prompts: Optional[int],
    max_prompt_tokens: Optional[int],
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


def main(cfg: Config) -> None:
    ds = cfg.ds
    drops: Counter = Counter()
    records = dedup(adapt_rows(iter_rows(ds.source), ds, drops), drops)
    n_read = len(records) + sum(drops.values())
    count_tokens = _token_counter(cfg) if ds.max_prompt_tokens is not None else None
    kept = select(records, ds.shuffle_seed, ds.max_prompts, ds.max_prompt_tokens, count_tokens, drops)
    out = data_dir(cfg.dataset)
    write_jsonl(out / "prompts.jsonl", kept)
    metrics = {
        "rows_read": n_read,
        "kept": len(kept),
        "dropped": dict(sorted(drops.items())),
        "dropped_total": sum(drops.values()),
    }
    write_json(out / "prompts_metrics.json", metrics)
    log(
        "prompts",
        dataset=cfg.dataset,
        rows=n_read,
        kept=len(kept),
        **{f"dropped_{k}": v for k, v in sorted(drops.items())},
    )


def _token_counter(cfg: Config) -> Callable[[dict], int]:
    from stages.target import load_tokenizer, render_prompt_ids

    tok = load_tokenizer(cfg.model)
    kwargs = dict(cfg.model.template_kwargs)
    return lambda rec: len(render_prompt_ids(tok, rec["messages"], rec.get("tools"), kwargs))


if __name__ == "__main__":
    cli(main)
