"""The target's final norm as data: pre-norm states plus these parameters give the post-norm ones exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FinalNorm:
    """The target's final norm, enough to turn a stored pre-norm state into the post-norm one exactly.

    kind `rms`: y = x / sqrt(mean(x²) + eps) * (weight_offset + weight) (Llama, Qwen, DeepSeek/Kimi: offset 0;
    Gemma, Qwen3-Next, Qwen3.5: offset 1); kind `layer`: LayerNorm with weight and bias. Computed in float32, as the
    models do."""

    kind: str
    eps: float
    weight: object  # torch.Tensor [H], float32
    bias: object | None = None
    weight_offset: float = 0.0

    def apply(self, x):
        import torch

        x = x.float()
        if self.kind == "rms":
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return y * (self.weight_offset + self.weight.float())
        y = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=self.eps)
        y = y * self.weight.float()
        return y + self.bias.float() if self.bias is not None else y

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "eps": self.eps,
            "weight_offset": self.weight_offset,
            "has_bias": self.bias is not None,
        }
