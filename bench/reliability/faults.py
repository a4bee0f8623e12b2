"""Faults: generate@D against a fault server on loopback (errors, resets, stalls, broken answers, restarts, deaths).

    python -m bench.reliability faults [--only NAME ...] [--keep DIR]

Each scenario runs the real stage, `python -m stages.generate dataset=<D>`, in a project of its own (the demo's
B3_magicoder prompts, a budget no run reaches so that every prompt is answered) against one or three servers of
bench/fake_server.py, which speak the OpenAI-compatible or SGLang protocol field by field and inject
one kind of fault. The right outcome is decided per scenario:
- a transient fault (an HTTP 500, 503 or 429, a reset, a stall, a missing `usage` in a stream, a restart, one of
  three servers dying) costs retries, not data: the run completes, every prompt is answered;
- a broken answer (malformed JSON, a plain answer without `usage`) is never stored: the request fails at once and is
  counted, the run completes without it, and a second run answers exactly the failed prompts;
- every server dead: the run stops with one line on stderr and no traceback, every finished response in the store.
Then the accounting is checked against the server's log (bench/reliability/fault_checks.py): every stored response
is the model's answer to its prompt and was finished by the server, no finished answer is missing, and the
metrics' responses, failures, attempt failures and kept/parked/lost/new/wasted tokens are the log's.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.fake_server import FakeServer, Fault, GreedyModel
from bench.reliability import fault_checks as fc

PROMPTS = 24
MAX_TOKENS = 32
CONCURRENCY = 8
TOKEN_DELAY_S = 0.01  # a decode step: slow enough that requests are mid-answer when a server dies
EVENT_AFTER = 6  # a server restarts or dies once this many answers have finished: mid-run, requests in flight
DOWN_S = 3.0  # how long a restarting server is down
# Retries fast enough for a bench; a scenario that needs them to outlast a downtime says so.
BACKEND = {
    "request_timeout_s": 30.0,
    "connect_timeout_s": 5.0,
    "startup_timeout_s": 10.0,
    "probe_interval_s": 0.5,
    "backoff_base_s": 0.05,
    "backoff_max_s": 0.2,
    "max_retries": 5,
}


@dataclass
class Scenario:
    name: str
    kind: str  # sglang | openai
    prompt_format: str = "ids"  # openai: ids (/v1/completions, token ids back) | chat (/v1/chat/completions, text)
    stream: bool = True
    faults: dict = field(default_factory=dict)  # arrival index on the first server -> Fault
    every: Fault | None = None  # a fault every request to the first server meets
    servers: int = 1
    event: str | None = None  # restart | one_dies | all_die | none_up
    expected: str = "complete"  # complete | stopped
    cause: str = ""  # what the one line of a stopped run must name
    backend: dict = field(default_factory=dict)
    run: dict = field(default_factory=dict)

    @property
    def text_only(self) -> bool:
        return self.kind == "openai" and self.prompt_format != "ids"

    @property
    def label(self) -> str:
        how = "stream" if self.stream else "plain"
        if self.kind == "sglang":
            return f"sglang /generate {how}"
        path = "/v1/chat/completions" if self.prompt_format == "chat" else "/v1/completions ids"
        return f"openai {path} {how}" + (f" x{self.servers}" if self.servers > 1 else "")


SCENARIOS = [
    Scenario("http_500", "openai", faults={2: Fault("status", 500), 5: Fault("status", 500), 9: Fault("status", 500)}),
    Scenario("http_503", "sglang", faults={2: Fault("status", 503), 5: Fault("status", 503), 9: Fault("status", 503)}),
    # Retry-After must hold the retry back although the backoff alone would retry within 0.2 s
    Scenario(
        "http_429_retry_after",
        "openai",
        "chat",
        stream=False,
        faults={3: Fault("status", 429, retry_after="1"), 7: Fault("status", 429, retry_after="1")},
    ),
    Scenario("reset_mid_stream", "sglang", faults={3: Fault("reset", after=4), 7: Fault("reset", after=4)}),
    # text only: the cut answer cannot be continued, so its streamed tokens are lost (and must be counted so)
    Scenario(
        "reset_mid_stream_text", "openai", "chat", faults={3: Fault("reset", after=4), 7: Fault("reset", after=4)}
    ),
    Scenario("reset_mid_body", "openai", stream=False, faults={2: Fault("reset"), 6: Fault("reset")}),
    Scenario("stall_past_timeout", "sglang", faults={4: Fault("stall", after=3)}, backend={"request_timeout_s": 5.0}),
    Scenario("malformed_json", "openai", stream=False, faults={3: Fault("malformed"), 8: Fault("malformed")}),
    # the broken line comes mid-stream: the tokens before it are parked and the next run continues them
    Scenario("malformed_stream_line", "sglang", faults={5: Fault("malformed", after=3)}),
    Scenario("missing_usage_stream", "openai", "chat", every=Fault("no_usage")),
    Scenario("missing_usage_plain", "openai", stream=False, faults={2: Fault("no_usage"), 6: Fault("no_usage")}),
    # retries must outlast the downtime: 10 of them, up to 2 s apart (full jitter), span about 9 s on average
    Scenario(
        "server_restart",
        "sglang",
        event="restart",
        backend={"max_retries": 10, "backoff_base_s": 0.5, "backoff_max_s": 2.0},
    ),
    Scenario("one_of_three_dies", "openai", servers=3, event="one_dies"),
    # the line must say why the requests failed: the retries' last cause, not only that they ran out
    Scenario(
        "all_dead_mid_run",
        "sglang",
        servers=3,
        event="all_die",
        expected="stopped",
        cause="retries_exhausted: connection",
        backend={"max_retries": 2},
        run={"fail_fast_after": CONCURRENCY},
    ),
    Scenario("all_dead_at_start", "sglang", servers=3, event="none_up", expected="stopped", cause="no healthy server"),
]


@dataclass
class Context:
    """What every scenario shares: the target's tokenizer, the model the servers serve, the prompts, a work dir."""

    work: Path
    target: Path
    model: GreedyModel
    prompts_project: Path


def prepare(work: Path) -> Context:
    from transformers import AutoTokenizer

    target = fc.build_target(work / "target")
    seed = fc.write_project(
        work / "prompts", target, fc.dataset_params(PROMPTS, MAX_TOKENS, CONCURRENCY), {"kind": "embedded"}
    )
    proc = fc.run_stage(seed, "prompts")
    if proc.returncode != 0:
        raise RuntimeError(f"the prompts stage failed: {proc.stderr.strip()[-500:]}")
    return Context(work, target, GreedyModel(AutoTokenizer.from_pretrained(target), mean_tokens=16), seed)


def _free_url() -> str:
    """A loopback URL nothing listens on: a server that is down from the start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _backend(s: Scenario, urls: list[str]) -> dict:
    b = {"kind": s.kind, "urls": urls, "stream": s.stream, **BACKEND}
    if s.kind == "openai":
        b.update(prompt_format=s.prompt_format, return_token_ids=s.prompt_format == "ids")
    b.update(s.backend)
    return b


class Driver(threading.Thread):
    """Restarts or kills servers mid-run: once `EVENT_AFTER` answers have finished, while requests are in flight."""

    def __init__(self, s: Scenario, servers: list[FakeServer]):
        super().__init__(daemon=True)
        self.s, self.servers = s, servers
        self.done = threading.Event()  # the stage's run is over
        self.fired = False

    def run(self) -> None:
        while sum(a.outcome == "complete" for srv in self.servers for a in srv.log) < EVENT_AFTER:
            if self.done.wait(0.005):
                return
        self.fired = True
        if self.s.event == "restart":
            self.servers[0].stop()
            time.sleep(DOWN_S)
            self.servers[0].start()
        elif self.s.event == "one_dies":
            self.servers[1].stop()
        elif self.s.event == "all_die":
            for srv in self.servers:
                srv.stop()


@dataclass
class Result:
    row: dict  # the table's row
    evidence: fc.Evidence | None  # what the run left (None: the stage never finished)
    rerun: fc.Evidence | None = None
    prompts: int = 0


def run_scenario(s: Scenario, ctx: Context) -> Result:
    project = ctx.work / s.name
    prompts = fc.copy_prompts(ctx.prompts_project, project)
    servers = [
        FakeServer(
            ctx.model,
            str(ctx.target),
            openai_flavour="vllm",
            faults=s.faults if i == 0 else {},
            every=s.every if i == 0 else None,
            token_delay_s=TOKEN_DELAY_S,
        )
        for i in range(s.servers)
    ]
    ev = rerun = None
    try:
        urls = [_free_url() for _ in servers] if s.event == "none_up" else [srv.start().url for srv in servers]
        fc.write_project(
            project, ctx.target, fc.dataset_params(PROMPTS, MAX_TOKENS, CONCURRENCY), _backend(s, urls), s.run
        )
        driver = Driver(s, servers)
        if s.event in ("restart", "one_dies", "all_die"):
            driver.start()
        t0 = time.time()
        try:
            proc = fc.run_stage(project, "generate")
        except subprocess.TimeoutExpired:
            proc = None
        finally:
            driver.done.set()
            if driver.is_alive():
                driver.join()
        if proc is None:
            problems = ["the stage did not finish: it hangs on this fault"]
        else:
            if s.event == "restart" and not servers[0].up:
                servers[0].start()
            ev = fc.gather(project, proc, [a for srv in servers for a in srv.log], t0)
            problems = check(s, ev, ctx, prompts, driver, servers, urls)
            if s.expected == "complete" and not problems and ev.metrics and ev.metrics["failed"]:
                rerun, more = _rerun(s, project, servers, ev, ctx, prompts)
                problems += more
    finally:
        for srv in servers:
            srv.close()
    row = {
        "name": s.name,
        "backend": s.label,
        "outcome": _outcome(ev) if ev else "hung",
        "expected": s.expected,
        "ok": not problems,
        "detail": _problems(problems) if problems else _summary(ev, rerun),
    }
    return Result(row, ev, rerun, prompts)


def check(s: Scenario, ev: fc.Evidence, ctx: Context, prompts: int, driver: Driver, servers, urls) -> list[str]:
    problems = fc.check_process(ev, s.expected, s.cause)
    problems += fc.check_rows(ev.rows, ctx.model, MAX_TOKENS)
    problems += fc.check_backing(ev.rows, ev.log, ctx.model)
    if s.event in ("restart", "one_dies", "all_die") and not driver.fired:
        problems.append("the run ended before the server event: nothing was tested")
    if s.expected == "complete":
        problems += fc.check_metrics(ev, prompts, s.text_only, unseen_connections=s.event is not None)
    else:
        problems += fc.check_stopped_store(ev)
        if s.event == "none_up":
            line = ev.stderr.strip()
            problems += [f"the line does not name {url}" for url in urls if url not in line]
            if ev.rows or ev.log:
                problems.append("a request was sent although no server was healthy at start")
    if s.name == "http_429_retry_after":
        problems += check_retry_after(ev.log)
    if s.name == "stall_past_timeout":
        stalled = [a.rid for a in ev.log if a.outcome == "stall"]
        if not stalled or not set(stalled) <= set(servers[0].aborts):
            problems.append(f"the attempt given up on was not aborted on the server: {stalled} vs {servers[0].aborts}")
    return problems


def check_retry_after(log) -> list[str]:
    """Each request answered 429 was retried no sooner than its Retry-After."""
    problems = []
    for a in log:
        if a.outcome != "status" or a.retry_after is None:
            continue
        nxt = next((b for b in log if b.context == a.context and b.t_start > a.t_start), None)
        if nxt is None:
            problems.append(f"#{a.index}: the request answered 429 was never retried")
        elif nxt.t_start - a.t_end < a.retry_after:
            problems.append(
                f"#{a.index}: retried {nxt.t_start - a.t_end:.2f}s after a Retry-After of {a.retry_after:g}s"
            )
    return problems


def _rerun(s: Scenario, project: Path, servers, first: fc.Evidence, ctx: Context, prompts: int):
    """The failed prompts are retried by the next run: with the faults gone, it must answer exactly those."""
    for srv in servers:
        srv.faults, srv.every = {}, None
    marks = [len(srv.log) for srv in servers]
    t0 = time.time()
    proc = fc.run_stage(project, "generate")
    ev = fc.gather(project, proc, [a for srv, m in zip(servers, marks) for a in srv.log[m:]], t0)
    problems = [f"rerun: {p}" for p in fc.check_process(ev, "complete")]
    problems += [f"rerun: {p}" for p in fc.check_rows(ev.rows, ctx.model, MAX_TOKENS)]
    problems += [f"rerun: {p}" for p in fc.check_backing(ev.rows, first.log + ev.log, ctx.model)]
    problems += fc.check_rerun(ev, first, prompts)
    return ev, problems


def _outcome(ev: fc.Evidence) -> str:
    lines = [line for line in ev.stderr.splitlines() if line.strip()]
    if ev.rc == 0:
        return "complete"
    if ev.rc == 2 and len(lines) == 1 and "Traceback" not in ev.stderr:
        return "stopped"
    return f"exit {ev.rc}"


def _problems(problems: list[str]) -> str:
    """The first two problems, and how many there are: a broken count usually breaks it for every row."""
    more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
    return "; ".join(problems[:2])[:300] + more


def _summary(ev: fc.Evidence, rerun: fc.Evidence | None) -> str:
    if ev.metrics is None:
        kept = sum(r["finish_reason"] in fc.COMPLETE for r in ev.rows.values())
        return f"{kept} responses kept in the store; {ev.stderr.strip()[:160]}"
    m = ev.metrics
    counts = ", ".join(f"{k}={v}" for k, v in sorted(m["attempt_failures"].items())) or "none"
    failed = ", ".join(f"{k}={v}" for k, v in sorted(m["failed"].items())) or "none"
    text = (
        f"{m['responses']} responses, {m['completion_tokens']} tokens; attempt failures {counts}; failed "
        f"{failed}; lost {m['lost_tokens']}, parked {m['parked_tokens']}"
    )
    if rerun is not None and rerun.metrics:
        text += f"; rerun: {rerun.metrics['responses']} responses, {len(rerun.log)} requests"
    return text


def print_table(rows: list[dict]) -> None:
    cols = ("name", "backend", "expected", "outcome", "ok", "detail")
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join(" --- " for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", nargs="+", choices=[s.name for s in SCENARIOS], help="run these scenarios only")
    p.add_argument("--keep", type=Path, help="keep each scenario's project under this directory")


def run(args) -> dict:
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = prepare(work)
        rows = []
        for s in chosen:
            t0 = time.perf_counter()
            rows.append(run_scenario(s, ctx).row)
            rows[-1]["wall_s"] = round(time.perf_counter() - t0, 1)
            print(f"{s.name}: {'ok' if rows[-1]['ok'] else 'FAILED'} ({rows[-1]['wall_s']}s)", flush=True)
    print_table(rows)
    failed = sum(not r["ok"] for r in rows)
    outcomes = Counter(r["outcome"] for r in rows)
    print(f"{len(rows)} scenarios, {failed} failed; outcomes: {dict(outcomes)}")
    return {
        "figures": {"fault_scenarios": len(rows), "fault_failed": failed},
        "rows": rows,
        "goal_met": failed == 0 and len(rows) >= len(SCENARIOS),
    }
