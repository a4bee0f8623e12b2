"""Stage `tiny_model`: build the demo target model locally.

A random-weight Llama with a byte-level BPE tokenizer trained in seconds on the demo prompts, and a ChatML chat
template with tool support (Qwen2.5 style). Deterministic for a given seed, so `dvc repro` on two machines gives
the same tokenizer and weights. A real user points `model.path` at their own model instead.

The weights are random, but two are set by hand so the demo behaves like a real model in the ways the pipeline
cares about: one residual dimension is held constant (embedding column = 1, every layer's write to it = 0) and the
end-of-turn logit reads it, so responses end by themselves with a tunable mean length instead of always running
into max_tokens.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from pathlib import Path

from draftdata.config.schema import TinyModelConfig

# Tokens the ChatML template and the tool/think conventions need as single ids.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen2.5-style ChatML with tools: tool definitions in the system turn, calls as <tool_call> JSON, results as
# <tool_response> inside a user turn. `arguments` may be a JSON string (OpenAI) or a mapping.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a JSON object within <tool_call></tool_call> tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + args + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def iter_demo_texts(demo_dir: Path) -> Iterator[str]:
    """Every string value in the demo files: enough varied text to train a small BPE vocabulary."""
    for path in sorted(demo_dir.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                yield from _strings(json.loads(line))


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def train_bpe(texts: Iterator[str], vocab_size: int, special_tokens: list[str]):
    """Byte-level BPE (any text encodes, no unknown token), trained in seconds: a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(texts: Iterator[str], vocab_size: int):
    """`train_bpe` wrapped as a transformers fast tokenizer with the ChatML template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(texts, vocab_size, SPECIAL_TOKENS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=ADDED_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(cfg: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int, arch: str = "llama"):
    """The random model; `arch` qwen3 is the same sizes as a Qwen3 (the tests' target with an MTP head)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    config_cls, model_cls, own = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": cfg.hidden_size // cfg.num_heads}),
    }[arch]
    torch.manual_seed(cfg.seed)
    config = getattr(transformers, config_cls)(
        **own,
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 2,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=max(1, cfg.num_heads // 2),
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = getattr(transformers, model_cls)(config).eval()
    _plant_eos_rate(model, eos_id, cfg.mean_response_tokens)
    # top_k=0: no top-k cut by default (GenerationConfig's default is 50), so a server that takes its defaults
    # from this file (`transformers serve` accepts no top_k) samples like the embedded backend.
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, top_k=0)
    return model


def _plant_eos_rate(model, eos_id: int, mean_tokens: int) -> None:
    """Make P(end of turn) ≈ 1/mean_tokens at every step (see module docstring)."""
    import torch

    k = 0  # the residual dimension held constant
    inner = model.model
    with torch.no_grad():
        inner.embed_tokens.weight[:, k] = 1.0
        for layer in inner.layers:
            layer.self_attn.o_proj.weight[k, :] = 0.0
            layer.mlp.down_proj.weight[k, :] = 0.0
        # Measure the normalised value of dimension k on a forward pass, then set the eos row so that its logit
        # exceeds the (near-zero) others by log(V / (mean - 1)).
        ids = torch.arange(min(64, model.config.vocab_size)).unsqueeze(0)
        h = inner(input_ids=ids).last_hidden_state[0, :, k].mean().item()
        model.lm_head.weight[:, k] = 0.0
        target = math.log(model.config.vocab_size / max(1.0, mean_tokens - 1))
        model.lm_head.weight[eos_id, k] = target / h


def build_target(tm: TinyModelConfig):
    """The tokenizer trained on tm.corpus_dir and the model built for it, both saved under tm.path; the tokenizer."""
    out = Path(tm.path)
    tokenizer = build_tokenizer(iter_demo_texts(Path(tm.corpus_dir)), tm.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(tm, len(tokenizer), eos_id, pad_id)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return tokenizer
