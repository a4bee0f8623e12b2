"""The vllm hidden-states engine against vLLM's own plain prefill of the same prompts: `capture_vs_forward`.

    python -m bench.hidden_states_vllm --vllm-python PATH [--samples 64] [--rounds 3] [--batch-tokens 4096]
        [--dtype bfloat16] [--threads 1] [--llm-kwargs JSON]

The target is bench.hidden_states' random-weight Llama (hidden 256, 8 layers, 4 heads of 64, MLP 688, vocab 8,192),
built here and saved with `save_pretrained`; samples are random ids of lognormal length (mean 256, at most 1,024;
seeded), cut into the batches the stage would send (`draftdata.hidden.compute.length_batches`), the layers kept are
EAGLE-3's default [1, 3, 4] and the final state. Three vLLM processes are loaded side by side, with the same
`vllm.LLM` settings (`draftdata.hidden.engines.vllm_worker.llm_kwargs`):

- extract: `VLLMEngine(path="extract")`, vLLM's own extraction (extract_hidden_states and its KV connector);
- hook: `VLLMEngine(path="hook")`, the capture inside vLLM's forward;
- plain: the same prompts through `LLM.generate` with `max_tokens=1` and nothing captured, in a worker run by this
  module (`--plain-worker`), answering on the same line protocol.

Each round sends every batch to each of the three in turn (the order rotated from round to round, so a slow spell of
the machine hits all three), timed in this process from the request to the answer: for extract and hook, until the
states are float32 tensors here, as the stage receives them (shards and the state store, the same for every engine,
are not in it). tok/s count real tokens; `capture_vs_forward` is a path's tok/s ÷ plain's, over all rounds, with the
per-round values and their median. Writes bench/results/hidden_states_vllm.json (on a GPU, as
bench/hidden_states_vllm_gpu.sh runs it: hidden_states_vllm_gpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

OUT = Path(__file__).resolve().parent / "results" / "hidden_states_vllm.json"
LAYERS = [1, 3, 4]
PATHS = ("extract", "hook", "plain")


def plain_worker(settings: dict) -> None:
    """vLLM with the engine's own LLM settings and no capture: `{"cmd": "forward", "input": PATH}` runs the batch
    (the engine's input file format) and answers `{"ok": true}`."""
    from vllm import LLM

    from draftdata.hidden.engines import vllm_worker as w

    proto = w.protocol_stream()
    llm = LLM(**w.llm_kwargs(settings, w.target_config(settings)))
    w.send(proto, ok=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "close":
            break
        w.generate(llm, w.read_batch(cmd["input"]))
        w.send(proto, ok=True)
    w.shutdown(llm)


def build(path: Path, vocab: int) -> None:
    from bench.hidden_states import build_model, model_config

    shape = SimpleNamespace(hidden=256, layers=8, heads=4, kv_heads=None, intermediate=None, vocab=vocab, max_len=4096)
    build_model(model_config(shape), str(path), "cpu")


def make_batches(n: int, batch_tokens: int, vocab: int) -> list[list[list[int]]]:
    import random

    from bench.hidden_states import lengths
    from draftdata.hidden.compute import length_batches

    rng = random.Random("ids/0")
    samples = [(str(i), [rng.randrange(vocab) for _ in range(k)]) for i, k in enumerate(lengths(n, 0, 256, 1024))]
    return [[ids for _, ids in b] for b in length_batches(samples, batch_tokens)]


class Plain:
    """The plain worker, driven like an engine."""

    def __init__(self, python: str, model: Path, batch_tokens: int, kwargs: dict, tmp: Path):
        from draftdata.hidden.engines.vllm import ROOT, Worker

        settings = {"model": str(model), "tensor_parallel_size": 1, "max_batch_tokens": batch_tokens}
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        argv = [
            python,
            "-m",
            "bench.hidden_states_vllm",
            "--plain-worker",
            json.dumps(dict(settings, llm_kwargs=kwargs)),
        ]
        self.worker, self.tmp, self.n = Worker(argv, env, tmp / "plain.log"), tmp, 0
        self.worker.reply(600, "while loading the model")

    def forward(self, batch: list[list[int]]) -> None:
        from draftdata.hidden.engines.vllm import write_batch

        self.n += 1
        path = str(self.tmp / f"plain-{self.n}.safetensors")
        write_batch(path, batch)
        self.worker.send({"cmd": "forward", "input": path})
        self.worker.reply(600, "while running a batch")
        os.unlink(path)

    def close(self) -> None:
        self.worker.close()


def start(args, model: Path, tmp: Path) -> dict:
    from draftdata.config.schema import ModelConfig
    from draftdata.hidden.engines.vllm import VLLMEngine

    kwargs = {"dtype": args.dtype, **json.loads(args.llm_kwargs)}
    runs = {"plain": Plain(args.vllm_python, model, args.batch_tokens, kwargs, tmp)}
    for path in ("extract", "hook"):
        runs[path] = VLLMEngine(
            ModelConfig(path=str(model)),
            LAYERS,
            python=args.vllm_python,
            max_batch_tokens=args.batch_tokens,
            llm_kwargs=kwargs,
            path=path,
        )
        assert runs[path].vllm_path == path, runs[path].fallback
    return runs


def measure(runs: dict, batches: list, rounds: int) -> dict:
    seconds = {p: [] for p in PATHS}
    for run in runs.values():  # a warm-up batch each: first-call allocations are not throughput
        run.forward(batches[0])
    for r in range(rounds):
        order = PATHS[r % 3 :] + PATHS[: r % 3]
        for batch in batches:
            for p in order:
                start = time.perf_counter()
                runs[p].forward(batch)
                seconds[p].append((r, time.perf_counter() - start))
    return {p: [sum(s for rr, s in seconds[p] if rr == r) for r in range(rounds)] for p in PATHS}


def summarise(args, per_round: dict, tokens: int, n_batches: int, wall: float) -> dict:
    tok_s = {p: tokens * args.rounds / sum(per_round[p]) for p in PATHS}
    result = {
        "settings": {
            "samples": args.samples,
            "tokens_per_round": tokens,
            "batches_per_round": n_batches,
            "rounds": args.rounds,
            "batch_tokens": args.batch_tokens,
            "dtype": args.dtype,
            "layers": LAYERS,
            "model": "random-weight Llama: hidden 256, 8 layers, 4 heads of 64, MLP 688, vocab 8192",
            "threads": args.threads,
            "llm_kwargs": json.loads(args.llm_kwargs),
        },
        "tok_s": {p: round(v, 1) for p, v in tok_s.items()},
        "seconds_per_round": {p: [round(s, 3) for s in v] for p, v in per_round.items()},
        "wall_s": round(wall, 1),
    }
    for p in ("extract", "hook"):
        rounds = [per_round["plain"][r] / per_round[p][r] for r in range(args.rounds)]
        result[f"capture_vs_forward_{p}"] = {
            "all_rounds": round(tok_s[p] / tok_s["plain"], 3),
            "per_round": [round(x, 3) for x in rounds],
            "median_of_rounds": round(statistics.median(rounds), 3),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hidden_states_vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=os.environ.get("DRAFTDATA_VLLM_PYTHON"))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each vLLM process")
    parser.add_argument("--llm-kwargs", default="{}", help="more vllm.LLM options, JSON (each of the three gets them)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--plain-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_worker:
        plain_worker(json.loads(args.plain_worker))
        return
    if not args.vllm_python:
        parser.error("--vllm-python (or DRAFTDATA_VLLM_PYTHON): a Python with vLLM")
    os.environ.update(OMP_NUM_THREADS=str(args.threads), VLLM_CPU_KVCACHE_SPACE="1")
    start_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-hs-vllm-") as tmp:
        model = Path(tmp) / "model"
        build(model, 8192)
        batches = make_batches(args.samples, args.batch_tokens, 8192)
        runs = start(args, model, Path(tmp))
        try:
            per_round = measure(runs, batches, args.rounds)
        finally:
            for run in runs.values():
                run.close()
    tokens = sum(len(ids) for b in batches for ids in b)
    result = summarise(args, per_round, tokens, len(batches), time.perf_counter() - start_all)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("tok_s", "capture"))}, indent=2))


if __name__ == "__main__":
    main()
