"""The embedded engine against what a user would run instead on a CPU, and against the CPU's limit, in one run.

    python -m bench.embedded [--model DIR] [--concurrency 1,8,32,64] [--vllm-python PY] [--out FILE]

The target is the demo's real one (SmolLM2-135M-Instruct, bf16; built by the packaged_model stage, or here when it is
missing), the prompts the demo's own (every demo dataset's last-turn prompts under the target's chat template, taken
in turn), sampled at temperature 0.8, top_p 0.95, each request allowed 128 to 256 new tokens (drawn once, the same for
every engine) and generating exactly that many, its end of turn ignored (vLLM's `ignore_eos`), so that every engine
does the same work: where each stopped at its own end of turn, the engines' answers, sampled apart, would differ in
length, and a run's longer answers amortize its prefills over more tokens. Each engine keeps `c` requests in flight
(c = 1, 8, 32, 64)
over the same requests, 3c of them (8 at least), each measurement in a process of its own (its peak memory is its
own), the model loaded before the clock starts:

- ours: the generate stage's embedded backend (slot batching on a CPU), driven as the dispatcher drives it;
- transformers_cb: the same backend on transformers' continuous batching (`backend.embedded_batching=transformers`);
- static: transformers' `generate` on a static, left-padded batch of c prompts at a time, what a user would write;
- vllm: vLLM's CPU build served by its OpenAI server (`--enforce-eager`, `--max-num-batched-tokens 32768`: see
  docs/generation.md on its seeded chunked-prefill crash) through our openai backend with token-id prompts, where a
  Python with vLLM is given (`--vllm-python` or DRAFTDATA_VLLM_PYTHON), in the dtype this CPU computes the model
  fastest in, the one ours computes in (`--vllm-dtype`, default auto: model/compute.py's rule; on a CPU without bf16
  instructions vLLM's bf16 runs at a fraction of its float32).

Where ours and vLLM are both measured, they take turns at each concurrency (ours, then vLLM, then the next c), so
that a shared machine's load weighs on both alike.

Output tokens per second: the tokens generated (the same count for every engine) over the wall time. Beside them,
measured in the same run, the CPU's limit for this model: its FLOPs per generated token (the linear layers and the
LM head, plus attention at the mean context) over the bf16 matmul rate measured at the model's own shapes, and its
weight bytes per step over the measured memory bandwidth (per token: divided by c); the lower of the two. Also the
time to first token, peak memory and, for ours at 32, where a decode step's time goes. Writes
bench/results/embedded.json. Goals: ours >= vllm at 8, 32 and 64 in flight, and ours >= 0.5 of the limit at 32.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL = ROOT / "models" / "smollm2-135m-instruct"
STREAM = os.environ.get("BENCH_STREAM", "1") == "1"
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": -1}
NEW_TOKENS = (128, 256)
ENGINES = ("ours", "transformers_cb", "static", "vllm")
GOAL_VS_VLLM = 1.0  # ours / vllm at 8, 32 and 64 in flight: at least
GOAL_OF_LIMIT = 0.5  # ours / the limit at 32 in flight: at least


# ---- the requests --------------------------------------------------------------------------------------------- #


def demo_prompts(model: Path) -> list[list[int]]:
    """Every demo dataset's last-turn prompts as the prompts stage selects them (params.yaml's sources and length
    caps), rendered by the target's chat template; the datasets taken in turn."""
    from draftdata.config.load import load_config
    from draftdata.config.schema import ModelConfig, Turns, template_kwargs_of
    from draftdata.model.tokenizer import load_tokenizer, render_prompt_ids
    from draftdata.sources.files import iter_rows
    from draftdata.sources.select import adapt_rows, dedup
    from draftdata.util.rejected import Tally

    cfg = load_config(dataset=None, overrides=[f"model.path={model}"], need_dataset=False)
    tok = load_tokenizer(ModelConfig(path=str(model)))
    per_dataset = []
    for name, ds in cfg.datasets.items():
        ds.turns = Turns.last
        kwargs = template_kwargs_of(cfg, name)
        ids = [
            render_prompt_ids(tok, r["messages"], r.get("tools"), kwargs)
            for r in dedup(adapt_rows(iter_rows(ds.source), ds, Tally()), Tally())
        ]
        per_dataset.append([x for x in ids if len(x) <= (ds.max_prompt_tokens or len(x))])
    mixed = []
    for i in range(max(map(len, per_dataset))):
        mixed.extend(d[i] for d in per_dataset if i < len(d))
    return mixed


def plan(prompts: list[list[int]], n: int, seed: int = 0, new_tokens: tuple[int, int] = NEW_TOKENS) -> list[dict]:
    """n requests: the prompts in turn, each with its own count of new tokens in `new_tokens` and a sampling seed."""
    rng = random.Random(seed)
    return [
        {"ids": prompts[i % len(prompts)], "max_tokens": rng.randint(*new_tokens), "seed": rng.randrange(1 << 30)}
        for i in range(n)
    ]


def requests_for(c: int) -> int:
    return max(8, 3 * c)


# ---- one measurement (its own process) -------------------------------------------------------------------------- #


class _TimedPartial:
    """A Partial that notes when its first token arrives (the backends fill it as the stream comes in)."""

    def __init__(self):
        from draftdata.generate.backends.protocol import Partial

        class Timed(Partial):
            def __setattr__(self, name, value):
                if name == "completion_tokens" and value and getattr(self, "first_at", None) is None:
                    object.__setattr__(self, "first_at", time.perf_counter())
                object.__setattr__(self, name, value)

        self.cls = Timed


def _config(model: Path, c: int, kind: str, **backend):
    from draftdata.config.schema import BackendConfig, BackendKind, Config, DatasetConfig, ModelConfig, SamplingConfig

    return Config(
        model=ModelConfig(path=str(model)),
        datasets={
            "bench": DatasetConfig(
                token_budget=1, max_tokens=NEW_TOKENS[1], concurrency=c, sampling=SamplingConfig(**SAMPLING)
            )
        },
        dataset="bench",
        backend=BackendConfig(kind=BackendKind(kind), **backend),
    )


async def _drive(backend, reqs: list[dict], c: int, sampling: dict) -> dict:
    """Our backend with c requests in flight, streamed, as the dispatcher drives it."""
    from draftdata.generate.backends.protocol import GenRequest

    timed = _TimedPartial().cls
    gate = asyncio.Semaphore(c)
    out: list = [None] * len(reqs)
    sent: list = [None] * len(reqs)

    async def one(i: int, r: dict) -> None:
        async with gate:
            req = GenRequest(
                f"r{i}",
                r["ids"],
                [],
                None,
                r["max_tokens"],
                dict(sampling),
                stream=STREAM,
                partial=timed(),
                seed=r["seed"],
            )
            sent[i] = time.perf_counter()
            res = await backend.generate(req)
            if res.error:
                raise RuntimeError(f"request {i}: {res.error} {res.detail}")
            out[i] = (res.completion_tokens, getattr(req.partial, "first_at", None))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    wall = time.perf_counter() - t0
    ttft = [first - s for (_, first), s in zip(out, sent) if first is not None]
    return {"wall_s": wall, "output_tokens": sum(n for n, _ in out), "ttft_s": ttft}


class StepTimes:
    """Where slot batching's time goes, timed from outside it: the engine instance's prefill and decode steps and
    the sampling within them, by wrapping those methods of the instance the bench built (the engine keeps no
    timers). A step's time is its wall time less the sampling in it; `decoded`: the rows of every decode step."""

    def __init__(self, engine):
        self.engine = engine
        self.times = {"prefill_s": 0.0, "decode_s": 0.0, "sample_s": 0.0, "steps": 0, "decoded": 0}
        self._sampled = 0.0
        sample = engine._sample
        engine._sample = self._timed(sample, "sample_s")
        engine._prefill = self._step(engine._prefill, "prefill_s")
        engine._decode = self._step(engine._decode, "decode_s")

    def _timed(self, fn, key: str):
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent = time.perf_counter() - t0
                self.times[key] += spent
                self._sampled += spent

        return timed

    def _step(self, fn, key: str):
        def step():
            rows = len(self.engine._active)
            sampled, t0 = self._sampled, time.perf_counter()
            try:
                return fn()
            finally:
                self.times[key] += time.perf_counter() - t0 - (self._sampled - sampled)
                if key == "decode_s":
                    self.times["steps"] += 1
                    self.times["decoded"] += rows

        return step


def measure_backend(model: Path, c: int, reqs: list[dict], kind: str, **backend) -> dict:
    from draftdata.generate.embedded.loop import SlotBatching
    from draftdata.generate.run.connect import make_backend
    from draftdata.model.target import load_target

    async def go():
        cfg = _config(model, c, kind, **backend)
        b = make_backend(cfg, load_target(cfg, None))
        await b.start()
        if kind == "embedded":  # every request generates its count (see the module docstring): no end of turn
            b.stop_ids = frozenset()
            if isinstance(getattr(b.manager, "stop_ids", None), set):  # slot batching's (transformers' keeps its)
                b.manager.stop_ids.clear()
        sampling = {**SAMPLING, "extra": {"ignore_eos": True}} if kind == "openai" else dict(SAMPLING)
        steps = StepTimes(b.manager) if isinstance(getattr(b, "manager", None), SlotBatching) else None
        try:
            r = await _drive(b, reqs, c, sampling)
            if steps is not None:
                r["engine_timers"] = dict(steps.times)
            return r
        finally:
            await b.close()

    return asyncio.run(go())


def measure_static(model: Path, c: int, reqs: list[dict], device: str = "cpu") -> dict:
    """transformers' generate on static left-padded batches of c requests, the model in its own dtype: each batch
    runs to its largest count of new tokens (`min_new_tokens`: no end of turn); a row's tokens count up to its own
    count. A request's first token arrives when its batch's does (timed from the batch's start)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.at = 0, None

        def put(self, value):  # first call: the prompt; second: the first new token
            self.calls += 1
            if self.calls == 2:
                self.at = time.perf_counter()

        def end(self):
            pass

    net = AutoModelForCausalLM.from_pretrained(model, dtype="auto").to(device).eval()
    eos = net.generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos])
    pad = net.generation_config.pad_token_id if net.generation_config.pad_token_id is not None else min(ends)
    total, ttft = 0, []
    t0 = time.perf_counter()
    for start in range(0, len(reqs), c):
        batch = reqs[start : start + c]
        width = max(len(r["ids"]) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r["ids"])) + r["ids"] for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r["ids"])) + [1] * len(r["ids"]) for r in batch], device=device)
        torch.manual_seed(batch[0]["seed"])
        first, sent = FirstToken(), time.perf_counter()
        with torch.inference_mode():
            out = net.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=SAMPLING["temperature"],
                top_p=SAMPLING["top_p"],
                top_k=0,
                max_new_tokens=max(r["max_tokens"] for r in batch),
                min_new_tokens=max(r["max_tokens"] for r in batch),
                pad_token_id=pad,
                eos_token_id=sorted(ends),
                streamer=first,
            )
        done = time.perf_counter()
        ttft += [(first.at or done) - sent] * len(batch)
        for r, row in zip(batch, out[:, width:].tolist()):
            total += len(row[: r["max_tokens"]])
    return {"wall_s": time.perf_counter() - t0, "output_tokens": total, "ttft_s": ttft}


def profile_decode(model: Path, reqs: list[dict], steps: int = 5) -> dict:
    """Where a decode step of ours goes at len(reqs) requests in flight (their prompts prefilled, 40 steps decoded
    first so that the cache holds answers too): torch's profiler over `steps` steps, self time by kind of op."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from draftdata.config.schema import ModelConfig
    from draftdata.generate.embedded.loop import Sampling, SlotBatching, _Request
    from draftdata.model.compute import compute_dtype
    from draftdata.model.load import load_model

    dtype = compute_dtype(ModelConfig(path=str(model)))  # as the backend chooses it
    engine = SlotBatching(None, Sampling(**SAMPLING), set(), slots=len(reqs), compute_dtype=dtype)
    torch.set_grad_enabled(False)
    engine._prepare(load_model(ModelConfig(path=str(model))))  # in this (main) thread, as the engine's own does
    engine._waiting = [_Request(f"r{i}", r["ids"], 10**6, False, r["seed"]) for i, r in enumerate(reqs)]
    with torch.inference_mode():
        while engine._waiting:
            engine._prefill()
        for _ in range(40):
            engine._decode()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine._decode()
        wall = (time.perf_counter() - t0) / steps
    kinds = {
        "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
        # the engine's decode kernel (attention.py), or torch's SDPA where it fell back to `reference`
        "attention": ("draftdata_attention::", "aten::_scaled_dot_product"),
        "cache_writes": ("aten::_index_put",),
        "sampling": (
            "aten::topk",
            "aten::logsumexp",
            "aten::rand",
            "aten::sort",
            "aten::argmax",
            "aten::log",
            "aten::cumsum",
        ),
    }
    split = dict.fromkeys(kinds, 0.0)
    total = 0.0
    for e in prof.key_averages():
        total += e.self_cpu_time_total
        for kind, names in kinds.items():
            if e.key.startswith(names):
                split[kind] += e.self_cpu_time_total
    split["other"] = total - sum(split.values())
    return {
        "requests_in_flight": len(reqs),
        "step_ms": round(wall * 1000, 1),
        "share": {k: round(v / total, 3) for k, v in split.items()},
        "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
        "attention_kernel": engine.attention,
    }


def run_one(args) -> None:
    """The child process: one engine at one concurrency; prints its JSON result."""
    import torch

    reqs = json.loads(Path(args.requests).read_text())
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.one == "profile":
        print("RESULT " + json.dumps(profile_decode(args.model, reqs[: args.c])), flush=True)
        return
    if args.one == "ours":
        r = measure_backend(args.model, args.c, reqs, "embedded", embedded_batching="slots")
    elif args.one == "transformers_cb":
        r = measure_backend(args.model, args.c, reqs, "embedded", embedded_batching="transformers")
    elif args.one == "static":
        r = measure_static(args.model, args.c, reqs)
    else:
        r = measure_backend(
            args.model,
            args.c,
            reqs,
            "openai",
            urls=[args.url],
            prompt_format="ids",
            return_token_ids=True,
            request_timeout_s=1800,
        )
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(r), flush=True)


# ---- the CPU's limit for this model ------------------------------------------------------------------------------ #


def _best_time(fn, repeat: int = 5, inner: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def linear_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of every matmul a token goes through: each layer's projections, then the LM head."""
    h, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    layer = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, inter), (h, inter), (inter, h)]
    return layer * config.num_hidden_layers + [(h, config.vocab_size)]


def matmul_rate(shapes: list[tuple[int, int]], m: int, dtype: str = "bfloat16") -> float:
    """FLOP/s of x[m, in] @ w[in, out] in `dtype` over the model's own shapes (each distinct shape timed, weighted
    by how often it occurs), as torch runs them here."""
    from collections import Counter

    import torch

    dt = getattr(torch, dtype)
    flops = seconds = 0.0
    for (k, n), count in Counter(shapes).items():
        x = torch.randn(m, k, dtype=dt)
        w = torch.randn(n, k, dtype=dt)
        t = _best_time(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        flops += 2 * m * k * n * count
        seconds += t * count
    return flops / seconds


def memory_bandwidth() -> float:
    """Bytes per second read from memory: a sum over a buffer far larger than the caches (1 GiB)."""
    import torch

    x = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    return x.numel() * 4 / _best_time(lambda: x.sum(), repeat=5, inner=1)


def attention_seconds(config, rows: int, context: int, causal: bool, dtype: str = "bfloat16") -> float:
    """One layer's attention as torch's own kernel (scaled_dot_product_attention) runs it here: a decode step of
    `rows` requests over `context` keys each (the query heads that share a key head as that head's queries, as the
    engine calls it), or, `causal`, a prompt of `context` tokens over itself."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    if causal:
        q, k = torch.randn(1, heads, context, d, dtype=dt), torch.randn(1, kv, context, d, dtype=dt)
        return _best_time(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
    q, k = torch.randn(rows, kv, heads // kv, d, dtype=dt), torch.randn(rows, kv, context, d, dtype=dt)
    return _best_time(lambda: F.scaled_dot_product_attention(q, k, k))


def limit(model: Path, concurrencies: list[int], prompt_tokens: float, output_tokens: dict[int, float]) -> dict:
    """What this CPU could give for this model, in output tokens per second at each concurrency c, measured now:

    - decode only: the FLOPs of a generated token (every layer's matmuls, the LM head, attention at the mean
      context) over the best matmul rate torch reaches here at c rows (bf16 or float32, the model's own shapes,
      whichever is faster), capped by the weights' bytes read once per step over the memory bandwidth (c tokens a
      step); the lower of the two;
    - this workload: the same, with each output token's share of its prompt's prefill counted (a prompt token
      costs the layers' FLOPs at the prefill's rate; a request averages `prompt_tokens` of prompt for
      `output_tokens[c]` of answer). Every engine must compute those, so this is the one the engines meet;
    - this workload with torch's attention: the same matmuls, and attention at the time torch's own attention kernel
      takes here (decode: c rows over the mean context; prefill: a prompt of the mean length over itself), not at
      the matmul rate. Attention on a CPU runs far below the matmul rate (few queries a key read while decoding,
      a softmax between two small products while prefilling): this is what an engine built on torch's kernels can
      at most reach, ours as much as vLLM's CPU build (which prefills with torch's too).
    """
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model).get_text_config()
    shapes = linear_shapes(config)
    head = shapes[-1]
    layer_flops = 2 * sum(k * n for k, n in shapes[:-1])
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 4 * config.num_hidden_layers * heads * d  # per position attended
    decode_flops = (
        layer_flops + 2 * head[0] * head[1] + attention * (prompt_tokens + statistics.mean(output_tokens.values()) / 2)
    )
    prefill_flops = layer_flops + attention * prompt_tokens / 2
    weight_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))  # bf16: read once per decode step
    bandwidth = memory_bandwidth()
    prefill_rates = {dt: matmul_rate(shapes[:-1], 512, dt) for dt in ("bfloat16", "float32")}
    prefill_rate = max(prefill_rates.values())
    layers = config.num_hidden_layers
    context = round(prompt_tokens + statistics.mean(output_tokens.values()) / 2)
    prompt_attention = attention_seconds(config, 1, round(prompt_tokens), causal=True) * layers / prompt_tokens
    out = {
        "decode_flops_per_token": round(decode_flops),
        "prefill_flops_per_token": round(prefill_flops),
        "weight_bytes": weight_bytes,
        "memory_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "prefill_matmul_gflop_s": {k: round(v / 1e9, 1) for k, v in prefill_rates.items()},
        "torch_threads": torch.get_num_threads(),
        "by_concurrency": {},
    }
    for c in concurrencies:
        rates = {dt: matmul_rate(shapes, c, dt) for dt in ("bfloat16", "float32")}
        rate = max(rates.values())
        memory = bandwidth / weight_bytes * c
        decode_only = min(rate / decode_flops, memory)
        prompt_share = prompt_tokens / output_tokens[c]
        per_output = 1 / decode_only + prompt_share * prefill_flops / prefill_rate
        decode_attention = attention_seconds(config, c, context, causal=False) * layers / c
        with_torch_attention = (
            (decode_flops - attention * context) / rate
            + decode_attention
            + prompt_share * (layer_flops / prefill_rate + prompt_attention)
        )
        out["by_concurrency"][str(c)] = {
            "matmul_gflop_s": {k: round(v / 1e9, 1) for k, v in rates.items()},
            "compute_tok_s": round(rate / decode_flops, 1),
            "memory_tok_s": round(memory, 1),
            "decode_only_tok_s": round(decode_only, 1),
            "output_tokens_per_request": round(output_tokens[c], 1),
            "workload_tok_s": round(1 / per_output, 1),
            "workload_torch_attention_tok_s": round(1 / with_torch_attention, 1),
            "attention_share_torch": round(
                (decode_attention + prompt_share * prompt_attention) / with_torch_attention, 3
            ),
        }
    return out


# ---- the run -------------------------------------------------------------------------------------------------- #

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx_ne_convert", "amx_bf16")


def command(argv: list[str] | None) -> str:
    """The command that wrote the results, as run, with the vLLM venv's path left out (it is this machine's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(args):
        if i > 0 and args[i - 1] == "--vllm-python":
            args[i] = "<venv>/bin/python"
        elif a.startswith("--vllm-python="):
            args[i] = "--vllm-python=<venv>/bin/python"
    return " ".join(["python -m bench.embedded", *args])


def cpu(model: Path) -> dict:
    """The CPU the figures belong to: its model name, the vector and matrix extensions that decide the engines'
    kernels (from /proc/cpuinfo), torch's kernel level, and the dtype our engine computes this model in here."""
    import torch

    from draftdata.config.schema import ModelConfig
    from draftdata.model.compute import compute_dtype

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "model_name": fields.get("model name", "unknown"),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "compute_dtype": compute_dtype(ModelConfig(path=str(model)), on_gpu=False),
    }


def vllm_env(python: str) -> dict:
    """vLLM's CPU build as its docs have a user set it up: its OpenMP threads on every core (by default it keeps
    one of two cores for its server), tcmalloc and Intel's OpenMP preloaded where this machine has them."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    preload = [
        p
        for p in (
            Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
            Path(python).resolve().parents[1] / "lib" / "libiomp5.so",
        )
        if p.exists()
    ]
    if preload:
        env["LD_PRELOAD"] = ":".join(map(str, preload))
    return env


def vllm_server(python: str, model: Path, log: Path, max_seqs: int, procs: list, dtype: str):
    """vLLM's CPU build serving `model` in `dtype` (bench.servers.server_process: a free port, /health, stopped
    after). --max-num-batched-tokens 32768: with its default, a seeded request whose prefill is chunked kills the
    CPU build's engine (docs/generation.md)."""
    from bench.servers import server_process

    def argv(port: int) -> list[str]:
        return [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--dtype",
            dtype,
            "--max-num-seqs",
            str(max_seqs),
            "--max-num-batched-tokens",
            "32768",
            "--max-model-len",
            "4096",
        ]

    return server_process(argv, log, vllm_env(python), timeout=600, procs=procs)


def child(engine: str, model: Path, c: int, reqs: Path, url: str | None = None) -> dict:
    argv = [sys.executable, "-m", "bench.embedded", "--one", engine, "--model", str(model), "--c", str(c)]
    argv += ["--requests", str(reqs)] + (["--url", url] if url else [])
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} at {c}: exit {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def tree_peak_rss_mb(pid: int) -> float:
    """The peak resident memory of a process and its descendants (vLLM's engine core and worker are children)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(x) for x in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            pass
    return total


def summarize(r: dict, limit_tok_s: float | None) -> dict:
    ttft = sorted(r.get("ttft_s") or [])
    out = {
        "output_tokens": r["output_tokens"],
        "wall_s": round(r["wall_s"], 2),
        "tok_s": round(r["output_tokens"] / r["wall_s"], 1),
        "ttft_median_s": round(ttft[len(ttft) // 2], 2) if ttft else None,
        "ttft_p90_s": round(ttft[int(len(ttft) * 0.9)], 2) if ttft else None,
        "peak_rss_mb": round(r["peak_rss_mb"]),
    }
    if limit_tok_s:
        out["of_limit"] = round(out["tok_s"] / limit_tok_s, 3)
    if "engine_timers" in r:
        t = r["engine_timers"]
        out["time_split_s"] = {k: round(t[k], 1) for k in ("prefill_s", "decode_s", "sample_s")}
        out["mean_decode_batch"] = round(t["decoded"] / max(1, t["steps"]), 1)
    return out


def workload(prompts: list[list[int]], files: dict[int, Path]) -> dict:
    lengths = [len(r["ids"]) for f in files.values() for r in json.loads(f.read_text())]
    return {
        "prompts": "every demo dataset's last-turn prompts under the target's template, in turn",
        "prompt_tokens_mean": round(statistics.mean(lengths), 1),
        "prompt_tokens_max": max(lengths),
        "new_tokens": list(NEW_TOKENS),
        "sampling": SAMPLING,
        "requests": {str(c): requests_for(c) for c in files},
    }


def measure_all(args, engines: list[str], concurrencies: list[int], files: dict, work: Path) -> dict:
    """Every engine at every concurrency, each in a process of its own. vLLM's server is started once, before the
    first measurement, and its runs take turns with the others' at each concurrency."""
    raw: dict = {e: {} for e in engines}

    def one(e: str, c: int, url: str | None, procs: list) -> None:
        raw[e][str(c)] = child(e, args.model, c, files[c], url if e == "vllm" else None)
        if e == "vllm":
            raw[e][str(c)]["peak_rss_mb"] = tree_peak_rss_mb(procs[0].pid)  # the server's, since start
        print(e, c, summarize(raw[e][str(c)], None), flush=True)

    procs: list = []
    with contextlib.ExitStack() as stack:
        url = None
        if "vllm" in engines:
            log = work / "vllm.log"
            url = stack.enter_context(
                vllm_server(args.vllm_python, args.model, log, max(concurrencies), procs, args.vllm_dtype)
            )
        for c in concurrencies:
            for e in engines:
                one(e, c, url, procs)
    return raw


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--vllm-python", default=os.environ.get("DRAFTDATA_VLLM_PYTHON"))
    parser.add_argument(
        "--vllm-dtype",
        default="auto",
        help="vLLM's --dtype; auto: the dtype ours computes the model in on this CPU (model/compute.py)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "embedded.json")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the measurements already in --out that this run does not take anew (same workload)",
    )
    parser.add_argument("--one", choices=(*ENGINES, "profile"), help=argparse.SUPPRESS)
    parser.add_argument("--c", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--requests", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.command = command(argv)
    if args.one:
        return run_one(args)
    if not args.model.is_dir():
        sys.exit(f"bench.embedded: {args.model} is not built; run `dvc repro packaged_model` first")
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    engines = [e for e in args.engines.split(",") if e != "vllm" or args.vllm_python]
    kept = json.loads(args.out.read_text()).get("raw", {}) if args.keep and args.out.exists() else {}
    reported = sorted({*concurrencies, *(int(c) for rows in kept.values() for c in rows if c.isdigit())})
    load_before = [round(x, 2) for x in os.getloadavg()]  # a shared machine's load weighs on every figure
    prompts = demo_prompts(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-embedded-"))
    files = {c: work / f"requests-{c}.json" for c in reported}
    for c, f in files.items():
        f.write_text(json.dumps(plan(prompts, requests_for(c))))
    if args.vllm_dtype == "auto":
        args.vllm_dtype = cpu(args.model)["compute_dtype"]
    raw = measure_all(args, engines, concurrencies, files, work)
    for e, rows in kept.items():  # what this run did not measure, as the last run measured it
        for c, row in rows.items():
            raw.setdefault(e, {}).setdefault(c, row)
    prompt_mean = statistics.mean(len(r["ids"]) for f in files.values() for r in json.loads(f.read_text()))
    answered = raw["ours"] if "ours" in raw else next(iter(raw.values()))
    per_request = {c: answered[str(c)]["output_tokens"] / requests_for(c) for c in reported}
    lim = limit(args.model, reported, prompt_mean, per_request)
    if "ours" in engines:
        at = max(c for c in concurrencies if c <= 32)
        raw["ours"]["profile"] = child("profile", args.model, at, files[at])
    machine = {"cpu": cpu(args.model), "load_average_1_5_15": {"start": load_before, "end": list(os.getloadavg())}}
    result = report(raw, lim, reported, workload(prompts, files), args, machine)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["goals"], indent=1))


def report(raw: dict, lim: dict, concurrencies: list[int], load: dict, args, machine: dict) -> dict:
    """The results file: every engine at every concurrency, the limit, the ratios and the goals."""
    engines = {}
    for e, rows in raw.items():  # an engine may be measured at fewer concurrencies (--concurrency, --keep)
        engines[e] = {
            str(c): summarize(rows[str(c)], lim["by_concurrency"][str(c)]["workload_tok_s"])
            for c in concurrencies
            if str(c) in rows
        }
    ratios = {}
    for other in (e for e in engines if e != "ours"):
        ratios[f"ours_vs_{other}"] = {
            c: round(engines["ours"][c]["tok_s"] / row["tok_s"], 2)
            for c, row in engines[other].items()
            if c in engines.get("ours", {})
        }
    goals = {}
    if "ours" in engines and "vllm" in engines:
        goals["ours_vs_vllm_at_8_32_64"] = {
            c: ratios["ours_vs_vllm"][c] for c in ("8", "32", "64") if c in ratios["ours_vs_vllm"]
        }
        goals["ours_vs_vllm_met"] = all(v >= GOAL_VS_VLLM for v in goals["ours_vs_vllm_at_8_32_64"].values())
    if "ours" in engines and "32" in engines["ours"]:
        row, at = engines["ours"]["32"], lim["by_concurrency"]["32"]
        goals["ours_of_limit_at_32"] = {
            "workload": round(row["tok_s"] / at["workload_tok_s"], 3),
            "decode_only": round(row["tok_s"] / at["decode_only_tok_s"], 3),
            "workload_torch_attention": round(row["tok_s"] / at["workload_torch_attention_tok_s"], 3),
        }
        goals["ours_of_limit_met"] = goals["ours_of_limit_at_32"]["workload"] >= GOAL_OF_LIMIT
    return {
        "command": args.command,
        "machine": {"cpus": os.cpu_count(), "torch_threads": lim["torch_threads"], **machine},
        "model": str(args.model.name),
        "workload": load,
        "vllm_setup": {
            "env": vllm_env(args.vllm_python) if "vllm" in raw else None,
            "flags": f"--enforce-eager --dtype {args.vllm_dtype} --max-num-batched-tokens 32768",
        },
        "limit": lim,
        "engines": engines,
        "ours_profile": raw.get("ours", {}).get("profile"),
        "ratios": ratios,
        "goals": goals,
        "raw": raw,  # every measurement as taken (`--keep` reuses it)
    }


if __name__ == "__main__":
    main()
