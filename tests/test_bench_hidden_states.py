"""The hidden-states bench's FLOP count and its fit to a real target's depth (pure arithmetic, no model run)."""

from __future__ import annotations

import argparse
import time

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


def rnd(seconds: float, padded: int, split: dict | None = None, cpu: float | None = None) -> dict:
    return {"seconds": seconds, "cpu_seconds": cpu or seconds, "tokens": 100, "padded": padded, "split": split or {}}


def test_capture_vs_forward_is_the_median_of_paired_rounds_and_the_split_accounts_for_every_second():
    ours = [rnd(10.0, 5, {"decoder": 9.0, "writes": 0.5}), rnd(8.0, 3, {"decoder": 7.0, "writes": 0.4}), rnd(12.0, 0)]
    forward = [rnd(9.0, 5), rnd(7.8, 3), rnd(9.0, 0)]
    got = hb.capture_figures(ours, forward)
    assert got["capture_vs_forward_per_round"] == [0.9, 0.975, 0.75]
    assert got["capture_vs_forward"] == 0.9 and got["same_batches"]
    assert got["capture_vs_forward_all_rounds"] == round(25.8 / 30.0, 3)
    split = got["time_split"]
    assert split["seconds"] == pytest.approx({"decoder": 16.0, "writes": 0.9, "other": 13.1})
    assert split["decoder_vs_plain_forward"] == round(16.0 / 25.8, 3)
    assert not hb.capture_figures(ours, [rnd(9.0, 6), *forward[1:]])["same_batches"]


def test_steps_on_the_writer_thread_are_listed_but_not_subtracted():
    ours = [rnd(10.0, 0, {"decoder": 9.0, "writes": 3.0, "waiting for the writer": 0.2})]
    split = hb.time_split(ours, [rnd(9.0, 0)], overlapped=("writes",))
    assert split["seconds"]["other"] == pytest.approx(0.8) and split["seconds"]["writes"] == 3.0


def ours_computer(engine, root):
    """The stage's Computer on `engine`, writing in line (as on a CPU) into a fresh store at `root`."""
    from draftdata.hidden.compute import Computer
    from draftdata.hidden.state_store import StateStore
    from draftdata.hidden.tally import HiddenTally

    engine, store = hb.Started(engine), StateStore(root)
    return Computer(engine, store, {"v": 1}, "bfloat16", 64, 1 << 20, HiddenTally(), background_writes=False)


SAMPLES = [[(7 * i + j) % 50 + 1 for j in range(n)] for i, n in enumerate([30, 5, 31, 12, 29, 6, 12, 64])]


def test_the_plain_forward_runs_the_stages_batches_through_the_same_decoder(tiny_model, tmp_path):
    """The floor is fair: the same padded shapes reach the decoder in the stage's Computer and in plain_forward, and
    the plain forward captures, copies and writes nothing. The split, measured from outside the stage's code, sees
    each step the stage takes, and leaves the stage's code as it found it."""
    import torch

    from draftdata.config.schema import ModelConfig
    from draftdata.hidden import compute
    from draftdata.hidden.engines.hf import HFEngine

    shapes: dict = {"ours": [], "plain": []}
    engines = {k: HFEngine(ModelConfig(path=str(tiny_model)), [1, 3, 4]) for k in shapes}
    for k, e in engines.items():
        e.decoder.register_forward_pre_hook(
            lambda _m, _a, kw, k=k: shapes[k].append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
    check = compute.check
    split = hb.Split()
    split.instrument(engines["ours"])
    computer = ours_computer(engines["ours"], tmp_path / "store")
    t0 = time.perf_counter()
    computer.run([(str(i), ids) for i, ids in enumerate(SAMPLES)])
    computer.close()
    wall = time.perf_counter() - t0
    split.restore()
    got = hb.plain_forward(engines["plain"], hb.stage_batches(SAMPLES, 64))
    assert shapes["plain"] == shapes["ours"] and len(shapes["ours"]) > 2
    assert got["padded"] == engines["ours"].pad_tokens > 0 and got["tokens"] == sum(map(len, SAMPLES))
    assert engines["plain"].pad_tokens == 0 and not engines["plain"]._out  # nothing kept or counted
    steps = split.snapshot()
    assert {"padding", "decoder", "copies to host", "checks", "shard packing", "writes", "state store"} <= set(steps)
    assert all(v > 0 for v in steps.values())
    assert sum(steps.values()) <= wall  # each second in one step: a step's time leaves out the steps inside it
    assert compute.check is check and "forward" not in vars(engines["ours"])  # restored
    # the engine's forward is whole after a prefill: the same states as one that never ran plain
    batch = [[5, 6, 7, 8], [9, 10]]
    for (a, f), (b, g) in zip(engines["plain"].forward(batch), engines["ours"].forward(batch)):
        assert torch.equal(a, b) and torch.equal(f, g)


class Listed(hb.Split):
    """A split that also lists the steps entered, in order."""

    def __init__(self):
        super().__init__()
        self.entered: list = []

    def enter(self, step: str) -> None:
        self.entered.append(step)
        super().enter(step)


def test_the_paired_prefill_runs_each_batch_beside_its_capture_and_leaves_the_captures_counts_alone(
    tiny_model, tmp_path
):
    """Paired: the stage's Computer on a Paired engine runs every batch twice, the plain prefill before the capture
    in one batch and after it in the next; the prefill's tokens, pads and time are handed over apart, and the
    engine's pad count and the split keep the capture's alone (as a Computer on the bare engine has them)."""
    from draftdata.config.schema import ModelConfig
    from draftdata.hidden.engines.hf import HFEngine

    calls: list = []
    engines = {k: HFEngine(ModelConfig(path=str(tiny_model)), [1, 3, 4]) for k in ("paired", "bare")}
    paired = hb.Paired(engines["paired"])
    split = Listed()
    split.time_engine(engines["paired"])  # the engine's steps alone: the stage's are timed in the test above
    capturing = engines["paired"].decoder.layers[1]._forward_hooks  # the engine's hooks, on only in its forward
    engines["paired"].decoder.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append((bool(capturing), tuple(kw["input_ids"].shape))), with_kwargs=True
    )
    for name, engine in (("paired", paired), ("bare", engines["bare"])):
        computer = ours_computer(engine, tmp_path / name)
        computer.run([(str(i), ids) for i, ids in enumerate(SAMPLES)])
        computer.close()
    split.restore()
    n = len(calls) // 2
    assert n > 2 and [c[1] for c in calls[0::2]] == [c[1] for c in calls[1::2]]  # each batch twice, same shape
    # prefill (capture off) first in even batches, second in odd ones
    assert [c[0] for c in calls] == [x for i in range(n) for x in ((False, True) if i % 2 == 0 else (True, False))]
    plain = paired.take()
    assert plain["tokens"] == sum(map(len, SAMPLES)) and plain["padded"] == engines["bare"].pad_tokens > 0
    assert plain["seconds"] > 0 and paired.take()["seconds"] == 0  # taken once
    assert engines["paired"].pad_tokens == engines["bare"].pad_tokens
    assert split.entered == ["padding", "decoder"] * n  # the captures timed, not the prefills
    assert set(split.snapshot()) == {"padding", "decoder", "copies to host"}


def test_device_cuda_without_a_gpu_fails_in_one_line(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        hb.main(["--device", "cuda", "--quick"])
    assert str(e.value) == hb.NO_GPU
    assert "\n" not in str(e.value)
