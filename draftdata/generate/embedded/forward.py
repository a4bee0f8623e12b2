"""A step's forward over the slot cache: the model's last hidden states, and its logits.

Two forwards with one interface (`hidden(ids, positions, cache)`, `logits(hidden)`), both on the model's own
weights in the engine's compute dtype:

- `LeanForward`, for Llama-family decoders (Llama, Qwen2): transformers' forward is the reference, but around each
  layer's few operations it runs a few hundred microseconds of Python (keyword plumbing, the attention-interface
  lookup, output recorders), and it projects q, k and v by three matmuls and gate and up by two; at a handful of
  requests in flight a decode step is mostly that (docs/benchmarks.md). This one runs the same arithmetic: q, k and
  v projected by one matmul over their weights laid side by side, gate and up likewise (the model's q/k/v and
  gate/up weights become views into those tensors, so nothing is held twice and the model's own forward, which the
  engine's probe compares against, still works), every matmul on weights packed once where that pays
  (`packed.py`), the model's own rotary embedding (any rope scaling it has), RMSNorm as transformers computes it (in
  float32, the weight applied in the compute dtype), and the cache's attention;
- `ModelForward`, for any other model: transformers' own forward, its attention our function (registered with
  transformers' AttentionInterface as `ATTN_NAME`), which hands each layer's keys and values to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftdata.generate.embedded.packed import PackedLinear, pack

SUPPORTED = ("llama", "qwen2")
ATTN_NAME = "draftdata_slots"
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks")


class Unsupported(RuntimeError):
    """The model's forward is not what slot batching computes."""


# ---- the model's own forward, with our attention ---------------------------------------------------------------- #


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)  # the cache makes each step's masks


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature; the step's `KVCache` arrives as `slot_cache`."""
    cache = kwargs.get("slot_cache")
    if cache is None:
        raise Unsupported("slot attention called outside a slot batch")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise Unsupported(f"the model's attention uses {name}")
    if dropout:
        raise Unsupported("attention dropout")
    return cache.attend(module.layer_idx, query, key, value, scaling), None


class ModelForward:
    """transformers' forward of `model`, whose attention implementation is `ATTN_NAME` while the engine runs."""

    def __init__(self, model):
        self.model = model

    def hidden(self, ids, positions, cache):
        out = self.model.base_model(input_ids=ids, position_ids=positions, use_cache=False, slot_cache=cache)
        return out.last_hidden_state

    def logits(self, hidden):
        return self.model.get_output_embeddings()(hidden)


# ---- the lean forward ----------------------------------------------------------------------------------------- #


@dataclass
class _Layer:
    norm_in: object
    qkv: PackedLinear
    o: PackedLinear
    norm_post: object
    gate_up: PackedLinear
    down: PackedLinear


def _fuse(linears) -> tuple:
    """One weight (and bias) for several linears fed the same input; each linear's own become views into it."""
    import torch

    weight = torch.cat([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    sizes = [lin.out_features for lin in linears]
    for lin, w, b in zip(linears, weight.split(sizes), bias.split(sizes) if bias is not None else [None] * len(sizes)):
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        if b is not None:
            lin.bias = torch.nn.Parameter(b, requires_grad=False)
    return weight, bias


class LeanForward:
    """The lean forward of a Llama-family model (see the module docstring); `unsupported_reason` says whether it is
    the model's."""

    def __init__(self, model, rows: int):
        """`rows`: the most rows a decode step multiplies (the engine's slots), up to which packing is timed."""
        config = model.config.get_text_config()
        base = model.base_model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.norm = base.norm.weight
        weights = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [
                _fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                (attn.o_proj.weight, attn.o_proj.bias),
                _fuse([mlp.gate_proj, mlp.up_proj]),
                (mlp.down_proj.weight, mlp.down_proj.bias),
            ]
        head = model.get_output_embeddings()
        *linears, self.head = pack(weights + [(head.weight, head.bias)], rows)
        self.layers = [
            _Layer(layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down)
            for layer, (qkv, o, gate_up, down) in zip(base.layers, zip(*[iter(linears)] * 4))
        ]

    @staticmethod
    def unsupported_reason(model) -> str | None:
        """Why this forward is not the model's (None: it is)."""
        config = model.config.get_text_config()
        if config.model_type not in SUPPORTED:
            return f"model type {config.model_type}"
        if getattr(config, "hidden_act", None) != "silu":
            return f"activation {config.hidden_act}"
        if getattr(config, "mlp_bias", False):
            return "biases in its MLP"
        # a window the probe's short sequences would not reach (Qwen2's use_sliding_window, per-layer types)
        if getattr(config, "use_sliding_window", False) or any(
            t != "full_attention" for t in getattr(config, "layer_types", None) or ()
        ):
            return "sliding-window attention"
        if getattr(config, "attention_bias", False) and config.model_type == "llama":
            o_bias = model.base_model.layers[0].self_attn.o_proj.bias
            if o_bias is not None:
                return "a bias on its output projection"
        return None

    def _rms(self, x, weight):
        import torch

        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def hidden(self, ids, positions, cache):
        import torch
        import torch.nn.functional as F

        batch, length = ids.shape
        heads, kv, dim = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [batch, length, 1, dim]: every head alike
        half = dim // 2
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(self._rms(x, layer.norm_in)).view(batch, length, -1, dim)
            qk, v = qkv[:, :, : heads + kv], qkv[:, :, heads + kv :]
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)  # transformers' rotate_half
            qk = qk * cos + rotated * sin
            q, k = qk[:, :, :heads], qk[:, :, heads:]
            out = cache.attend(i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scaling)
            x = x + layer.o(out.reshape(batch, length, heads * dim))
            gate, up = layer.gate_up(self._rms(x, layer.norm_post)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return self._rms(x, self.norm)

    def logits(self, hidden):
        return self.head(hidden)
