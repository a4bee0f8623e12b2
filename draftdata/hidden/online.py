"""Exports for online training: tokenize's samples alone, no hidden states (the trainer computes them as it trains).

    draftdata export dataset=<D> export.format=speculators_online|specforge_online [export.draft_vocab_size=N]

They read `data/<D>/samples.parquet` (and, for SpecForge's conversations, `responses.jsonl`), so they work with
`datasets.<D>.store_hidden_states: false`. `export.family` keeps the rows that family can train on (a block
drafter's: two adjacent supervised tokens) and names in the marker the layers its trainer is to capture. Row/record
i is the i-th sample written, in samples.parquet's order; the samples' `conversation` and `turn` (`turns: all`) ride
along where the format has room for them (the readers ignore them).

speculators_online (`<dir>` is `speculators train --data-path`): the offline export without `hidden_states/`: the
`save_to_disk` dataset (`input_ids`, `loss_mask`, `seq_len`, torch format) and `token_freq.pt`. Facts checked in
speculators 0.9.0: train/data.py `ArrowDataset` looks for `hidden_states/hs_<i>.safetensors` first
(`FileTransfer.get_cached`); where there is none, `--on-missing generate` (the default) sends row i's `input_ids`
(`build_client_item`: the token ids alone for a text-only row; `messages` only for multimodal content) to the vLLM
endpoint (`--vllm-endpoint`, data_generation/vllm_client.py `generate_hidden_states`: a Completions request with the
ids as the prompt, `max_tokens` 1, `return_token_ids`), checks the returned prompt ids against the row
(`extract_output`), loads the states vLLM's hidden-states connector wrote (`kv_transfer_params.hidden_states_path`)
and takes `loss_mask` from the row. vLLM must be serving the target with speculators' extraction settings
(docs/hidden-states.md gives the flags; tests/test_online_vllm.py runs them against a live server).

specforge_online: `prompts.jsonl` for `data.prompts_path` (pre-tokenized: `{"input_ids", "loss_mask"}` per line,
used as they are: specforge/data/prompt_builder.py `prepare_prompt_tasks`, which truncates to `data.max_length` and
ignores other keys) and `conversations.jsonl` for `data.train_data_path` (`{"id", "conversations": [{role, content,
tool_calls}], "tools"}`: the prompt's messages and the regenerated answer (with `turns: all`, every regenerated turn),
which SpecForge re-tokenizes with `data.chat_template` (data/preprocessing.py `build_eagle3_dataset` →
data/parse.py `GeneralParser`: the tokenizer's own chat template renders the messages; its loss mask is the text
from the template's `assistant_header` to its `end_of_turn_token`, by regex, so it may differ from ours; it keeps
`role`, `content` and `tool_calls` of a message only, so reasoning kept apart in `reasoning_content` is not trained;
without a system message it inserts the template's `system_prompt`). `tool_calls` and `tools` are JSON strings,
which it parses (Arrow cannot hold arguments of varying shapes). SpecForge 0.2.0 derives a vocab mapping itself
only for offline features: an online run with a draft vocabulary smaller than the target's wants
`model.vocab_mapping_path` (`export.draft_vocab_size`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from draftdata.config.schema import Config, TrainOn, Turns
from draftdata.drafters.families import FAMILIES, Family, online_trainers
from draftdata.errors import ConfigError, UserError
from draftdata.hidden.export import (
    LAYER_NUMBERING,
    ExportTally,
    count,
    save_speculators_rows,
    speculators_row,
    trainable,
)
from draftdata.util.files import atomic_path, read_jsonl

EXTRA = ("conversation", "turn", "mode")  # samples.parquet's columns under `turns: all`, and with modes


def check_samples(src: Path, dataset: str, fmt: str) -> None:
    need = ["samples.parquet"] + (["responses.jsonl"] if fmt == "specforge_online" else [])
    for name in need:
        if not (src / name).is_file():
            raise UserError(f"{src / name}: not found; run the tokenize stage first (dvc repro tokenize@{dataset})")


def samples(path: Path) -> Iterator[dict]:
    """samples.parquet a batch at a time: id, input_ids, loss_mask, and conversation/turn/mode where present."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    cols = ["id", "input_ids", "loss_mask"] + [c for c in EXTRA if c in pf.schema_arrow.names]
    for batch in pf.iter_batches(columns=cols, batch_size=1024):
        yield from batch.to_pylist()


def online_family(fmt: str, name: str) -> Family:
    """`export.family` for an online format, refused in one line where the trainer's online mode lacks it."""
    f, trainer = FAMILIES[name], fmt.removesuffix("_online")
    if trainer not in online_trainers(f):
        others = [f"{t}_online" for t in online_trainers(f)]
        raise ConfigError(
            "export.family",
            f"{trainer} has no online mode for {name}" + (f"; export it as {' or '.join(others)}" if others else ""),
        )
    return f


# where each trainer's draft config names the layers its online capture takes, by the family's kind of layers
ONLINE_LAYER_KEY = {
    "speculators": {"eagle": "eagle_aux_hidden_state_layer_ids", "block": "aux_hidden_state_layer_ids"},
    "specforge": {"eagle": "eagle_config.eagle_aux_hidden_state_layer_ids", "block": "dflash_config.target_layer_ids"},
}


def online_marker(fmt: str, f: Family, cfg: Config) -> dict:
    """The family and the layers its trainer is to capture as it trains, in that trainer's numbering: what this
    dataset's hidden_states settings would capture for the family (none for mtp: the last state alone)."""
    from draftdata.drafters.layers import block_layers, eagle_layers, layer_numberings
    from draftdata.hidden.compute import n_layers_of

    trainer = fmt.removesuffix("_online")
    out = {"family": f.name}
    if f.layers == "none":
        return out | {"aux_layer_ids": [], "final_state": "the last state alone"}
    n = n_layers_of(cfg)
    layers = eagle_layers(cfg, n) if f.layers == "eagle" else block_layers(cfg, n)
    return out | {
        "aux_layer_ids": layer_numberings(layers, n)[LAYER_NUMBERING[trainer]],
        "aux_layer_numbering": LAYER_NUMBERING[trainer],
        "draft_config_key": ONLINE_LAYER_KEY[trainer][f.layers],
    }


def extra_of(row: dict) -> dict:
    return {k: row[k] for k in EXTRA if k in row}


def has_extra(path: Path) -> bool:
    import pyarrow.parquet as pq

    return "conversation" in pq.read_schema(path).names


def has_mode(path: Path) -> bool:
    import pyarrow.parquet as pq

    return "mode" in pq.read_schema(path).names


def counted(row: dict, tally: ExportTally, i: int) -> None:
    import torch

    count(torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"]), tally, i)


# ---- speculators ------------------------------------------------------------------------------------------------- #


def trainable_rows(src: Path, f: Family, tally: ExportTally) -> Iterator[tuple[int, dict]]:
    """samples.parquet's rows the family can train on, numbered as written (those it cannot are counted by reason in
    the marker's `skipped`, never written)."""
    written = 0
    for row in samples(src / "samples.parquet"):
        if trainable(f, row["loss_mask"], tally):
            yield written, row
            written += 1


def write_speculators_online(src: Path, staging: Path, tally: ExportTally, cfg: Config, f: Family) -> dict:
    def rows():
        for i, row in trainable_rows(src, f, tally):
            counted(row, tally, i)
            yield speculators_row(row["input_ids"], row["loss_mask"], extra_of(row))

    path = src / "samples.parquet"
    save_speculators_rows(staging, rows(), has_extra(path), tally, has_mode(path))
    return {"hidden_states": "none: computed by vLLM as speculators trains (--on-missing generate)"}


# ---- specforge --------------------------------------------------------------------------------------------------- #


def specforge_message(m: dict) -> dict:
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = json.dumps(m["tool_calls"], ensure_ascii=False)
    return out


def conversation_record(rec: dict) -> dict:
    """A response record as SpecForge's raw online input: its prompt's messages, then the regenerated answer (and
    its mode, where the dataset has modes)."""
    from draftdata.model.tokenizer import assistant_message

    out = {"id": rec["id"], "conversations": [specforge_message(m) for m in rec["messages"] + [assistant_message(rec)]]}
    if rec.get("tools"):
        out["tools"] = json.dumps(rec["tools"], ensure_ascii=False)
    if rec.get("mode") is not None:  # datasets.<D>.modes: SpecForge's reader takes the keys it knows
        out["mode"] = rec["mode"]
    return out


def write_specforge_online(src: Path, staging: Path, tally: ExportTally, cfg: Config, family: Family) -> dict:
    ids = set()
    with atomic_path(staging / "prompts.jsonl") as tmp, open(tmp, "w") as f:
        for i, row in trainable_rows(src, family, tally):
            counted(row, tally, i)  # SpecForge counts rows in order
            ids.add(row["id"])
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    # a sample is named after its last turn's response, whose messages hold the conversation up to it (with
    # `turns: all`, the target's own earlier answers); responses.jsonl is read as it comes, in its own order
    written = 0
    with atomic_path(staging / "conversations.jsonl") as tmp, open(tmp, "w") as f:
        for rec in read_jsonl(src / "responses.jsonl"):
            if rec["id"] in ids:
                f.write(json.dumps(conversation_record(rec), ensure_ascii=False) + "\n")
                written += 1
    if written != len(ids):
        raise UserError(f"{src / 'responses.jsonl'}: holds {written} of {len(ids)} samples; rerun dvc repro")
    return {"train_only_last_turn": train_only_last_turn(cfg)}


def train_only_last_turn(cfg: Config) -> bool:
    """SpecForge's `data.train_only_last_turn` for conversations.jsonl: every assistant turn of a conversation is
    trained only where each was regenerated and trained here (`turns: all` with `train_on: all_turns`); otherwise
    the earlier answers are the source's (or untrained), and only the last one is ours."""
    return not (cfg.ds.turns == Turns.all and cfg.tokenize.train_on == TrainOn.all_turns)


ONLINE_WRITERS = {"speculators_online": write_speculators_online, "specforge_online": write_specforge_online}
