"""The embedded engine's decode-attention kernel against the machine's memory speed (docs/benchmarks.md, "Decode
attention"): a sum over 1 GiB, and the kernel over 32 rows of 492 keys (3 key heads of 64, 3 query heads each, bf16
keys and values), as the keys and values it reads per second.

    python scripts/attention_bandwidth.py
"""

from __future__ import annotations

import time

import torch

from draftdata.generate.embedded import attention


def best(fn, n: int) -> float:
    """The fastest of n calls, in seconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    torch.set_num_threads(torch.get_num_threads())
    x = torch.ones(1 << 28)  # 1 GiB of float32
    print(f"1 GiB sum: {x.numel() * 4 / best(x.sum, 5) / 1e9:.1f} GB/s")
    op = attention.kernel()
    if op is None:
        raise SystemExit("the kernel cannot be built here (no C++ compiler or ninja)")
    rows, kv, per, dim, width = 32, 3, 3, 64, 492
    q, k_new, v_new = torch.randn(rows, kv, per, dim), torch.randn(rows, kv, dim), torch.randn(rows, kv, dim)
    k, v = (torch.randn(rows, kv, 512, dim).to(torch.bfloat16) for _ in range(2))
    lengths = torch.full((rows,), width)
    seconds = best(lambda: op(q, k_new, v_new, k, v, lengths), 200)
    read = rows * kv * width * dim * 2 * 2  # keys and values, 2 bytes each
    print(f"kernel {rows} x {width}: {seconds * 1e6:,.0f} us, {read / seconds / 1e9:.1f} GB/s of keys and values")


if __name__ == "__main__":
    main()
