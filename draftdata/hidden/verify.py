"""Checking stored hidden states against a recomputation: `draftdata verify dataset=<D>`.

A few stored samples, spread over the lengths (the shortest, the longest and evenly between), are computed again by
`verify.engine` at `verify.batch_size` samples a forward, and each token's state in each captured layer is compared
with the stored one: its relative error is |stored - recomputed| / |recomputed| over the hidden dimension. An engine
that gets some batches wrong (padding, positions, a kernel) shows up here as a layer whose error is far above what
rounding explains; a shard whose numbers were damaged does too.

What rounding explains depends on the dtype the two forwards compute in, not only on the one the states are stored in:
- both in float32 (hf on a float32 target): each token's error is the stored dtype's rounding alone, so each token's
  error is held to the stored dtype's tolerance;
- either in 16 bits (any bf16 target; vLLM's default for a float32 one): every layer rounds its output again, and the
  two engines' kernels round differently. A few tokens, where the computation is most sensitive to rounding, then
  end up far off in either engine: SmolLM2-135M's bf16 states are up to 25 % off its float32 ones (a token at
  layer 10; 7 % in the layers and samples its vLLM test checks, where vLLM and hf differ by 8 %), while most tokens are
  within 1-3 %; no bound on a single token tells those from a fault. A sample's mean over its tokens is steady: it
  grows like the square root of the layers the state went through (independent roundings adding up), so each sample's
  mean error is held to the larger of the stored dtype's tolerance and the forward dtype's eps x sqrt(depth).
A fault of the kind looked for moves a whole sample (a batch's padding or positions, a shard's numbers), so its mean;
a NaN anywhere makes it infinite.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from draftdata.config.schema import Config
from draftdata.errors import UserError
from draftdata.hidden.compute import states_fingerprint
from draftdata.hidden.engines.factory import make_engine
from draftdata.hidden.reader import SKIPPED, HiddenStates, Sample
from draftdata.hidden.shards import torn
from draftdata.model.compute import compute_dtype, vllm_dtype, weights_dtype

# The largest relative error of one token's state, per dtype: rounding to it (bf16 keeps 8 significant bits, an
# error of at most 2^-9 per value; fp8 e4m3 3 bits, 2^-4) with a margin for kernels that add in another order.
TOLERANCE = {"float32": 1e-3, "float16": 5e-3, "bfloat16": 2e-2, "fp8": 1e-1}
# The spacing of a forward dtype's numbers near 1 (torch.finfo(dtype).eps): a sample's mean error after `depth` layers
# computed in it is held to eps x sqrt(depth). Measured on SmolLM2-135M (30 layers, bf16), it is at most 0.6 of that
# in any layer (vLLM against hf, hf's eager attention against its sdpa one, bf16 against float32): a margin of two,
# and a sample 5 % off in a layer (0.050 to 0.056 against vLLM) stays above each layer's tolerance (0.020 to 0.043).
EPS = {"float32": 2**-23, "float16": 2**-10, "bfloat16": 2**-7}


@dataclass
class LayerError:
    """One captured layer's error over every token of the samples checked, and each sample's mean."""

    name: str
    tolerance: float = 0.0  # for the error the report judges: a token's, or a sample's mean (Report.per_token)
    max: float = 0.0
    sum: float = 0.0
    tokens: int = 0
    worst: str = ""  # where the max is: sample id and token position
    sample_max: float = 0.0  # the largest of the samples' mean errors
    sample_worst: str = ""  # whose it is

    @property
    def mean(self) -> float:
        return self.sum / self.tokens if self.tokens else 0.0

    def add(self, sample_id: str, errors) -> None:
        i = int(errors.argmax())
        if float(errors[i]) >= self.max:
            self.max, self.worst = float(errors[i]), f"sample {sample_id}, token {i}"
        mean = float(errors.mean())
        if mean >= self.sample_max:
            self.sample_max, self.sample_worst = mean, f"sample {sample_id} (the mean of its {len(errors)} tokens)"
        self.sum += float(errors.sum())
        self.tokens += len(errors)


@dataclass
class Report:
    path: Path
    engine: str
    batch_size: int
    stored_dtype: str
    computed_dtype: str  # as the engine returned the states (vLLM: float32, whatever it computed in)
    forward_dtype: str  # the coarser of the dtypes the stored and the recomputed states were computed in
    tolerance: float  # the stored dtype's, or verify.tolerance; in 16 bits a layer's own may be larger
    total: int  # samples stored
    checked: list[tuple[str, int]]  # (id, tokens) of the samples recomputed
    layers: list[LayerError] = field(default_factory=list)

    @property
    def per_token(self) -> bool:
        """Each token's error judged (both forwards in float32), else each sample's mean (the module's doc says why)."""
        return self.forward_dtype == "float32"

    def judged(self, e: LayerError) -> tuple[float, str]:
        """A layer's error that is held to its tolerance, and where it is."""
        return (e.max, e.worst) if self.per_token else (e.sample_max, e.sample_worst)

    @property
    def worst(self) -> LayerError:
        """The layer nearest its tolerance, or furthest above it."""
        return max(self.layers, key=lambda e: self.judged(e)[0] / e.tolerance)

    @property
    def ok(self) -> bool:
        return all(self.judged(e)[0] <= e.tolerance for e in self.layers)


def forward_dtype(engine: str, own: str, vllm_kwargs: dict, hf: str | None = None) -> str:
    """The dtype an engine computes the target in, `own` being its weights': hf's is the one it names (`hf:<dtype>`,
    as the state store records it), else `hf` (model.compute_dtype resolved here; the weights' by default); vLLM's
    is its `dtype` option, by default (auto) the weights' too, but 16 bits for float32 ones (the platform's choice,
    bf16 on a CPU or a recent GPU: bf16 counted, the coarser). Unknown: bf16, the coarsest."""
    asked = hf or own
    if engine.startswith("hf:"):
        asked = engine.removeprefix("hf:")
    elif engine.startswith("vllm"):
        asked = vllm_dtype(vllm_kwargs) or (own if own != "float32" else "bfloat16")
    return asked if asked in EPS else "bfloat16"


def forwards_dtype(cfg: Config, stored_by: set[str | None]) -> str:
    """The coarser of the dtypes the recomputation and the stored states were computed in; a shard that does not
    say which engine computed it (a store older than the record) is counted as the stage's backend's."""
    own, hf = weights_dtype(cfg.model), compute_dtype(cfg.model)
    engines = {cfg.verify.engine, *(e or cfg.hidden_states.backend for e in stored_by)}
    return max((forward_dtype(e, own, cfg.hidden_states.vllm_kwargs, hf) for e in engines), key=EPS.__getitem__)


def layer_tolerance(base: float, dtype: str, depth: int) -> float:
    """The tolerance of a state `depth` layers deep: the stored dtype's, or in a 16-bit forward eps x sqrt(depth)
    where larger (the module's doc says why)."""
    return base if dtype == "float32" else max(base, EPS[dtype] * math.sqrt(depth))


def spread(lengths: list[int], n: int) -> list[int]:
    """Indices of `n` samples spread over the lengths, shortest first: the shortest, the longest, and evenly between
    (3: the median); samples of one length in the order stored, so the choice is the same on every run (of several
    longest, the last one stored)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if n >= len(order):
        return order
    if n == 1:
        return [order[(len(order) - 1) // 2]]
    return [order[j * (len(order) - 1) // (n - 1)] for j in range(n)]  # of two middle ones, the lower (3: the median)


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
    doc = json.loads(index.read_text())
    if not doc.get("states", True):
        raise UserError(f"{path}: holds the target's policy alone (hidden_states.drafters: []), no states to verify")
    return doc


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
    now = states_fingerprint(cfg)
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
    recorded = "engine" in pq.read_schema(path / "samples.parquet").names  # which engine computed each sample
    table = pq.read_table(path / "samples.parquet", columns=["shard", "n_tokens", *(["engine"] if recorded else [])])
    lengths = table.column("n_tokens").to_pylist()
    if not lengths:
        raise UserError(f"{path}: holds no samples; there is nothing to verify")
    rows = spread(lengths, v.samples)
    stored_by = {table.column("engine")[i].as_py() for i in rows} if recorded else {None}
    check_shards(path, table.column("shard").unique().to_pylist(), cfg.dataset)
    hs = HiddenStates(path)
    stored = [hs[i] for i in rows]
    layers = index["layers"]["physical"]
    # the states alone: the policy kept beside them is not what is compared here
    recompute = replace(cfg.hidden_states, backend=v.engine, policy_top_k=0)
    engine = make_engine(replace(cfg, hidden_states=recompute), layers)
    try:
        fresh = [
            out
            for start in range(0, len(stored), v.batch_size)
            for out in engine.forward([s.input_ids.tolist() for s in stored[start : start + v.batch_size]])
        ]
    finally:
        engine.close()
    computed = str(fresh[0][0].dtype).removeprefix("torch.")
    dtype = forwards_dtype(cfg, stored_by)
    base = v.tolerance or max(TOLERANCE[index["dtype"]], TOLERANCE[dtype])
    depths = [(f"layer {layer}", layer + 1) for layer in layers] + [("final (pre-norm)", index["model"]["n_layers"])]
    report = Report(
        path,
        v.engine,
        v.batch_size,
        index["dtype"],
        computed,
        dtype,
        base,
        len(lengths),
        [(s.id, len(s.input_ids)) for s in stored],
        [LayerError(name, v.tolerance or layer_tolerance(base, dtype, depth)) for name, depth in depths],
    )
    for s, (aux, final) in zip(stored, fresh):
        compare(report.layers, s, aux, final)
    return report


def compare(layers: list[LayerError], stored: Sample, aux, final) -> None:
    """One sample's errors into each layer's tally: the captured layers in order, then the final state."""
    for j, err in enumerate(layers[:-1]):
        err.add(stored.id, row_errors(stored.aux[:, j], aux[:, j]))
    layers[-1].add(stored.id, row_errors(stored.final_pre_norm, final))
