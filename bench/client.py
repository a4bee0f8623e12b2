"""Client overhead: what our generate path costs the client per request and per streamed token, against a
zero-latency server, beside what a careful user's client and a bare loop cost.

    python -m bench.client [--requests 1000] [--long-requests 200] [--concurrency 64] [--rounds 3]

A local OpenAI-compatible server (a separate process, so it does not share the client's event loop or CPU
accounting) answers every request at once. A stream is one `data: {...}` event per token, a write each, in vLLM's
field layout (bench/fake_server.py's `OpenAI` wire format), `usage` in a last event with `choices: []` when
`stream_options.include_usage` asks for it, then `data: [DONE]`; the server yields between tokens, so the tokens of
the requests in flight interleave as a decode step's do. Side by side, in one run, each client `concurrency`
requests in flight, streamed:

- ours: the generate stage's Dispatcher (budget controller, ledger, a SQLite commit per wake-up) driving the
  `openai` backend with token-id prompts, as in a default run; also not streamed (`ours_unstreamed`);
- openai: one shared `openai.AsyncOpenAI` client and an `asyncio.Semaphore(concurrency)`, what a careful user
  writes (the text and usage of every answer kept in memory);
- raw: a bare aiohttp loop that sends, splits the SSE lines and parses their JSON, the floor.

Every client runs at two answer lengths (`SHORT` and `LONG` tokens), so the CPU a request costs splits into a fixed
part and a part per streamed token (a line through the two medians). Rounds are interleaved, so drift in a busy
machine's speed hits every client alike; medians are reported. Writes bench/results/client.json. Goals: ours costs
at most 1.25x the CPU of the shared AsyncOpenAI client per request (SHORT) and per streamed token, and sustains at
least 0.8x its requests per second. `python -m bench.client --profile N` only prints where ours spends its time
(cProfile over N requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.servers import bare_target
from bench.stage import MODEL, stage_config

RESULTS = Path(__file__).parent / "results"
SHORT, LONG = 16, 128  # answer lengths in tokens
PROMPT = list(range(100, 164))  # a 64-token prompt
GOAL_CPU = 1.25  # ours ÷ openai, CPU per request and per token: at most
GOAL_RPS = 0.8  # ours ÷ openai, requests per second: at least


# ---- the zero-latency server (its own process) -------------------------------------------------------------- #


def answers(tokens: int) -> tuple[list[bytes], bytes]:
    """The stream's events (one per token, then usage, then [DONE]) and the plain answer, encoded once."""
    from bench.fake_server import FakeModel, OpenAI, fake_output_ids

    server = SimpleNamespace(model=FakeModel(), openai_flavour="vllm")
    body = {"model": MODEL, "stream_options": {"include_usage": True}}
    wire = OpenAI(server, "cmpl-bench", PROMPT, body, chat=False)
    out = fake_output_ids(PROMPT, tokens)
    chunks = [wire.chunk(out[: k + 1], k, "length" if k + 1 == tokens else None) for k in range(tokens)]
    events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in [*chunks, wire.usage_chunk(out)]]
    return [*events, b"data: [DONE]\n\n"], json.dumps(wire.answer(out, "length")).encode()


def serve(port: int) -> None:
    from aiohttp import web

    encoded = {n: answers(n) for n in (SHORT, LONG)}

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL}]})

    async def completions(request):
        body = await request.json()
        events, plain = encoded[int(body["max_tokens"])]
        if not body.get("stream"):
            return web.Response(body=plain, content_type="application/json")
        if not (body.get("stream_options") or {}).get("include_usage"):
            events = events[:-2] + events[-1:]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)
            for event in events[:-1]:
                await resp.write(event)
                await asyncio.sleep(0)  # a decode step: every request in flight gets its token before the next
            # [DONE] with the body's end in one write: a client that stops reading at [DONE] (the openai package
            # does) would otherwise leave the end unread, and its connection could not be used again
            await resp.write_eof(events[-1])
        except ConnectionError:  # the client went away: nobody to answer
            pass
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


# ---- the clients: each returns its wall time and checks every answer ---------------------------------------- #


def run_ours(url: str, n: int, concurrency: int, tokens: int, stream: bool = True) -> float:
    from draftdata.config.schema import BackendConfig, BackendKind
    from draftdata.generate.request import Planned
    from draftdata.generate.run.budget.controller import BudgetController
    from draftdata.generate.run.connect import make_backend
    from draftdata.generate.run.dispatcher import Dispatcher
    from draftdata.generate.run.failfast import FailFastWindow
    from draftdata.generate.run.ledger import Ledger
    from draftdata.generate.run.work import WorkQueue
    from draftdata.generate.store import ResponseStore

    with tempfile.TemporaryDirectory() as tmp:
        backend = BackendConfig(kind=BackendKind.openai, urls=[url], prompt_format="ids", stream=stream, max_retries=0)
        cfg = stage_config(tmp, backend, token_budget=10**12, max_tokens=tokens, concurrency=concurrency)
        # keys are hex digests, as the store's are
        plan = [
            Planned({"id": f"p{i}", "messages": [{"role": "user", "content": "x"}]}, f"{i:032x}", PROMPT)
            for i in range(n)
        ]
        store = ResponseStore(cfg.run.store_path)

        async def go() -> float:
            backend = make_backend(cfg, bare_target())
            await backend.start()
            ctrl = BudgetController(cfg.ds.token_budget, cfg.ds.max_tokens, concurrency, observes_rate=stream)
            t0 = time.perf_counter()
            ledger = Ledger(cfg.ds, cfg.dataset, ctrl, None, backend.name)
            failfast = FailFastWindow(cfg.run.fail_fast_after)
            dispatcher = Dispatcher(backend, ctrl, ledger, failfast, store, cfg, stream, {})
            stats = await dispatcher.run(WorkQueue(plan))
            wall = time.perf_counter() - t0
            await backend.close()
            assert stats.new == n and stats.kept == n * tokens and not stats.failed, (stats.new, dict(stats.failed))
            assert store.count() == n
            return wall

        try:
            return asyncio.run(go())
        finally:
            store.close()


def run_openai(url: str, n: int, concurrency: int, tokens: int) -> float:
    import openai

    async def go() -> float:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        gate = asyncio.Semaphore(concurrency)

        async def one() -> tuple[str, int, str | None]:
            async with gate:
                stream = await client.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                text, used, finish = [], 0, None
                async for chunk in stream:
                    for choice in chunk.choices:
                        text.append(choice.text)
                        finish = choice.finish_reason or finish
                    if chunk.usage:
                        used = chunk.usage.completion_tokens
                return "".join(text), used, finish

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        await client.close()
        assert all(used == tokens and finish == "length" and text for text, used, finish in done)
        return wall

    return asyncio.run(go())


def run_raw(url: str, n: int, concurrency: int, tokens: int) -> float:
    import aiohttp

    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def one(session: aiohttp.ClientSession) -> tuple[str, int]:
        text, used = [], 0
        async with session.post(url + "/v1/completions", json=body) as resp:
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                text += [c["text"] for c in event["choices"]]
                used = (event.get("usage") or {}).get("completion_tokens", used)
        return "".join(text), used

    async def go() -> float:
        left = iter(range(n))
        done = []

        async def worker(session: aiohttp.ClientSession) -> None:
            for _ in left:
                done.append(await one(session))

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
            wall = time.perf_counter() - t0
        assert len(done) == n and all(used == tokens and text for text, used in done)
        return wall

    return asyncio.run(go())


CLIENTS = {
    "ours": run_ours,
    "ours_unstreamed": lambda url, n, c, tokens: run_ours(url, n, c, tokens, stream=False),
    "openai": run_openai,
    "raw": run_raw,
}


# ---- measuring ------------------------------------------------------------------------------------------------ #


def measure(fn, url: str, n: int, concurrency: int, tokens: int) -> dict:
    cpu0 = time.process_time()
    wall = fn(url, n, concurrency, tokens)
    cpu = time.process_time() - cpu0
    return {
        "requests": n,
        "wall_s": round(wall, 3),
        "rps": round(n / wall, 1),
        "cpu_us_per_request": round(1e6 * cpu / n, 1),
        "wall_us_per_request": round(1e6 * wall / n, 1),
    }


def summary(runs: list[dict]) -> dict:
    """Medians over the rounds, each figure on its own."""
    return {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0] if k != "requests"} | {
        "requests": runs[0]["requests"]
    }


def split(short: dict, long: dict) -> dict:
    """A request's CPU and wall as a fixed part plus a part per streamed token: the line through both lengths."""
    out = {}
    for what in ("cpu", "wall"):
        a, b = short[f"{what}_us_per_request"], long[f"{what}_us_per_request"]
        per_token = (b - a) / (LONG - SHORT)
        out[f"{what}_us_per_token"] = round(per_token, 2)
        out[f"{what}_us_fixed"] = round(a - SHORT * per_token, 1)
    return out


def results(runs: dict, args) -> dict:
    med = {name: {str(t): summary(by_len[t]) for t in by_len} for name, by_len in runs.items()}
    per_token = {name: split(m[str(SHORT)], m[str(LONG)]) for name, m in med.items() if str(LONG) in m}
    ours, oa = med["ours"][str(SHORT)], med["openai"][str(SHORT)]
    ratios = {
        "cpu_per_request_vs_openai": round(ours["cpu_us_per_request"] / oa["cpu_us_per_request"], 3),
        "cpu_per_token_vs_openai": round(
            per_token["ours"]["cpu_us_per_token"] / per_token["openai"]["cpu_us_per_token"], 3
        ),
        "rps_vs_openai": round(ours["rps"] / oa["rps"], 3),
        "rps_vs_raw": round(ours["rps"] / med["raw"][str(SHORT)]["rps"], 3),
    }
    return {
        "medians": med,
        "per_token": per_token,
        "ratios": ratios,
        "goals": {
            f"cpu_per_request_le_{GOAL_CPU}x_openai": ratios["cpu_per_request_vs_openai"] <= GOAL_CPU,
            f"cpu_per_token_le_{GOAL_CPU}x_openai": ratios["cpu_per_token_vs_openai"] <= GOAL_CPU,
            f"rps_ge_{GOAL_RPS}x_openai": ratios["rps_vs_openai"] >= GOAL_RPS,
        },
        "rounds": runs,
        "settings": {
            "concurrency": args.concurrency,
            "prompt_tokens": len(PROMPT),
            "output_tokens": [SHORT, LONG],
            "rounds": args.rounds,
        },
    }


def profile(n: int, concurrency: int) -> None:
    """Where ours spends its time: cProfile of one run, the functions with the most cumulative time."""
    import cProfile
    import pstats

    proc, url = start_server()
    try:
        run_ours(url, 100, concurrency, SHORT)  # warm-up
        prof = cProfile.Profile()
        prof.runcall(run_ours, url, n, concurrency, SHORT)
    finally:
        proc.terminate()
        proc.wait()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(r"draftdata|aiohttp/client\.py|sqlite3|json", 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help=f"per client and round, answers of {SHORT} tokens")
    ap.add_argument("--long-requests", type=int, default=200, help=f"per client and round, answers of {LONG} tokens")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every client; medians reported")
    ap.add_argument("--profile", type=int, metavar="N", help=f"only profile ours over N requests of {SHORT} tokens")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.profile:
        profile(args.profile, args.concurrency)
        return
    plan = [(name, SHORT, args.requests) for name in CLIENTS]
    plan += [(name, LONG, args.long_requests) for name in CLIENTS if name != "ours_unstreamed"]
    runs: dict = {name: {} for name in CLIENTS}
    proc, url = start_server()
    try:
        for name, tokens, _ in plan:  # warm-up: imports, connections, the server's first requests
            CLIENTS[name](url, 100, args.concurrency, tokens)
        for _ in range(args.rounds):  # interleaved, so drift in the machine's speed hits every client alike
            for name, tokens, n in plan:
                runs[name].setdefault(tokens, []).append(measure(CLIENTS[name], url, n, args.concurrency, tokens))
    finally:
        proc.terminate()
        proc.wait()
    result = results(runs, args)
    print(f"{'client (median)':<16} {'tokens':>6} {'req/s':>9} {'cpu µs/req':>11} {'wall µs/req':>12}")
    for name, by_len in result["medians"].items():
        for tokens, m in by_len.items():
            cpu, wall = m["cpu_us_per_request"], m["wall_us_per_request"]
            print(f"{name:<16} {tokens:>6} {m['rps']:>9.1f} {cpu:>11.1f} {wall:>12.1f}")
    for name, s in result["per_token"].items():
        print(f"{name:<16} cpu: {s['cpu_us_fixed']:.1f} µs + {s['cpu_us_per_token']:.2f} µs/token")
    print("ratios: " + ", ".join(f"{k}={v}" for k, v in result["ratios"].items()))
    print("goals: " + ", ".join(f"{k}={'ok' if v else 'MISSED'}" for k, v in result["goals"].items()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "client.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS / 'client.json'}")


if __name__ == "__main__":
    main()
