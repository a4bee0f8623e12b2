"""The tokenize benchmark measures drift where it can occur (ids from a generation, stored as text, re-encoded), the
id path gives back the generated ids whole, and Qwen3's thinking template with tools goes through the text path."""

from __future__ import annotations

import pytest

from bench import tokenize as bench
from draftdata.config.schema import Config, ModelConfig, TokenizeConfig
from draftdata.model.tokenizer import end_of_turn_ids, load_tokenizer


@pytest.fixture
def tok(tiny_model):
    return load_tokenizer(ModelConfig(path=str(tiny_model)))


@pytest.fixture
def cfg(tiny_model):
    return Config(model=ModelConfig(path=str(tiny_model)), tokenize=TokenizeConfig(max_seq_len=1 << 20))


def same_length_resplit(tok) -> tuple[list[int], list[int]]:
    """Two tokens whose text the tokenizer encodes as two other tokens: a re-encoding of the same length."""
    vocab = [t for t in tok.get_vocab() if t.isascii() and t.isalpha()][:300]
    for a in vocab:
        for b in vocab:
            pair = tok.convert_tokens_to_ids([a, b])
            canonical = tok.encode(a + b, add_special_tokens=False)
            if len(canonical) == 2 and canonical != pair:
                return pair, canonical
    pytest.fail("no pair of tokens re-encodes to another pair")


def test_drift_counts_generated_ids_that_do_not_round_trip(tok, cfg):
    word = max((t for t in tok.get_vocab() if t.isascii() and t.isalpha() and t.islower()), key=len)  # one token
    letters = tok.convert_tokens_to_ids(list(word))  # the model emitted it letter by letter
    resplit, _ = same_length_resplit(tok)
    eos = tok.eos_token_id
    generated = [
        letters + [eos],
        tok.encode(word, add_special_tokens=False) + [eos],  # what the tokenizer itself would give
        resplit + [eos],
        tok.encode(" and so on", add_special_tokens=False),  # cut by max_tokens: no end of turn
    ]
    recs = bench.short_prompts(tok, len(generated), seed=0)
    d = bench.drift(tok, cfg, recs, generated)
    assert d["text_path_samples"] == 4 and d["id_path_samples"] == 4 and d["id_path_exact"]
    assert d["samples_differ_pct"] == 50.0  # the spelled word and the re-split pair
    assert d["stage_drift_pct"] == 25.0  # the stage counts length changes only: the re-split pair is not seen
    unmatched = len(letters) + 2  # all the letters, both tokens of the pair
    assert d["tokens_differ_pct"] == round(100.0 * unmatched / sum(map(len, generated)), 2)
    assert d["prompts_differ"] == 0 and d["ended_pct"] == 75.0


def test_samplers_draw_seeded_ids_that_end_their_turn_or_reach_the_cap(tok, monkeypatch):
    monkeypatch.setattr(bench, "MAX_NEW_TOKENS", 12)
    ends = end_of_turn_ids(tok, None, {})
    prompts = [r["prompt_ids"] for r in bench.short_prompts(tok, 3, seed=0)]
    for draw in (
        lambda seed: bench.sample_tiny_model(tok, prompts, ends, seed, batch=2),
        lambda seed: bench.sample_bigram(tok, 3, ends, seed),
    ):
        out = draw(0)
        assert len(out) == 3 and out == draw(0) and out != draw(1)
        for ids in out:
            assert 0 < len(ids) <= 12 and (ids[-1] in ends or len(ids) == 12)
            assert not any(t in ends for t in ids[:-1])


def test_qwen3_tool_conversations_go_through_both_paths(tiny_model):
    model = ModelConfig(path=str(tiny_model), chat_template=str(bench.QWEN3_TEMPLATE))
    tok = load_tokenizer(model)
    recs = bench.qwen3_records(tok, 6, seed=0)
    r = bench.time_paths(tok, Config(model=model, tokenize=TokenizeConfig(max_seq_len=1 << 20)), recs)
    assert r["samples"] == 6  # none skipped: the template is prefix-stable for these conversations
    prompt = tok.apply_chat_template(recs[0]["messages"], tools=recs[0]["tools"], tokenize=False)
    assert "<tools>" in prompt and "<tool_call>" in prompt and "<tool_response>" in prompt and "<think>" in prompt
    assert all(r["text"].startswith("<think>\n") for r in recs)
