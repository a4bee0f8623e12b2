"""Weights packed once for the engine's matmuls, in whatever dtype the engine computes.

F.linear hands its weight to the BLAS as it is, and the BLAS lays it out for its kernel on every call. A decode step
multiplies a few rows by every weight of the model, and at a few rows that layout costs as much as the arithmetic.
oneDNN's matmul on a weight reordered once into its kernel's layout (`mkldnn::_reorder_linear_weight`, then
`mkldnn::_linear_pointwise`: what torch's inductor emits for a linear layer whose batch varies) skips it, in float32
and in bf16 alike, for any number of rows. MKL's own packing (`mkl::_mkl_reorder_linear_weight`, which inductor
uses for float32 at one fixed batch) serves that one batch only: torch's `mkl::_mkl_linear` multiplies any other
number of rows by F.linear, and where it does use the packing it ran at about F.linear's speed on the model's
shapes (docs/benchmarks.md), so it is not used here.

Packing pays up to some number of rows, past which the arithmetic dominates and F.linear's kernels may be as fast
or faster; where depends on the CPU, the dtype and the weight's shape. So each distinct weight shape is timed at
start (in the engine's thread, on its threads), packed against F.linear, at row counts doubling up to the engine's
largest decode; its crossover is the largest count at which the packed product was faster (`crossover`). Which
kernel runs changes the order of the additions, never the dtype: both compute in the weight's dtype (the engine's
compute dtype, model/compute.py) and accumulate in float32, whatever the number of rows.
"""

from __future__ import annotations

import time

MARGIN = 0.95  # packed must be this much faster than F.linear to count as paying: timing noise is not a win
REPEATS = 5  # timings per row count, interleaved, the fastest kept


def _ops():
    import torch

    try:
        return torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return None


class PackedLinear:
    """`x @ weight.T + bias` in the weight's dtype: on a copy packed once for forwards of at most `up_to` rows, by
    F.linear on the weight itself for more (`up_to` 0: always F.linear, and no copy is made). `layout_rows`: the
    rows oneDNN lays the copy out for (a hint: any number of rows multiplies by it)."""

    def __init__(self, weight, bias=None, up_to: int = 0, layout_rows: int = 0):
        self.weight, self.bias, self.up_to, self.packed = weight, bias, 0, None
        self.out_features, self.in_features = weight.shape
        ops = _ops()
        if up_to and ops is not None:
            reorder, self._pointwise = ops  # looked up once: __call__ is on every step's path
            self.packed = reorder(weight.detach(), layout_rows or up_to)
            self.up_to = up_to

    def __call__(self, x):
        import torch.nn.functional as F

        rows = x.numel() // self.in_features
        if rows > self.up_to:
            return F.linear(x, self.weight, self.bias)
        y = self._pointwise(x.reshape(rows, self.in_features), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def row_counts(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (and `most` itself): the row counts a crossover is timed at."""
    counts = [1]
    while counts[-1] * 2 < most:
        counts.append(counts[-1] * 2)
    return counts + ([most] if most > 1 else [])


def crossover(weight, most_rows: int) -> int:
    """Up to how many rows a packed copy of `weight` multiplies faster than F.linear here (0: never, or oneDNN has no
    kernel for this dtype on this CPU): the largest of `row_counts(most_rows)` at which packed was faster by the
    margin. Where the two are near parity (past the crossover, as a rule) a count falls either way; either costs
    little there."""
    import torch
    import torch.nn.functional as F

    if _ops() is None or weight.device.type != "cpu":
        return 0
    try:
        packed = PackedLinear(weight, up_to=most_rows, layout_rows=most_rows)
        best = 0
        for rows in row_counts(most_rows):
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            plain, fast = _fastest([lambda x=x: F.linear(x, weight), lambda x=x: packed(x)])
            if fast < MARGIN * plain:
                best = rows
    except RuntimeError:  # this build's oneDNN has no kernel for the dtype here (bf16 without AVX-512BW): F.linear
        return 0
    return best


def pack(weights: list[tuple], most_rows: int) -> list[PackedLinear]:
    """A PackedLinear for each (weight, bias), the crossover measured once per distinct shape and dtype."""
    measured: dict[tuple, int] = {}
    out = []
    for weight, bias in weights:
        key = (tuple(weight.shape), weight.dtype)
        if key not in measured:
            measured[key] = crossover(weight, most_rows)
        out.append(PackedLinear(weight, bias, measured[key], layout_rows=most_rows))
    return out


def _fastest(fns) -> list[float]:
    """Each function's fastest time over REPEATS rounds, the functions interleaved within a round so that a busy
    moment of the machine weighs on all of them alike."""
    for fn in fns:
        fn()  # warm-up: first-call allocations, oneDNN's kernel creation
    best = [float("inf")] * len(fns)
    for _ in range(REPEATS):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best
