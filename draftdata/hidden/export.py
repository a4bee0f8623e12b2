"""Command `export`: `data/<D>/hidden_states/` → a trainer's own offline-training layout (the online formats, from
the samples alone, are in draftdata/hidden/online.py; Model-Optimizer's layouts and the policy's in
draftdata/hidden/modelopt.py).

    draftdata export dataset=<D> export.format=specforge|speculators|modelopt [export.family=F] [export.dir=...]
        [export.draft_vocab_size=N]

`export.family` (eagle3 by default) picks one drafter family's layers out of the capture and writes the layout the
trainer reads for that family (draftdata/drafters/families.py): below, EAGLE-3's; a block drafter's SpecForge files
hold `hidden_states` (and dspark's `target_last_hidden_states`) instead, its speculators files its own layers. Rows a
family cannot train on are not written, and counted in the marker's `skipped`.

Not a DVC stage: run it where the drafter is trained. It reads the stage output through `draftdata.hidden.HiddenStates`
one sample at a time and writes the trainer's files, one sample in memory at a time. The whole export is built in
a hidden sibling directory (`.<dir>.partial`) and renamed into place after its end marker (`draftdata_export.json`)
is written, so a killed export never sits at the export path: a trainer pointed there finds either nothing or a
complete export (both trainers' readers ignore the marker file). Inside it, files are written under their own names
(`staged_path`: no temp name and rename per file, no sweep of the directory per file, so the time stays linear in the
samples however many share a directory). A rerun replaces an earlier export (one with the
marker; it is moved to `.<dir>.old` for the swap) and refuses a file or any other non-empty directory. Row/file i is
sample i of `samples.parquet` (already shuffled by the prompts stage); the trainers shuffle or split on their own.

Both trainers get bfloat16 states, the dtype their own capture writes and trains on: exact for states stored in
bfloat16 (the default), rounded once for float32/float16/fp8 storage. The aux layers come in index order
(`HiddenStates.layers`); the marker records their ids in the trainer's numbering, for the draft config's
`eagle_aux_hidden_state_layer_ids`.

specforge (`<dir>/rows_<g>-<g+2000>/data_<i>.ckpt`, sample i of the dataset):
  one `torch.save` dict per sample: `input_ids` int64 [T], `loss_mask` int64 [T], `aux_hidden_state` bf16
  [1, T, k*H] (the aux layers concatenated) and `hidden_state` bf16 [1, T, H] AFTER the target's final norm (its
  target head applies lm_head only). Without `export.draft_vocab_size` no vocab mapping is written: SpecForge's
  trainer derives one itself at start from these files' loss-masked tokens (below); with it,
  `vocab_mapping/vocab_mapping.pt` is the one it would derive (draftdata/hidden/vocab.py), for
  `model.vocab_mapping_path` (required for disaggregated runs).

speculators (`<dir>` is the `--data-path` of `speculators train`):
  a `datasets` `save_to_disk` dataset (columns `input_ids`, `loss_mask` int64 lists, `seq_len` int64; torch format,
  as its preprocessing saves it), `hidden_states/hs_<i>.safetensors` for row i (`token_ids` int64 [T],
  `hidden_states` bf16 [T, k+1, H]: the aux layers, then the final state BEFORE the final norm, which its trainer
  applies itself) and `token_freq.pt` (a dict token id → count of loss-masked tokens, what its preparation saves;
  its trainer turns it into d2t/t2d for the `--draft-vocab-size` it is given; with `export.draft_vocab_size`, the
  `d2t-<N>.npy` and `t2d-<N>.npy` it would cache there, which it then loads instead).

facts checked in specforge 0.2.0 (the package, and scripts/prepare_hidden_states.py of its repository, which the
wheel does not ship):
- specforge/runtime/data_plane/offline_reader.py: `OfflineManifestReader` (what `specforge train` uses offline,
  via specforge/algorithms/eagle3/data.py `build_offline_reader`) walks the directory recursively and takes every
  file ending in `.ckpt` or `.ckpt.gz`, sorted by path; other files (this marker) are ignored. Required keys:
  input_ids, loss_mask, hidden_state, aux_hidden_state. Files are loaded lazily with
  `torch.load(path, weights_only=False, mmap=True)` (runtime/data_plane/feature_store.py `load_feature_file`).
- specforge/algorithms/eagle3/data.py `normalize_offline_sample` (and the older
  specforge/data/preprocessing.py `OfflineEagle3Dataset.process_data`, same files via `list_local_files`):
  `aux_hidden_state.squeeze(0)` → the draft input `hidden_state`, `hidden_state.squeeze(0)` → `target`, both
  [1, T, ...] after truncation to max_len; the loss mask's last position is zeroed; no dtype conversion.
- scripts/prepare_hidden_states.py: files `rows_{g}-{g + 2000}/data_{idx}.ckpt` (`--file-group-size` 2000), the
  dict built by the eagle3 `OfflineCaptureLayout` (input_ids, loss_mask, aux_hidden_state, hidden_state), states
  `.cpu().clone().unsqueeze(0)` in the target's dtype (bf16 for a bf16 model); the vocab mapping goes to
  `<output>/vocab_mapping/vocab_mapping.pt` ({"d2t", "t2d"}, from the loss-masked token counts and the draft
  vocab size). specforge/training/assembly.py `_ensure_offline_vocab_mapping`: offline training without
  `model.vocab_mapping_path` recounts the tokens from the .ckpt files themselves
  (training/vocab_mapping.py `count_effective_feature_tokens`: input_ids where loss_mask, up to max_length).
- specforge/modeling/target/target_head.py `TargetHead.forward` is lm_head only: `hidden_state` is post-norm.

facts checked in speculators 0.9.0 (and hs-connectors 0.9.0, which it reads the files with):
- speculators/train/data.py `ArrowDataset` (built by train/dataloader.py `create_train_val_loaders`):
  `load_from_disk(data_path)`, lengths from the `seq_len` column, row i's states from
  `hidden_states/hs_{i}.safetensors` (hs_connectors/transfer.py `FileTransfer.get_cached`, `safetensors load_file`,
  keys `token_ids` and `hidden_states`); `torch.equal(token_ids, row["input_ids"])` must hold (so the dataset is
  saved in torch format), then `hidden_states[:, :-1].flatten(1)` → `hidden_states` [T, k*H] and
  `hidden_states[:, -1]` → `verifier_last_hidden_states` [T, H]; `loss_mask` comes from the row. `CollateFn`
  casts the states to `--hidden-states-dtype` (bfloat16 by default) and packs samples into `total_seq_len`.
- speculators/models/eagle3/core.py applies `verifier_norm` to `verifier_last_hidden_states`: pre-norm.
- speculators/data_generation/preprocessing.py: rows `input_ids`/`loss_mask` int64, `seq_len`, `set_format("torch")`
  before speculators/cli/prepare_data.py `save_to_disk`; `token_freq.pt` next to it
  (train/vocab_mapping.py `save_token_frequency_distribution`: dict of input_ids where loss_mask → count);
  train/cli.py reads `<data_path>/token_freq.pt` with `torch.load(weights_only=True)`.
- hs_connectors/fp8_hidden_states_connector.py documents the file vLLM writes: `token_ids` int64 [T],
  `hidden_states` [T, num_layers, H] in the target's dtype (the aux layers and the last layer's output).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from draftdata.config.schema import Config
from draftdata.drafters.families import FAMILIES, Family, last_state, trainers_of, unusable
from draftdata.errors import ConfigError, UserError
from draftdata.hidden.modelopt import POLICY_FORMAT, RECIPES, save_records, write_modelopt
from draftdata.hidden.reader import SKIPPED, HiddenStates, Sample
from draftdata.hidden.tally import ExportTally, count
from draftdata.hidden.vocab import specforge_mapping, speculators_mapping
from draftdata.util.files import data_dir, staged_path

MARKER = "draftdata_export.json"
SPECFORGE_VOCAB = "vocab_mapping/vocab_mapping.pt"  # where SpecForge's prepare_hidden_states.py puts it
SPECFORGE_GROUP = 2000  # prepare_hidden_states.py's --file-group-size default: files per rows_* folder
SOURCE_FILES = ("index.json", "samples.parquet", "final_norm.safetensors")
# per format: the numbering its draft configs use for the aux layer ids, and the final state it trains on
LAYER_NUMBERING = {"specforge": "sglang_specforge", "speculators": "vllm_speculators", "modelopt": "physical"}
# where SpecForge's draft configs name the layers, by the family's layout
SPECFORGE_LAYER_KEY = {
    "eagle3": "eagle_config.eagle_aux_hidden_state_layer_ids",
    "block": "dflash_config.target_layer_ids",
    "block_last": "dflash_config.target_layer_ids",
}


@dataclass(frozen=True)
class Picked:
    """One drafter family's share of the capture: its layers' positions in a sample's `aux` (dim 1)."""

    family: Family
    positions: list[int]

    def aux(self, s: Sample):
        if self.positions == list(range(s.aux.shape[1])):  # every captured layer: no copy
            return s.aux
        return s.aux[:, self.positions]

    def trainable(self, s: Sample, tally: ExportTally) -> bool:
        return trainable(self.family, s.loss_mask.tolist(), tally)


def trainable(f: Family, loss_mask: list[int], tally: ExportTally) -> bool:
    """A row the family can train on; one it cannot is counted by reason and not written (never a stub)."""
    reason = unusable(f, loss_mask)
    if reason is not None:
        tally.skipped[reason] += 1
    return reason is None


def check_trainer(fmt: str, name: str) -> Family:
    """The family, refused in one line where the trainer has no offline data path for it: checked before the
    capture is even looked for, since no capture would mend that (a capture made for it first would be time lost)."""
    f = FAMILIES[name]
    if getattr(f, fmt) is None:
        readers = trainers_of(f)
        raise ConfigError(
            "export.family",
            f"{fmt} has no offline data path for {name}" + (f"; export it for {', '.join(readers)}" if readers else ""),
        )
    return f


def pick(hs: HiddenStates, fmt: str, name: str) -> Picked:
    """The family's layers in these states, refused in one line where the trainer or the capture lacks it: the
    trainer first, since no capture would mend that (a capture made for it first would be time lost)."""
    f = check_trainer(fmt, name)
    if not hs.index.get("states", True):
        raise ConfigError(
            "hidden_states.drafters",
            f"is empty for the states at {hs.path}: the capture holds the target's policy alone; export it as "
            "export.format=modelopt_policy, or name the drafter families in hidden_states.drafters and dvc repro",
        )
    if name not in hs.families:
        raise ConfigError(
            "export.family",
            f"{name}: the states at {hs.path} were captured for {', '.join(hs.families)}; add {name} to "
            "hidden_states.drafters and dvc repro (layers already stored are not computed again)",
        )
    positions = list(hs.families[name]["positions"])
    if fmt == "specforge" and f.specforge == "eagle3" and len(positions) != 3:
        raise ConfigError(
            "export.family",
            f"SpecForge's eagle3 reads exactly three aux layers (its resolve_eagle_capture_layers); these states hold "
            f"{len(positions)} for {name}: export them for speculators, or capture three in hidden_states.layers",
        )
    return Picked(f, positions)


# ---- where: source, target, the swap --------------------------------------------------------------------------- #


def export_dir(cfg: Config) -> Path:
    """`export.dir`, else one folder per format and family: exporting another family never replaces this one."""
    fmt = cfg.export.format
    name = f"export-{fmt}" if fmt == POLICY_FORMAT else f"export-{fmt}-{cfg.export.family}"  # the policy: no family
    default = data_dir(cfg.dataset) / name
    return Path(cfg.export.dir) if cfg.export.dir else default


def check_source(src: Path, dataset: str) -> None:
    if (src / SKIPPED).is_file():
        raise ConfigError(
            f"datasets.{dataset}.store_hidden_states",
            f"false: no hidden states are stored for {dataset}; export its samples for online training "
            "(export.format=specforge_online|speculators_online), or set it true and dvc repro",
        )
    for name in SOURCE_FILES:
        if not (src / name).is_file():
            raise UserError(
                f"{src / name}: not found; run the hidden_states stage first (dvc repro hidden_states@{dataset})"
            )


def check_export_dir(out: Path) -> None:
    """Refuse a path that is not ours to replace: a file, or a non-empty directory without the end marker."""
    if out.exists() and not out.is_dir():
        raise ConfigError("export.dir", f"{out} is a file, not a directory; choose another export.dir")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ConfigError(
            "export.dir",
            f"{out} is a non-empty directory without {MARKER} (not an export of "
            "this command); choose another export.dir or empty it",
        )


def staging_dir(out: Path) -> Path:
    """A fixed name beside `out`: a rerun clears what a killed run left."""
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, out: Path) -> None:
    """Rename the finished export into place; an earlier export is moved aside first, then deleted."""
    old = out.parent / f".{out.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)


# ---- specforge --------------------------------------------------------------------------------------------------- #


def specforge_path(i: int, group: int = SPECFORGE_GROUP) -> str:
    g = i // group * group
    return f"rows_{g}-{g + group}/data_{i}.ckpt"


def specforge_record(s: Sample, picked: Picked) -> dict:
    """Keys, dtypes and shapes as SpecForge's offline capture layout for the family saves them (batch dim 1 on the
    states): eagle3's `aux_hidden_state` and post-norm `hidden_state`; a block drafter's `hidden_states` (its layers
    concatenated), with dspark's post-norm `target_last_hidden_states`."""
    import torch

    n = s.aux.shape[0]
    aux = picked.aux(s).reshape(n, -1).to(torch.bfloat16).unsqueeze(0)
    record = {"input_ids": s.input_ids.to(torch.int64), "loss_mask": s.loss_mask.to(torch.int64)}
    if s.mode is not None:  # datasets.<D>.modes: SpecForge's reader takes the keys it knows and leaves the rest
        record["mode"] = s.mode
    layout = picked.family.specforge
    if layout == "eagle3":
        return record | {"aux_hidden_state": aux, "hidden_state": s.final_post_norm.to(torch.bfloat16).unsqueeze(0)}
    record["hidden_states"] = aux
    if layout == "block_last":
        record["target_last_hidden_states"] = s.final_post_norm.to(torch.bfloat16).unsqueeze(0)
    return record


def write_specforge(hs: HiddenStates, staging: Path, tally: ExportTally, picked: Picked) -> None:
    save_records(hs, staging, tally, picked, specforge_path, specforge_record)


# ---- speculators ------------------------------------------------------------------------------------------------- #


def speculators_tensors(s: Sample, picked: Picked) -> dict:
    """One `hs_<i>.safetensors`: the family's aux layers then the PRE-norm final state, along dim 1 (mtp: the final
    state alone, [T, 1, H])."""
    import torch

    states = torch.cat([picked.aux(s), s.final_pre_norm.unsqueeze(1)], dim=1).to(torch.bfloat16)
    return {"token_ids": s.input_ids.to(torch.int64).contiguous(), "hidden_states": states.contiguous()}


def speculators_row(input_ids: list[int], loss_mask: list[int], extra: dict) -> dict:
    return {"input_ids": input_ids, "loss_mask": loss_mask, "seq_len": len(input_ids), **extra}


def speculators_features(extra: bool, mode: bool = False):
    """The columns and types speculators' preprocessing saves (int64 lists from torch.long tensors); `extra`: the
    samples' `conversation` and `turn` too, `mode` their mode (its reader reads only its own columns)."""
    from datasets import Features, Sequence, Value

    cols = {"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")), "seq_len": Value("int64")}
    if extra:
        cols |= {"conversation": Value("string"), "turn": Value("int64")}
    if mode:
        cols |= {"mode": Value("string")}
    return Features(cols)


def save_speculators_rows(staging: Path, rows, extra: bool, tally: ExportTally, mode: bool = False) -> None:
    """The rows go to one Arrow file as they come (no dataset in memory), which `save_to_disk` then lays out as
    speculators' preparation does, in torch format; `token_freq.pt` beside it."""
    import torch
    from datasets import Dataset
    from datasets.arrow_writer import ArrowWriter

    arrow = staging.with_name(f"{staging.name}.rows.arrow")  # beside, not in: save_to_disk won't write over its source
    try:
        with ArrowWriter(features=speculators_features(extra, mode), path=str(arrow)) as writer:
            for row in rows:
                writer.write(row)
            writer.finalize()
        Dataset.from_file(str(arrow)).with_format("torch").save_to_disk(str(staging))
    finally:
        arrow.unlink(missing_ok=True)
    with staged_path(staging / "token_freq.pt") as path:
        torch.save(dict(tally.token_freq), path)


def write_speculators(hs: HiddenStates, staging: Path, tally: ExportTally, picked: Picked) -> None:
    """The states file by file, the rows with them (speculators' `hs_<i>` is row i)."""
    from safetensors.torch import save_file

    (staging / "hidden_states").mkdir()

    def rows():
        i = 0
        for s in hs:
            if not picked.trainable(s, tally):
                continue
            with staged_path(staging / "hidden_states" / f"hs_{i}.safetensors") as path:
                save_file(speculators_tensors(s, picked), str(path))
            count(s.input_ids, s.loss_mask, tally, i)
            i += 1
            # the conversation and turn of `turns: all` come with the states: the output is whole on its own
            extra = {"conversation": s.conversation, "turn": s.turn} if hs.carries_turns else {}
            if hs.carries_mode:
                extra["mode"] = s.mode
            yield speculators_row(s.input_ids.tolist(), s.loss_mask.tolist(), extra)

    save_speculators_rows(staging, rows(), hs.carries_turns, tally, hs.carries_mode)


# ---- the run ----------------------------------------------------------------------------------------------------- #


def write_vocab_mapping(fmt: str, staging: Path, tally: ExportTally, n: int, vocab: int) -> list[str]:
    """The draft vocabulary mapping where the trainer looks for it; returns the files written."""
    import numpy as np
    import torch

    if fmt.startswith("speculators"):  # its trainer's cache of what it would compute (train/cli.py)
        d2t, t2d = speculators_mapping(tally.token_freq, n, vocab)
        files = {f"d2t-{n}.npy": d2t, f"t2d-{n}.npy": t2d}
        for name, t in files.items():
            with staged_path(staging / name) as path, open(path, "wb") as f:
                np.save(f, t.numpy())
        return list(files)
    d2t, t2d = specforge_mapping(tally.token_freq, tally.first_seen, n, vocab)
    with staged_path(staging / SPECFORGE_VOCAB) as path:
        torch.save({"d2t": d2t, "t2d": t2d}, path)
    return [SPECFORGE_VOCAB]


def marker(fmt: str, src: Path, tally: ExportTally) -> dict:
    return {
        "format": fmt,
        "source": str(src),
        "samples": tally.samples,
        "tokens": tally.tokens,
        "trained_tokens": tally.trained_tokens,
        "skipped": dict(sorted(tally.skipped.items())),  # samples the family cannot train on, not written
        "order": "file/row i is the i-th sample written, in the source's order (samples.parquet)",
    }


def states_marker(fmt: str, hs: HiddenStates, picked: Picked) -> dict:
    """What the draft config needs: the family's layer ids in the trainer's numbering, under the key its config
    reads them from, and the last state the files hold."""
    f = picked.family
    ids = hs.families[f.name]["layers"][LAYER_NUMBERING[fmt]]
    key = {"speculators": f.speculators, "modelopt": RECIPES.get(f.name, ("", ""))[1]}.get(fmt)
    key = key if fmt != "specforge" else SPECFORGE_LAYER_KEY[f.specforge]
    return {
        "model": hs.index["model"],
        "hidden_size": hs.hidden_size,
        "dtype": "bfloat16",
        "family": f.name,
        "aux_layer_ids": ids,
        "aux_layer_numbering": LAYER_NUMBERING[fmt],
        "draft_config_key": key,
        "final_state": last_state(f, fmt),
    }


WRITERS = {"specforge": write_specforge, "speculators": write_speculators, "modelopt": write_modelopt}
