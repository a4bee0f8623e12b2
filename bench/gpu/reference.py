"""The hf hidden-states engine's states on this CPU, carried to the GPU run as its reference.

A few demo conversations rendered by the target's chat template (their first `max_tokens` ids), run through
`draftdata.hidden.engines.hf.HFEngine` in float32 here: EAGLE-3's layers and the final state, with the token ids, in one
safetensors file. There the same engine runs them on the GPU in float32 and in bf16, padded into one batch (its
mask-free path), and `compare` gives each one's relative L2 error against these.
"""

from __future__ import annotations

from pathlib import Path

SAMPLES, MAX_TOKENS = 4, 128  # 410 tokens: 3.8 MB of float32 states for SmolLM2, within the two transfers


def engine(model: Path, dtype: str):
    from draftdata.config.schema import ModelConfig
    from draftdata.drafters.layers import default_layers
    from draftdata.hidden.engines.hf import HFEngine
    from draftdata.model.load import local_config

    n = local_config(ModelConfig(path=str(model)))["num_hidden_layers"]
    return HFEngine(ModelConfig(path=str(model), compute_dtype=dtype), default_layers(n))


def samples(model: Path, n: int = SAMPLES, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The first `n` held-out demo conversations of different lengths (so a batch of them pads), cut to `max_tokens`."""
    from transformers import AutoTokenizer

    from bench.drafter_target import rendered_conversations

    held = rendered_conversations(AutoTokenizer.from_pretrained(model))[1]
    return [ids[: max_tokens - 17 * i] for i, ids in enumerate(held[:n])]


def states(eng, batch: list[list[int]]) -> list:
    """Per sample, [T, k + 1, H] float32: the aux layers and the final state."""
    import torch

    return [torch.cat([aux.float(), final.float()[:, None]], dim=1) for aux, final in eng.forward(batch)]


def write_reference(out: Path, model: Path | None = None) -> None:
    import torch
    from safetensors.torch import save_file

    from bench.embedded import MODEL

    model = model or MODEL
    if not (model / "config.json").is_file():
        raise SystemExit(f"bench.gpu.bundle: {model} is not built; run `dvc repro packaged_model` first")
    batch = samples(model)
    eng = engine(model, "float32")
    tensors = {}
    for i, ids in enumerate(batch):  # one at a time, unpadded: the GPU runs them padded in one batch
        tensors[f"ids_{i}"] = torch.tensor(ids)
        tensors[f"states_{i}"] = states(eng, [ids])[0].contiguous()
    ref = [tensors[f"states_{i}"] for i in range(len(batch))]
    floor = rel_l2(states(engine(model, "bfloat16"), batch), ref)  # bf16's own error here: the GPU's to meet
    meta = {"layers": ",".join(map(str, eng.layers)), "dtype": "float32", "cpu_rel_l2_bfloat16": repr(floor)}
    save_file(tensors, str(out), metadata=meta)


def read_reference(path: Path) -> tuple[list[list[int]], list, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        n = sum(1 for k in f.keys() if k.startswith("ids_"))
        ids = [f.get_tensor(f"ids_{i}").tolist() for i in range(n)]
        ref = [f.get_tensor(f"states_{i}") for i in range(n)]
        meta = f.metadata()
    return ids, ref, meta


def rel_l2(got: list, ref: list) -> float:
    """||got - ref|| / ||ref|| over every sample, layer and token together."""
    import torch

    num = sum(float(torch.linalg.vector_norm(g.float() - r.float()) ** 2) for g, r in zip(got, ref))
    den = sum(float(torch.linalg.vector_norm(r.float()) ** 2) for r in ref)
    return (num / den) ** 0.5


def compare(model: Path, path: Path) -> dict:
    """The engine's states here (float32 and bf16, one padded batch) against the reference's."""
    ids, ref, meta = read_reference(path)
    layers = [int(x) for x in meta["layers"].split(",")]
    out = {"samples": len(ids), "tokens": sum(map(len, ids)), "layers": layers}
    out["cpu_rel_l2_bfloat16"] = float(meta["cpu_rel_l2_bfloat16"])
    for dtype in ("float32", "bfloat16"):
        eng = engine(model, dtype)
        if eng.layers != layers:
            raise SystemExit(f"bench.gpu: the reference's layers {layers} are not the engine's {eng.layers}")
        got = states(eng, ids)
        out[f"rel_l2_{dtype}"] = rel_l2(got, ref)
        out[f"pad_tokens_{dtype}"] = eng.pad_tokens
        del eng
    return out
