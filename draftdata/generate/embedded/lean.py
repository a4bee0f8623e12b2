"""A lean forward for Llama-family decoders (Llama, Qwen2), for slot batching.

transformers' forward is the reference, but around each layer's few operations it runs a few hundred microseconds
of Python (keyword plumbing, the attention-interface lookup, output recorders), and it projects q, k and v by three
matmuls and gate and up by two. At a handful of requests in flight a decode step is mostly that: on
SmolLM2-135M-Instruct at 8 in flight, 51 ms a step of which about 17 ms ran outside any torch operation and a third
of the matmul time went to the smaller of those calls (docs/benchmarks.md).

This runs the same arithmetic on the model's own weights: q, k and v projected by one matmul over their weights laid
side by side, gate and up likewise (the model's q/k/v and gate/up weights become views into those tensors, so
nothing is held twice and the model's own forward, which `probe` compares against, still works), the model's own
rotary embedding (any rope scaling it has), RMSNorm as transformers computes it (in float32, the weight applied in
the model's dtype), and the cache's attention. A model it does not describe is left to transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftdata.generate.embedded.linear import _best, _ops

SUPPORTED = ("llama", "qwen2")


PACKED_ROWS = 128  # forwards of at most this many rows multiply on packed weights (where packing pays, `Packed`)


class Packed:
    """A weight for F.linear, and oneDNN's bf16 matmul on a copy of it packed once (`mkldnn::_reorder_linear_weight`,
    as torch's inductor packs them) for forwards of a few rows: F.linear's bf16 path repacks the weight on every
    call, which at decode's few rows costs more than the arithmetic (measured here on SmolLM2's shapes: 1.6x faster
    at 8 rows, 1.75x at 32). Forwards of more rows (prefills) use the weight as it is."""

    def __init__(self, weight, bias=None, rows: int = 0):
        self.weight, self.bias, self.packed = weight, bias, None
        self.out_features, self.in_features = weight.shape
        if rows and (ops := _ops()) is not None:
            reorder, self.pointwise = ops  # looked up once: __call__ is on every decode step's path
            try:
                self.packed = reorder(weight.detach(), rows)
            except RuntimeError:  # a CPU whose oneDNN has no bf16 path (no AVX-512BW nor AVX-NE-CONVERT): F.linear
                self.packed = None

    def __call__(self, x):
        import torch.nn.functional as F

        rows = x.numel() // self.in_features
        if self.packed is None or rows > PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = self.pointwise(x.reshape(rows, self.in_features), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def packing_pays(weights, rows: int) -> bool:
    """Whether `rows` rows through `weights` (a layer's, one after the other as a forward takes them) multiply
    faster on packed copies than by F.linear here: bf16 weights on a CPU with oneDNN's bf16 kernels."""
    import torch
    import torch.nn.functional as F

    if _ops() is None or weights[0].dtype != torch.bfloat16 or weights[0].device.type != "cpu":
        return False
    try:
        packed = [Packed(w, rows=rows) for w in weights]
        if any(p.packed is None for p in packed):
            return False
        xs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
        plain = _best(lambda: [F.linear(x, w) for x, w in zip(xs, weights)])
        fast = _best(lambda: [p(x) for x, p in zip(xs, packed)])
    except RuntimeError:  # this build's oneDNN refuses the dtype: F.linear it is
        return False
    return fast < 0.9 * plain


@dataclass
class _Layer:
    norm_in: object
    qkv: Packed
    o: Packed
    norm_post: object
    gate_up: Packed
    down: Packed


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


class LeanDecoder:
    """`forward(ids, positions, cache)`: the base model's last hidden state (after its final norm)."""

    def __init__(self, model, rows: int = 0):
        """`rows`: the forwards' usual rows (the engine's slots), to pack the weights for where packing pays (0:
        never)."""
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
        self.layers = []
        fused = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused.append((_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), _fuse([mlp.gate_proj, mlp.up_proj])[0]))
        first = base.layers[0]
        shapes = [fused[0][0][0], first.self_attn.o_proj.weight, fused[0][1], first.mlp.down_proj.weight]
        rows = rows if rows and packing_pays(shapes, rows) else 0
        for layer, ((qkv, qkv_bias), gate_up) in zip(base.layers, fused):
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight,
                    Packed(qkv, qkv_bias, rows),
                    Packed(layer.self_attn.o_proj.weight, rows=rows),
                    layer.post_attention_layernorm.weight,
                    Packed(gate_up, rows=rows),
                    Packed(layer.mlp.down_proj.weight, rows=rows),
                )
            )
        head = model.get_output_embeddings()
        self.head = Packed(head.weight, head.bias, rows)
        self.packed = bool(rows)

    @staticmethod
    def describes(model) -> str | None:
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

    def forward(self, ids, positions, cache):
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
