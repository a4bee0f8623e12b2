"""One bad input, run through the real stage, and the verdict on how the stage handled it.

A case is handled clearly when the stage either
- refuses it: a non-zero exit (not a signal), exactly one line on stderr, `error: ...`, no traceback, the line
  names what the case says it must (the file and line, or the config key), no generation request reached a server,
  and no file that existed before was changed or removed; or
- counts it as a skip, where the config asks for skipping: exit 0 and the stage's metrics hold the expected counts.
Anything else (a traceback, a vague or multi-line message, a request sent, a slow hub lookup, data lost) is unclear.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.reliability.inputs_workspace import DATASET, Assets, SetupError, Workspace

Name = str | tuple  # a string the line must hold, or a tuple of alternatives (any one will do)

# Earlier outputs each stage reads, copied from the base project before the case's own setup.
INPUTS = {
    "prompts": (),
    "generate": ("prompts.jsonl",),
    "tokenize": ("prompts.jsonl", "responses.jsonl"),
    "hidden_states": ("prompts.jsonl", "responses.jsonl", "samples.parquet"),
}


@dataclass
class Case:
    name: str
    stage: str
    what: str  # the bad input, in words
    setup: Callable[[Workspace], None]
    refused: tuple = ()  # what the one stderr line must name
    secret: str = ""  # what the output must never show (a key pasted where its variable's name belongs)
    # {metrics file: {dotted key: value}} for inputs the config says to skip; a value may be a function giving it
    # (called when judged, so a base output it counts is made only for the cases that run)
    counted: dict | None = None
    dataset: str = DATASET
    overrides: tuple = ()
    inputs: tuple | None = None  # earlier outputs to copy in; None: what the stage reads (INPUTS)
    may_change: tuple = ()  # path prefixes the run may rightly rewrite (e.g. the store it appends to)
    after: Callable[[Workspace], str | None] | None = None  # what was lost (checked after the run), or None
    max_s: float | None = None  # a refusal slower than this did not fail fast (e.g. it waited on a hub)
    sends: bool = False  # the bad input shows only once generation runs (a full disk): requests are expected
    timeout_s: float = 180.0

    def __post_init__(self) -> None:
        assert bool(self.refused) != bool(self.counted), f"{self.name}: expect a refusal or a count, not both"

    def expected(self) -> str:
        if self.counted:
            counts = (f"{k}={_shown(v)}" for want in self.counted.values() for k, v in want.items())
            return "counted as skip: " + ", ".join(counts)
        return "refused naming " + " & ".join(_show(n) for n in self.refused)


@dataclass
class Outcome:
    rc: int | None  # None: killed at the case's timeout
    stderr: str = ""
    stdout: str = ""  # read only to make sure a secret is not shown
    seconds: float = 0.0
    requests: int = 0  # generation requests (POSTs) the servers received
    changed: list = field(default_factory=list)  # files that existed before the run and were changed or removed
    metrics: dict = field(default_factory=dict)  # metrics file -> its content, for counted cases
    lost: str | None = None  # the case's own check of earlier outputs


def judge(case: Case, out: Outcome) -> list[str]:
    """The problems with how the stage handled the case; empty when it was handled clearly."""
    if out.rc is None:
        return [f"no answer within {case.timeout_s:.0f}s"]
    problems = []
    if "Traceback (most recent call last)" in out.stderr:
        problems.append("traceback")
    if case.refused:
        problems += _refusal_problems(case, out)
    else:
        problems += _count_problems(case, out)
    changed = [p for p in out.changed if not p.startswith(case.may_change)]
    if changed:
        problems.append(f"changed or removed: {', '.join(changed[:3])}")
    if out.lost:
        problems.append(out.lost)
    if case.max_s is not None and out.seconds > case.max_s:
        problems.append(f"took {out.seconds:.0f}s, not a fast failure (limit {case.max_s:.0f}s)")
    return problems


def _refusal_problems(case: Case, out: Outcome) -> list[str]:
    if out.rc == 0:
        return ["exit 0: not refused"] + ([f"{out.requests} requests reached the server"] if out.requests else [])
    problems = [f"killed by signal {-out.rc}"] if out.rc < 0 else []
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr")
    line = lines[-1] if lines else ""
    if not line.startswith("error: "):
        problems.append("the last line is not an `error: ` line")
    missing = [_show(n) for n in case.refused if not any(alt in line for alt in _alternatives(n))]
    if missing:
        problems.append(f"does not name {', '.join(missing)}")
    if case.secret and (case.secret in out.stderr or case.secret in out.stdout):
        problems.append("shows the secret it was given")
    if out.requests and not case.sends:
        problems.append(f"{out.requests} requests reached the server")
    return problems


def _count_problems(case: Case, out: Outcome) -> list[str]:
    if out.rc != 0:
        return [f"exit {out.rc}: not counted"]
    problems = []
    for file, want in case.counted.items():
        doc = out.metrics.get(file)
        if doc is None:
            problems.append(f"no {file}")
            continue
        for key, value in want.items():
            try:
                value = _value(value)
            except SetupError as e:
                problems.append(f"setup failed: {e}")
                continue
            got = _dotted(doc, key)
            if got != value:
                problems.append(f"{file}: {key}={got}, expected {value}")
    return problems


def got(case: Case, out: Outcome) -> str:
    """What the stage did, in one line for the table: its exit code and last stderr line (or the counts)."""
    if out.rc is None:
        return f"timed out after {case.timeout_s:.0f}s"
    if case.counted and out.rc == 0:
        return "exit 0; " + ", ".join(
            f"{k}={_dotted(out.metrics.get(f) or {}, k)}" for f, want in case.counted.items() for k in want
        )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "(nothing on stderr)"
    return f"exit {out.rc}: {last.replace(case.secret, '<the secret>') if case.secret else last}"


def run_case(case: Case, assets: Assets) -> dict:
    """Prepare the case's project, run the stage once as a subprocess, and report the row of the table."""
    ws = assets.workspace(case.name)
    try:
        try:
            inputs = INPUTS[case.stage] if case.inputs is None else case.inputs
            if inputs:
                ws.copy_base(*inputs)
            case.setup(ws)
        except SetupError as e:
            out = Outcome(rc=None)
            return _row(case, out, [f"setup failed: {e}"], f"setup failed: {e}", ws)
        before = snapshot(ws.path)
        assets.reset()
        t0 = time.monotonic()
        try:
            proc = ws.run(case.stage, case.dataset, case.overrides, case.timeout_s)
            out = Outcome(proc.returncode, proc.stderr, proc.stdout)
        except subprocess.TimeoutExpired as e:
            out = Outcome(None, _text(e.stderr), _text(e.stdout))
        out.seconds = time.monotonic() - t0
        out.requests = assets.requests()
        out.changed = changed_files(before, snapshot(ws.path))
        if case.counted:
            out.metrics = {f: _read_json(ws.path / "data" / case.dataset / f) for f in case.counted}
        if case.after is not None:
            out.lost = case.after(ws)
        return _row(case, out, judge(case, out), got(case, out), ws)
    finally:
        for cleanup in reversed(ws.cleanups):
            cleanup()


def _row(case: Case, out: Outcome, problems: list[str], seen: str, ws: Workspace) -> dict:
    row = {
        "name": case.name,
        "stage": case.stage,
        "what": case.what,
        "expected": case.expected(),
        "got": seen,
        "exit_code": out.rc,
        "seconds": round(out.seconds, 1),
        "requests": out.requests,
        "ok": not problems,
        "problems": problems,
    }
    if ws.disk:
        row["disk"] = ws.disk
    return row


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` by its relative path -> sha256 (the projects are small)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name != ".filler":
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [p for p, digest in before.items() if after.get(p) != digest]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _dotted(doc: Any, key: str) -> Any:
    for part in key.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def _value(value: Any) -> Any:
    return value() if callable(value) else value


def _shown(value: Any) -> str:
    try:
        return str(_value(value))
    except SetupError:  # the base output it counts could not be made: the row says why
        return "?"


def _alternatives(name: Name) -> tuple:
    return name if isinstance(name, tuple) else (name,)


def _show(name: Name) -> str:
    return " | ".join(_alternatives(name))


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
