"""What an engine is: the protocol the compute loop drives."""

from __future__ import annotations

from typing import Protocol

from draftdata.hidden.norm import FinalNorm


class Engine(Protocol):
    n_layers: int
    hidden_size: int
    final_norm: FinalNorm
    pad_tokens: int  # padded positions computed so far (0 for an engine that packs sequences)

    def forward(self, batch: list[list[int]]) -> list[tuple[object, object]]:
        """Per sample of `batch`, in order: (aux [T, k, H], final pre-norm [T, H]) on the CPU (float32 or the
        model's dtype), and, where the engine keeps the policy, its (tokens [T, k], log-probs [T, k]) third."""

    def close(self) -> None: ...
