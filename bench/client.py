"""Client overhead: requests per second our full generate path sustains against a zero-latency server.

    python -m bench.client [--requests 4000] [--concurrency 64]

A local OpenAI-compatible server (a separate process: `/v1/models`, `/v1/completions`, plain or streamed) answers
every request at once, so what is measured is the client. Side by side, in one run:

- ours: the generate stage's Dispatcher (budget controller, a SQLite commit per response, bookkeeping) driving
  the `openai` backend with token-id prompts, streamed as in a default run;
- baseline: the common pattern of the anchor scripts: a thread pool, and a new OpenAI client per request;
- raw: a bare aiohttp loop that only sends and parses (the floor of what the machine allows).

Writes bench/results/client.json: ours_rps, baseline_rps, raw_rps, ratio (ours/baseline), raw_ratio (ours/raw),
and client CPU seconds per 1k requests (medians of interleaved rounds). Goals: ratio >= 10, raw_ratio >= 0.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODEL = "bench-model"
OUTPUT_TOKENS = 16
PROMPT = list(range(100, 164))  # a 64-token prompt


# ---- the zero-latency server (its own process, so it does not share the client's event loop) ---------------- #


def serve(port: int) -> None:
    from aiohttp import web

    choice_text = " tok" * OUTPUT_TOKENS
    usage = {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": OUTPUT_TOKENS,
        "total_tokens": len(PROMPT) + OUTPUT_TOKENS,
    }

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request):
        body = await request.json()
        choice = {"index": 0, "text": choice_text, "finish_reason": "length", "logprobs": None}
        doc = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": MODEL}
        if not body.get("stream"):
            return web.json_response({**doc, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = json.dumps({**doc, "choices": [choice]})
        final = json.dumps({**doc, "choices": [], "usage": usage})
        await resp.write(f"data: {chunk}\n\ndata: {final}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.client", "--serve", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("bench server did not start")


# ---- the three clients -------------------------------------------------------------------------------------- #


def run_ours(url: str, n: int, concurrency: int, stream: bool) -> float:
    from draftdata.config.schema import (
        BackendConfig,
        BackendKind,
        Config,
        DatasetConfig,
        ModelConfig,
        RunConfig,
        SourceConfig,
    )
    from draftdata.generate.backends import make_backend
    from draftdata.generate.budget import BudgetController
    from draftdata.generate.dispatcher import Dispatcher
    from draftdata.generate.selection import Planned
    from draftdata.generate.store import ResponseStore

    ds = DatasetConfig(
        source=SourceConfig(shape="messages", path="-"),
        token_budget=10**12,
        max_tokens=OUTPUT_TOKENS,
        concurrency=concurrency,
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(
            dataset="bench",
            datasets={"bench": ds},
            model=ModelConfig(path=MODEL),
            backend=BackendConfig(
                kind=BackendKind.openai, urls=[url], prompt_format="ids", stream=stream, max_retries=0
            ),
            run=RunConfig(store_path=f"{tmp}/store.sqlite", progress=False, log_every_s=3600),
        )
        # keys are hex digests, as the store's are
        plan = [
            Planned({"id": f"p{i}", "messages": [{"role": "user", "content": "x"}]}, f"{i:032x}", PROMPT)
            for i in range(n)
        ]
        store = ResponseStore(cfg.run.store_path)

        class Quiet:
            def update(self, _dispatcher) -> None:
                pass

        async def go() -> float:
            backend = make_backend(cfg, tokenizer=None)
            await backend.start()
            ctrl = BudgetController(ds.token_budget, ds.max_tokens, concurrency, observes_rate=stream)
            t0 = time.perf_counter()
            stats = await Dispatcher(backend, ctrl, store, cfg, None, stream, {}, Quiet()).run(plan)
            wall = time.perf_counter() - t0
            await backend.close()
            assert stats.new == n and not stats.failed, (stats.new, dict(stats.failed))
            assert store.count() == n
            return wall

        try:
            return asyncio.run(go())
        finally:
            store.close()


def run_baseline(url: str, n: int, concurrency: int) -> float:
    import openai

    def one(_i: int) -> int:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")  # a new client per request, as anchors do
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=OUTPUT_TOKENS)
        client.close()
        return out.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        assert sum(pool.map(one, range(n))) == n * OUTPUT_TOKENS
    return time.perf_counter() - t0


def run_raw(url: str, n: int, concurrency: int) -> float:
    import aiohttp

    async def go() -> float:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS}
        left = iter(range(n))
        done = 0

        async def worker(session: aiohttp.ClientSession) -> None:
            nonlocal done
            for _ in left:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    doc = await resp.json()
                done += doc["usage"]["completion_tokens"] == OUTPUT_TOKENS

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
            wall = time.perf_counter() - t0
        assert done == n
        return wall

    return asyncio.run(go())


def measure(fn, *args) -> dict:
    cpu0 = time.process_time()
    wall = fn(*args)
    cpu = time.process_time() - cpu0
    n = args[1]
    return {
        "requests": n,
        "wall_s": round(wall, 3),
        "rps": round(n / wall, 1),
        "cpu_s_per_1k": round(1000 * cpu / n, 3),
    }


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--baseline-requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of ours and raw; medians reported")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    proc, url = start_server()
    runs: dict[str, list[dict]] = {"ours": [], "ours_unstreamed": [], "raw": []}
    try:
        run_raw(url, 200, args.concurrency)  # warm-up: imports, connections, the server's first requests
        for _ in range(args.rounds):  # interleaved, so drift in the machine's speed hits every client alike
            runs["raw"].append(measure(run_raw, url, args.requests, args.concurrency))
            runs["ours"].append(measure(run_ours, url, args.requests, args.concurrency, True))
            runs["ours_unstreamed"].append(measure(run_ours, url, args.requests, args.concurrency, False))
        baseline = measure(run_baseline, url, args.baseline_requests, args.concurrency)
    finally:
        proc.terminate()
        proc.wait()
    raw, ours, ours_plain = (median_run(runs[k]) for k in ("raw", "ours", "ours_unstreamed"))
    result = {
        "ours_rps": ours["rps"],
        "ours_unstreamed_rps": ours_plain["rps"],
        "baseline_rps": baseline["rps"],
        "raw_rps": raw["rps"],
        "ratio": round(ours["rps"] / baseline["rps"], 2),
        "raw_ratio": round(ours["rps"] / raw["rps"], 3),
        "cpu_s_per_1k": {
            "ours": ours["cpu_s_per_1k"],
            "ours_unstreamed": ours_plain["cpu_s_per_1k"],
            "baseline": baseline["cpu_s_per_1k"],
            "raw": raw["cpu_s_per_1k"],
        },
        "runs": {"ours": ours, "ours_unstreamed": ours_plain, "baseline": baseline, "raw": raw},
        "rounds": runs,
        "settings": {"concurrency": args.concurrency, "output_tokens": OUTPUT_TOKENS, "prompt_tokens": len(PROMPT)},
    }
    result["goals"] = {"ratio_ge_10": result["ratio"] >= 10, "raw_ratio_ge_0.5": result["raw_ratio"] >= 0.5}
    print(f"{'client (median)':<18} {'req/s':>9} {'cpu s/1k req':>13}")
    for name, r in result["runs"].items():
        print(f"{name:<18} {r['rps']:>9.1f} {r['cpu_s_per_1k']:>13.3f}")
    print(f"ratio (ours/baseline) = {result['ratio']}, raw_ratio (ours/raw) = {result['raw_ratio']}")
    print("goals: " + ", ".join(f"{k}={'ok' if v else 'MISSED'}" for k, v in result["goals"].items()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "client.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS / 'client.json'}")


if __name__ == "__main__":
    main()
