"""The budget controller live: the generate path against a streaming SGLang-protocol server whose aggregate
throughput is flat above a knee, beside check-then-cancel as a user writes it.

    python -m bench.budget_live [--repeats 3] [--budget 200000] [--concurrency 150] [--knee 16] [--max-tokens 2048]
                                [--family lognormal] [--neighbour] [--hog N] [--out PATH]

The server is bench/fake_server.py in a process of its own (so it does not share the client's interpreter),
speaking SGLang's native protocol: streamed `/generate` with `--incremental-streaming-output`, a chunk every
`stream_interval` tokens, `/abort_request`. Its token delay is `token_delay_s` up to `knee` running requests and
grows with the batch above it, so the aggregate throughput is knee / token_delay_s tokens/s from the knee to the
full batch: draining down to the knee is free. Answer lengths come from one of bench/budget.py's length families,
scaled from its max_tokens (10,240) to this run's, one draw per prompt (`DrawnLengthModel`), so both clients meet
the same lengths in the same prompt order.

Side by side, in one run, on the same prompts (a new set each repeat, the two in alternating order):
- ours: `generate_missing` (draftdata/generate/run/generation.py, what the generate stage calls, under `landing:
  finished`) with the `sglang` backend, streamed, `on_budget: cancel`, against a store in a temporary directory; what it
  keeps is the output the stage would write (`select_responses`). The in-flight requests it stops at the budget are
  parked in the store.
- check_cancel: one aiohttp session, a semaphore of `concurrency`, every prompt a task; when the committed tokens
  reach the budget, one `/abort_request` with `abort_all` and every task cancelled: what was in flight is dropped.

What was generated is counted by the server (`Attempt.produced`: every token it made, those of an abort's last step
included), what was kept by the client. Per strategy, as in bench/budget.py (tokens past the budget were not asked
for): overshoot = (kept - budget) / budget, waste = (generated - min(kept, budget)) / generated (parked tokens count:
they are not in this run's output), lost = generated and in no store (check_cancel's dropped requests, what an abort
left unsent), time = the server's busy span (first request in to last request out) and its ratio to the time the
budget's tokens take at the server's full throughput; and the batch: requests in flight at the stop and ours' knee
estimate (`floor`, the batch its controller held the drain at). The server sends a chunk every `stream_interval`
tokens (8) and keeps its delays on a schedule, so that a busy machine does not bend its throughput curve.
Writes bench/results/budget_live.json. Goal (issue 15): ours' waste at most half of check_cancel's, in no more time.

On a shared machine (bench/results/budget_live_neighbour.json): `--neighbour` slows the server to half its rate for
10 to 60 s at a time, a minute apart on average, at random (bench/budget.py's `slow_episodes`, drawn per prompt set
and the same for both strategies); the ideal time goes through the same episodes. `--hog N` runs N processes that
keep a core busy each all through, so the server and the client are slowed as another job on their machine slows
them, at no schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.budget import ideal_through, slow_episodes
from bench.servers import bare_target
from bench.stage import MODEL, fresh_run, id_plan, stage_config

RESULTS = Path(__file__).parent / "results"
PROMPT_LEN = 64
STRATEGIES = ("check_cancel", "ours")
IDLE_POLL_S = 0.2
NEIGHBOUR_HORIZON_S = 3600.0  # past any run's end


# ---- the server (a process of its own) ---------------------------------------------------------------------- #


def serve(conn, settings: dict) -> None:
    """Run the fake server until told to stop; answer `log` with what it did since the last `log`."""
    from bench.budget import MAX_TOKENS, draw
    from bench.fake_server import DrawnLengthModel, FakeServer

    scale, family = settings["max_tokens"] / MAX_TOKENS, settings["family"]
    srv = FakeServer(
        model=DrawnLengthModel(lambda rng: scale * draw(family, rng)),
        model_path=MODEL,
        token_delay_s=settings["token_delay_s"],
        knee=settings["knee"],
        noise=settings["noise"],
        stream_interval=settings["stream_interval"],
        incremental=True,
    ).start()
    conn.send(srv.url)
    while (cmd := conn.recv()) != "stop":
        if isinstance(cmd, tuple):  # ("slow", episodes): a noisy neighbour's episodes, in seconds from now
            t0 = time.monotonic()
            srv.slow, srv.slow_factor = [(t0 + a, t0 + b) for a, b in cmd[1]], settings["neighbour_factor"]
            conn.send(t0)
        elif cmd == "running":
            conn.send(sum(not a.t_end for a in srv.log))
        elif cmd == "log":
            attempts, srv.log[:] = list(srv.log), []  # asked when idle: no handler appends meanwhile
            conn.send([attempt_record(a) for a in attempts])
    srv.stop()


def attempt_record(a) -> dict:
    return {
        "rid": a.rid,
        "t_start": a.t_start,
        "t_end": a.t_end,
        "produced": a.produced,
        "sent": len(a.sent),
        "outcome": a.outcome,
    }


class ServerProcess:
    def __init__(self, settings: dict):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, settings), daemon=True)
        self.proc.start()
        self.url = self.conn.recv()

    def ask(self, cmd: str):
        self.conn.send(cmd)
        return self.conn.recv()

    def drained_log(self) -> list[dict]:
        """Every attempt since the last call, once the server has nothing running (aborted streams end a step or
        two after their abort)."""
        while self.ask("running"):
            time.sleep(IDLE_POLL_S)
        return self.ask("log")

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(timeout=10)


# ---- the two clients ------------------------------------------------------------------------------------------ #


def run_ours(url: str, prompts: list[list[int]], args) -> dict:
    """The generate stage's generation and output selection, on a fresh store."""
    from draftdata.config.schema import BackendConfig, BackendKind, Landing, OnBudget
    from draftdata.generate.land.selection import select_responses
    from draftdata.generate.run.generation import generate_missing
    from draftdata.generate.store import ResponseStore

    plan = id_plan(prompts)
    with tempfile.TemporaryDirectory() as tmp:
        backend = BackendConfig(kind=BackendKind.sglang, urls=[url], stream=True, max_retries=0)
        cfg = stage_config(
            tmp,
            backend,
            token_budget=args.budget,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            on_budget=OnBudget.cancel,
            # the rule that stops at the budget as check_cancel does (exact waits for the prompt-order run: its cost
            # is bench/budget.py's); the output is the one the stage writes under it
            landing=Landing.finished,
        )
        store = ResponseStore(cfg.run.store_path)
        try:
            stats = generate_missing(cfg, bare_target(), fresh_run(plan, cfg.ds), store).stats
            kept = select_responses(plan, store.get_many(p.key for p in plan), cfg.ds).total
        finally:
            store.close()
    assert not stats.failed, dict(stats.failed)
    # complete responses past the budget in prompt order stay in the store, out of this run's output
    stored = stats.kept + stats.parked_tokens
    return {
        "kept_tokens": kept,
        "stored_tokens": stored,
        "parked_tokens": stats.parked_tokens,
        "floor": stats.server.get("floor"),
    }


def run_check_cancel(url: str, prompts: list[list[int]], args) -> dict:
    """Keep `concurrency` requests in flight; at the budget abort everything on the server and drop it."""
    import aiohttp

    async def go() -> int:
        committed, kept = 0, 0
        reached = asyncio.Event()
        gate = asyncio.Semaphore(args.concurrency)

        async def one(session: aiohttp.ClientSession, i: int, ids: list[int]) -> None:
            nonlocal committed, kept
            async with gate:
                body = {
                    "rid": f"cc-{i}",
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 1.0},
                    "stream": True,
                }
                meta = None
                async with session.post(url + "/generate", json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            meta = json.loads(line[6:])["meta_info"]
                if reached.is_set() or not meta or meta["finish_reason"]["type"] not in ("stop", "length"):
                    return
                committed += meta["completion_tokens"]
                if committed >= args.budget:
                    kept = committed
                    reached.set()

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:
            tasks = [asyncio.create_task(one(session, i, ids)) for i, ids in enumerate(prompts)]
            everything = asyncio.gather(*tasks, return_exceptions=True)
            budget_met = asyncio.create_task(reached.wait())
            # the budget, or the prompts run out (then nothing is in flight and the run falls short of it)
            await asyncio.wait([budget_met, everything], return_when=asyncio.FIRST_COMPLETED)
            budget_met.cancel()
            async with session.post(url + "/abort_request", json={"rid": "", "abort_all": True}) as resp:
                await resp.read()
            for task in tasks:
                task.cancel()
            await everything
        return kept or committed

    kept = asyncio.run(go())
    return {"kept_tokens": kept, "stored_tokens": kept, "parked_tokens": 0}


CLIENTS = {"check_cancel": run_check_cancel, "ours": run_ours}


# ---- measuring ---------------------------------------------------------------------------------------------------- #


def prompts_for(repeat: int, n: int) -> list[list[int]]:
    """n distinct prompts of ids below the model's answer tokens; a new set each repeat."""
    rng = random.Random(f"prompts/{repeat}")
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def measure(attempts: list[dict], out: dict, args, slow: tuple[float, list] | None = None) -> dict:
    """One strategy's run: what the server generated and when, against what the client kept. As in
    bench/budget.py, tokens past the budget were not asked for: waste and time count the budget's at most. `slow`:
    (when on the server's clock, the neighbour's episodes from then), which the ideal time goes through too."""
    generated = sum(a["produced"] for a in attempts)
    kept = out["kept_tokens"]
    useful = min(kept, args.budget)
    start = min(a["t_start"] for a in attempts)
    span = max(a["t_end"] for a in attempts) - start
    if slow is None:
        ideal = useful / full_rate(args)
    else:  # from the first request on, through the episodes still to come
        t0, episodes = slow
        ideal = ideal_through(useful, full_rate(args), args.neighbour_factor, episodes, start - t0)
    stopped = [a for a in attempts if a["outcome"] != "complete"]
    m = {
        "kept_tokens": kept,
        "generated_tokens": generated,
        "streamed_tokens": sum(a["sent"] for a in attempts),
        "parked_tokens": out["parked_tokens"],
        "requests": len(attempts),
        "stopped_in_flight": len(stopped),
        "stopped_tokens": sum(a["produced"] for a in stopped),
        "overshoot_pct": 100.0 * (kept - args.budget) / args.budget,
        "waste_pct": 100.0 * (generated - useful) / generated,
        # generated and in no store: the in-flight requests check_cancel drops, the tokens an abort leaves unsent
        "lost_pct": 100.0 * (generated - out["stored_tokens"]) / generated,
        "time_s": span,
        "time_vs_ideal": span / ideal,
        "server_tok_s": generated / span,
    }
    if out.get("floor") is not None:
        m["floor"] = out["floor"]
    return m


def full_rate(args) -> float:
    """The server's aggregate throughput from its knee to the full batch, tokens/s."""
    return args.knee / args.token_delay_s


SETTINGS = ("max_tokens", "family", "token_delay_s", "knee", "noise", "stream_interval", "neighbour_factor")


def run(args) -> dict:
    server = ServerProcess({k: getattr(args, k) for k in SETTINGS})
    hogs = [busy_process() for _ in range(args.hog)]
    runs: dict[str, list[dict]] = {name: [] for name in STRATEGIES}
    try:
        for repeat in range(args.repeats):
            prompts = prompts_for(repeat, args.prompts)
            order = STRATEGIES if repeat % 2 == 0 else STRATEGIES[::-1]  # drift in the machine's speed hits both
            for name in order:
                slow = None
                if args.neighbour:  # the same episodes for both strategies of a prompt set: paired
                    episodes = slow_episodes(repeat, horizon=NEIGHBOUR_HORIZON_S)
                    slow = (server.ask(("slow", episodes)), episodes)
                out = CLIENTS[name](server.url, prompts, args)
                m = measure(server.drained_log(), out, args, slow)
                runs[name].append(m)
                print(f"repeat {repeat} {name}: {json.dumps({k: round(v, 4) for k, v in m.items()})}", flush=True)
    finally:
        server.close()
        for hog in hogs:
            hog.terminate()
    return runs


def spin() -> None:
    while True:
        pass


def busy_process():
    """Another job on the machine: a process that keeps one core busy (`--hog`)."""
    proc = multiprocessing.get_context("spawn").Process(target=spin, daemon=True)
    proc.start()
    return proc


def summarize(runs: dict[str, list[dict]]) -> dict:
    keys = ("overshoot_pct", "waste_pct", "lost_pct", "time_s", "time_vs_ideal", "server_tok_s", "stopped_in_flight")
    out = {name: {k: round(statistics.fmean(r[k] for r in rs), 4) for k in keys} for name, rs in runs.items()}
    floors = [r["floor"] for r in runs["ours"] if "floor" in r]
    if floors:
        out["ours"]["floor"] = floors
    return out


def goals(summary: dict) -> dict:
    ours, cc = summary["ours"], summary["check_cancel"]
    return {
        "ours_waste_le_half_check_cancel": ours["waste_pct"] <= 0.5 * cc["waste_pct"],
        "ours_time_le_check_cancel": ours["time_s"] <= cc["time_s"],
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="prompt sets, each run by both strategies")
    ap.add_argument("--budget", type=int, default=200_000, help="completion tokens")
    ap.add_argument("--concurrency", type=int, default=150)
    ap.add_argument("--knee", type=int, default=16, help="running requests above which throughput is flat")
    ap.add_argument("--token-delay-s", type=float, default=0.004, help="one request's token delay up to the knee")
    ap.add_argument("--noise", type=float, default=0.02, help="relative standard deviation of every token delay")
    ap.add_argument("--stream-interval", type=int, default=8, help="tokens per stream chunk (--stream-interval)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--family", default="lognormal", help="bench/budget.py's length family, scaled to max_tokens")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per repeat (default: 3 budgets' worth)")
    ap.add_argument(
        "--neighbour",
        action="store_true",
        help="a noisy neighbour: the server's rate at --neighbour-factor for 10-60 s at a time, a minute apart on "
        "average (bench/budget.py's episodes, the same for both strategies of a prompt set)",
    )
    ap.add_argument("--neighbour-factor", type=float, default=0.5)
    ap.add_argument("--hog", type=int, default=0, help="processes that keep a core busy each, all through the runs")
    ap.add_argument("--out", type=Path, default=None, help="default: budget_live.json, budget_live_neighbour.json")
    args = ap.parse_args(argv)
    shared = args.neighbour or args.hog
    args.out = args.out or RESULTS / ("budget_live_neighbour.json" if shared else "budget_live.json")
    from bench.budget import MAX_TOKENS, MEAN_LEN

    # the family's lengths are scaled to max_tokens; three budgets' worth at the tuned family's mean, and a batch
    args.prompts = (
        args.prompts or math.ceil(3 * args.budget / (MEAN_LEN * args.max_tokens / MAX_TOKENS)) + args.concurrency
    )
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    runs = run(args)
    summary = summarize(runs)
    results = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"full_rate_tok_s": full_rate(args)},
        "runs": runs,
        "summary": summary,
        "goals": goals(summary),
    }
    results["all_goals_met"] = all(results["goals"].values())
    for name, s in summary.items():
        print(f"{name}: {json.dumps(s)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"goals: {results['goals']}; wrote {args.out} in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
