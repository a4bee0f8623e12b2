"""What an engine is (the protocol the compute loop drives) and where a model keeps its decoder."""

from __future__ import annotations

from typing import Protocol

from draftdata.errors import UserError
from draftdata.hidden.norm import FinalNorm


class Engine(Protocol):
    n_layers: int
    hidden_size: int
    final_norm: FinalNorm
    pad_tokens: int  # padded positions computed so far (0 for an engine that packs sequences)

    def forward(self, batch: list[list[int]]) -> list[tuple[object, object]]:
        """Per sample of `batch`, in order: (aux [T, k, H], final pre-norm [T, H]) on the CPU (float32 or the
        model's dtype)."""

    def close(self) -> None: ...


def find_decoder(model):
    """The text decoder (its `layers` and final `norm`) through the model's own accessors, so a multimodal wrapper
    (a vision tower around a language model, as Kimi-K2.5's) is handled like a plain causal LM: transformers' models
    name it with get_decoder(), vLLM's with get_language_model() or a `language_model` attribute."""
    holders = []
    if hasattr(model, "get_decoder"):
        holders.append(model.get_decoder())
    if hasattr(model, "get_language_model"):
        holders.append(model.get_language_model())
    holders += [getattr(model, "language_model", None), model]
    for holder in filter(None, holders):
        for candidate in (holder, getattr(holder, "model", None)):
            if candidate is not None and hasattr(candidate, "layers") and hasattr(candidate, "norm"):
                return candidate
    raise UserError(f"model.path: cannot find the decoder layers and final norm of {type(model).__name__}")
