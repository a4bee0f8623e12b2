"""Which layers' outputs are captured: each drafter family's (families.py: EAGLE-3's default or a draft config's ids,
a block drafter's), their union, and every trainer's numbering."""

from __future__ import annotations

import json
from pathlib import Path

from draftdata.config.schema import Config
from draftdata.drafters.families import FAMILIES, block_default_layers
from draftdata.errors import ConfigError, UserError
from draftdata.util.log import log


def default_layers(n_layers: int) -> list[int]:
    """EAGLE-3's reference choice: outputs of layers 1, N//2 - 1 and N - 4 (inputs to 2, N//2, N - 3)."""
    return [1, n_layers // 2 - 1, n_layers - 4]


def resolve_layers(cfg: Config, n_layers: int) -> list[int]:
    """The capture's layers (`captured`) for the families in `hidden_states.drafters`."""
    return captured(family_layers(cfg, n_layers))


def captured(families: dict[str, list[int]]) -> list[int]:
    """The union of the families' layers, physical 0-based ids in ascending order: each stored once (the last state,
    before the final norm, is kept beside them whatever the families)."""
    return sorted({i for ids in families.values() for i in ids})


def family_layers(cfg: Config, n_layers: int) -> dict[str, list[int]]:
    """Each named family's layers (physical ids, ascending): EAGLE-3's for eagle3 and peagle, a block drafter's for
    dflash, dflash2, dspark and domino, none for mtp (the last state alone)."""
    hs = cfg.hidden_states
    kinds = {FAMILIES[name].layers for name in hs.drafters}
    given_by = (("layers", "eagle", hs.layers), ("draft_config", "eagle", hs.draft_config))
    for key, kind, given in (*given_by, ("block_layers", "block", hs.block_layers)):
        if given is not None and kind not in kinds:
            readers = ", ".join(f.name for f in FAMILIES.values() if f.layers == kind)
            raise ConfigError(
                f"hidden_states.{key}",
                f"is set but no family that reads it ({readers}) is in hidden_states.drafters {list(hs.drafters)}",
            )
    by_kind = {
        "eagle": eagle_layers(cfg, n_layers) if "eagle" in kinds else [],
        "block": block_layers(cfg, n_layers) if "block" in kinds else [],
        "none": [],
    }
    return {name: by_kind[FAMILIES[name].layers] for name in hs.drafters}


def eagle_layers(cfg: Config, n_layers: int) -> list[int]:
    """EAGLE-3's (and P-EAGLE's) aux layers: `hidden_states.layers`, else a draft config's
    `eagle_aux_hidden_state_layer_ids` (in its own numbering), else EAGLE-3's default for this model."""
    hs = cfg.hidden_states
    if hs.layers is not None:
        return _valid(list(hs.layers), n_layers, "hidden_states.layers")
    if hs.draft_config is not None:
        ids, numbering = _draft_layer_ids(Path(hs.draft_config), hs.draft_numbering)
        return _valid([i - 1 for i in ids] if numbering == "vllm" else ids, n_layers, "hidden_states.draft_config")
    layers = default_layers(n_layers)
    if len(set(layers)) != 3 or min(layers) < 0:
        raise UserError(
            f"model.path: the target has {n_layers} decoder layers, too few for EAGLE-3's default "
            f"[1, N//2-1, N-4] = {layers} to be three distinct layers; choose them in "
            "hidden_states.layers"
        )
    return layers


def block_layers(cfg: Config, n_layers: int) -> list[int]:
    """A block drafter's target layers: `hidden_states.block_layers`, else z-lab's default for a draft of
    `hidden_states.block_draft_layers` layers."""
    hs = cfg.hidden_states
    if hs.block_layers is not None:
        return _valid(list(hs.block_layers), n_layers, "hidden_states.block_layers")
    n = hs.block_draft_layers
    layers = block_default_layers(n_layers, n)
    if len(set(layers)) != n or not all(0 <= i < n_layers for i in layers):
        raise UserError(
            f"model.path: the target has {n_layers} decoder layers, too few for the block drafters' default "
            f"(round(1 + i(N-4)/(n-1)) for n = {n}: {layers}) to be {n} distinct layers; lower "
            "hidden_states.block_draft_layers or choose them in hidden_states.block_layers"
        )
    return layers


def _valid(layers: list[int], n_layers: int, key: str) -> list[int]:
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(
            key, f"layer ids {bad} out of range for the target's {n_layers} decoder layers (physical ids: 0 .. N-1)"
        )
    if len(set(layers)) != len(layers):
        raise ConfigError(key, f"layer ids must be distinct, got {layers}")
    if layers != sorted(layers):
        # SGLang and vLLM collect the aux states in the forward, so in ascending layer order whatever the list's:
        # stored in another order, a drafter would train on one order and be served another
        log(
            "hidden_states",
            layers=sorted(layers),
            given=layers,
            note=f"{key} sorted: SGLang and vLLM collect the aux states in ascending layer order",
        )
    return sorted(layers)


def _draft_layer_ids(path: Path, numbering: str) -> tuple[list[int], str]:
    """The draft config's layer ids and their numbering: `sglang` (SGLang, SpecForge: id L is the output of layer
    L) or `vllm` (vLLM, speculators: id L is the output of layer L - 1). `auto` tells them apart by the config's
    shape: a speculators config (`speculators_config`) numbers like vLLM, a SpecForge one (an *Eagle3
    architecture) like SGLang."""
    key = "hidden_states.draft_config"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(key, f"file not found: {path}") from None
    except ValueError as e:
        raise ConfigError(key, f"{path}: not JSON ({e})") from None
    ids = doc.get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        raise ConfigError(key, f"{path}: no eagle_aux_hidden_state_layer_ids list of layer ids")
    if numbering == "auto":
        if "speculators_config" in doc or "speculators_model_type" in doc:
            numbering = "vllm"
        elif any("Eagle3" in a for a in doc.get("architectures") or []):
            numbering = "sglang"
        else:
            raise ConfigError(
                "hidden_states.draft_numbering",
                f"cannot tell which numbering {path} uses; set "
                "sglang (SpecForge/SGLang: L = output of layer L) or vllm (speculators/vLLM: L + 1)",
            )
    return ids, numbering


def layer_numberings(layers: list[int], n_layers: int) -> dict:
    return {
        "physical": layers,
        # HF's hidden_states[N] is the last layer's output after the final norm, not the pre-norm output we keep:
        # that layer has no index there (null)
        "hf_hidden_states_index": [i + 1 if i + 1 < n_layers else None for i in layers],
        "sglang_specforge": layers,
        "vllm_speculators": [i + 1 for i in layers],
    }
