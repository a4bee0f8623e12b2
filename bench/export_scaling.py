"""The offline export's time per sample against the number of samples: it must stay flat (linear total time).

    python -m bench.export_scaling [--sizes 10000,100000] [--formats speculators,specforge] [--tokens 4] [--hidden 8]
        [--out bench/results/export_scaling.json]

Per size, a synthetic hidden-states output is built untimed (the stage's shard format, `samples.parquet`,
`index.json`, the final norm: what `draftdata.hidden.HiddenStates` reads), with tiny states (`--tokens` tokens a
sample, hidden size `--hidden`, 3 aux layers) so that the export's per-file work, not its bytes, is what is measured.
Then the export itself, timed: the staging directory, the format's writer (`draftdata.hidden.export.WRITERS`: every
sample's file, and speculators' dataset and token counts), the rename into place. speculators writes every
`hs_<i>.safetensors` into one directory, specforge 2,000 files a directory: an export whose cost per file grew with
the files already beside it would show here as seconds per sample rising with the size.

Prints seconds per sample for each size and their ratio (largest ÷ smallest; 1 is linear) and writes
bench/results/export_scaling.json. Goal: the ratio ≤ 1.5 for every format.

It uses only what every version of the export has, so it can time an older tree too (copied into that tree's
bench/ and run there as `python -m bench.export_scaling`, that tree first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
AUX_LAYERS = 3
SHARD_SAMPLES = 10_000  # samples a shard of the synthetic output holds
GOAL_RATIO = 1.5


def build_output(out: Path, n: int, tokens: int, hidden: int) -> None:
    """A hidden-states stage output of `n` samples, as the stage lays it out."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    from draftdata.hidden.shards import SampleStates, write

    (out / "shards").mkdir(parents=True)
    rows: dict[str, list] = {"id": [], "shard": [], "row": [], "n_tokens": [], "loss_mask": []}
    g = torch.Generator().manual_seed(0)
    for start in range(0, n, SHARD_SAMPLES):
        name = f"{start // SHARD_SAMPLES:06d}.safetensors"
        samples = []
        for i in range(start, min(n, start + SHARD_SAMPLES)):
            ids = [(7 * i + j) % 1000 + 1 for j in range(tokens)]
            aux = torch.randn(tokens, AUX_LAYERS, hidden, generator=g)
            samples.append(SampleStates(f"k{i}", ids, aux, torch.randn(tokens, hidden, generator=g)))
            rows["id"].append(f"s{i}")
            rows["shard"].append(name)
            rows["row"].append(i - start)
            rows["n_tokens"].append(tokens)
            rows["loss_mask"].append([0] + [1] * (tokens - 1))
        write(out / "shards" / name, samples, "bfloat16", {"bench": "export_scaling"})
    pq.write_table(pa.table(rows), out / "samples.parquet", row_group_size=SHARD_SAMPLES)
    save_file({"weight": torch.ones(hidden)}, str(out / "final_norm.safetensors"))
    layers = list(range(1, AUX_LAYERS + 1))
    index = {
        "model": {"path": "synthetic", "hidden_size": hidden, "n_layers": AUX_LAYERS + 2},
        "layers": {"physical": layers, "sglang_specforge": layers, "vllm_speculators": [x + 1 for x in layers]},
        "final_norm": {"file": "final_norm.safetensors", "kind": "rms", "eps": 1e-6, "weight_offset": 0.0},
        "dtype": "bfloat16",
    }
    (out / "index.json").write_text(json.dumps(index))


def export(src: Path, out: Path, fmt: str) -> float:
    """The export's own work, timed: staging, the format's files, the rename into place. Its seconds."""
    from draftdata.hidden.export import WRITERS, ExportTally, pick, publish, staging_dir
    from draftdata.hidden.reader import HiddenStates

    t0 = time.perf_counter()
    staging = staging_dir(out)
    hs = HiddenStates(src)
    WRITERS[fmt](hs, staging, ExportTally(), pick(hs, fmt, "eagle3"))
    publish(staging, out)
    return time.perf_counter() - t0


def run_size(n: int, formats: list[str], args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        src = Path(tmp) / "hidden_states"
        t0 = time.perf_counter()
        build_output(src, n, args.tokens, args.hidden)
        built = time.perf_counter() - t0
        out = {}
        for fmt in formats:
            seconds = export(src, Path(tmp) / f"export-{fmt}", fmt)
            shutil.rmtree(Path(tmp) / f"export-{fmt}")  # the disk of one export at a time
            out[fmt] = {"seconds": round(seconds, 2), "s_per_sample": seconds / n}
            print(f"{fmt:<12} {n:>9,} samples: {seconds:8.1f} s, {1e3 * seconds / n:.3f} ms a sample")
        return {"build_seconds": round(built, 1), **out}


def summarise(runs: dict, formats: list[str]) -> dict:
    """Per format: seconds per sample at each size, and the largest size's ÷ the smallest's."""
    sizes = sorted(runs, key=int)
    out = {}
    for fmt in formats:
        per = {n: runs[n][fmt]["s_per_sample"] for n in sizes}
        out[fmt] = {
            "ms_per_sample": {n: round(1e3 * v, 4) for n, v in per.items()},
            "ratio": round(per[sizes[-1]] / per[sizes[0]], 3),
        }
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda x: [int(v) for v in x.split(",")], default=[10_000, 100_000])
    ap.add_argument("--formats", type=lambda x: x.split(","), default=["speculators", "specforge"])
    ap.add_argument("--tokens", type=int, default=4, help="tokens a sample")
    ap.add_argument("--hidden", type=int, default=8, help="the hidden size of the synthetic states")
    ap.add_argument("--out", type=Path, default=RESULTS / "export_scaling.json")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    runs = {str(n): run_size(n, args.formats, args) for n in args.sizes}
    res = {
        "runs": runs,
        "per_format": summarise(runs, args.formats),
        "settings": {
            "sizes": args.sizes,
            "tokens_per_sample": args.tokens,
            "hidden": args.hidden,
            "aux_layers": AUX_LAYERS,
            "python": platform.python_version(),
        },
    }
    res["goals"] = {f"{fmt}_ratio_le_{GOAL_RATIO}": v["ratio"] <= GOAL_RATIO for fmt, v in res["per_format"].items()}
    for fmt, v in res["per_format"].items():
        print(f"{fmt}: ms a sample {v['ms_per_sample']}; largest ÷ smallest size {v['ratio']}")
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out} in {res['wall_s']}s")


if __name__ == "__main__":
    main()
