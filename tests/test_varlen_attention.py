"""The embedded backend's per-sequence attention: the same attention as continuous batching's block-diagonal mask
(built here by transformers' own mask builder), calls it does not know left to transformers, and greedy answers
from packed, chunked prefills equal the model's own one-prompt-at-a-time generation."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import target_for

from draftdata.config.schema import BackendConfig, BackendKind, Config, DatasetConfig, ModelConfig, SamplingConfig
from draftdata.generate.embedded import varlen_attention
from draftdata.generate.embedded.varlen_attention import varlen_sdpa

# (queries, keys) per sequence: a decode, a whole prompt, a later chunk of a prompt, a short decode, another prompt
SEQS = [(1, 37), (50, 50), (20, 70), (1, 5), (33, 33)]
HEADS, KV_HEADS, DIM = 4, 2, 16


class Attn(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def packed(seqs=SEQS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n_q, n_k = sum(q for q, _ in seqs), sum(k for _, k in seqs)
    q = torch.randn(1, HEADS, n_q, DIM, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, n_k, DIM, generator=gen) for _ in range(2))
    cu_q = torch.tensor([0] + [sum(s[0] for s in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(s[1] for s in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    kwargs = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max(s[0] for s in seqs), is_causal=False)
    return q, k, v, kwargs


def block_mask(kwargs) -> torch.Tensor:
    """The mask continuous batching gives SDPA, from transformers' own builder."""
    from transformers.generation.continuous_batching.utils import build_attention_mask

    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    mask = torch.full((1, 1, cu_q[-1], cu_k[-1]), torch.finfo(torch.float32).min)
    build_attention_mask(mask, cu_q, cu_k)
    return mask


def stock(q, k, v, mask, kwargs, module=None):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module or Attn(), q, k, v, mask, 0.0, DIM**-0.5, **kwargs)[0]


def test_per_sequence_attention_equals_the_block_diagonal_mask():
    q, k, v, kwargs = packed()
    expected = stock(q, k, v, block_mask(kwargs), kwargs)
    # the mask's content is not read: with a mask that hides nothing, the result is still the causal one
    got, _ = varlen_sdpa(Attn(), q, k, v, torch.zeros_like(block_mask(kwargs)), 0.0, DIM**-0.5, **kwargs)
    assert got.shape == expected.shape == (1, q.shape[2], HEADS, DIM)
    assert torch.allclose(got, expected, atol=1e-5)
    unmasked = stock(q, k, v, torch.zeros_like(block_mask(kwargs)), kwargs)
    assert not torch.allclose(unmasked, expected, atol=1e-3)  # the test can tell the two apart


@pytest.mark.parametrize(
    "case",
    ["decodes only", "sliding window", "attention sinks", "dropout", "no packing"],
)
def test_what_it_does_not_know_goes_to_transformers(case):
    seqs = [(1, 9), (1, 30)] if case == "decodes only" else SEQS
    q, k, v, kwargs = packed(seqs)
    module, dropout = Attn(), 0.0
    if case == "sliding window":
        module.sliding_window = 8
    elif case == "attention sinks":
        kwargs["s_aux"] = torch.zeros(HEADS)
    elif case == "dropout":
        dropout = 0.1
    elif case == "no packing":
        kwargs = {}
    zeros = torch.zeros(1, 1, q.shape[2], k.shape[2])  # a mask that hides nothing: only the stock call follows it
    torch.manual_seed(0)
    got, _ = varlen_sdpa(module, q, k, v, zeros, dropout, DIM**-0.5, **kwargs)
    torch.manual_seed(0)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    want = sdpa_attention_forward(module, q, k, v, zeros, dropout, DIM**-0.5, **kwargs)[0]
    assert torch.equal(got, want)


def test_installed_while_an_embedded_backend_runs_and_removed_after():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    stock_fn = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert varlen_attention.install() and varlen_attention.install()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is varlen_sdpa
    varlen_attention.uninstall()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is varlen_sdpa  # a second backend still runs
    varlen_attention.uninstall()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is stock_fn


@pytest.fixture(scope="module")
def sharp_model(tiny_model, tmp_path_factory):
    """The tiny target's shapes and tokenizer with weights at 10 times its initial scale, so that attention moves
    the answers (the tiny target's, built around a planted end-of-turn rate, follow the last token's embedding
    almost alone, and would hide a wrong attention). Named like it: start-up compares basenames."""
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig.from_pretrained(tiny_model)
    conf.initializer_range = 0.2
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("sharp") / Path(tiny_model).name
    LlamaForCausalLM(conf).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


@pytest.mark.parametrize("batching", ["transformers", "slots"])
def test_greedy_answers_from_packed_chunked_prefills_equal_one_prompt_generation(sharp_model, monkeypatch, batching):
    """Six prompts of different lengths at once, prefilled packed beside the others' decodes: each greedy answer
    equals `generate` on that prompt alone. transformers' continuous batching (a GPU's engine, run here on the CPU)
    prefills in chunks of 48 tokens, and the per-sequence path did its packed steps; slot batching (the CPU's) packs
    whole prompts up to 48 tokens a forward, through its own attention."""
    from draftdata.generate.embedded.loop import SlotBatching
    from draftdata.generate.run.connect import make_backend
    from draftdata.model.load import load_model
    from draftdata.model.tokenizer import end_of_turn_ids, load_tokenizer, render_prompt_ids

    calls = []
    handles = varlen_attention._handles
    monkeypatch.setattr(varlen_attention, "_handles", lambda *a: calls.append(handles(*a)) or calls[-1])
    ds = DatasetConfig(sampling=SamplingConfig(temperature=0.0, top_p=1.0, top_k=-1))
    cfg = Config(
        model=ModelConfig(path=str(sharp_model)),
        datasets={"d": ds},
        dataset="d",
        backend=BackendConfig(
            kind=BackendKind.embedded, embedded_batching=batching, max_batch_tokens=48, num_blocks=64
        ),
    )
    tok = load_tokenizer(cfg.model)
    prompts = [
        render_prompt_ids(tok, [{"role": "user", "content": "word " * n}], None, {}) for n in (3, 40, 9, 70, 1, 25)
    ]

    async def go():
        from draftdata.generate.backends.protocol import GenRequest

        backend = make_backend(cfg, target_for(cfg, tok))
        await backend.start()
        try:
            reqs = [GenRequest(f"r{i}", ids, None, None, 12, {}) for i, ids in enumerate(prompts)]
            return isinstance(backend.manager, SlotBatching), await asyncio.gather(*(backend.generate(r) for r in reqs))
        finally:
            await backend.close()

    slots, results = asyncio.run(asyncio.wait_for(go(), 120))
    assert slots == (batching == "slots")
    assert slots or any(calls), "no packed step took the per-sequence path"
    model, stop = load_model(cfg.model), sorted(end_of_turn_ids(tok, cfg.model))
    answers = [
        model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=stop) for ids in prompts
    ]
    assert [r.output_ids for r in results] == [a[0, len(ids) :].tolist() for a, ids in zip(answers, prompts)]
    assert len({tuple(r.output_ids) for r in results}) > 1  # the answers depend on the prompts
