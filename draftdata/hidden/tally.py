"""What a hidden-states run counts: its output's samples and tokens, the samples it answered for and computed, and
the time its engine took. Under torchrun each rank counts its own share (`draftdata.hidden.ranks` sums them)."""

from __future__ import annotations

from collections import Counter
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


@dataclass
class ExportTally:
    """What an export counts (draftdata/hidden/export.py): its samples and tokens, and the loss-masked token counts
    the trainers build their draft vocabulary from."""

    samples: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    token_freq: Counter = field(default_factory=Counter)
    first_seen: dict = field(default_factory=dict)  # token -> where SpecForge's count first meets it (vocab.py)
    skipped: Counter = field(default_factory=Counter)  # samples the family cannot train on, by reason


def count(input_ids, loss_mask, tally: ExportTally, order) -> None:
    """Tokens, and the loss-masked token frequencies both trainers build their draft vocabulary from; `order`: where
    SpecForge's own count meets this sample (its ties at the vocabulary's cut go to the token met first)."""
    trained = input_ids[loss_mask.bool()]
    ids, counts = trained.unique(return_counts=True)
    tally.token_freq.update(dict(zip(ids.tolist(), counts.tolist())))
    for t in ids.tolist():
        if t not in tally.first_seen or order < tally.first_seen[t]:
            tally.first_seen[t] = order
    tally.samples += 1
    tally.tokens += int(input_ids.shape[0])
    tally.trained_tokens += int(trained.shape[0])
