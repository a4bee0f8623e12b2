"""Stage `prompts@D`: a source dataset → the prompts to send, in the source's shape adapted to chat messages,
deduplicated, selected (shuffle, max_prompts, max_prompt_tokens); every row not kept is counted by reason and listed
in `prompts_rejected.jsonl`.
"""

from __future__ import annotations

from collections.abc import Callable

from draftdata.config.load import cli
from draftdata.config.schema import Config
from draftdata.sources.files import iter_rows
from draftdata.sources.select import adapt_rows, dedup, select_prompts
from draftdata.util.files import data_dir, write_json, write_jsonl
from draftdata.util.log import log
from draftdata.util.rejected import Rejections


def main(cfg: Config) -> None:
    ds = cfg.ds
    # the work begins (a source of millions of rows takes a while before the closing line)
    log("prompts", dataset=cfg.dataset, reading=ds.source.path or ds.source.hf_name)
    out = data_dir(cfg.dataset)
    with Rejections(out / "prompts_rejected.jsonl", "prompts") as drops:  # every row not kept, with its reason
        records = dedup(adapt_rows(iter_rows(ds.source), ds, drops), drops)  # a stream: never held whole
        count_tokens = _token_counter(cfg) if ds.max_prompt_tokens is not None else None
        kept = select_prompts(records, ds.shuffle_seed, ds.max_prompts, ds.max_prompt_tokens, count_tokens, drops)
    n_read = len(kept) + drops.rows  # every row read is kept or rejected for one reason
    log("prompts", dataset=cfg.dataset, writing=out / "prompts.jsonl")  # the writing of the outputs begins
    write_jsonl(out / "prompts.jsonl", kept)
    metrics = {
        "rows_read": n_read,
        "kept": len(kept),
        "dropped": dict(sorted(drops.counts.items())),
        "dropped_total": drops.rows,
    }
    write_json(out / "prompts_metrics.json", metrics)
    log(
        "prompts",
        dataset=cfg.dataset,
        rows=n_read,
        kept=len(kept),
        **{f"dropped_{k}": v for k, v in sorted(drops.counts.items())},
    )


def _token_counter(cfg: Config) -> Callable[[dict], int]:
    from draftdata.model.tokenizer import load_tokenizer, render_prompt_ids

    tok = load_tokenizer(cfg.model)
    kwargs = cfg.template_kwargs
    return lambda rec: len(render_prompt_ids(tok, rec["messages"], rec.get("tools"), kwargs))


if __name__ == "__main__":
    cli(main)
