"""The command a trainer runs on an export, written beside its files (`train_command.sh`) and logged by the export:
the layers the export holds given explicitly, so that no trainer default reads others.

speculators 0.9.0 reads layers [2, N // 2, N - 3] (vLLM's numbering) for every family when `speculators train` is
not given `--target-layer-ids` (`speculators.models.utils.resolve_target_layer_ids`), and says so only in a Python
warning: a block export with `hidden_states.block_draft_layers: 3` on a 30-layer target holds 2, 15, 28 and trains
with the same loss curve as on 2, 15, 27, its drafter then served on the wrong layers. `default_layers_note` says it
in one line where the export holds other layers than that default.

SpecForge 0.2.0 trains from a run config (`specforge train -c train_config.yaml`). For EAGLE-3 the export writes it:
the target, the states, the strategy and the layers captured (`model.aux_hidden_state_layer_ids`, which its offline
path reads only for the width but its exported draft config records); `model.lm_head_key` on a target that ties
its LM head to the embeddings (its offline path looks `lm_head.weight` up in the safetensors index, with no
fallback), and one line where the target has no `*.index.json` (the offline path needs one). Its block drafters read
their layers from a draft config (dspark and domino require one): the export writes it, `draft_config.json`, the
target's shape with `dflash_config.target_layer_ids` the export's layers and the draft's depth one layer per target
layer, and the run config that names it. SpecForge replaces those ids with its own default whenever
`model.draft_num_hidden_layers` is set (`apply_dflash_overrides`), silently: the run config leaves it out and the
export says so in one line.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from draftdata.config.schema import Config

COMMAND_FILE = "train_command.sh"
SPECFORGE_CONFIG = "train_config.yaml"  # SpecForge's run config (`specforge train -c`), beside its command
SPECFORGE_DRAFT = "draft_config.json"  # a block drafter's draft config, which the run config names
# SpecForge's draft architectures for the block families (its modeling/draft: a Qwen3 decoder over the target's layers)
DRAFT_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "domino": "DominoDraftModel"}


def speculators_default_layers(n_layers: int) -> list[int]:
    """The layers `speculators train` reads when not told (vLLM's numbering; speculators 0.9.0)."""
    return [2, n_layers // 2, n_layers - 3]


def speculators_argv(cfg: Config, out: Path, meta: dict, online: bool) -> list[str]:
    """`speculators train` on the export at `out`: its family, the target, the data, the layers it holds (none for
    mtp, which reads the last state alone), the draft vocabulary where the export holds its mapping, and, online,
    the vLLM endpoint that serves the target's states (a placeholder to fill)."""
    argv = ["speculators", "train", "--speculator-type", meta["family"]]
    argv += ["--verifier-name-or-path", cfg.model.path, "--data-path", str(out)]
    if meta.get("aux_layer_ids"):
        argv += ["--target-layer-ids", *(str(i) for i in meta["aux_layer_ids"])]
    if "vocab_mapping" in meta:
        argv += ["--draft-vocab-size", str(meta["vocab_mapping"]["draft_vocab_size"])]
    if online:
        argv += ["--vllm-endpoint", "http://HOST:8000/v1"]
    return [*argv, "--save-path", f"checkpoints/{cfg.dataset}-{meta['family']}"]


def default_layers_note(meta: dict, n_layers: int | None) -> str | None:
    """One line where speculators' default would read other layers than the export holds (None: the same, a family
    that reads none, or a target whose depth is not known here)."""
    held = meta.get("aux_layer_ids") or []
    if not held or n_layers is None:
        return None
    default = speculators_default_layers(n_layers)
    if held == default:
        return None
    return (
        f"speculators train reads layers {default} unless told (--target-layer-ids); this export holds {held}: "
        f"run {COMMAND_FILE}, which passes them"
    )


def specforge_config(cfg: Config, out: Path, meta: dict, tied: bool) -> dict:
    """SpecForge's run config for an export at `out` (`tied`: the target ties its LM head): EAGLE-3's with the
    layers captured; a block drafter's naming the draft config written beside it, and no draft_num_hidden_layers."""
    family = meta["family"]
    if family == "eagle3":
        model = {"target_model_path": cfg.model.path, "aux_hidden_state_layer_ids": meta["aux_layer_ids"]}
        if tied:
            model["lm_head_key"] = "model.embed_tokens.weight"
    else:
        model = {"target_model_path": cfg.model.path, "draft_model_config": str(out / SPECFORGE_DRAFT)}
    if "vocab_mapping" in meta:
        model["vocab_mapping_path"] = str(out / "vocab_mapping" / "vocab_mapping.pt")
    return {
        "model": model,
        "data": {"hidden_states_path": str(out)},
        "training": {"strategy": family},
        "output_dir": f"checkpoints/{cfg.dataset}-{family}",
    }


def specforge_draft_config(family: str, ids: list[int], target: Path) -> dict | None:
    """A block drafter's draft config as SpecForge's own examples write one: a Qwen3 decoder of the target's width,
    heads and vocabulary, one layer per target layer, fed the export's layers (`dflash_config.target_layer_ids`,
    physical); None where the target's config.json is not here to size it."""
    conf = target_config(target, None)
    if conf is None:
        return None
    h, heads = conf["hidden_size"], conf["num_attention_heads"]
    rope = conf.get("rope_theta") or (conf.get("rope_parameters") or {}).get("rope_theta")
    head = {"emb_dim": h, "gru_hidden_dim": h} if family == "domino" else {}  # Domino's GRU, required
    return {
        "architectures": [DRAFT_ARCHITECTURES[family]],
        "model_type": "qwen3",
        "hidden_size": h,  # its fc maps len(ids) * H to H: the target's width
        "intermediate_size": conf["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": conf.get("num_key_value_heads", heads),
        "head_dim": conf.get("head_dim") or h // heads,
        "num_hidden_layers": len(ids),
        "num_target_layers": conf["num_hidden_layers"],  # required by SpecForge even with the ids given
        "vocab_size": conf["vocab_size"],
        "rms_norm_eps": conf.get("rms_norm_eps", 1e-6),
        **({"rope_theta": rope} if rope else {}),
        "max_position_embeddings": conf["max_position_embeddings"],
        "block_size": 16,
        "dflash_config": {"target_layer_ids": list(ids), **head},
    }


def specforge_notes(meta: dict, target: Path) -> list[str]:
    """The lines a SpecForge export says: what its offline path needs of the target, and the block drafters' trap."""
    if meta["family"] == "eagle3":
        if target.is_dir() and not any(target.glob("*.index.json")):
            return [
                f"SpecForge's eagle3 reads the target's LM head through a *.index.json, which {target} lacks "
                "(one safetensors file): give it one (its weight_map names the file of each tensor)"
            ]
        return []
    return [
        f"SpecForge reads {meta['family']}'s layers from the draft config ({SPECFORGE_DRAFT}: "
        f"dflash_config.target_layer_ids {meta['aux_layer_ids']}); leave model.draft_num_hidden_layers out of the "
        "run config (set, it replaces them with SpecForge's default, silently)"
    ]


def specforge_online_note(out: Path, meta: dict) -> str:
    """SpecForge 0.2.0 trains online only disaggregated (SGLang capture servers streaming over Mooncake: a cluster's
    own deployment section), so no run config is written for it; the line says what to put in the user's."""
    where = (
        f"model.aux_hidden_state_layer_ids: {meta['aux_layer_ids']}"
        if meta["family"] in ("eagle3", "peagle")
        else f"dflash_config.target_layer_ids {meta['aux_layer_ids']} in the draft config"
    )
    return (
        f"SpecForge trains online only disaggregated (deployment.mode: disaggregated, your SGLang capture servers): "
        f"in your run config set data.prompts_path: {out / 'prompts.jsonl'} and {where}"
    )


def target_config(target: Path, key: str | None, default=None):
    """A key of the target's config.json (its text config's, for a multimodal one; key None: the whole text
    config); `default` where the export runs without the target's files (a hub id, a machine that holds only the
    states)."""
    import json

    path = target / "config.json"
    if not path.is_file():
        return default
    conf = json.loads(path.read_text())
    if key is None:
        return conf | conf.get("text_config", {})
    return conf.get(key, conf.get("text_config", {}).get(key, default))


def ties_lm_head(target: Path) -> bool:
    """Whether the target ties its LM head to the embeddings."""
    return bool(target_config(target, "tie_word_embeddings", False))


def write_specforge_config(staging: Path, conf: dict, draft: dict | None = None) -> None:
    import json

    import yaml

    (staging / SPECFORGE_CONFIG).write_text(yaml.safe_dump(conf, sort_keys=False))
    if draft is not None:
        (staging / SPECFORGE_DRAFT).write_text(json.dumps(draft, indent=1) + "\n")


def write_command(out: Path, argv: list[str]) -> str:
    """`train_command.sh` in the export (the trainers' readers ignore it); the command as one line."""
    line = shlex.join(argv)
    (out / COMMAND_FILE).write_text(
        f"#!/bin/sh\n# written by draftdata export: the trainer's command on this export\n{line}\n"
    )
    return line
