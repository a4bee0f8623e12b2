"""What a hidden-states run counts: its output's samples and tokens, the samples it answered for and computed, and
the time its engine took. Under torchrun each rank counts its own share (`draftdata.hidden.ranks` sums them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HiddenTally:
    samples: int = 0  # in the output (rank 0's, as it writes the output)
    tokens: int = 0
    trained_tokens: int = 0  # under the loss mask
    owned: int = 0  # samples this rank answers for, found in the store or computed
    computed: int = 0
    computed_tokens: int = 0
    pad_tokens: int = 0  # padded positions the engine computed and dropped
    torn: int = 0  # torn shards forgotten (their samples computed again)
    gathered_shards: int = 0  # shards rank 0 received from other nodes' stores (local disks), and their bytes
    gathered_bytes: int = 0
    seconds: float = 0.0
    fp8_err_num: float = 0.0
    fp8_err_den: float = 0.0
    engines: dict = field(default_factory=dict)  # samples of the output by the engine that computed them
