"""The hidden-state shard format: samples packed along the token axis, no pad stored.

A shard is one safetensors file:
- `offsets` int64 [n + 1]: sample i is rows offsets[i]:offsets[i + 1];
- `input_ids` int32 [T]: the tokens the states belong to (checked on every read and write);
- `aux_hidden_states` [T, k, H]: the outputs of the k chosen decoder layers (physical 0-based ids, in index order);
- `final_hidden_states` [T, H]: the last decoder layer's output, BEFORE the final norm;
- with `dtype: fp8`: both in float8 e4m3 with `aux_scale` float32 [T, k] and `final_scale` float32 [T], one scale per
  token and layer (a row's max |value| maps to e4m3's largest finite number), about half of bf16's bytes.
The metadata holds the settings the states were computed under and the samples' keys. Writes go to a temp name and
are renamed; `check` runs before every write (ids and states agree, values finite) and `torn` finds a file cut short.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftdata.errors import UserError
from draftdata.util.files import atomic_path
from draftdata.util.timing import Timers

FORMAT_VERSION = 1
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
VALUE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}  # bytes of one stored value


class StateError(UserError):
    """States that must not be written: non-finite values, ids that do not match. One line, naming the sample."""


@dataclass
class SampleStates:
    key: str
    input_ids: list[int]
    aux: object  # torch.Tensor [T, k, H], float32 or the model's dtype
    final: object  # torch.Tensor [T, H], pre-norm


def bytes_per_token(n_kept: int, hidden_size: int, dtype: str) -> int:
    """A token's bytes in a shard: k kept layers + the final state, H values each (2·(k+1)·H in bf16), plus its
    int32 id; fp8 adds a float32 scale per layer. Headers and offsets aside (a few bytes a sample)."""
    per_layer = hidden_size * VALUE_BYTES[dtype] + (4 if dtype == "fp8" else 0)
    return (n_kept + 1) * per_layer + 4


def disk_per_token(n_kept: int, hidden_size: int) -> dict[str, int]:
    """A token's bytes in bf16 and in fp8, and online training's: 0 (the trainer computes the states; none are
    stored)."""
    return {d: bytes_per_token(n_kept, hidden_size, d) for d in ("bfloat16", "fp8")} | {"online": 0}


def quantize_fp8(x):
    """Per-row e4m3 with a float32 scale per row (the last dimension is the row)."""
    import torch

    x = x.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def dequantize_fp8(q, scale):
    return q.float() * scale.unsqueeze(-1)


def encode(x, dtype: str) -> dict:
    """A state tensor as stored: {"": values} or, for fp8, {"": values, "_scale": scales}."""
    import torch

    if dtype == "fp8":
        q, scale = quantize_fp8(x)
        return {"": q, "_scale": scale}
    return {"": x.to(getattr(torch, dtype))}


def pack(samples: list[SampleStates], dtype: str) -> dict:
    """The tensors of one shard."""
    import torch

    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    tensors = {
        "offsets": offsets,
        "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32),
    }
    for name, parts in (
        ("aux_hidden_states", [s.aux for s in samples]),
        ("final_hidden_states", [s.final for s in samples]),
    ):
        for suffix, t in encode(torch.cat(parts), dtype).items():
            tensors[name.replace("_hidden_states", "_scale") if suffix else name] = t.contiguous()
    return tensors


def finite(t) -> bool:
    """Whether every value is finite. A tensor's min and max are NaN if any value is NaN and infinite if any is: one
    pass without a temporary, where `isfinite(t).all()` builds a mask (on bf16 on a CPU, 20x slower: it was the
    biggest cost of the stage beside the forward)."""
    import torch

    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def check(samples: list[SampleStates], sample_ids: dict[str, str]) -> None:
    """Before writing: every sample's states cover its tokens and are finite; the first bad one is named."""
    for s in samples:
        n = len(s.input_ids)
        if s.aux.shape[0] != n or s.final.shape[0] != n:
            raise StateError(
                f"sample {sample_ids.get(s.key, s.key)}: states for {s.aux.shape[0]} tokens, {n} token ids"
            )
        for name, t in (("aux", s.aux), ("final", s.final)):
            if not finite(t):
                raise StateError(
                    f"sample {sample_ids.get(s.key, s.key)}: non-finite values in its {name} states "
                    "(the target produced NaN or inf: check the model and its dtype)"
                )


def write(path: Path, samples: list[SampleStates], dtype: str, settings: dict, timers: Timers | None = None) -> int:
    """Write one shard (temp name, then rename); returns its size in bytes. `timers` gets the packing's and the
    write's seconds."""
    from safetensors.torch import save_file

    timers = timers or Timers()
    meta = {"version": FORMAT_VERSION, "settings": settings, "keys": [s.key for s in samples]}
    with timers("shard packing"):
        tensors = pack(samples, dtype)
    with timers("writes"), atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"draftdata": json.dumps(meta, sort_keys=True)})
    return path.stat().st_size


def torn(path: Path) -> bool:
    """A file that is missing, cut short or not a safetensors file: its header says how long it must be."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return path.stat().st_size != 8 + n + end
    except (OSError, ValueError):
        return True


class ShardReader:
    """Rows of one shard, decoded to float32 (fp8 dequantized)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._f = safe_open(str(path), framework="pt")
        self.meta = json.loads(self._f.metadata()["draftdata"])
        self.offsets = self._f.get_tensor("offsets")
        self._names = set(self._f.keys())

    def sample(self, row: int) -> tuple[object, object, object]:
        """(input_ids int64 [T], aux float32 [T, k, H], final pre-norm float32 [T, H]) of the row-th sample."""
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        ids = self._f.get_slice("input_ids")[a:b].long()
        return ids, self._decoded("aux", a, b), self._decoded("final", a, b)

    def _decoded(self, what: str, a: int, b: int):
        values = self._f.get_slice(f"{what}_hidden_states")[a:b]
        if f"{what}_scale" in self._names:
            return dequantize_fp8(values, self._f.get_slice(f"{what}_scale")[a:b])
        return values.float()
