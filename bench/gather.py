"""Gathering shards to rank 0 (`run.states_layout: local`, capture across nodes): its rate against copying the same
files, and the arithmetic a cluster's network then sets.

    python -m bench.gather [--gb 2] [--shard-mb 256] [--out bench/results/gather.json]

Two processes on this machine form a gloo job over loopback, as two nodes' ranks do. Rank 1's store holds `--gb` of
shards (the stage's format: bf16 states of H = 4096, 3 layers and the final state, 32 KiB a token), written untimed.
Timed: `draftdata.hidden.nodes.gather`, rank 1 sending every shard its share holds and rank 0 writing each into its
own store and indexing it, as the stage does after computing. Beside it, the same files copied on this disk
(`shutil.copyfile`, both ends in the page cache, as the gather's are): what the machine does with no process group
between the two. Loopback has no network's limit, so the ratio is the gather's own cost (messages of 64 MiB through
gloo and the copies into and out of them); on a cluster the gather goes at the smaller of that rate and the link's.

Writes bench/results/gather.json. Goal: gather ÷ copy ≥ 0.25 (the gather adds a socket's two copies to a file
copy's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

from bench.servers import free_port

RESULTS = Path(__file__).parent / "results"
HIDDEN, LAYERS = 4096, 3
GOAL = 0.25


def make_shards(store, gb: float, shard_mb: int) -> list[str]:
    """Shards of random bf16 states filling `gb`, indexed in `store`: the keys they hold."""
    import torch

    from draftdata.hidden.shards import SampleStates, write

    per_token = (LAYERS + 1) * HIDDEN * 2
    tokens = int(shard_mb * 2**20 / per_token)
    keys: list[str] = []
    g = torch.Generator().manual_seed(0)
    for i in range(max(1, round(gb * 1024 / shard_mb))):
        ids = [list(range(512))] * (tokens // 512)
        samples = [
            SampleStates(
                f"{i:08x}{j:024x}",
                x,
                torch.randn(len(x), LAYERS, HIDDEN, generator=g, dtype=torch.bfloat16),
                torch.randn(len(x), HIDDEN, generator=g, dtype=torch.bfloat16),
            )
            for j, x in enumerate(ids)
        ]
        name = store.new_shard_name("bench", [s.key for s in samples])
        size = write(store.path(name), samples, "bfloat16", {"bench": True})
        store.add_shard(name, "bench", [s.key for s in samples], [len(s.input_ids) for s in samples], size, "bench")
        keys += [s.key for s in samples]
    return keys


def worker(rank: int, port: int, root: str, gb: float, shard_mb: int, out: str) -> None:
    import torch.distributed as dist

    from draftdata.hidden.nodes import gather
    from draftdata.hidden.ranks import Rank
    from draftdata.hidden.state_store import StateStore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    store = StateStore(Path(root) / f"node{rank}")
    owned = make_shards(store, gb, shard_mb) if rank == 1 else []
    every: list = [None, None]
    dist.all_gather_object(every, {"store": store.identity()})
    dist.barrier()
    t0 = time.perf_counter()
    shards, size = gather(Rank(rank, 2, 0, rank), store, every, owned)
    seconds = time.perf_counter() - t0
    if rank == 0:
        Path(out).write_text(json.dumps({"shards": shards, "bytes": size, "seconds": seconds}))
    store.close()
    dist.destroy_process_group()


def copy_rate(src: Path, dest: Path) -> tuple[int, float]:
    files = sorted(src.rglob("*.safetensors"))
    dest.mkdir(parents=True)
    t0 = time.perf_counter()
    for f in files:
        shutil.copyfile(f, dest / f.name)
    return sum(f.stat().st_size for f in files), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--out", type=Path, default=RESULTS / "gather.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        timing = Path(tmp) / "timing.json"
        mp.spawn(worker, (free_port(), tmp, args.gb, args.shard_mb, str(timing)), nprocs=2)
        gathered = json.loads(timing.read_text())
        copied, copy_s = copy_rate(Path(tmp) / "node1", Path(tmp) / "copy")
    gather_gbs = gathered["bytes"] / gathered["seconds"] / 1e9
    copy_gbs = copied / copy_s / 1e9
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "conditions": {"gb": args.gb, "shard_mb": args.shard_mb, "transport": "gloo over loopback, 2 processes"},
        "gather": gathered | {"gb_s": round(gather_gbs, 3)},
        "copy": {"bytes": copied, "seconds": copy_s, "gb_s": round(copy_gbs, 3)},
        "gather_over_copy": round(gather_gbs / copy_gbs, 3),
        "goals": {f"gather_over_copy_ge_{GOAL}": gather_gbs / copy_gbs >= GOAL},
    }
    print(
        f"gather {gathered['shards']} shards, {gathered['bytes'] / 1e9:.2f} GB in {gathered['seconds']:.2f} s: "
        f"{gather_gbs:.2f} GB/s; copy {copy_gbs:.2f} GB/s; gather / copy {gather_gbs / copy_gbs:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
