"""`draftdata export dataset=<D> export.format=specforge|speculators|modelopt|modelopt_policy|specforge_online|
speculators_online [export.family=eagle3|peagle|dflash|dflash2|dspark|domino|mtp]`: a dataset's hidden states
(offline: one drafter family's layers, in the layout the trainer reads for that family), the target's top-k policy
(modelopt_policy: ModelOpt's external draft), or its samples alone (online: the rows the family can train on, and the
layers its trainer is to capture named in the marker) in a trainer's own layout, with the command that trains on it
and `export.draft_vocab_size=N` the draft vocabulary mapping too (not a DVC stage: run it where the drafter is
trained).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from draftdata.config.load import cli
from draftdata.config.schema import Config
from draftdata.errors import ConfigError
from draftdata.hidden.export import (
    MARKER,
    WRITERS,
    ExportTally,
    check_export_dir,
    check_source,
    check_trainer,
    export_dir,
    marker,
    pick,
    publish,
    staging_dir,
    states_marker,
    write_vocab_mapping,
)
from draftdata.hidden.modelopt import POLICY_FORMAT, check_policy, modelopt_argv, policy_argv, write_policy
from draftdata.hidden.online import ONLINE_WRITERS, check_samples, online_family, online_marker
from draftdata.hidden.reader import HiddenStates
from draftdata.hidden.trainer_command import (
    SPECFORGE_CONFIG,
    default_layers_note,
    specforge_config,
    specforge_draft_config,
    specforge_notes,
    specforge_online_note,
    speculators_argv,
    target_config,
    ties_lm_head,
    write_command,
    write_specforge_config,
)
from draftdata.model.load import model_limits
from draftdata.util.files import data_dir, write_json
from draftdata.util.log import log


def main(cfg: Config) -> None:
    fmt = cfg.export.format
    if fmt == POLICY_FORMAT:
        return export_policy(cfg)
    if fmt not in WRITERS and fmt not in ONLINE_WRITERS:  # config.check says so first; kept for hand-built configs
        raise ConfigError("export.format", f"must be one of {', '.join([*WRITERS, *ONLINE_WRITERS])}, got {fmt!r}")
    vocab = target_vocab(cfg)
    src = data_dir(cfg.dataset) / "hidden_states" if fmt in WRITERS else data_dir(cfg.dataset)
    if fmt in WRITERS:
        check_trainer(fmt, cfg.export.family)  # first: no capture, made or found, would mend the trainer's lack
        check_source(src, cfg.dataset)
    else:
        check_samples(src, cfg.dataset, fmt)
    out = export_dir(cfg)
    check_export_dir(out)
    # the family, refused here before any file where the capture or the trainer lacks it
    hs = HiddenStates(src) if fmt in WRITERS else None
    picked = pick(hs, fmt, cfg.export.family) if hs is not None else None
    family = picked.family if picked is not None else online_family(fmt, cfg.export.family)
    if vocab is not None and fmt == "specforge" and family.specforge != "eagle3":
        raise ConfigError("export.draft_vocab_size", f"SpecForge's {family.name} reads no vocabulary mapping")
    if vocab is not None and fmt == "modelopt":
        raise ConfigError("export.draft_vocab_size", "the modelopt export writes no vocabulary mapping; leave it unset")
    staging, tally = staging_dir(out), ExportTally()
    try:
        meta = write(fmt, src, staging, tally, cfg, hs, picked, family)
        if vocab is not None:
            files = write_vocab_mapping(fmt, staging, tally, cfg.export.draft_vocab_size, vocab)
            meta["vocab_mapping"] = {"draft_vocab_size": cfg.export.draft_vocab_size, "target_vocab_size": vocab}
            meta["vocab_mapping"]["files"] = files
        command = trainer_command(cfg, fmt, out, meta, staging)
        write_json(staging / MARKER, meta)  # last: its presence means complete
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    layers = {"aux_layer_ids": json.dumps(meta["aux_layer_ids"])} if "aux_layer_ids" in meta else {}
    skipped = {"skipped": json.dumps(dict(tally.skipped))} if tally.skipped else {}
    log(
        "export",
        dataset=cfg.dataset,
        format=fmt,
        family=family.name,
        dir=out,
        samples=tally.samples,
        tokens=tally.tokens,
        **layers,
        **skipped,
    )
    line, notes = command
    if line is not None:
        log("export", train_command=line)
    for note in notes:
        log("export", warning=note)


def trainer_command(cfg: Config, fmt: str, out: Path, meta: dict, staging: Path) -> tuple[str | None, list[str]]:
    """The trainer's command on the export, written into it (with SpecForge's run config, and a block drafter's draft
    config), and the lines that say what the trainer would otherwise read wrong (trainer_command.py)."""
    if fmt == "modelopt":
        ids, family = meta["aux_layer_ids"], meta["family"]
        return write_command(staging, modelopt_argv(family, cfg.model.path, out, ids, cfg.dataset)), []
    if fmt in ("speculators", "speculators_online"):
        line = write_command(staging, speculators_argv(cfg, out, meta, online=fmt.endswith("_online")))
        note = default_layers_note(meta, target_config(Path(cfg.model.path), "num_hidden_layers"))
        return line, [note] if note is not None else []
    if fmt == "specforge_online":  # a disaggregated run over SGLang capture servers: its deployment is the cluster's
        return None, [specforge_online_note(out, meta)]
    target = Path(cfg.model.path)
    notes = specforge_notes(meta, target)
    draft = None
    if meta["family"] != "eagle3":
        draft = specforge_draft_config(meta["family"], meta["aux_layer_ids"], target)
        if draft is None:  # no config.json here to size the draft: the draft config is the user's
            return None, [*notes, f"{target}/config.json is not here: write the draft config yourself"]
    write_specforge_config(staging, specforge_config(cfg, out, meta, ties_lm_head(target)), draft)
    return write_command(staging, ["specforge", "train", "-c", str(out / SPECFORGE_CONFIG)]), notes


def export_policy(cfg: Config) -> None:
    """`export.format=modelopt_policy`: the capture's top-k policy as ModelOpt's external draft reads it (no family,
    no states: the capture may hold the policy alone)."""
    if cfg.export.draft_vocab_size is not None:  # an external draft has its own tokenizer: no mapping to write
        raise ConfigError(
            "export.draft_vocab_size", f"the {POLICY_FORMAT} export writes no vocabulary mapping; leave it unset"
        )
    src = data_dir(cfg.dataset) / "hidden_states"
    check_source(src, cfg.dataset)
    hs = HiddenStates(src)
    policy = check_policy(hs)
    out = export_dir(cfg)
    check_export_dir(out)
    staging, tally = staging_dir(out), ExportTally()
    try:
        records = write_policy(hs, staging, tally)
        meta = marker(POLICY_FORMAT, src, tally) | {"model": hs.index["model"], "policy": policy, "records": records}
        line = write_command(staging, policy_argv(cfg.model.path, out, policy))
        write_json(staging / MARKER, meta)
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log("export", dataset=cfg.dataset, format=POLICY_FORMAT, dir=out, records=records, tokens=tally.tokens)
    log("export", train_command=line)


def write(fmt: str, src: Path, staging: Path, tally: ExportTally, cfg: Config, hs, picked, family) -> dict:
    """The format's files; returns the end marker's contents."""
    if fmt in ONLINE_WRITERS:
        own = ONLINE_WRITERS[fmt](src, staging, tally, cfg, family)
        return marker(fmt, src / "samples.parquet", tally) | own | online_marker(fmt, family, cfg)
    WRITERS[fmt](hs, staging, tally, picked)
    return marker(fmt, src, tally) | states_marker(fmt, hs, picked)


def target_vocab(cfg: Config) -> int | None:
    """The target's vocabulary size when a mapping is asked for (t2d covers it), checked before any work."""
    n = cfg.export.draft_vocab_size
    if n is None:
        return None
    vocab = model_limits(cfg.model).vocab
    if vocab is None:
        raise ConfigError(
            "export.draft_vocab_size", f"the mapping needs the target's vocab_size: no config.json at {cfg.model.path}"
        )
    if n > vocab:
        raise ConfigError("export.draft_vocab_size", f"{n} is more than the target's vocabulary ({vocab} tokens)")
    return vocab


def run(argv: list[str]) -> None:
    cli(main, argv=argv, prog="draftdata export")
