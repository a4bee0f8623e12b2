"""torchrun's ranks: which samples are this process's, the process group, and the whole job's tally.

Ranks take disjoint contiguous shares of the dataset, balanced by tokens; rank 0 writes the output once every rank
has finished (across nodes, draftdata/hidden/nodes.py). Without torchrun the process is rank 0 of 1 and none of
this reaches torch.distributed.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from draftdata.hidden.tally import HiddenTally


@dataclass
class Rank:
    """This process's place in a torchrun job (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1
    local: int = 0
    node: int = 0  # torchrun's GROUP_RANK: the node's rank (its --node-rank)

    @classmethod
    def from_env(cls) -> Rank:
        env = {k: int(os.environ.get(k, 0)) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK")}
        return cls(env["RANK"], int(os.environ.get("WORLD_SIZE", 1)), env["LOCAL_RANK"], env["GROUP_RANK"])

    def share(self, lengths: Sequence[int]) -> range:
        """This rank's rows of the dataset: a contiguous run, cut so that every rank gets about as many tokens
        (compute goes by tokens). A row is the rank's whose slice of the job's tokens holds the row's first token;
        so a rank's shards hold a run of the dataset, and the shares of a job cover it once."""
        starts, total = [], 0
        for n in lengths:
            starts.append(total)
            total += n
        if self.world == 1 or total == 0:
            return range(len(starts)) if self.rank == 0 else range(0)

        # row i is rank floor(starts[i] * world / total)'s: rank r's first row has starts[i] >= ceil(r * total / world)
        def first_row(r: int) -> int:
            return bisect_left(starts, -(-r * total // self.world)) if r < self.world else len(starts)

        return range(first_row(self.rank), first_row(self.rank + 1))

    def add_up(self, tally: HiddenTally) -> HiddenTally:
        """Every rank's compute tally summed, its time the longest rank's: what rank 0's metrics report for the
        whole job (each rank's own tally counts its share alone). A collective: it returns once every rank has
        finished computing, so it is also the barrier before rank 0 writes the output."""
        if self.world == 1:
            return tally
        import torch
        import torch.distributed as dist

        counts = summed_fields(tally)
        sums = torch.tensor([float(getattr(tally, f)) for f in counts], dtype=torch.float64)
        longest = torch.tensor([tally.seconds], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        summed = {f: type(getattr(tally, f))(v) for f, v in zip(counts, sums.tolist())}
        return replace(tally, **summed, seconds=longest.item())


def summed_fields(tally: HiddenTally) -> list[str]:
    """Every count of the tally, taken from its fields rather than listed here, so that a count added to it is summed
    over the ranks without a second place to name it; `seconds` is the longest rank's. The output's own counts
    (samples, tokens, engines) are rank 0's, made after the sum: still 0 on every rank here."""
    numbers = (int, float)
    return [f.name for f in fields(tally) if f.name != "seconds" and isinstance(getattr(tally, f.name), numbers)]


def join_group(rank: Rank, gpu: bool) -> None:
    """The job's process group, over gloo (TCP) on GPU nodes too: its messages are small (counts, lists of keys) but
    for the shards gathered across nodes, which go through host memory anyway, and NCCL would open a CUDA context
    on each rank's GPU, memory that a vLLM engine started by that rank counts on. `gpu`: the rank computes on its
    node's GPU number LOCAL_RANK (the hf backend), made its current device."""
    import torch
    import torch.distributed as dist

    if gpu and torch.cuda.is_available():
        torch.cuda.set_device(rank.local)
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def leave_group() -> None:
    """Close the process group before the process exits. Left to interpreter exit, gloo's threads can be torn down
    while a peer's connection closes, and the process aborts (SIGABRT) after its work is done."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
