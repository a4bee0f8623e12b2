"""The keys and values of the requests in flight, kept by capacity class, and the attention over them.

A row holds one request's keys (and, in a tensor beside it, its values) for every layer, contiguously:
[rows, kv heads, capacity, head dim]. Rows live in classes of capacity 64, 128, 256, ... positions; a request sits in
the smallest class that holds it and moves up one class when it outgrows it (copying its keys once per doubling, so
at most once per token on average). Within a class the rows in use are 0..n-1 (a freed row takes the class's last
one), so a decode step attends over a view of each class, never a copy, and one call per class covers its rows: its
width is its longest row's, and a row at least half its class's capacity long wastes under half of it on padding.
One padded call over every request would attend as far as the longest prompt in flight for every one of them.

Keys and values are stored in the cache's dtype (the model's own, 16-bit: half the bytes a decode step reads) even
where the model computes in float32 (`model.compute_dtype`, model/compute.py). Attention computes its scores in
float32 either way: a decode step's by `attention.py`'s kernel over each class's rows, a prefill's by SDPA in the
compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftdata.generate.embedded.attention import reference

MIN_CAPACITY = 64
ZERO_AHEAD = 128  # positions past the decode window a row's padding is zeroed, so that it is zeroed rarely


def capacity_for(length: int) -> int:
    cap = MIN_CAPACITY
    while cap < length:
        cap *= 2
    return cap


@dataclass
class _Class:
    """The rows of one capacity; `owners[i]` is the request id in row i, `filled[i]` its positions written, and
    `clean[i]` how far row i's memory is known to hold finite values (a property of the memory, kept across
    owners: a masked padding position still meets a zero weight, and 0 x NaN, from uninitialised memory, is NaN)."""

    cap: int
    k: list
    v: list
    owners: list[str] = field(default_factory=list)
    filled: list[int] = field(default_factory=list)
    clean: list[int] = field(default_factory=list)


@dataclass
class _Group:
    """One attention call of a decode step: rows 0..count-1 of a class, at batch rows offset..offset+count-1."""

    cls: _Class
    offset: int
    count: int
    width: int
    lengths: object  # [count] each row's keys once the new one is in (it goes at length - 1)


class KVCache:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype, max_rows: int, decode=reference):
        """`decode`: the decode attention (`attention.py`: its kernel where it builds here)."""
        self.n_layers, self.kv_heads, self.head_dim, self.dtype = n_layers, kv_heads, head_dim, dtype
        self.max_rows = max_rows
        self.decode = decode
        self.classes: dict[int, _Class] = {}
        self.where: dict[str, tuple[int, int]] = {}  # request id -> (capacity, row)
        self.step: tuple | None = None  # what the next forward attends: ("decode", groups) or ("prefill", segments)

    # --- rows --------------------------------------------------------------------------------------------------
    def _class(self, cap: int) -> _Class:
        import torch

        if cap not in self.classes:
            shape = (self.max_rows, self.kv_heads, cap, self.head_dim)
            layers = range(self.n_layers)
            self.classes[cap] = _Class(
                cap,
                [torch.empty(shape, dtype=self.dtype) for _ in layers],
                [torch.empty(shape, dtype=self.dtype) for _ in layers],
                clean=[0] * self.max_rows,
            )
        return self.classes[cap]

    def place(self, rid: str, length: int) -> None:
        """A row for a new request that will hold `length` positions."""
        cls = self._class(capacity_for(length))
        self.where[rid] = (cls.cap, len(cls.owners))
        cls.owners.append(rid)
        cls.filled.append(0)

    def free(self, rid: str) -> None:
        cap, row = self.where.pop(rid)
        cls = self.classes[cap]
        last = len(cls.owners) - 1
        if row != last:  # the class's last row moves into the hole: rows in use stay 0..n-1
            self._copy(cls, last, cls, row, cls.filled[last])
            cls.owners[row], cls.filled[row] = cls.owners[last], cls.filled[last]
            self.where[cls.owners[row]] = (cap, row)
        cls.owners.pop()
        cls.filled.pop()

    def filled(self, rid: str) -> int:
        """The positions of `rid`'s row written so far."""
        cap, row = self.where[rid]
        return self.classes[cap].filled[row]

    def share(self, src: str, dst: str, n: int) -> None:
        """The first `n` positions of `src`'s row copied into `dst`'s, a row placed and not written yet: a prompt
        that begins with another request's tokens takes their keys and values rather than computing them again
        (they are a function of those tokens alone), and its prefill continues from position `n`."""
        (src_cap, src_row), (dst_cap, dst_row) = self.where[src], self.where[dst]
        dst_cls = self.classes[dst_cap]
        if dst_cls.filled[dst_row] or not n <= min(self.classes[src_cap].filled[src_row], dst_cap):
            raise ValueError(f"request {dst}: cannot take {n} positions from {src}")
        self._copy(self.classes[src_cap], src_row, dst_cls, dst_row, n)
        dst_cls.filled[dst_row] = n

    def clear(self) -> None:
        """Every row free (their memory kept, and what is known of it: `clean`)."""
        for cls in self.classes.values():
            cls.owners, cls.filled = [], []
        self.where = {}
        self.step = None

    def _grow(self, rid: str, length: int) -> None:
        """Move a request whose next position is past its class into the class that holds `length`."""
        cap, row = self.where[rid]
        src = self.classes[cap]
        filled = src.filled[row]
        dst = self._class(capacity_for(length))
        new_row = len(dst.owners)
        self._copy(src, row, dst, new_row, filled)
        self.free(rid)
        dst.owners.append(rid)
        dst.filled.append(filled)
        self.where[rid] = (dst.cap, new_row)

    def _copy(self, src: _Class, src_row: int, dst: _Class, dst_row: int, n: int) -> None:
        for layer in range(self.n_layers):
            dst.k[layer][dst_row, :, :n] = src.k[layer][src_row, :, :n]
            dst.v[layer][dst_row, :, :n] = src.v[layer][src_row, :, :n]
        dst.clean[dst_row] = max(dst.clean[dst_row], n)

    # --- steps -------------------------------------------------------------------------------------------------
    def begin_prefill(self, segments: list[tuple[str, int]]) -> None:
        """The next forward feeds packed segments (request id, tokens), in order, after what each has cached."""
        out = []
        for rid, n in segments:
            cap, row = self.where[rid]
            cls = self.classes[cap]
            start = cls.filled[row]
            if start + n > cap:
                raise ValueError(f"request {rid}: {start + n} positions in a row of {cap}")
            out.append((cls, row, start, n))
            cls.filled[row] = start + n
            cls.clean[row] = max(cls.clean[row], start + n)
        self.step = ("prefill", out)

    def begin_decode(self) -> list[str]:
        """Set up a decode step of one new token per request in flight; the request ids in batch order (the
        largest class first, each class's rows in order)."""
        import torch

        for rid in list(self.where):
            cap, row = self.where[rid]  # read afresh: a row that grows moves another into its place
            if self.classes[cap].filled[row] + 1 > cap:
                self._grow(rid, self.classes[cap].filled[row] + 1)
        order, groups, offset = [], [], 0
        for cap in sorted(self.classes, reverse=True):
            cls = self.classes[cap]
            count = len(cls.owners)
            if not count:
                continue
            positions = list(cls.filled)
            width = max(positions) + 1
            self._zero_padding(cls, count, width)
            groups.append(_Group(cls, offset, count, width, torch.tensor(positions) + 1))
            cls.filled = [p + 1 for p in positions]
            order.extend(cls.owners)
            offset += count
        self.step = ("decode", groups)
        return order

    def _zero_padding(self, cls: _Class, count: int, width: int) -> None:
        for row in range(count):
            if cls.clean[row] < width:
                end = min(cls.cap, width + ZERO_AHEAD)
                for t in (*cls.k, *cls.v):
                    t[row, :, cls.clean[row] : end] = 0
                cls.clean[row] = end

    # --- attention ---------------------------------------------------------------------------------------------
    def attend(self, layer: int, query, key, value, scaling):
        """query [B or 1, H, T, D], key/value [., H_kv, T, D] after RoPE: stored in their rows, attended; the
        output [B or 1, T, H, D] in the query's dtype."""
        kind, parts = self.step
        if kind == "decode":
            return self._attend_decode(parts, layer, query, key, value, scaling)
        return self._attend_prefill(parts, layer, query, key, value, scaling)

    def _attend_decode(self, groups: list[_Group], layer: int, query, key, value, scaling):
        import torch

        heads, dim = query.shape[1], query.shape[3]
        per_key_head = heads // self.kv_heads
        # float32 and scaled here, once for every class: the kernel's scores are float32 whatever the compute dtype
        scaled = query.float() * (dim**-0.5 if scaling is None else scaling)
        outs = []
        new_k, new_v = (t[:, :, 0].float().contiguous() for t in (key, value))
        for g in groups:
            batch = slice(g.offset, g.offset + g.count)
            k_all, v_all = g.cls.k[layer], g.cls.v[layer]
            # the query heads that read one key head as that head's queries: GQA without repeating the keys
            q = scaled[batch].reshape(g.count, self.kv_heads, per_key_head, dim)
            rows = (k_all[: g.count, :, : g.width], v_all[: g.count, :, : g.width])
            out = self.decode(q, new_k[batch], new_v[batch], *rows, g.lengths)  # stores the new key and value too
            outs.append(out.reshape(g.count, heads, 1, dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.transpose(1, 2).to(query.dtype)

    def _attend_prefill(self, segments: list, layer: int, query, key, value, scaling):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        outs, offset = [], 0
        for cls, row, start, n in segments:
            k_all, v_all = cls.k[layer], cls.v[layer]
            k_new, v_new = key[:, :, offset : offset + n], value[:, :, offset : offset + n]
            k_all[row, :, start : start + n] = k_new[0]
            v_all[row, :, start : start + n] = v_new[0]
            q = query[:, :, offset : offset + n]
            if start == 0:  # a whole prompt: its own keys, as the forward computed them (the compute dtype)
                out = F.scaled_dot_product_attention(q, k_new, v_new, is_causal=True, scale=scaling, enable_gqa=True)
            else:  # a continuation: the keys cached before it too, widened to the compute dtype
                k, v = (t[row : row + 1, :, : start + n].to(query.dtype) for t in (k_all, v_all))
                mask = causal_lower_right(n, start + n)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
            outs.append(out)
            offset += n
        return torch.cat(outs, dim=2).transpose(1, 2)
