"""Per-sequence attention for the embedded backend's continuous batching.

transformers' continuous batching packs a step's sequences into one row and, with SDPA (the attention a CPU has),
runs one attention call under a block-diagonal mask: every query of the step against every key of every sequence
in it, where each sequence needs only its own. A step that prefills a chunk of long prompts beside the running
decodes then costs (tokens in the step) x (keys of the whole batch). On a GPU, flash-attention's varlen kernel
does the per-sequence work; on a CPU there is none, and this masked attention was most of the demo's generation
time on its longest prompts (docs/benchmarks.md). Here each sequence of such a step gets its own SDPA call, causal and
aligned to the end of its keys exactly as the block's mask is, so the result is the same attention.

Only the calls continuous batching makes with SDPA come here, and only steps with a prefill chunk: a step of
decodes alone keeps the one masked call, as fast there. Anything this does not know (a sliding window, attention
sinks, soft-capping, dropout, an unknown argument) goes to transformers' own function unchanged. The override is
installed while an embedded backend runs and removed when the last one closes.
"""

from __future__ import annotations

import threading

# the arguments continuous batching passes to the attention function (transformers 5.x) beside query/key/value/mask
_CB_KWARGS = frozenset(
    {
        "block_table",
        "cu_seq_lens_k",
        "cu_seq_lens_q",
        "is_causal",
        "logits_indices",
        "logits_processor_args",
        "max_length_k",
        "max_length_q",
        "position_ids",
        "read_index",
        "use_cache",
        "write_index",
    }
)

_lock = threading.Lock()
_users = 0


def varlen_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: query [1, H, Q, D], key/value [1, H_kv, K, D] packed by
    sequence (`cu_seq_lens_q`/`cu_seq_lens_k` the cumulative lengths); returns ([1, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _handles(module, query, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    import torch
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    outs = []
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        q, k, v = query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1]
        n_q, n_k = q1 - q0, k1 - k0
        if n_q == 0:
            continue
        # a query sees the keys up to its own position; its position is its offset from the end of the keys
        mask = None if n_q == 1 or n_q == n_k else causal_lower_right(n_q, n_k)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=n_q == n_k and n_q > 1, scale=scaling
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _handles(module, query, attention_mask, dropout: float, kwargs: dict) -> bool:
    """A continuous-batching call this computes exactly: packed sequences, a prefill chunk among them, plain causal
    full attention."""
    import torch

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    return (
        isinstance(cu_q, torch.Tensor)
        and isinstance(cu_k, torch.Tensor)
        and attention_mask is not None
        and query.shape[0] == 1
        and int(kwargs.get("max_length_q") or 1) > 1
        and dropout == 0.0
        and getattr(module, "sliding_window", None) is None
        and set(kwargs) <= _CB_KWARGS
        and len(cu_q) == len(cu_k)
        and int(cu_q[-1]) == query.shape[2]
    )


def install() -> bool:
    """Route SDPA through `varlen_sdpa` (for every model in this process: calls other than continuous batching's go
    straight on to transformers' function). False where this transformers has no such hook."""
    global _users
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    with _lock:
        _users += 1
        ALL_ATTENTION_FUNCTIONS["sdpa"] = varlen_sdpa
    return True


def uninstall() -> None:
    global _users
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with _lock:
        _users = max(0, _users - 1)
        if _users == 0 and "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]  # transformers' own again
