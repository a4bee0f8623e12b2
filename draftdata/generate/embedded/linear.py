"""The matmuls of slot batching where the model computes in float32 on a CPU: forwards of a few rows multiply in bf16
on weights packed once, the others in float32.

A decode step of a few requests multiplies a few rows by every weight: the weights' bytes, not the arithmetic, set
its time, and MKL's float32 sgemm repacks each weight on every call. oneDNN's bf16 matmul on a weight packed once
(`mkldnn::_reorder_linear_weight`, as torch's inductor packs them) reads half the bytes and packs nothing. At a few
dozen rows the arithmetic takes over, and float32's is faster on a CPU without AMX. So each layer keeps its float32
weight, and a packed bf16 copy (exact: the model's weights are 16-bit) for forwards of at most `SMALL_ROWS` rows;
whether that pays is measured at start, on the model's own weights (`packing_pays`).
"""

from __future__ import annotations

import time

SMALL_ROWS = 8  # measured on the demo target: 1.2-1.4x faster at 4 to 8 rows, slower from 16 to 32


def _ops():
    import torch

    try:
        return torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return None


def _hybrid_class():
    import torch

    class HybridLinear(torch.nn.Linear):
        """An nn.Linear (the same float32 weight and bias) that multiplies forwards of at most `small_rows` rows in
        bf16 by its packed copy; its output is float32 either way."""

        def forward(self, x):
            rows = x.numel() // self.in_features
            if rows > self.small_rows:
                return torch.nn.functional.linear(x, self.weight, self.bias)
            flat = x.reshape(rows, self.in_features).to(torch.bfloat16)
            y = self.pointwise(flat, self.packed, self.bias16, "none", [], "")
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    return HybridLinear


def _linears(model):
    import torch

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32:
                yield parent, name, child


def hybridize(model, small_rows: int = SMALL_ROWS) -> int:
    """Give every float32 nn.Linear of `model` (the LM head included) its packed bf16 copy; how many."""
    import torch

    ops = _ops()
    if ops is None:
        return 0
    reorder, pointwise = ops
    cls = _hybrid_class()
    count = 0
    for parent, name, child in _linears(model):
        hybrid = cls.__new__(cls)
        hybrid.__dict__ = dict(child.__dict__)  # the same parameters (tied ones stay tied), hooks and sizes
        hybrid.small_rows, hybrid.pointwise = small_rows, pointwise
        hybrid.packed = reorder(child.weight.detach().to(torch.bfloat16), small_rows)
        hybrid.bias16 = None if child.bias is None else child.bias.detach().to(torch.bfloat16)
        setattr(parent, name, hybrid)
        count += 1
    return count


def packing_pays(model, rows: int = SMALL_ROWS) -> bool:
    """Whether `rows` rows through every linear layer of `model`, one after the other as a forward takes them, are
    faster in bf16 on packed weights than in float32 here (a CPU without oneDNN's bf16 kernels: no)."""
    import torch

    ops = _ops()
    if ops is None:
        return False
    reorder, pointwise = ops
    layers = [child for _, _, child in _linears(model.base_model)]
    try:
        packed = [reorder(m.weight.detach().to(torch.bfloat16), rows) for m in layers]
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
        plain = _best(lambda: [torch.nn.functional.linear(inputs[m.in_features], m.weight) for m in layers])
        small = _best(
            lambda: [
                pointwise(inputs[m.in_features].to(torch.bfloat16), p, None, "none", [], "").float()
                for m, p in zip(layers, packed)
            ]
        )
    except RuntimeError:  # this build's oneDNN refuses: float32 it is
        return False
    return small < 0.9 * plain


def _best(fn) -> float:
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
