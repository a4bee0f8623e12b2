"""torchrun's ranks: which samples are this process's, the process group, and the whole job's tally.

Ranks take disjoint samples (by key) and share one state store; rank 0 writes the output once every rank has
finished. Without torchrun the process is rank 0 of 1 and none of this reaches torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from draftdata.hidden.tally import HiddenTally


@dataclass
class Rank:
    """This process's place in a torchrun job (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> Rank:
        return cls(
            int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
        )

    def owns(self, key: str) -> bool:
        return int(key[:8], 16) % self.world == self.rank

    def add_up(self, tally: HiddenTally) -> HiddenTally:
        """Every rank's compute tally summed, its time the longest rank's: what rank 0's metrics report for the
        whole job (each rank's own tally counts its share alone). A collective: it returns once every rank has
        finished computing, so it is also the barrier before rank 0 writes the output."""
        if self.world == 1:
            return tally
        import torch
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
        counts = summed_fields(tally)
        sums = torch.tensor([float(getattr(tally, f)) for f in counts], dtype=torch.float64, device=device)
        longest = torch.tensor([tally.seconds], dtype=torch.float64, device=device)
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


def join_group(rank: Rank) -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(rank.local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def leave_group() -> None:
    """Close the process group before the process exits. Left to interpreter exit, gloo's threads can be torn down
    while a peer's connection closes, and the process aborts (SIGABRT) after its work is done."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
