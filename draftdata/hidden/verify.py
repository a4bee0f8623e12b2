"""Checking stored hidden states against a recomputation: `draftdata verify dataset=<D>`.

A few stored samples, spread over the lengths (the shortest, the longest and evenly between), are computed again by
`verify.engine` at `verify.batch_size` samples a forward, and each token's state in each captured layer is compared
with the stored one: its relative error is |stored - recomputed| / |recomputed| over the hidden dimension. An engine
that gets some batches wrong (padding, positions, a kernel) shows up here as a layer whose error is far above what
rounding to the stored dtype explains; a shard whose numbers were damaged does too. The tolerance follows the stored
dtype, or the engine's own if that is coarser (a bf16 target recomputes in bf16 whatever the states are stored in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from draftdata.config.schema import Config
from draftdata.errors import UserError
from draftdata.hidden.compute import make_engine
from draftdata.hidden.reader import SKIPPED, HiddenStates, Sample
from draftdata.hidden.shards import torn
from draftdata.target.fingerprint import model_fingerprint
from draftdata.util.sqlite import hash_cache_path

# The largest relative error of one token's state, per dtype: rounding to it (bf16 keeps 8 significant bits, an
# error of at most 2^-9 per value; fp8 e4m3 3 bits, 2^-4) with a margin for kernels that add in another order.
TOLERANCE = {"float32": 1e-3, "float16": 5e-3, "bfloat16": 2e-2, "fp8": 1e-1}


@dataclass
class LayerError:
    """One captured layer's error over every token of the samples checked."""

    name: str
    max: float = 0.0
    sum: float = 0.0
    tokens: int = 0
    worst: str = ""  # where the max is: sample id and token position

    @property
    def mean(self) -> float:
        return self.sum / self.tokens if self.tokens else 0.0

    def add(self, sample_id: str, errors) -> None:
        i = int(errors.argmax())
        if float(errors[i]) >= self.max:
            self.max, self.worst = float(errors[i]), f"sample {sample_id}, token {i}"
        self.sum += float(errors.sum())
        self.tokens += len(errors)


@dataclass
class Report:
    path: Path
    engine: str
    batch_size: int
    stored_dtype: str
    computed_dtype: str
    tolerance: float
    total: int  # samples stored
    checked: list[tuple[str, int]]  # (id, tokens) of the samples recomputed
    layers: list[LayerError] = field(default_factory=list)

    @property
    def worst(self) -> LayerError:
        return max(self.layers, key=lambda e: e.max)

    @property
    def ok(self) -> bool:
        return self.worst.max <= self.tolerance


def spread(lengths: list[int], n: int) -> list[int]:
    """Indices of `n` samples spread over the lengths, shortest first: the shortest, the longest, and evenly between
    (3: the median); ties go to the earlier sample, so the choice is the same on every run."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if n >= len(order):
        return order
    if n == 1:
        return [order[(len(order) - 1) // 2]]
    return [order[round(j * (len(order) - 1) / (n - 1))] for j in range(n)]


def row_errors(stored, fresh):
    """Per token ([T, H] -> [T]): |stored - fresh| / |fresh| over the hidden dimension; a NaN (a damaged value) is
    an infinite error, not one that compares as small."""
    fresh = fresh.float()
    errors = (stored - fresh).norm(dim=-1) / fresh.norm(dim=-1).clamp_min(1e-12)
    return errors.nan_to_num(nan=float("inf"))


def check_stored(path: Path, dataset: str) -> dict:
    """index.json, read; a missing output says which stage to run, before any model is loaded."""
    index = path / "index.json"
    if (path / SKIPPED).is_file():
        raise UserError(
            f"{path}: holds no states to verify (datasets.{dataset}.store_hidden_states is false: its samples are for "
            "online training)"
        )
    if not index.is_file():
        raise UserError(f"{index}: not found; run the hidden_states stage first (dvc repro hidden_states@{dataset})")
    return json.loads(index.read_text())


def check_shards(path: Path, shards: list[str], dataset: str) -> None:
    """Every shard of the output whole (its size against its header: cheap, whatever the dataset's size): a file
    cut short (a copy or a disk that failed) is named in one line rather than failing inside the reader. The stage
    recomputes such a shard (its store copy is the same file)."""
    for name in sorted(set(shards)):
        shard = path / "shards" / name
        if torn(shard):
            raise UserError(
                f"{shard}: missing or cut short (its header names more bytes than it holds): the stored states are "
                f"damaged; run the hidden_states stage again (dvc repro hidden_states@{dataset}) to recompute it"
            )


def check_model(cfg: Config, index: dict, path: Path) -> None:
    """The states were computed by the target configured now: a recomputation by another model would only
    measure the difference between the two."""
    now = model_fingerprint(cfg.model.path, cfg.model.revision, hash_cache_path(cfg.run.store_path))
    if index["model"]["fingerprint"] != now:
        raise UserError(
            f"{path}: computed by another model than model.path={cfg.model.path} now is (fingerprint "
            f"{index['model']['fingerprint'][:12]} stored, {now[:12]} now); run the hidden_states stage first"
        )


def verify(cfg: Config, path: Path) -> Report:
    """Recompute `verify.samples` stored samples and measure each layer's error against what is stored."""
    import pyarrow.parquet as pq

    v = cfg.verify
    index = check_stored(path, cfg.dataset)
    check_model(cfg, index, path)
    table = pq.read_table(path / "samples.parquet", columns=["shard", "n_tokens"])
    lengths = table.column("n_tokens").to_pylist()
    if not lengths:
        raise UserError(f"{path}: holds no samples; there is nothing to verify")
    rows = spread(lengths, v.samples)
    check_shards(path, table.column("shard").unique().to_pylist(), cfg.dataset)
    hs = HiddenStates(path)
    stored = [hs[i] for i in rows]
    layers = index["layers"]["physical"]
    engine = make_engine(replace(cfg, hidden_states=replace(cfg.hidden_states, backend=v.engine)), layers)
    try:
        fresh = [
            out
            for start in range(0, len(stored), v.batch_size)
            for out in engine.forward([s.input_ids.tolist() for s in stored[start : start + v.batch_size]])
        ]
    finally:
        engine.close()
    computed = str(fresh[0][0].dtype).removeprefix("torch.")
    report = Report(
        path,
        v.engine,
        v.batch_size,
        index["dtype"],
        computed,
        v.tolerance or max(TOLERANCE[index["dtype"]], TOLERANCE.get(computed, 0.0)),
        len(lengths),
        [(s.id, len(s.input_ids)) for s in stored],
        [LayerError(f"layer {layer}") for layer in layers] + [LayerError("final (pre-norm)")],
    )
    for s, (aux, final) in zip(stored, fresh):
        compare(report.layers, s, aux, final)
    return report


def compare(layers: list[LayerError], stored: Sample, aux, final) -> None:
    """One sample's errors into each layer's tally: the captured layers in order, then the final state."""
    for j, err in enumerate(layers[:-1]):
        err.add(stored.id, row_errors(stored.aux[:, j], aux[:, j]))
    layers[-1].add(stored.id, row_errors(stored.final_pre_norm, final))
