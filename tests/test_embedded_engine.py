"""The embedded engine's edges: a model it cannot set up (falls back, or one clear error), faults and stops that
must end every request with a result or an error (never a wait forever), and its arithmetic in the compute dtype
whatever the number of rows (packed weights, decode attention)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from conftest import target_for

from draftdata.config.schema import BackendConfig, BackendKind, Config, DatasetConfig, ModelConfig, SamplingConfig
from draftdata.errors import ConfigError
from draftdata.generate.backends.protocol import GenRequest
from draftdata.generate.embedded import attention
from draftdata.generate.embedded.cache import KVCache
from draftdata.generate.embedded.loop import STOPPED, SlotBatching
from draftdata.generate.embedded.packed import PackedLinear, crossover, pack, row_counts
from draftdata.generate.embedded.sampling import Sampling
from draftdata.generate.run.connect import make_backend
from draftdata.model.tokenizer import load_tokenizer, render_prompt_ids

GREEDY = Sampling(0.0, 1.0, -1)
WAIT_S = 60  # a request that never ends fails the test here rather than hanging it


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return LlamaForCausalLM(LlamaConfig(**small, num_key_value_heads=2, max_position_embeddings=512)).eval()


def config(model_dir, batching: str = "auto") -> Config:
    return Config(
        model=ModelConfig(path=str(model_dir)),
        datasets={"d": DatasetConfig(token_budget=1, max_tokens=8, sampling=SamplingConfig(temperature=0.0))},
        dataset="d",
        backend=BackendConfig(kind=BackendKind.embedded, embedded_batching=batching),
    )


# ---- a model slot batching cannot set up ---------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def gpt2_model(tiny_model, tmp_path_factory):
    """A real tiny GPT-2 (its config has n_head, n_embd, ... and none of Llama's num_key_value_heads), with the tiny
    target's tokenizer and chat template."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    conf = GPT2Config(vocab_size=len(tok), n_positions=512, n_embd=32, n_layer=2, n_head=4)
    conf.eos_token_id = tok.eos_token_id
    out = tmp_path_factory.mktemp("gpt2") / "gpt2-tiny"
    GPT2LMHeadModel(conf).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def generate_once(cfg, tok, request, after_start=lambda: None):
    """The backend the config builds, started, one request sent (`after_start` runs between), closed; the backend
    and the request's result."""

    async def go():
        backend = make_backend(cfg, target_for(cfg, tok))
        await backend.start()
        try:
            after_start()
            return backend, await asyncio.wait_for(backend.generate(request), 300)
        finally:
            await backend.close()

    return asyncio.run(go())


def test_a_model_without_llamas_config_fields_falls_back_under_auto(gpt2_model, capsys):
    """auto: slot batching cannot set it up (no num_key_value_heads); the backend says so in one line and serves the
    request by transformers' continuous batching, where it used to die with the AttributeError."""
    cfg = config(gpt2_model, "auto")
    tok = load_tokenizer(cfg.model)
    prompt = render_prompt_ids(tok, [{"role": "user", "content": "Hello there"}], None, {})

    backend, res = generate_once(cfg, tok, GenRequest("r0", prompt, [], None, 8, {"temperature": 0.0}))
    manager = type(backend.manager).__name__
    assert manager != "SlotBatching"
    assert res.error is None and 1 <= res.completion_tokens <= 8, res.detail
    lines = [x for x in capsys.readouterr().out.splitlines() if "batching=transformers" in x]
    assert len(lines) == 1 and "num_key_value_heads" in lines[0], lines


def test_a_model_without_llamas_config_fields_is_a_config_error_under_slots(gpt2_model):
    cfg = config(gpt2_model, "slots")

    async def go():
        backend = make_backend(cfg, target_for(cfg))
        try:
            await backend.start()
        finally:
            await backend.close()

    with pytest.raises(ConfigError) as err:
        asyncio.run(asyncio.wait_for(go(), 300))
    assert err.value.key == "backend.embedded_batching" and "num_key_value_heads" in str(err.value)


def test_slots_on_a_machine_with_a_gpu_runs_on_its_cpu(tiny_model, monkeypatch):
    """`slots` where torch sees a GPU: the engine loads the target on the CPU and serves (where it used to refuse), its
    dtype resolved by the CPU's rule; auto and transformers there would compute on the GPU."""
    from draftdata.model.compute import embedded_on_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert embedded_on_gpu(config(tiny_model, "auto")) and embedded_on_gpu(config(tiny_model, "transformers"))
    cfg = config(tiny_model, "slots")
    assert not embedded_on_gpu(cfg)
    tok = load_tokenizer(cfg.model)
    prompt = render_prompt_ids(tok, [{"role": "user", "content": "Hello there"}], None, {})

    async def go():
        backend = make_backend(cfg, target_for(cfg, tok))
        await backend.start()
        try:
            device = next(backend.manager.model.parameters()).device.type
            return type(backend.manager).__name__, device, await asyncio.wait_for(backend.generate(request), 300)
        finally:
            await backend.close()

    request = GenRequest("r0", prompt, [], None, 8, {"temperature": 0.0})
    engine, device, res = asyncio.run(go())
    assert (engine, device) == ("SlotBatching", "cpu")
    assert res.error is None and 1 <= res.completion_tokens <= 8, res.detail


def test_a_model_load_error_is_the_loaders_own(tmp_path):
    """A load failure is not a model slot batching cannot run: it reaches the caller as the loader raised it."""
    engine = SlotBatching(lambda: (_ for _ in ()).throw(ConfigError("model.path", "gone")), GREEDY, set(), slots=2)
    engine.start()
    with pytest.raises(ConfigError, match="model.path: gone"):
        engine.wait_ready()
    engine.stop()


# ---- every request ends ----------------------------------------------------------------------------------------- #


async def _submit(engine: SlotBatching, prompts: list[list[int]], max_new: int = 10_000) -> list:
    """Each prompt as a request; the futures of their final outputs."""
    loop = asyncio.get_running_loop()
    futures = []
    for i, ids in enumerate(prompts):
        f = loop.create_future()
        engine.register_result_handler(f"r{i}", lambda o, f=f: f.set_result(o) if o.is_finished() else None)
        engine.add_request(ids, f"r{i}", max_new)
        futures.append(f)
    return futures


PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]


def test_a_fault_in_prefill_ends_every_request_with_an_error(monkeypatch):
    """`cache.place` raising for the second request of a prefill: the requests already taken from the waiting list
    (placed or not) end with the error, as the one placed did; none is left waiting forever."""
    engine = SlotBatching(tiny_llama, GREEDY, set(), slots=4, prefill_tokens=1000)
    engine.start()
    engine.wait_ready()
    calls, place = [], KVCache.place

    def faulty(self, rid, length):
        calls.append(rid)
        if len(calls) == 2:
            raise RuntimeError("no room")
        return place(self, rid, length)

    monkeypatch.setattr(KVCache, "place", faulty)

    async def go():
        futures = await _submit(engine, PROMPTS)  # one prefill: all four fit in its tokens
        return await asyncio.wait_for(asyncio.gather(*futures), 10)

    try:
        outs = asyncio.run(go())
    finally:
        engine.stop()
    assert all(o.finished and o.error == "RuntimeError: no room" for o in outs), outs


def test_the_engine_serves_on_after_a_fault():
    """The loop outlives a failed step: a request sent after it is answered."""
    engine = SlotBatching(tiny_llama, GREEDY, set(), slots=2)
    engine.start()
    engine.wait_ready()
    broken = threading.Event()
    real = engine._decode

    def once_broken():
        if not broken.is_set():
            broken.set()
            raise RuntimeError("a broken step")
        real()

    engine._decode = once_broken

    async def go():
        first = await asyncio.wait_for(asyncio.gather(*await _submit(engine, PROMPTS[:1], 5)), 10)
        second = await asyncio.wait_for(asyncio.gather(*await _submit(engine, PROMPTS[1:2], 5)), 10)
        return first[0], second[0]

    try:
        failed, served = asyncio.run(go())
    finally:
        engine.stop()
    assert failed.error == "RuntimeError: a broken step"
    assert served.error is None and len(served.generated_tokens) == 5


def test_stop_ends_the_requests_in_flight_and_those_sent_after_with_an_error():
    """stop() with requests decoding and others waiting for a slot: each ends with the error STOPPED (it was left
    undelivered), and so does a request sent once the engine is stopped."""
    engine = SlotBatching(tiny_llama, GREEDY, set(), slots=2)
    engine.start()
    engine.wait_ready()

    async def go():
        futures = await _submit(engine, PROMPTS)  # two decode, two wait for a slot
        await asyncio.sleep(0.5)
        await asyncio.to_thread(engine.stop)
        late = asyncio.get_running_loop().create_future()
        engine.register_result_handler("late", late.set_result)
        engine.add_request([1, 2, 3], "late", 4)
        return await asyncio.wait_for(asyncio.gather(*futures, late), 10)

    outs = asyncio.run(go())
    assert all(o.finished and o.error == STOPPED for o in outs), outs


def test_an_engine_fault_reaches_the_caller_as_a_failed_result(tiny_model, monkeypatch):
    """Through the backend: the fault in prefill is a GenResult with the error code engine_error, not a hang."""
    cfg = config(tiny_model, "slots")
    tok = load_tokenizer(cfg.model)
    prompt = render_prompt_ids(tok, [{"role": "user", "content": "Hello"}], None, {})

    def fault():
        monkeypatch.setattr(KVCache, "place", lambda *a: (_ for _ in ()).throw(RuntimeError("no room")))

    _, res = generate_once(cfg, tok, GenRequest("r0", prompt, [], None, 8, {}), after_start=fault)
    assert res.error == "engine_error" and "no room" in res.detail


# ---- the arithmetic: the compute dtype at every row count -------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_computes_in_its_weights_dtype_at_every_row_count(dtype):
    """Packed (rows up to its crossover) or not, the product is F.linear's in the weight's dtype: float32 to float32's
    rounding, whatever the rows (a float32 engine once multiplied forwards of up to 8 rows in bf16). Where oneDNN has
    no kernel for the dtype on this CPU (bf16 without AVX-512BW), nothing is packed and F.linear runs throughout."""
    torch.manual_seed(0)
    w, b = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    try:
        lin = PackedLinear(w, b, up_to=8, layout_rows=8)
    except RuntimeError:
        assert dtype == torch.bfloat16 and crossover(w, 8) == 0
        assert pack([(w, b)], 8)[0].packed is None
        return
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 3, 8, 9, 300):
        x = torch.randn(1, rows, 64).to(dtype)
        want = torch.nn.functional.linear(x.double(), w.double(), b.double())
        got = lin(x)
        assert got.shape == (1, rows, 96) and got.dtype == dtype
        assert (got.double() - want).abs().max() <= tolerance * want.abs().max(), rows


def test_the_crossover_is_timed_per_shape_and_bounded_by_the_rows():
    """One timing per distinct weight shape, its crossover one of the row counts timed (or 0)."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 32), torch.randn(48, 32)
    packed = pack([(a, None), (b, None), (a.clone(), None)], 16)
    assert row_counts(16) == [1, 2, 4, 8, 16] and row_counts(12) == [1, 2, 4, 8, 12] and row_counts(1) == [1]
    assert all(p.up_to in (0, *row_counts(16)) for p in packed)
    assert packed[0].up_to == packed[2].up_to  # the same shape: measured once
    assert all((p.packed is None) == (p.up_to == 0) for p in packed)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_attention_is_float32_attention_over_each_rows_own_keys(kv_dtype):
    """The kernel (built here: a C++ compiler is part of this project's test setup) and the reference: each row's
    new key and value stored at its last position, rounded to the cache's dtype as `.to` rounds, then float32
    attention over the row's first `length` keys, whatever lies past them (NaN, which the kernel never reads; far
    off values for the reference, which masks them and so needs them finite), rows of one and many alike, on views
    of rows wider than the step attends."""
    gen = torch.Generator().manual_seed(0)
    rows, kv, per, dim, width = 5, 2, 3, 16, 70
    q = torch.randn(rows, kv, per, dim, generator=gen)
    k_new, v_new = (torch.randn(rows, kv, dim, generator=gen) for _ in range(2))
    lengths = torch.tensor([70, 1, 33, 64, 2])
    kernel = attention.kernel()
    assert kernel is not None
    for fn, filler in ((kernel, float("nan")), (attention.reference, 1e4)):
        for n in (rows, 1):
            k, v = (torch.randn(8, kv, 128, dim, generator=gen).to(kv_dtype) for _ in range(2))
            for r, length in enumerate(lengths.tolist()):
                k[r, :, length:], v[r, :, length:] = filler, filler
            got = fn(q[:n], k_new[:n], v_new[:n], k[:n, :, :width], v[:n, :, :width], lengths[:n])
            assert got.dtype == torch.float32 and got.shape == (n, kv, per, dim)
            for r in range(n):
                at = lengths[r] - 1
                assert torch.equal(k[r, :, at], k_new[r].to(kv_dtype))
                assert torch.equal(v[r, :, at], v_new[r].to(kv_dtype))
                keys, values = k[r, :, : lengths[r]].double(), v[r, :, : lengths[r]].double()
                want = torch.softmax(q[r].double() @ keys.transpose(-1, -2), -1) @ values
                assert torch.allclose(got[r].double(), want, atol=1e-5), (fn, n, r)
