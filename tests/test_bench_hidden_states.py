"""The hidden-states bench's FLOP count and its fit to a real target's depth (pure arithmetic, no model run)."""

from __future__ import annotations

import argparse

import pytest

from bench import hidden_states as hb

TINY = {
    "hidden_size": 2,
    "num_attention_heads": 1,
    "head_dim": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 3,
    "vocab_size": 5,
    "num_hidden_layers": 1,
}


def test_flops_count_padded_tokens_causal_attention_and_the_lm_head():
    # one batch of lengths 2 and 1: width 2, 4 padded tokens, 3 real
    # matrices a padded token: 2 * (q 2x2 + k, v 2 * 2x2 + o 2x2 + MLP 3 * 2x3) = 68; attention: 2 rows * 2 * 2^2 * 2
    got = hb.flops_per_token(TINY, [[2, 1]], lm_head=True)
    assert got == pytest.approx({"layers": (4 * 68 + 32) / 3, "lm_head": 4 * 2 * 2 * 5 / 3})
    assert hb.flops_per_token(TINY, [[2, 1]], lm_head=False)["lm_head"] == 0


def llama8b(layers: int) -> dict:
    args = hb.parse_args([])
    return hb.model_config(argparse.Namespace(**{**vars(args), **hb.LLAMA_8B, "layers": layers}))


def test_few_layers_inflate_the_lm_heads_share():
    """The review's point: at 2 layers the LM head is most of naive's work, at an 8B target's 32 under a tenth."""
    lens = hb.lengths(8, 0, hb.MEAN_LEN, hb.MAX_LEN)
    cut = argparse.Namespace(rounds=2, batch_tokens=4096, naive_batch=1)
    shares = {n: hb.flop_shares(llama8b(n), lens, cut)["lm_head_share_of_naive"] for n in (2, 4, 32)}
    assert shares[2] > 0.5 and shares[2] > shares[4] > shares[32]
    assert 0.05 < shares[32] < 0.1
    assert llama8b(32)["head_dim"] == 128 and llama8b(32)["num_key_value_heads"] == 8


def test_the_fit_reads_each_paths_line_at_the_real_depth():
    ours, naive = (0.01, 0.002), (0.05, 0.0021)  # (fixed, per layer) seconds a token
    depths = {d: {"s": {"ours": ours[0] + ours[1] * d, "naive": naive[0] + naive[1] * d}} for d in (2, 4)}
    got = hb.extrapolate(depths, "s")
    assert got["fit"]["naive"] == pytest.approx({"fixed": 0.05, "per_layer": 0.0021})
    at = {k: f[0] + f[1] * hb.LLAMA_8B_LAYERS for k, f in (("ours", ours), ("naive", naive))}
    assert got["ratio"] == round(at["naive"] / at["ours"], 3)
    assert got["ratio"] < depths[2]["s"]["naive"] / depths[2]["s"]["ours"]  # a shallow model flatters ours


def test_implied_rates_agree_when_times_follow_the_flops():
    """Times made of FLOPs at one rate give that rate back for every fitted term."""
    lens = hb.lengths(8, 0, hb.MEAN_LEN, hb.MAX_LEN)
    cut = argparse.Namespace(rounds=2, batch_tokens=4096, naive_batch=1)
    rate = 200e9
    depths = {}
    for d in (2, 4):
        flops = hb.flop_shares(llama8b(d), lens, cut)
        depths[d] = {"flops": flops, "s": {k: v * 1e9 / rate for k, v in flops["gflop_per_token"].items()}}
    rates = hb.implied_rates(depths, hb.extrapolate(depths, "s")["fit"])
    assert rates == pytest.approx({"ours_layer": 200, "naive_layer": 200, "lm_head": 200}, rel=2e-3)
