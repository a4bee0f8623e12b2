"""Stage `hidden_states@D`: samples → EAGLE-3 training shards in `data/<D>/hidden_states/`.

For each sample the target runs once; forward hooks capture the outputs of the chosen decoder layers (physical,
0-based ids: no +1 conventions to get wrong) and the final post-norm state. Samples are packed along the token
axis with an offsets tensor (no pad tokens stored) into safetensors shards, each written to a temp name and
renamed. A shard whose file already holds the same samples under the same settings is skipped, so a killed run
resumes where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from stages.artifacts import atomic_path, data_dir, log, write_json
from stages.config import Config, ConfigError, UserError, cli
from stages.store import hash_cache_path
from stages.target import content_hash, load_model, model_fingerprint


def default_layers(n_layers: int) -> list[int]:
    """EAGLE-3's reference choice: outputs of layers 1, N//2 - 1 and N - 4 (inputs to 2, N//2, N - 3)."""
    return [1, n_layers // 2 - 1, n_layers - 4]


def resolve_layers(configured: Optional[list[int]], n_layers: int) -> list[int]:
    layers = list(configured) if configured is not None else default_layers(n_layers)
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ConfigError("hidden_states.layers", f"layer ids {bad} out of range for a {n_layers}-layer model")
    if len(set(layers)) != len(layers):
        raise ConfigError("hidden_states.layers", f"layer ids must be distinct, got {layers}")
    return layers


@dataclass
class ShardPlan:
    index: int
    rows: list[int]  # row numbers in samples.parquet
    ids: list[str]
    n_tokens: int


def plan_shards(ids: list[str], lengths: list[int], max_tokens: int) -> list[ShardPlan]:
    """Pack samples in order until a shard would pass max_tokens (a longer sample gets a shard of its own)."""
    shards: list[ShardPlan] = []
    cur = ShardPlan(0, [], [], 0)
    for row, (sid, n) in enumerate(zip(ids, lengths)):
        if cur.rows and cur.n_tokens + n > max_tokens:
            shards.append(cur)
            cur = ShardPlan(len(shards), [], [], 0)
        cur.rows.append(row)
        cur.ids.append(sid)
        cur.n_tokens += n
    if cur.rows:
        shards.append(cur)
    return shards


def shard_done(path: Path, expected: dict) -> bool:
    """A shard counts as done only if it opens and its metadata matches this plan (never 'file exists')."""
    if not path.exists():
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata().get("draftdata") == json.dumps(expected, sort_keys=True)
    except Exception:  # a torn or foreign file is redone, not trusted
        return False


class Capture:
    """Forward hooks on the chosen layers and on the final norm."""

    def __init__(self, model, layers: list[int]):
        self.out: dict = {}
        inner = model.model
        self.handles = [inner.layers[i].register_forward_hook(self._hook(f"layer{i}")) for i in layers]
        self.handles.append(inner.norm.register_forward_hook(self._hook("final")))

    def _hook(self, name: str):
        def fn(_module, _inputs, output):
            self.out[name] = output[0] if isinstance(output, tuple) else output
        return fn


def run_batch(model, capture: Capture, batch: list[list[int]], layers: list[int], dtype):
    """One padded forward; returns per-sample (aux [T, k*H], final [T, H]) without the padding."""
    import torch

    width = max(len(x) for x in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    with torch.inference_mode():
        model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False)
    aux = torch.cat([capture.out[f"layer{i}"] for i in layers], dim=-1)
    final = capture.out["final"]
    return [(aux[i, : len(x)].to(dtype).cpu(), final[i, : len(x)].to(dtype).cpu()) for i, x in enumerate(batch)]


def write_shard(path: Path, ids: list[list[int]], masks: list[list[int]], states: list, meta: dict) -> None:
    import torch
    from safetensors.torch import save_file

    aux = torch.cat([a for a, _ in states])
    final = torch.cat([f for _, f in states])
    lengths = torch.tensor([len(x) for x in ids])
    offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    tensors = {
        "input_ids": torch.tensor([t for x in ids for t in x], dtype=torch.int32),
        "loss_mask": torch.tensor([t for x in masks for t in x], dtype=torch.int8),
        "offsets": offsets,
        "aux_hidden_states": aux.contiguous(),
        "hidden_states": final.contiguous(),
    }
    check_shard(tensors)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"draftdata": json.dumps(meta, sort_keys=True)})


def check_shard(t: dict) -> None:
    """Before writing: ids and states agree in length, and every value is finite."""
    import torch

    n = t["input_ids"].shape[0]
    for name in ("loss_mask", "aux_hidden_states", "hidden_states"):
        if t[name].shape[0] != n:
            raise RuntimeError(f"shard check: {name} has {t[name].shape[0]} rows, input_ids {n}")
    if int(t["offsets"][-1]) != n:
        raise RuntimeError("shard check: offsets do not cover the tokens")
    for name in ("aux_hidden_states", "hidden_states"):
        if not torch.isfinite(t[name].float()).all():
            raise RuntimeError(f"shard check: non-finite values in {name}")


def main(cfg: Config) -> None:
    import pyarrow.parquet as pq
    import torch

    out = data_dir(cfg.dataset)
    src = out / "samples.parquet"
    if not src.exists():
        raise UserError(f"{src}: not found; run the tokenize stage first (dvc repro tokenize@{cfg.dataset})")
    hs = cfg.hidden_states
    table = pq.read_table(src)
    ids, input_ids, masks = (table.column(c).to_pylist() for c in ("id", "input_ids", "loss_mask"))
    model = load_model(cfg.model)
    n_layers = model.config.num_hidden_layers
    layers = resolve_layers(hs.layers, n_layers)
    dtype = getattr(torch, hs.dtype)
    capture = Capture(model, layers)
    model_fp = model_fingerprint(cfg.model.path, cfg.model.revision, hash_cache_path(cfg.run.store_path))
    settings = {"model": model_fp, "layers": layers,
                "dtype": hs.dtype, "final_state": "post_norm", "hidden_size": model.config.hidden_size}
    shard_dir = out / "hidden_states"
    shard_dir.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(ids, [len(x) for x in input_ids], hs.shard_max_tokens)
    index, reused = [], 0
    for sp in shards:
        name = f"shard-{sp.index:05d}.safetensors"
        meta = dict(settings, samples=content_hash(sp.ids), n_samples=len(sp.ids), n_tokens=sp.n_tokens)
        if shard_done(shard_dir / name, meta):
            reused += 1
        else:
            states = []
            for batch in _batches([input_ids[r] for r in sp.rows], hs.batch_tokens):
                states += run_batch(model, capture, batch, layers, dtype)
            write_shard(shard_dir / name, [input_ids[r] for r in sp.rows], [masks[r] for r in sp.rows], states, meta)
        index.append({"file": name, "sample_ids": sp.ids, "n_tokens": sp.n_tokens})
    keep = {e["file"] for e in index}
    for stale in shard_dir.glob("shard-*.safetensors"):  # shards of an earlier, larger plan
        if stale.name not in keep:
            stale.unlink()
    write_json(shard_dir / "index.json", {**settings, "layer_convention": "physical 0-based decoder layer outputs",
                                          "shards": index})
    metrics = {"samples": len(ids), "tokens": sum(len(x) for x in input_ids), "shards": len(shards),
               "shards_reused": reused, "layers": layers, "bytes": sum(p.stat().st_size for p in shard_dir.iterdir())}
    write_json(out / "hidden_states_metrics.json", metrics)
    log("hidden_states", dataset=cfg.dataset, samples=len(ids), shards=len(shards), reused=reused, layers=layers)


def _batches(seqs: list[list[int]], batch_tokens: int):
    """Consecutive samples whose padded size stays under batch_tokens (one long sample may exceed it alone)."""
    batch: list[list[int]] = []
    width = 0
    for s in seqs:
        if batch and max(width, len(s)) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, width = [], 0
        batch.append(s)
        width = max(width, len(s))
    if batch:
        yield batch


if __name__ == "__main__":
    cli(main)
