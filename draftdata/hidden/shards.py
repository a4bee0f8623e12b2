"""The hidden-state shard format: samples packed along the token axis, no pad stored.

A shard is one safetensors file:
- `offsets` int64 [n + 1]: sample i is rows offsets[i]:offsets[i + 1];
- `input_ids` int32 [T]: the tokens the states belong to (checked on every read and write);
- `aux_hidden_states` [T, k, H]: the outputs of the k chosen decoder layers (physical 0-based ids, in index order);
- `final_hidden_states` [T, H]: the last decoder layer's output, BEFORE the final norm;
- with `dtype: fp8`: both in float8 e4m3 with `aux_scale` float32 [T, k] and `final_scale` float32 [T], one scale per
  token and layer (a row's max |value| maps to e4m3's largest finite number), about half of bf16's bytes;
- with `hidden_states.policy_top_k`: `policy_tokens` int32 [T, p] and `policy_logprobs` float32 [T, p], the target's
  policy for the next token at every position (draftdata/hidden/policy.py); with the policy alone (`drafters: []`)
  no final state is stored and the aux axis is empty.
The metadata holds the settings the states were computed under and the samples' keys. Writes go to a temp name and
are renamed; `check` runs before every write (ids and states agree, values finite) and `torn` finds a file cut short.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from draftdata.errors import UserError
from draftdata.hidden.policy import bytes_per_token as policy_bytes_per_token
from draftdata.util.files import atomic_path

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
    final: object  # torch.Tensor [T, H], pre-norm; None where the policy alone is kept
    policy: tuple | None = None  # (tokens int32 [T, p], log-probs float32 [T, p]) where the policy is kept


def bytes_per_token(n_kept: int, hidden_size: int, dtype: str, policy_k: int = 0, states: bool = True) -> int:
    """A token's bytes in a shard: k kept layers + the final state, H values each (2·(k+1)·H in bf16), plus its
    int32 id; fp8 adds a float32 scale per layer; the policy (top p tokens) 8·p; `states` False: the policy alone.
    Headers and offsets aside (a few bytes a sample)."""
    per_layer = hidden_size * VALUE_BYTES[dtype] + (4 if dtype == "fp8" else 0)
    return ((n_kept + 1) * per_layer if states else 0) + policy_bytes_per_token(policy_k) + 4


def disk_per_token(n_kept: int, hidden_size: int, policy_k: int = 0) -> dict[str, int]:
    """A token's bytes: its states in bf16 and in fp8; the policy alone (top policy_k tokens, ModelOpt's k = 20
    where none is set) with its id; online training's 0 (the trainer computes the states; none are stored)."""
    states = {d: bytes_per_token(n_kept, hidden_size, d) for d in ("bfloat16", "fp8")}
    return states | {"policy": bytes_per_token(0, 0, "bfloat16", policy_k or 20, states=False), "online": 0}


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


def pack(samples: list[SampleStates], dtype: str) -> dict[str, list]:
    """The tensors of one shard, each as its samples' parts in order (joined where the file is laid out)."""
    import torch

    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    parts: dict[str, list] = {
        "offsets": [offsets],
        "input_ids": [torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32)],
    }
    for i, name in enumerate(("policy_tokens", "policy_logprobs")):
        if samples[0].policy is not None:
            parts[name] = [s.policy[i] for s in samples]
    for what in ("aux", "final") if samples[0].final is not None else ("aux",):
        encoded = [encode(getattr(s, what), dtype) for s in samples]  # fp8's scales are per row: per sample is the same
        for suffix, name in (("", f"{what}_hidden_states"), ("_scale", f"{what}_scale")):
            if suffix in encoded[0]:
                parts[name] = [e[suffix] for e in encoded]
    return parts


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
        got = [t.shape[0] for t in (s.aux, s.final, *(s.policy or ())) if t is not None]
        if any(m != n for m in got):
            raise StateError(f"sample {sample_ids.get(s.key, s.key)}: states for {got[0]} tokens, {n} token ids")
        # the policy's cut slots hold -inf by design: its kept log-probabilities are finite where the states are
        for name, t in (("aux", s.aux), ("final", s.final)) if s.final is not None else (("aux", s.aux),):
            if not finite(t):
                raise StateError(
                    f"sample {sample_ids.get(s.key, s.key)}: non-finite values in its {name} states "
                    "(the target produced NaN or inf: check the model and its dtype)"
                )


def write(
    path: Path, samples: list[SampleStates], dtype: str, settings: dict, buffer: ShardBuffer | None = None
) -> int:
    """Write one shard (temp name, then rename); returns its size in bytes. `buffer`, kept from one shard to the
    next, saves touching fresh memory for every shard."""
    meta = {"version": FORMAT_VERSION, "settings": settings, "keys": [s.key for s in samples]}
    own = buffer is None
    buffer = buffer or ShardBuffer()
    try:
        image = ShardImage(pack(samples, dtype), {"draftdata": json.dumps(meta, sort_keys=True)}, buffer)
        with atomic_path(path) as tmp:
            image.write(tmp)
    finally:
        if own:
            buffer.close()
    return path.stat().st_size


SAFETENSORS_DTYPES = {
    "int64": "I64",
    "int32": "I32",
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float8_e4m3fn": "F8_E4M3",
}
ALIGN = 4096  # O_DIRECT wants the buffer, the offsets and the lengths in whole blocks of the device: 4 KiB covers them
CHUNK = 1 << 30  # one write call at most (Linux moves under 2 GiB a call)


class ShardBuffer:
    """Page-aligned memory for one shard's image, kept and grown to the largest shard: a writer that reuses it
    copies into pages already mapped, where a new buffer for every shard pays for mapping each page again (a
    shard is 134 MB at the bench's shape, gigabytes at a large target's)."""

    def __init__(self):
        self._map = None

    def get(self, size: int):
        import mmap

        size = -(-size // ALIGN) * ALIGN
        if self._map is None or len(self._map) < size:
            self.close()
            self._map = mmap.mmap(-1, size)
        return self._map

    def close(self) -> None:
        # forgotten before it is closed: a Ctrl-C between the two must not leave a closed map to be reused on the way
        # out (ValueError: mmap closed, in place of the interrupt's one line)
        held, self._map = self._map, None
        if held is not None:
            held.close()


class ShardImage:
    """A shard's file, byte for byte, in one page-aligned buffer: safetensors' layout (an 8-byte header length, the
    JSON header padded with spaces to 8 bytes, then each tensor's bytes, widest type first, so that every tensor
    starts aligned to its own type), with the samples' parts copied straight to their places.

    Why not safetensors' own `save_file`: it writes through the page cache, and copying into the page cache was
    the biggest cost of storing the states beside the forward (`python -m bench.hidden_states`, its time split), where
    O_DIRECT hands the pages to the device with next to no CPU. On a CPU target a writer thread cannot hide that copy:
    the forward takes every core. And the states are written once and read back by a later stage or a trainer, so
    caching them buys nothing and evicts what is worth caching (the model's weights). The files are read with
    safetensors (`ShardReader`)."""

    def __init__(self, parts: dict[str, list], metadata: dict[str, str], buffer: ShardBuffer):
        import torch

        order = sorted(parts, key=lambda name: -parts[name][0].element_size())  # sorted() is stable: ties keep order
        header: dict = {"__metadata__": metadata}
        start = 0
        for name in order:
            first = parts[name][0]
            shape = [sum(p.shape[0] for p in parts[name]), *first.shape[1:]]
            size = math.prod(shape) * first.element_size()
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[str(first.dtype).removeprefix("torch.")],
                "shape": shape,
                "data_offsets": [start, start + size],
            }
            start += size
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        base = 8 + len(head)
        self.size = base + start
        self.buffer = buffer.get(self.size)
        self.buffer[:base] = len(head).to_bytes(8, "little") + head
        flat = torch.frombuffer(self.buffer, dtype=torch.uint8)
        for name in order:
            a, b = header[name]["data_offsets"]
            dtype = parts[name][0].dtype
            torch.cat(parts[name], out=flat[base + a : base + b].view(dtype).view(header[name]["shape"]))
        del flat  # no view may outlive the buffer

    def write(self, path: Path) -> None:
        """The image into the (existing, empty) file at `path`: with O_DIRECT where the file system takes it, else
        through the page cache."""
        direct = getattr(os, "O_DIRECT", 0)
        if direct and self._write(path, direct):
            return
        self._write(path, 0)

    def _write(self, path: Path, flags: int) -> bool:
        """False where the file system refuses O_DIRECT (tmpfs, some network file systems: EINVAL)."""
        # O_DIRECT moves whole blocks from a block-aligned address (the buffer's start is a page's): the last block
        # goes out whole and the file is cut to its size after
        end = -(-self.size // ALIGN) * ALIGN if flags else self.size
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | flags)
        except OSError as e:
            if flags and e.errno == errno.EINVAL:
                return False
            raise
        view = memoryview(self.buffer)
        try:
            done = 0
            while done < end:
                done += os.write(fd, view[done : min(end, done + CHUNK)])
            os.ftruncate(fd, self.size)
        except OSError as e:
            if flags and e.errno == errno.EINVAL:
                return False
            raise
        finally:
            view.release()
            os.close(fd)
        return True


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
        """(input_ids int64 [T], aux float32 [T, k, H], final pre-norm float32 [T, H] or None where the shard holds
        the policy alone) of the row-th sample."""
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        ids = self._f.get_slice("input_ids")[a:b].long()
        final = self._decoded("final", a, b) if "final_hidden_states" in self._names else None
        return ids, self._decoded("aux", a, b), final

    def policy(self, row: int) -> tuple[object, object] | None:
        """(tokens int64 [T, p], log-probs float32 [T, p]) of the row-th sample; None where none was kept."""
        if "policy_tokens" not in self._names:
            return None
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        return self._f.get_slice("policy_tokens")[a:b].long(), self._f.get_slice("policy_logprobs")[a:b]

    def _decoded(self, what: str, a: int, b: int):
        values = self._f.get_slice(f"{what}_hidden_states")[a:b]
        if f"{what}_scale" in self._names:
            return dequantize_fp8(values, self._f.get_slice(f"{what}_scale")[a:b])
        return values.float()


def contents(path: Path) -> tuple[list[str], list[int]]:
    """The keys of a shard's samples and their token counts, from its header and offsets alone."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = json.loads(f.metadata()["draftdata"])["keys"]
        offsets = f.get_tensor("offsets")
    return keys, (offsets[1:] - offsets[:-1]).tolist()
