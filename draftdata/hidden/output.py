"""What the hidden-states stage writes beside the shards: index.json (settings, layer ids in every trainer's
numbering, the final-state convention) and the metrics."""

from __future__ import annotations

from pathlib import Path

from draftdata.config.schema import Config
from draftdata.drafters.families import FAMILIES, last_state, trainers_of
from draftdata.drafters.layers import layer_numberings
from draftdata.hidden.engines.factory import LazyEngine
from draftdata.hidden.policy import PolicySpec
from draftdata.hidden.shards import FORMAT_VERSION, disk_per_token
from draftdata.hidden.state_store import NormAndSizes
from draftdata.hidden.tally import HiddenTally


def index_doc(
    cfg: Config, target: NormAndSizes, settings: dict, layers: list[int], families: dict[str, list[int]], view: dict
) -> dict:
    return {
        "format": "draftdata-hidden-states",
        "version": FORMAT_VERSION,
        "model": {
            "path": cfg.model.path,
            "revision": cfg.model.revision,
            "fingerprint": settings["model"],
            "n_layers": target.n_layers,
            "hidden_size": target.hidden_size,
        },
        "layers": layer_numberings(layers, target.n_layers),
        "layers_as_given": cfg.hidden_states.layers,  # hidden_states.layers in the user's order (null: not set)
        "families": families_doc(families, layers, target.n_layers),
        "layer_convention": "physical id L = output of decoder layer L (0-based) = HF hidden_states[L + 1] = "
        "SGLang/SpecForge id L = vLLM/speculators id L + 1; in ascending order, as SGLang and vLLM collect them; "
        "the last layer's (L = N - 1) is kept before the final norm, which HF's hidden_states[N] is not: its HF "
        "index is null",
        "final_state": "pre_norm",
        "final_norm": {"file": "final_norm.safetensors", **target.norm.describe()},
        "dtype": settings["dtype"],
        "shards": view["shards"],
        "link": view["link"],
        "tensors": tensors_doc(settings),
        "states": settings.get("states", True),  # false: the policy alone (hidden_states.drafters: [])
        "policy": policy_doc(settings),
    }


def tensors_doc(settings: dict) -> dict:
    out = {"aux_hidden_states": "[T, k, H]"}
    if settings.get("states", True):
        out["final_hidden_states"] = "[T, H], before the final norm"
    if "policy" in settings:
        out |= {"policy_tokens": "int32 [T, p]", "policy_logprobs": "float32 [T, p]"}
    return out


def policy_doc(settings: dict) -> dict | None:
    """The policy's settings and conventions where it is kept (draftdata/hidden/policy.py), else None."""
    if "policy" not in settings:
        return None
    p = settings["policy"]
    return PolicySpec(p["top_k"], p["top_p"]).describe()


def families_doc(families: dict[str, list[int]], captured: list[int], n_layers: int) -> dict:
    """Per drafter family the capture serves: its layers in every numbering, where they sit in the capture's
    aux_hidden_states, the trainers whose offline data path reads it and the last state each one reads (pre- or
    post-norm, made from the stored pre-norm one), and whether it needs two adjacent supervised tokens a row."""
    out = {}
    for name, ids in families.items():
        f = FAMILIES[name]
        trainers = trainers_of(f)
        out[name] = {
            "layers": layer_numberings(ids, n_layers),
            "positions": [captured.index(i) for i in ids],
            "trainers": trainers,
            "last_state": {t: last_state(f, t) for t in trainers},
            "needs_adjacent_supervised": f.needs_adjacent,
        }
    return out


def output_metrics(
    out: Path, engine: LazyEngine, target: NormAndSizes, hs, layers: list[int], view: dict, tally: HiddenTally
) -> dict:
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    # over the shards' own bytes and tokens: a linked shard may also hold other datasets' samples
    shard_bytes, shard_tokens = view["sizes"]
    computed = tally.computed_tokens
    m = {
        "samples": tally.samples,
        "tokens": tally.tokens,
        "computed_samples": tally.computed,
        "computed_tokens": computed,
        "reused_samples": tally.samples - tally.computed,
        "torn_shards_redone": tally.torn,
        "gathered_shards": tally.gathered_shards,  # from other nodes' stores (run.states_layout: local)
        "gathered_bytes": tally.gathered_bytes,
        "dtype": hs.dtype,
        "bytes": size,
        "bytes_per_token": round(shard_bytes / shard_tokens, 2) if shard_tokens else 0.0,
        # bf16, k aux layers + final (none for the policy alone), + the policy's 8 bytes a slot
        "limit_bytes_per_token": (2 * (len(layers) + 1) * target.hidden_size if hs.drafters else 0)
        + 8 * hs.policy_top_k,
        "padded_compute_share": round(tally.pad_tokens / (computed + tally.pad_tokens), 4) if computed else 0.0,
        "tok_s": round(computed / tally.seconds, 1) if tally.seconds else 0.0,
        # starting the engine, the target's load included: once per stage that computes (0: all reused)
        "load_s": round(engine.load_s, 3),
    }
    m["engines"] = dict(sorted(tally.engines.items()))  # which computed the output's samples (samples.parquet: each)
    if engine.vllm_path is not None:  # the vllm engine ran: which of its paths, and why not vLLM's extraction
        m["vllm_path"], m["vllm_path_fallback"] = engine.vllm_path
    if hs.dtype == "fp8" and tally.fp8_err_den:
        m["fp8_rel_err"] = round((tally.fp8_err_num / tally.fp8_err_den) ** 0.5, 5)
    return m | disk_per_trained_token(m["bytes_per_token"], tally, len(layers), target.hidden_size, hs.policy_top_k)


def disk_per_trained_token(stored: float, tally: HiddenTally, n_kept: int, hidden_size: int, policy_k: int) -> dict:
    """What a token of training signal costs on disk: the bytes per token as stored over the share of tokens the
    loss mask trains (the prompts' states are stored too), and the same in bf16 and fp8, beside online training's
    nothing (the trainer computes the states; none are stored)."""
    share = tally.trained_tokens / tally.tokens if tally.tokens else 0.0
    per_token = disk_per_token(n_kept, hidden_size, policy_k)
    return {
        "trained_tokens": tally.trained_tokens,
        "bytes_per_trained_token": round(stored / share, 1) if share else 0.0,
        "per_trained_token": {d: round(n / share) if share else 0 for d, n in per_token.items()},
    }
