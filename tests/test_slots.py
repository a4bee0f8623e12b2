"""Slot batching, the embedded backend's engine on a CPU (draftdata/generate/embedded/): its sampling against
transformers' own warpers, its cache's rows as requests come, grow and go, its tokens against the model's own, and
its refusal of a model it does not compute the same."""

from __future__ import annotations

import asyncio

import pytest
import torch

from draftdata.generate.embedded.cache import KVCache, capacity_for
from draftdata.generate.embedded.forward import LeanForward
from draftdata.generate.embedded.loop import SlotBatching
from draftdata.generate.embedded.sampling import Sampling, _candidates, sample


def hf_kept(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tokens transformers' own warpers keep (TopK, then TopP), as a boolean mask."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    out = scores
    if top_k > 0:
        out = TopKLogitsWarper(top_k)(None, out)
    if top_p < 1.0:
        out = TopPLogitsWarper(top_p)(None, out)
    return out > float("-inf")


@pytest.mark.parametrize("top_k, top_p", [(-1, 0.95), (-1, 0.5), (20, 1.0), (40, 0.9), (-1, 1.0)])
def test_the_cut_keeps_what_transformers_keeps(top_k, top_p):
    """Peaked rows (a real model's) are cut on the candidates; a flat row's cut lies beyond them and is sorted
    whole: either way the kept tokens are transformers'."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 5000, generator=gen)
    scores[:3, :7] += 12  # peaked: the mass is in a few tokens
    sampling = Sampling(1.0, top_p, top_k)
    vals, idx = _candidates(scores, 5000 if top_k <= 0 and top_p >= 1 else (top_k if top_k > 0 else 256), sampling)
    for row in range(6):
        want = hf_kept(scores[row : row + 1], top_k, top_p)[0]
        ours = torch.zeros_like(want)
        ours[idx[row][vals[row] > float("-inf")]] = True
        if top_k <= 0 and top_p < 1 and bool(vals[row, -1] > float("-inf")):
            continue  # beyond the candidates: sample() sorts this row whole (checked below)
        assert torch.equal(ours, want), row
    tokens = sample(scores, Sampling(1.0, top_p, top_k), [7] * 6, [100] * 6)
    kept = hf_kept(scores, top_k, top_p)
    assert all(bool(kept[row, t]) for row, t in enumerate(tokens))


def test_a_seeded_draw_depends_on_the_seed_and_position_only():
    scores = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    sampling = Sampling(0.8, 0.95, -1)
    a = sample(scores, sampling, [5, 5, 9], [10, 11, 10])
    b = sample(scores[[2, 0]], sampling, [9, 5], [10, 10])  # other batch-mates, another order
    assert (a[0], a[2]) == (b[1], b[0])
    draws = [sample(scores[:1], sampling, [5], [p])[0] for p in range(40)]
    assert len(set(draws)) > 1  # a position's draw is its own
    assert sample(scores, Sampling(0.0, 1.0, -1), [None] * 3, [0] * 3) == scores.argmax(-1).tolist()


def test_a_rounding_that_reorders_near_equal_candidates_leaves_the_draw_alone():
    """Noise keyed by token id, not by rank: scores moved by far less than bf16's rounding (which reorders the
    near-equal candidates of a flat distribution) draw the same tokens, position after position."""
    flat = torch.randn(64, 49_152, generator=torch.Generator().manual_seed(2)) * 0.05  # many near-ties
    nudged = flat + torch.randn(flat.shape, generator=torch.Generator().manual_seed(3)) * 1e-5
    sampling = Sampling(0.8, 0.95, -1)
    positions = list(range(64))
    assert (flat.topk(256).indices != nudged.topk(256).indices).any()  # the ranks did move
    assert sample(flat, sampling, [7] * 64, positions) == sample(nudged, sampling, [7] * 64, positions)


def test_sampling_follows_the_distribution():
    """Gumbel-max over the kept tokens draws each with its softmax probability (a 1,000-draw chi-square-ish check)."""
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    probs = torch.softmax(scores[0, :4], -1)
    counts = torch.zeros(5)
    for p in range(2000):
        counts[sample(scores, Sampling(1.0, 1.0, -1), [3], [p])[0]] += 1
    assert counts[4] == 0
    assert torch.allclose(counts[:4] / 2000, probs, atol=0.03)


def test_rows_grow_through_classes_and_keep_their_keys():
    """Keys written position by position stay where they were through a class change and another row's removal."""
    cache = KVCache(n_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, max_rows=4)
    for rid, n in (("a", 60), ("b", 10), ("c", 30)):
        cache.place(rid, n)
    assert {rid: cap for rid, (cap, _) in cache.where.items()} == {"a": 64, "b": 64, "c": 64}
    keys = {rid: [] for rid in "abc"}
    cache.begin_prefill([("a", 60), ("b", 10), ("c", 30)])
    q = torch.zeros(1, 1, 100, 2)
    k = torch.arange(100, dtype=torch.float32).repeat_interleave(2).view(1, 1, 100, 2)
    for layer in range(2):
        cache.attend(layer, q, k, k, 1.0)
    keys["a"], keys["b"], keys["c"] = list(range(60)), list(range(60, 70)), list(range(70, 100))
    for step in range(8):  # a outgrows 64 positions at its 5th step
        order = cache.begin_decode()
        new = torch.tensor([[[[1000.0 + 10 * step + i] * 2]] for i, _ in enumerate(order)]).view(len(order), 1, 1, 2)
        for layer in range(2):
            cache.attend(layer, torch.zeros(len(order), 1, 1, 2), new, new, 1.0)
        for i, rid in enumerate(order):
            keys[rid].append(1000.0 + 10 * step + i)
        if step == 3:
            cache.free("b")
            del keys["b"]
    assert cache.where["a"][0] == 128 and capacity_for(68) == 128
    for rid, want in keys.items():
        cap, row = cache.where[rid]
        cls = cache.classes[cap]
        got = cls.k[1][row, 0, : len(want), 0].tolist()
        assert got == want and cls.filled[row] == len(want), rid


def model_with(tmp_path, kind: str = "llama", **config):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    small = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if "sliding_window" in config:
        return MistralForCausalLM(MistralConfig(**small, **config)).eval()
    if kind == "qwen2":  # biases on q, k and v
        return Qwen2ForCausalLM(Qwen2Config(**small, **config)).eval()
    return LlamaForCausalLM(LlamaConfig(**small, **config)).eval()


def test_a_model_it_does_not_compute_the_same_is_refused_at_start(tmp_path):
    """A sliding window (Mistral's): the probe against the model's own forward refuses it before any request."""
    from draftdata.generate.embedded.loop import Unsupported

    engine = SlotBatching(lambda: model_with(tmp_path, sliding_window=4), Sampling(0.0, 1.0, -1), {1}, slots=2)
    engine.start()
    with pytest.raises(Unsupported, match="sliding_window"):
        engine.wait_ready()
    engine.stop()
    ok = SlotBatching(lambda: model_with(tmp_path), Sampling(0.0, 1.0, -1), {1}, slots=2)
    ok.start()
    ok.wait_ready()
    ok.stop()


def serve(engine: SlotBatching, prompts: list[list[int]], max_new: list[int]) -> list:
    """Start the engine, send each prompt at once (with its own max_new), wait for every final output, stop."""

    async def go():
        engine.start()
        await asyncio.to_thread(engine.wait_ready)
        loop = asyncio.get_running_loop()
        futures = []
        for i, (ids, n) in enumerate(zip(prompts, max_new)):
            f = loop.create_future()
            engine.register_result_handler(f"r{i}", lambda o, f=f: f.set_result(o) if o.is_finished() else None)
            engine.add_request(ids, f"r{i}", n)
            futures.append(f)
        out = await asyncio.gather(*futures)
        engine.stop()
        return out

    return asyncio.run(go())


def assert_the_models_greedy_tokens(model, prompts: list[list[int]], results: list) -> None:
    """Each result's tokens are the model's own greedy ones, from its plain forward token by token."""
    for ids, res in zip(prompts, results):
        assert res.error is None
        seq = list(ids)
        with torch.inference_mode():
            for _ in res.generated_tokens:
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert res.generated_tokens == seq[len(ids) :]


@pytest.mark.parametrize(
    "kind, config, lean",
    [("llama", {}, True), ("qwen2", {}, True), ("llama", {"mlp_bias": True}, False)],
    ids=["llama-lean", "qwen2-lean", "mlp-bias-transformers-forward"],
)
def test_greedy_tokens_are_the_models_own_through_joins_and_leaves(tmp_path, kind, config, lean):
    """Requests of other lengths joining and leaving a running batch (slots 3, 7 requests): each one's greedy
    tokens are its own, as the model's plain forward gives them token by token (float32: exact); through the lean
    forward where it describes the model (Llama, Qwen2's q/k/v biases), through transformers' own where it does not
    (biases in the MLP)."""
    model = model_with(tmp_path, kind, **config)
    prompts = [[(5 * i + 7 * j) % 60 + 2 for j in range(n)] for i, n in enumerate((3, 70, 9, 130, 5, 40, 66))]
    engine = SlotBatching(lambda: model, Sampling(0.0, 1.0, -1), set(), slots=3, prefill_tokens=100)
    results = serve(engine, prompts, [12 + i for i in range(len(prompts))])
    assert isinstance(engine.forward, LeanForward) is lean
    if lean:  # q, k and v are views into the one fused weight: nothing held twice
        attn = model.model.layers[1].self_attn
        fused = engine.forward.layers[1].qkv.weight
        assert attn.k_proj.weight.data_ptr() == fused[attn.q_proj.out_features :].data_ptr()
    assert_the_models_greedy_tokens(model, prompts, results)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_prompt_sharing_a_prefix_with_a_request_in_flight_takes_its_keys_and_gives_the_models_tokens(
    tmp_path, monkeypatch, kind
):
    """Prompts that begin alike (one system prompt, then their own turns), sent while others decode: each takes the
    shared prefix's keys and values from a request in flight (a donor mid-answer included: its cached tokens are
    prompt and answer) and computes the rest, and its greedy tokens are the model's own (float32: exact)."""
    from draftdata.generate.embedded import loop
    from draftdata.generate.embedded.cache import KVCache

    model = model_with(tmp_path, kind)
    system = [(3 * j + 1) % 60 + 2 for j in range(40)]
    prompts = [system + [(5 * i + 7 * j) % 60 + 2 for j in range(n)] for i, n in enumerate((5, 30, 1, 12, 50))]
    prompts.insert(1, prompts[0] + [9, 9, 9])  # extends the first one's prompt (in flight still): shares all of it
    shared, share = [], KVCache.share
    monkeypatch.setattr(KVCache, "share", lambda self, src, dst, n: shared.append(n) or share(self, src, dst, n))
    engine = SlotBatching(lambda: model, Sampling(0.0, 1.0, -1), set(), slots=3, prefill_tokens=60)
    results = serve(engine, prompts, [40] + [10] * (len(prompts) - 1))
    assert len(shared) >= 3 and min(shared) >= loop.MIN_SHARED and max(shared) > len(system)
    assert_the_models_greedy_tokens(model, prompts, results)


def test_a_lean_forward_the_probe_refuses_leaves_the_model_to_its_own(tmp_path, monkeypatch):
    """Should the lean forward ever compute a model differently (a fault injected here: its hidden states scaled),
    the probe sees it and the engine runs transformers' forward over the same cache instead, which the probe then
    checks in turn."""
    real = LeanForward.hidden
    monkeypatch.setattr(LeanForward, "hidden", lambda self, *a: real(self, *a) * 1.5)
    engine = SlotBatching(lambda: model_with(tmp_path), Sampling(0.0, 1.0, -1), {1}, slots=2)
    engine.start()
    engine.wait_ready()
    engine.stop()
    assert engine.forward is not None and not isinstance(engine.forward, LeanForward)
    assert engine.probe() < 1e-4


def test_the_lean_forward_leaves_a_sliding_window_to_the_models_own(tmp_path):
    """A window wider than the probe's sequences would pass the probe unseen: the lean forward declines it by its
    config, so the model's own forward (which hands the window to the slot attention, refused there) decides."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = Qwen2Config(
        **small, num_key_value_heads=2, use_sliding_window=True, sliding_window=200, max_window_layers=0
    )
    windowed = Qwen2ForCausalLM(config).eval()
    assert "sliding" in LeanForward.unsupported_reason(windowed)
    assert LeanForward.unsupported_reason(model_with(tmp_path, "qwen2")) is None


def test_rows_past_the_candidates_draw_as_over_the_whole_vocabulary(monkeypatch):
    """Rows whose top-p cut lies past the first candidates (flatter ones, one of them flat enough to pass the wider
    ones too) draw the token a whole-row sort draws, seed by seed."""
    from draftdata.generate.embedded import sampling as sm

    torch.manual_seed(0)
    logits = torch.randn(6, 20000) * torch.tensor([[8.0], [3.0], [1.0], [0.5], [0.05], [2.0]])
    seeds, positions = [11, 12, 13, 14, 15, None], [5, 6, 7, 8, 9, 10]
    s = Sampling(0.8, 0.95, -1)
    got = sample(logits, s, seeds, positions)
    monkeypatch.setattr(sm, "WIDER", 10**9)  # every such row sorted whole
    want = sample(logits, s, seeds, positions)
    assert got[:5] == want[:5]
    vals, _ = sm._candidates(logits / 0.8, sm.TOP_CANDIDATES, s)
    assert (vals[:5, -1] > float("-inf")).sum() >= 3  # the case is the one claimed: rows past the first cut
