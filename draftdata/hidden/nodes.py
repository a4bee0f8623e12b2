"""Hidden states across nodes: every rank agrees on what it computes before anything is computed, and, where each node
keeps its own store on a local disk, rank 0 gathers the shards its store lacks over the job's own process group.

Under torchrun a job's ranks may run on several nodes (`--nnodes`). Their state stores are one of:
- one store that every rank sees: one node's disk (SQLite, `run.states_layout: local`), or a network file system
  (`shared`: a manifest beside each shard, no SQLite); rank 0 finds every rank's shards in it;
- a store per node, each on its node's local disk (`local`): after computing, the ranks of the other nodes send rank
  0 the shards that hold their shares, and rank 0 writes them into its store (and indexes each once whole), so the
  node that runs DVC ends with every sample's states, as one process would have left them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from draftdata.errors import ConfigError, UserError
from draftdata.hidden.ranks import Rank
from draftdata.hidden.shards import contents, torn
from draftdata.util.files import HOST, atomic_path, sha256_of

CHUNK = 64 << 20  # bytes per message of a shard sent to rank 0


class NodeMismatch(UserError):
    """Two ranks of one job would compute different states: one line, naming the rank, its node and what differs."""


def code_version() -> str:
    """This package's version and a hash of its sources: two nodes with other code (a pull on one of them) compute
    states that their keys cannot tell apart."""
    import draftdata

    root = Path(draftdata.__file__).parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    try:
        version = metadata.version("draftdata")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed: its sources say it all
        version = "source"
    return f"{version}+{h.hexdigest()[:12]}"


def node_facts(settings: dict, samples: Path, layout: str) -> dict:
    """What every rank of a job must share, by the name a refusal gives it."""
    return {
        "model fingerprint": settings["model"],
        "layers": settings["layers"],
        "dtype": settings["dtype"],
        "state format": settings["version"],
        "code version": code_version(),
        f"{samples.name} (sha256)": sha256_of(samples)[:16],
        "run.states_layout": layout,
    }


def agree(rank: Rank, facts: Callable[[], dict], store_id: str, store_root: Path) -> list[dict]:
    """Every rank's facts (`facts()`, made only under torchrun: it reads samples.parquet whole) and store, once all
    of them agree; else every rank refuses to start, in one line (the first rank and fact that differ from rank
    0's). Two nodes may not share an SQLite store: a network file system takes `run.states_layout: shared`."""
    if rank.world == 1:
        return [{"store": store_id}]
    import torch.distributed as dist

    mine = {"facts": facts(), "node": rank.node, "host": HOST, "store": store_id}
    every: list = [None] * rank.world
    dist.all_gather_object(every, mine)
    first = every[0]
    for r, theirs in enumerate(every):
        for name, value in first["facts"].items():
            if theirs["facts"].get(name) != value:
                raise NodeMismatch(
                    f"hidden_states: rank {r} (node {theirs['node']}, {theirs['host']}) has another {name} than rank 0"
                    f" (node {first['node']}, {first['host']}): {theirs['facts'].get(name)!r} against {value!r}; every"
                    " node must run the same params, model, code and samples"
                )
    if mine["facts"]["run.states_layout"] == "local":
        nodes_of: dict[str, set] = {}
        for theirs in every:
            nodes_of.setdefault(theirs["store"], set()).add(theirs["node"])
        shared = next((sorted(n) for n in nodes_of.values() if len(n) > 1), None)
        if shared:
            raise ConfigError(
                "run.states_layout",
                f"nodes {shared[0]} and {shared[1]} share the state store {store_root} (a network file system): its"
                " SQLite index must not be written from several nodes; set run.states_layout: shared",
            )
    return every


def gather(rank: Rank, store, every: list[dict], owned: list[str]) -> tuple[int, int]:
    """Local disks: the shards that rank 0's store lacks, sent to it by the ranks of other stores that hold them (a
    collective: every rank calls it). Returns the (shards, bytes) rank 0 received; (0, 0) where all share a store."""
    stores = [e["store"] for e in every]
    if all(s == stores[0] for s in stores):
        return 0, 0
    import torch.distributed as dist

    offer = {} if stores[rank.rank] == stores[0] else offered(store, owned)
    offers: list | None = [None] * rank.world if rank.rank == 0 else None
    dist.gather_object(offer, offers, dst=0)
    plan: list = [planned(store, offers) if rank.rank == 0 else None]
    dist.broadcast_object_list(plan, src=0)
    received = 0
    for src, name, keys, lengths, engine in plan[0]:  # over the job's gloo group (ranks.join_group)
        if rank.rank == src:
            _send(store.path(name))
        elif rank.rank == 0:
            size = _receive(store.path(name), src)
            store.add_shard(name, name.split("/")[0], keys, lengths, size, engine)
            received += size
    return len(plan[0]), received


def offered(store, owned: list[str]) -> dict[str, tuple]:
    """The shards of this rank's store that hold its share: name -> (keys, lengths, engine), read from the files."""
    names = sorted({loc.shard for loc in store.lookup(owned).values()})
    engines = store.engines(names)
    return {name: (*contents(store.path(name)), engines.get(name)) for name in names}


def planned(store, offers: list[dict]) -> list[tuple]:
    """Rank 0: which rank sends which shard, for every sample its store lacks, each shard once."""
    plan, covered = [], set()
    for src, offer in enumerate(offers):
        for name, (keys, lengths, engine) in sorted(offer.items()):
            have = store.lookup(keys)
            if all(k in have or k in covered for k in keys):
                continue
            plan.append((src, name, keys, lengths, engine))
            covered.update(keys)
    return plan


def _send(path: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.send(torch.tensor([path.stat().st_size], dtype=torch.int64), 0)
    buf = torch.empty(CHUNK, dtype=torch.uint8)  # read into, sent from: no copy between the two
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf.numpy()):
            dist.send(buf[:n], 0)


def _receive(path: Path, src: int) -> int:
    """A shard from rank `src`, written to a temp name and renamed once whole (as a computed one)."""
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    left = int(size)
    buf = torch.empty(min(CHUNK, left), dtype=torch.uint8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # buffered: it writes every byte of a large write
        while left:
            part = buf[: min(CHUNK, left)]
            dist.recv(part, src)
            f.write(part.numpy().data)
            left -= part.numel()
    if torn(path):
        raise UserError(f"{path}: the shard rank {src} sent is cut short; run again")
    return int(size)
