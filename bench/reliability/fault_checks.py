"""What a run of `generate@D` against the fault server must leave behind, checked against the server's own log.

Each check returns the problems it found (an empty list: none), so a caller can report every one of them and a test
can show that a planted fault is caught. The truth comes from two places the stage does not control: the greedy
model (every correct answer follows from its prompt alone) and the server's log (which answers finished, which met
a fault, which tokens left the server).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.fake_server import Attempt, GreedyModel

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "sources" / "demo"
DATASET = "B3_magicoder"
SHAPE = "magicoder_oss"
COMPLETE = ("stop", "length")
PARKED = ("budget_cut", "interrupted")
# The client's failure code for each way an attempt ended in the server's log (draftdata/generate/backends/http.py).
# Anything not here (`disconnected`, `aborted`) is an answer the client dropped on its own: never expected in these
# runs.
CODE = {
    "reset": "connection",
    "killed": "connection",
    "stall": "timeout",
    "malformed": "bad_response",
    "no_usage": "bad_response",
}
NOT_RETRIED = {"bad_response"}  # retrying a broken answer only repeats it: the request fails at once


def code_of(a: Attempt) -> str | None:
    if a.outcome == "status":
        return f"http_{a.status}"
    return CODE.get(a.outcome)


# ---- the project the stage runs in ------------------------------------------------------------------------------ #


def build_target(path: Path) -> Path:
    """The target's tokenizer and chat template (all `generate` reads of a model): the demo's byte-level BPE, built
    from the demo prompts as the tiny_model stage builds it."""
    from draftdata.model.tiny import build_tokenizer, iter_demo_texts

    build_tokenizer(iter_demo_texts(DEMO), 2048).save_pretrained(path)
    return path


def dataset_params(max_prompts: int, max_tokens: int, concurrency: int) -> dict:
    """A budget no run reaches: every prompt is answered, so every count has one right value."""
    return {
        "source": {"shape": SHAPE, "path": str(DEMO / f"{DATASET}.jsonl.gz")},
        "max_prompts": max_prompts,
        "max_prompt_tokens": 512,
        "shuffle_seed": 0,
        "on_bad_record": "fail",
        "token_budget": 10**7,
        "budget_unit": "completion",
        "max_tokens": max_tokens,
        "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": -1},
        "on_budget": "cancel",
        "on_truncation": "keep",
        "concurrency": concurrency,
    }


def write_project(path: Path, model: Path, dataset: dict, backend: dict, run: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    params = {
        "model": {"path": str(model), "revision": None, "chat_template": None, "template_kwargs": {}},
        "backend": backend,
        "run": {"store_path": str(path / "store.sqlite"), "log_every_s": 60.0, **(run or {})},
        "datasets": {DATASET: dataset},
    }
    (path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def run_stage(project: Path, stage: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    """`python -m stages.<stage> dataset=<D>` in the project, as DVC runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", f"stages.{stage}", f"dataset={DATASET}"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def copy_prompts(source_project: Path, project: Path) -> int:
    """The prompts stage's output, shared by every scenario (it does not depend on the server)."""
    src = source_project / "data" / DATASET / "prompts.jsonl"
    dst = project / "data" / DATASET / "prompts.jsonl"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return sum(1 for line in src.read_text().splitlines() if line.strip())


# ---- what the run left ------------------------------------------------------------------------------------------ #


@dataclass
class Evidence:
    rc: int
    stderr: str
    rows: dict  # store key -> row (prompt_ids and output_ids as lists)
    responses: list | None  # responses.jsonl, None when the run wrote none
    metrics: dict | None  # generate_metrics.json, None when the run wrote none
    log: list  # the servers' Attempts during this run


def gather(project: Path, proc: subprocess.CompletedProcess, log: list[Attempt], since: float) -> Evidence:
    """Outputs are read only if this run wrote them (newer than `since`, the run's start)."""
    out = project / "data" / DATASET
    fresh = [
        p if p.exists() and p.stat().st_mtime >= since else None
        for p in (out / "responses.jsonl", out / "generate_metrics.json")
    ]
    responses = [json.loads(line) for line in fresh[0].read_text().splitlines() if line.strip()] if fresh[0] else None
    metrics = json.loads(fresh[1].read_text()) if fresh[1] else None
    return Evidence(proc.returncode, proc.stderr, read_store(project / "store.sqlite"), responses, metrics, log)


def read_store(path: Path) -> dict:
    if not path.exists():
        return {}
    with sqlite3.connect(path) as db:
        db.row_factory = sqlite3.Row
        found = [dict(r) for r in db.execute("SELECT * FROM responses")]
    for r in found:
        r["prompt_ids"] = json.loads(r["prompt_ids"]) if r["prompt_ids"] else None
        r["output_ids"] = json.loads(r["output_ids"]) if r["output_ids"] else None
    return {r["key"]: r for r in found}


# ---- checks ----------------------------------------------------------------------------------------------------- #


def check_process(ev: Evidence, expected: str, cause: str = "") -> list[str]:
    """`complete`: exit 0. `stopped`: exit 2 and one line on stderr, `error: ...` naming `cause`. Never a
    traceback."""
    problems = []
    if "Traceback" in ev.stderr:
        problems.append("a traceback on stderr: " + ev.stderr.strip().splitlines()[-1][:200])
    lines = [line for line in ev.stderr.splitlines() if line.strip()]
    if expected == "complete":
        if ev.rc != 0:
            problems.append(f"exit {ev.rc}, expected 0: {' | '.join(lines)[-300:]}")
    else:
        if ev.rc != 2:
            problems.append(f"exit {ev.rc}, expected 2 (stopped with a message)")
        if len(lines) != 1 or not lines[0].startswith("error: "):
            problems.append(f"stderr has {len(lines)} lines, expected one `error: ...` line: {lines[:3]}")
        elif cause and cause not in lines[0]:
            problems.append(f"the line does not name {cause!r}: {lines[0][:200]}")
    return problems


def check_rows(rows: dict, model: GreedyModel, max_tokens: int) -> list[str]:
    """Every stored row is what the model answers to its prompt: a complete answer whole, a parked one a prefix
    (with its token ids, so a later run can continue it)."""
    problems = []
    for key, r in rows.items():
        full, finish = model.answer(r["prompt_ids"], max_tokens)
        ids, n = r["output_ids"], r["completion_tokens"]
        where = f"row {key[:8]}"
        if r["finish_reason"] in COMPLETE:
            if ids is not None and ids != full:
                problems.append(f"{where}: output_ids are not the answer to its prompt ({len(ids)} vs {len(full)})")
            if (n, r["finish_reason"]) != (len(full), finish):
                problems.append(f"{where}: {n} tokens, {r['finish_reason']}; the answer has {len(full)}, {finish}")
            if r["text"] != model.text(full):
                problems.append(f"{where}: text is not the answer's: {r['text'][:60]!r}")
        elif r["finish_reason"] in PARKED:
            if ids is None or len(ids) != n or not 0 < n < len(full) or ids != full[:n]:
                problems.append(f"{where}: parked, but not a continuable prefix of the answer ({n} tokens)")
        else:
            problems.append(f"{where}: finish_reason {r['finish_reason']!r} stored")
    return problems


def _backing(r: dict, a: Attempt) -> bool:
    """Whether attempt `a` produced the end of row `r`: it continued the row's prompt and what came before, and
    sent the rest (text-only rows: it answered the prompt with the row's text)."""
    prompt, ids = r["prompt_ids"], r["output_ids"]
    if ids is None:
        return a.context == prompt and len(a.sent) == r["completion_tokens"] > 0
    k = len(a.context) - len(prompt)
    return 0 <= k <= len(ids) and a.context == prompt + ids[:k] and ids[k:] == a.sent


def check_backing(rows: dict, log: list[Attempt], model: GreedyModel) -> list[str]:
    """No faulty answer is stored and no finished one is lost: every complete row ends with an answer the server
    finished, every parked row with the tokens of an attempt that did not finish, and every answer the server
    finished is a stored complete row, once (a second complete answer to one prompt is generation wasted)."""
    problems = []
    complete = [a for a in log if a.outcome == "complete"]
    for key, r in rows.items():
        done = r["finish_reason"] in COMPLETE
        pool = complete if done else [a for a in log if a.outcome != "complete" and a.sent]
        if not any(_backing(r, a) and (r["output_ids"] is not None or model.text(a.sent) == r["text"]) for a in pool):
            what = "a finished answer" if done else "an unfinished attempt's tokens"
            problems.append(f"row {key[:8]} ({r['finish_reason']}) is not {what} from the server's log")
    finished = Counter()
    for a in complete:
        owners = [k for k, r in rows.items() if r["finish_reason"] in COMPLETE and _backing(r, a)]
        if not owners:
            problems.append(f"{a.server} #{a.index}: an answer the server finished is not in the store")
        finished.update(owners)
    problems += [f"row {k[:8]}: the server finished {n} answers to it" for k, n in finished.items() if n > 1]
    dropped = [a for a in log if a.outcome in ("disconnected", "aborted")]
    if dropped:
        problems.append(f"the client dropped {len(dropped)} answers while the server was producing them")
    return problems


def expected_counts(log: list[Attempt], text_only: bool) -> tuple[Counter, Counter, int]:
    """From the server's log: failed attempts by the client's code, requests that end failed (a broken answer is
    not retried), and the tokens a text-only client must count as lost (streamed, then cut: nothing to go on from)."""
    attempts = Counter(c for a in log if (c := code_of(a)))
    failed = Counter(c for a in log if (c := code_of(a)) in NOT_RETRIED)
    lost = sum(len(a.sent) for a in log if text_only and a.stream and a.outcome != "complete")
    return attempts, failed, lost


def asked_again(log: list[Attempt], rows: dict, text_only: bool) -> tuple[int, int, int]:
    """Under landing exact a request that failed is asked once more in the same run, from the partial it parked
    where that can be continued (streamed ids): of the failed requests in the server's log, (how many were
    continued, the tokens they had parked, the prompts that failed twice and so end the output before them)."""
    prompts = [r["prompt_ids"] for r in rows.values() if r["prompt_ids"]]
    failures: Counter = Counter()
    continued = tokens = 0
    for a in log:
        if code_of(a) not in NOT_RETRIED:
            continue
        prompt = max((p for p in prompts if a.context[: len(p)] == p), key=len, default=a.context)
        failures[tuple(prompt)] += 1
        had = len(a.context) - len(prompt) + len(a.sent) if a.stream and not text_only else 0
        if failures[tuple(prompt)] == 1 and had:
            continued, tokens = continued + 1, tokens + had
    return continued, tokens, sum(n > 1 for n in failures.values())


def check_metrics(ev: Evidence, prompts: int, text_only: bool, unseen_connections: bool) -> list[str]:
    """generate_metrics.json and responses.jsonl against the store and the server's log, for a first run on an empty
    store. `unseen_connections`: a server was down, and attempts refused at connect never reach its log, so the
    log only bounds the `connection` count from below."""
    m, out = ev.metrics, ev.responses
    if m is None or out is None:
        return ["no generate_metrics.json or responses.jsonl written"]
    problems = []
    attempts, failed, lost = expected_counts(ev.log, text_only)
    got = Counter(m["attempt_failures"])
    if unseen_connections:
        if got["connection"] < attempts["connection"]:
            problems.append(
                f"attempt_failures.connection {got['connection']} < {attempts['connection']} cut by the server"
            )
        got.pop("connection", None)
        attempts.pop("connection", None)
    if got != attempts:
        problems.append(f"attempt_failures {dict(m['attempt_failures'])}, the server's log says {dict(attempts)}")
    if Counter(m["failed"]) != failed:
        problems.append(f"failed {m['failed']}, the server's log says {dict(failed)}")
    stored = {k: r for k, r in ev.rows.items() if r["finish_reason"] in COMPLETE}
    for rec in out:
        r = stored.get(rec["key"])
        fields = ("prompt_ids", "output_ids", "text", "completion_tokens", "finish_reason")
        if r is None or any(rec[f] != r[f] for f in fields):
            problems.append(f"responses.jsonl row {rec['id']} is not the stored complete response")
    if len({rec["id"] for rec in out}) != len(out):
        problems.append("responses.jsonl repeats a prompt")
    continued, again, twice = asked_again(ev.log, ev.rows, text_only)
    want = prompts - twice
    if not m["responses"] == len(out) == want:
        problems.append(
            f"responses {m['responses']}, responses.jsonl {len(out)}, expected {want} "
            f"({prompts} prompts, {sum(failed.values())} failed, {twice} of them twice)"
        )
    tokens = sum(rec["completion_tokens"] for rec in out)
    parked = sum(r["completion_tokens"] for r in ev.rows.values() if r["finish_reason"] in PARKED)
    figures = {
        "completion_tokens": tokens,
        "kept_tokens": tokens - again,  # a request asked again: its parked part is counted parked, then continued
        "parked_tokens": parked + again,
        "lost_tokens": lost,
        "new_tokens": tokens + parked + lost,
        "wasted_tokens": parked + lost,
        "lost_estimated": False,
        "reused_from_store": 0,
        "continued": continued,
    }
    for name, value in figures.items():
        if m[name] != value:
            problems.append(f"{name} {m[name]}, expected {value}")
    return problems


def check_rerun(ev: Evidence, first: Evidence, prompts: int) -> list[str]:
    """A second run after failures: it sends exactly the failed prompts once each (a parked partial continued from
    its tokens), and the output then holds every prompt."""
    m = ev.metrics
    if m is None or ev.responses is None:
        return ["the rerun wrote no generate_metrics.json or responses.jsonl"]
    problems = []
    missing = {k: r for k, r in first.rows.items() if r["finish_reason"] not in COMPLETE}
    parked = {k: r for k, r in missing.items() if r["output_ids"]}
    done_before = len(first.rows) - len(missing)
    owners = Counter(k for a in ev.log for k, r in ev.rows.items() if _backing(r, a))
    if not len(ev.log) == sum(owners.values()) == prompts - done_before or any(n != 1 for n in owners.values()):
        problems.append(
            f"the rerun sent {len(ev.log)} requests, expected one for each of the "
            f"{prompts - done_before} prompts without a response"
        )
    for k, r in parked.items():
        now = ev.rows.get(k)
        if (
            now is None
            or now["finish_reason"] not in COMPLETE
            or now["output_ids"][: len(r["output_ids"])] != r["output_ids"]
        ):
            problems.append(f"row {k[:8]}: the parked partial was not continued into a complete response")
    figures = {
        "responses": prompts,
        "failed": {},
        "attempt_failures": {},
        "reused_from_store": done_before,
        "continued": len(parked),
        "continued_tokens": sum(r["completion_tokens"] for r in parked.values()),
    }
    for name, value in figures.items():
        if m[name] != value:
            problems.append(f"rerun {name} {m[name]}, expected {value}")
    return problems


COMMITTED = re.compile(r"\((\d+) responses committed this run are in the store\)")


def check_stopped_store(ev: Evidence) -> list[str]:
    """A run that stopped says how many responses it committed: the store holds exactly those."""
    match = COMMITTED.search(ev.stderr)
    complete = sum(r["finish_reason"] in COMPLETE for r in ev.rows.values())
    if match and int(match.group(1)) != complete:
        return [f"the message says {match.group(1)} responses committed, the store holds {complete}"]
    return []
