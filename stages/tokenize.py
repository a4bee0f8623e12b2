"""Stage `tokenize@D`: responses → samples.parquet, token-exact where the server returned ids (prompt ids + output
ids, the loss mask built with them; text-only responses are re-encoded, their drift counted), skips counted by
reason.
"""

from __future__ import annotations

from draftdata.config.load import cli
from draftdata.config.schema import Config
from draftdata.errors import UserError
from draftdata.model.tokenizer import load_tokenizer, tokenizer_fingerprint
from draftdata.tokenize.parquet import SCHEMA_VERSION, samples_table, write_parquet
from draftdata.tokenize.samples import SKIP_REASONS, build_samples, check_skips, reject_rows, response_groups
from draftdata.util.files import data_dir, read_jsonl, write_csv, write_json
from draftdata.util.log import log
from draftdata.util.plots import outcome_rows
from draftdata.util.rejected import Rejections


def main(cfg: Config) -> None:
    out = data_dir(cfg.dataset)
    src = out / "responses.jsonl"
    if not src.exists():
        raise UserError(f"{src}: not found; run the generate stage first (dvc repro generate@{cfg.dataset})")
    tok = load_tokenizer(cfg.model)
    recs = list(read_jsonl(src))
    log("tokenize", dataset=cfg.dataset, responses=len(recs))  # the work begins: tokenizing them
    samples, tally = build_samples(recs, tok, cfg)
    check_skips(tally.skipped, len(recs), cfg.tokenize.max_skip_pct)
    with Rejections(out / "tokenize_rejected.jsonl", "tokenize") as rejected:  # every row no sample holds, and why
        rows_kept = reject_rows(rejected, recs, samples, tally)
    meta = {
        "schema_version": SCHEMA_VERSION,
        "dataset": cfg.dataset,
        "tokenizer": tokenizer_fingerprint(tok, cfg.model, cfg.template_kwargs),
        "max_seq_len": cfg.tokenize.max_seq_len,
        "train_on": cfg.tokenize.train_on.value,
        "loss_mask": "int8 list: 0 prompt and history, 1 tokens the target generated (end-of-turn included)",
    }
    table = samples_table(samples, meta)
    log("tokenize", dataset=cfg.dataset, writing=out / "samples.parquet")  # the writing of the outputs begins
    write_parquet(out / "samples.parquet", table)
    write_csv(
        out / "plots" / "skips.csv",
        outcome_rows(len(recs), tally.skipped, SKIP_REASONS),
        ["reason", "responses"],
    )
    metrics = {
        "responses": len(recs),
        "samples": len(samples),
        "tokens": sum(len(s.input_ids) for s in samples),
        "trained_tokens": sum(sum(s.loss_mask) for s in samples),
        "skipped": dict(sorted(tally.skipped.items())),
        "rows": len(response_groups(recs)),  # responses, or conversations (`turns: all`)
        "rows_kept": rows_kept,
        "rejected": dict(sorted(rejected.counts.items())),
        "truncated_to_max_seq_len": tally.truncated,
        "conversations": tally.conversations,
        "conversations_per_turn_samples": tally.per_turn,
        "samples_per_conversation": samples_per_conversation(samples, tally.conversations),
        "text_path_samples": tally.text_path,
        "drift_pct": round(100.0 * tally.drift / tally.text_path, 3) if tally.text_path else 0.0,
    }
    write_json(out / "tokenize_metrics.json", metrics)
    log(
        "tokenize",
        dataset=cfg.dataset,
        samples=len(samples),
        tokens=metrics["tokens"],
        drift_pct=metrics["drift_pct"],
        **{f"skipped_{k}": v for k, v in sorted(tally.skipped.items())},
    )


def samples_per_conversation(samples: list, conversations: int) -> float | None:
    """1.0 where every conversation is one sample; up to its turns where a template splits them (null: no
    conversations, `turns: last`)."""
    if not conversations:
        return None
    return round(sum(s.conversation is not None for s in samples) / conversations, 2)


if __name__ == "__main__":
    cli(main)
