"""Stage `tokenize@D`: responses → `data/<D>/samples.parquet`, token-exact.

Where the server returned ids, a sample is `prompt_ids + output_ids` and the loss mask is 0 over the prompt and 1
over what the target generated — no re-encoding, no regex. Where only text came back, the conversation is
rendered with the chat template, the prompt rendering must be a prefix of the full one, and the drift between
re-encoded and served completion lengths is measured. Every skipped response is counted by reason.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from stages.artifacts import atomic_path, data_dir, log, read_jsonl, write_json
from stages.config import Config, OnTooLong, UserError, cli
from stages.target import load_tokenizer, render_prompt_ids, template_messages, tokenizer_fingerprint

SCHEMA_VERSION = 1


@dataclass
class Sample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]


class Skip(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def from_ids(prompt_ids: list[int], output_ids: list[int]) -> tuple[list[int], list[int]]:
    """The exact tokens the target saw and produced; the mask is built with the ids."""
    return prompt_ids + output_ids, [0] * len(prompt_ids) + [1] * len(output_ids)


def from_text(tok, rec: dict, template_kwargs: dict) -> tuple[list[int], list[int]]:
    """Render prompt (with generation prompt) and whole conversation; the first must prefix the second."""
    prompt = render_prompt_ids(tok, rec["messages"], rec.get("tools"), template_kwargs)
    convo = template_messages(rec["messages"]) + [{"role": "assistant", "content": rec["text"]}]
    full = list(tok.apply_chat_template(convo, tools=rec.get("tools"), tokenize=True, return_dict=False,
                                        **template_kwargs))
    if full[: len(prompt)] != prompt:
        raise Skip("template_not_prefix_stable")
    return full, [0] * len(prompt) + [1] * (len(full) - len(prompt))


def build_sample(rec: dict, tok, cfg: Config, drift: Counter) -> tuple[Sample, bool]:
    """The sample and whether max_seq_len cut it."""
    if rec["completion_tokens"] == 0 or not rec["text"].strip():
        raise Skip("empty_output")
    if rec.get("prompt_ids") is not None and rec.get("output_ids") is not None:
        ids, mask = from_ids(rec["prompt_ids"], rec["output_ids"])
    else:
        ids, mask = from_text(tok, rec, dict(cfg.model.template_kwargs))
        drift["text_path"] += 1
        drift["differs"] += int(sum(mask) != rec["completion_tokens"])
    sample = Sample(rec["id"], ids, mask)
    return limit_length(sample, cfg.tokenize.max_seq_len, cfg.tokenize.on_too_long), len(ids) > cfg.tokenize.max_seq_len


def limit_length(s: Sample, max_len: int, policy: OnTooLong) -> Sample:
    if len(s.input_ids) <= max_len:
        return s
    if policy == OnTooLong.drop:
        raise Skip("over_max_seq_len")
    s = Sample(s.id, s.input_ids[:max_len], s.loss_mask[:max_len])
    if not any(s.loss_mask):  # the prompt alone fills max_seq_len: nothing left to train on
        raise Skip("no_trained_tokens_after_truncation")
    return s


def write_parquet(path, samples: list[Sample], meta: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
         ("n_tokens", pa.int32()), ("n_trained", pa.int32())],
        metadata={"draftdata": json.dumps(meta, sort_keys=True)},
    )
    table = pa.table(
        {"id": [s.id for s in samples], "input_ids": [s.input_ids for s in samples],
         "loss_mask": [s.loss_mask for s in samples], "n_tokens": [len(s.input_ids) for s in samples],
         "n_trained": [sum(s.loss_mask) for s in samples]},
        schema=schema,
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def main(cfg: Config) -> None:
    out = data_dir(cfg.dataset)
    src = out / "responses.jsonl"
    if not src.exists():
        raise UserError(f"{src}: not found; run the generate stage first (dvc repro generate@{cfg.dataset})")
    tok = load_tokenizer(cfg.model)
    samples, skipped, drift, truncated = [], Counter(), Counter(), 0
    for rec in read_jsonl(src):
        try:
            s, cut = build_sample(rec, tok, cfg, drift)
        except Skip as e:
            skipped[e.reason] += 1
            continue
        truncated += cut
        samples.append(s)
    meta = {"schema_version": SCHEMA_VERSION, "dataset": cfg.dataset, "tokenizer": tokenizer_fingerprint(tok, cfg.model),
            "max_seq_len": cfg.tokenize.max_seq_len}
    write_parquet(out / "samples.parquet", samples, meta)
    metrics = {
        "samples": len(samples),
        "tokens": sum(len(s.input_ids) for s in samples),
        "trained_tokens": sum(sum(s.loss_mask) for s in samples),
        "skipped": dict(sorted(skipped.items())),
        "truncated_to_max_seq_len": truncated,
        "text_path_samples": drift["text_path"],
        "drift_pct": round(100.0 * drift["differs"] / drift["text_path"], 3) if drift["text_path"] else 0.0,
    }
    write_json(out / "tokenize_metrics.json", metrics)
    log("tokenize", dataset=cfg.dataset, samples=len(samples), tokens=metrics["tokens"],
        **{f"skipped_{k}": v for k, v in sorted(skipped.items())})


if __name__ == "__main__":
    cli(main)
