"""Whether the embedded engine's matmuls give a row the same values whatever the rows beside it: the cause of
answers that change with `concurrency` on a fresh store (issue: answers that do not depend on the batch).

    python -m bench.row_invariance [--out bench/results/row_invariance.json]

For each weight shape of the demo's target (SmolLM2-135M: hidden 576, 9 heads of 64 with 3 key-value heads,
intermediate 1536, vocabulary 49,152) in float32 (what the engine computes in on a CPU without bf16 arithmetic), and
for each kernel the engine may pick (`F.linear`, MKL's; `packed`, oneDNN's on a weight packed once:
draftdata/generate/embedded/packed.py), it multiplies a batch of 64 random rows, then sub-batches of it (1 row,
rows 5..6, 3..40, 63..64, ...), and says whether every sub-batch's rows equal the same rows of the whole batch bit
for bit: as called (`plain`), and computed in fixed tiles of 8 or 16 rows, the last one padded with zeros. It also
says whether the two kernels agree with each other. No timing: the answer does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = {  # (out_features, in_features) of the demo target's linears
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
SLICES = ((0, 1), (5, 6), (1, 3), (3, 40), (10, 26), (63, 64))
TILES = (0, 8, 16)  # 0: as called


def tiled(f, x, tile: int):
    """f over x in fixed tiles of `tile` rows (the last padded with zeros), or as called for tile 0."""
    import torch

    if not tile:
        return f(x)
    n = x.shape[0]
    pad = (-n) % tile
    xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    return torch.cat([f(xp[i : i + tile]) for i in range(0, xp.shape[0], tile)])[:n]


def check(shape: tuple[int, int], seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    from draftdata.generate.embedded.packed import PackedLinear, _ops

    torch.manual_seed(seed)
    w = torch.randn(*shape)
    x = torch.randn(64, shape[1])
    kernels = {"F.linear": lambda a: F.linear(a, w)}
    if _ops() is not None:
        kernels["packed"] = PackedLinear(w, up_to=1 << 30, layout_rows=16)
    out = {}
    for name, f in kernels.items():
        for tile in TILES:
            whole = tiled(f, x, tile)
            out[f"{name}/{'plain' if not tile else f'tile{tile}'}"] = all(
                torch.equal(tiled(f, x[a:b], tile), whole[a:b]) for a, b in SLICES
            )
    if "packed" in kernels:
        out["kernels_agree"] = bool(torch.equal(kernels["F.linear"](x), kernels["packed"](x)))
    return out


def main(argv: list[str] | None = None) -> dict:
    import torch

    ap = argparse.ArgumentParser(prog="python -m bench.row_invariance", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "slices": [list(s) for s in SLICES],
        "shapes": {name: {"shape": list(shape), **check(shape)} for name, shape in SHAPES.items()},
    }
    for name, r in results["shapes"].items():
        cells = " ".join(f"{k}={'yes' if v else 'NO'}" for k, v in r.items() if k != "shape")
        print(f"{name:8} {str(tuple(r['shape'])):14} {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
