"""The demo as a newcomer meets it, on a fresh clone: the figures README and the docs quote about it.

    python -m bench.demo [--install] [--fresh-kernel] [--out bench/results/demo.json]

Clones this repository's HEAD into a temporary folder and runs there what README says to run: with `--install`, the
install line in a new venv (timed; pip's own cache makes it faster than a machine that never downloaded the wheels),
else this interpreter's environment; then `dvc repro` (timed, every line stamped as it is printed), and after it
`draftdata plan`, `draftdata verify dataset=B3_magicoder`, two family exports of B3_magicoder and a second
`dvc repro`. `--fresh-kernel` gives the decode-attention kernel an empty build folder, so its first build is timed
too. It writes what it read (no path of this machine) to the results file; `python -m bench.report --write` renders
README's demo paragraph and the docs' plan, verify and disk examples from it, and tests/test_bench_demo.py keeps
them equal and the file in step with params.yaml's demo.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "demo.json"
VERIFIED = "B3_magicoder"  # the dataset verify, the exports and the raised budget read (the docs' examples)
QUOTED = ("B6_ultrachat", "I already read the encyclopedia article")  # README quotes its answer
RAISED = 1_500  # B3_magicoder's budget planned, then generated (docs/generation.md's example)
EXPORTS = ("eagle3", "dflash")  # two families exported side by side (each its own folder)
LOG_EVERY_S = 1.0  # run.log_every_s in the clone (the schema's default is 10)
ETA_FACTOR, ETA_SLACK_S = 2.0, 1.0  # as tests/test_generate.py checks a run's ETAs
INSTALL = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ."


def stamped(argv: list[str], cwd: Path, env: dict) -> tuple[int, list[tuple[float, str]], float]:
    """Run `argv`, each line of its output with the time it came (seconds from the start); its exit status, its
    lines and its wall time."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stdout]
    return proc.wait(), lines, time.monotonic() - t0


def run(argv: list[str], cwd: Path, env: dict) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def eta_check(lines: list[tuple[float, str]]) -> dict:
    """Every progress line's ETA against the time its stage's progress really went on (to its last progress line):
    how many there were, how many fell outside ETA_FACTOR (or ETA_SLACK_S), and the `ETA 0s` lines with work left."""
    units = {"s": 1, "min": 60, "h": 3600}
    by_stage: dict[str, list[tuple[float, float | None]]] = {}
    for t, line in lines:
        m = re.match(r"generate (\S+)( \[\S+\])?: ", line)
        if m is None:
            continue
        eta = re.search(r"ETA ([\d.]+)(s|min|h)", line)
        by_stage.setdefault(m[1] + (m[2] or ""), []).append((t, float(eta[1]) * units[eta[2]] if eta else None))
    etas = outside = zero_with_work = 0
    worst = 1.0
    for marks in by_stage.values():
        end = marks[-1][0]
        for t, eta in marks:
            if eta is None:
                continue
            left, etas = end - t, etas + 1
            outside += not (left / ETA_FACTOR - ETA_SLACK_S <= eta <= left * ETA_FACTOR + ETA_SLACK_S)
            zero_with_work += eta == 0 and left > ETA_SLACK_S
            if left > ETA_SLACK_S:
                worst = max(worst, eta / left, left / max(eta, 0.5))
    return {
        "lines": [[round(t, 2), line] for t, line in lines if re.match(r"generate \S+( \[\S+\])?: ", line)],
        "progress_lines": sum(len(m) for m in by_stage.values()),
        "eta_lines": etas,
        "eta_outside_factor": outside,
        "eta_0s_with_work_left": zero_with_work,
        "eta_worst_ratio": round(worst, 2),
        "factor": ETA_FACTOR,
        "slack_s": ETA_SLACK_S,
    }


def turns_before_after(clone: Path, params: dict, py: str, env: dict) -> dict:
    """The `turns: all` datasets as the demo ran them, and each again on `turns: last` (prompts, generate and tokenize
    with the override, into the same files: run last): the trained share before and after, and how the
    conversations went."""
    out = {}
    for name, ds in params["datasets"].items():
        if ds.get("turns", "last") != "all":
            continue
        d = clone / "data" / name
        g, t = (json.loads((d / f"{s}_metrics.json").read_text()) for s in ("generate", "tokenize"))
        after = {
            "on_tool_divergence": ds.get("on_tool_divergence"),
            "trained_share": round(t["trained_tokens"] / t["tokens"], 3),
            "turns": g["turns_regenerated"],
            "conversations": g["conversations"],
            "ended": g["conversations_ended"],
            "budget_tokens": g["budget_tokens"],
            "budget": g["budget"],
        }
        for stage in ("prompts", "generate", "tokenize"):
            run([py, "-m", f"stages.{stage}", f"dataset={name}", f"datasets.{name}.turns=last"], clone, env)
        t = json.loads((d / "tokenize_metrics.json").read_text())
        out[name] = after | {"trained_share_last": round(t["trained_tokens"] / t["tokens"], 3)}
    return out


def quoted_answer(responses: Path, opening: str) -> str | None:
    """The answer to the first user message that opens with `opening` (README quotes it)."""
    for line in responses.read_text().splitlines():
        row = json.loads(line)
        user = next((m["content"] for m in row["messages"] if m["role"] == "user"), "")
        if isinstance(user, str) and user.startswith(opening):
            return row["text"]
    return None


def processor() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def dataset_figures(clone: Path, name: str) -> dict:
    d = clone / "data" / name
    g = json.loads((d / "generate_metrics.json").read_text())
    h = json.loads((d / "hidden_states_metrics.json").read_text())
    t = json.loads((d / "tokenize_metrics.json").read_text())
    return {
        "budget": g["budget"],
        "budget_tokens": g["budget_tokens"],
        "budget_met": g["budget_met"],
        "responses": g["responses"],
        "generate_wall_s": g["wall_s"],
        "new_tokens": g["new_tokens"],
        "new_in_output_tokens": g["new_in_output_tokens"],
        "samples": t.get("samples"),
        "tokens": h.get("tokens"),
        "trained_tokens": h.get("trained_tokens"),
        "bytes_per_token": h.get("bytes_per_token"),
        "bytes_per_trained_token": h.get("bytes_per_trained_token"),
        "per_trained_token": h.get("per_trained_token"),
    }


def demo(tmp: Path, args: argparse.Namespace, head: str) -> dict:
    """The run in a clone under `tmp`, and what it read."""
    clone = Path(tmp) / "draftdata"
    run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], Path(tmp), dict(os.environ))
    env = dict(os.environ, DVC_NO_ANALYTICS="1", PYTHONUNBUFFERED="1")
    if args.fresh_kernel:
        env["TORCH_EXTENSIONS_DIR"] = str(Path(tmp) / "torch_extensions")
    install_s = None
    if args.install:
        t0 = time.monotonic()
        run(["bash", "-c", INSTALL], clone, env)
        install_s = round(time.monotonic() - t0, 1)
        env["PATH"] = f"{clone / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
    else:
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    py = "python" if args.install else sys.executable  # the new venv's (first on the PATH), or this one
    # a progress line a second (a run-time knob: the outputs are the same), so that the ETAs are read often
    params_file = clone / "params.yaml"
    edited = params_file.read_text().replace("\nrun:\n", f"\nrun:\n  log_every_s: {LOG_EVERY_S}\n", 1)
    assert "log_every_s" in edited, "params.yaml has no run: section"
    params_file.write_text(edited)
    status, lines, repro_s = stamped([py, "-m", "dvc", "repro"], clone, env)
    if status != 0:
        sys.exit("error: dvc repro failed:\n" + "\n".join(line for _, line in lines[-60:]))
    text = [line for _, line in lines]
    quoted = quoted_answer(clone / "data" / QUOTED[0] / "responses.jsonl", QUOTED[1])
    params = yaml.safe_load((clone / "params.yaml").read_text())
    model = json.loads((clone / params["model"]["path"] / "config.json").read_text())
    figures = {name: dataset_figures(clone, name) for name in params["datasets"]}  # before anything reruns a stage
    kernel = [line for line in text if "decode-attention kernel" in line]
    # `python -m draftdata` in the clone: its code, whichever checkout this interpreter has installed
    draftdata = [py, "-m", "draftdata"]
    raise_b3 = f"datasets.{VERIFIED}.token_budget={RAISED}"
    plan = run([*draftdata, "plan", raise_b3, "plan.out=plan.json"], clone, env)
    planned = json.loads((clone / "plan.json").read_text())
    plan_one = run([*draftdata, "plan", f"dataset={VERIFIED}"], clone, env)
    verify = run([*draftdata, "verify", f"dataset={VERIFIED}"], clone, env)
    for family in EXPORTS:
        export = [f"dataset={VERIFIED}", "export.format=speculators", f"export.family={family}"]
        run([*draftdata, "export", *export], clone, env)
    exported = sorted(p.name for p in (clone / "data" / VERIFIED).iterdir() if p.name.startswith("export-"))
    _, again, _ = stamped([py, "-m", "dvc", "repro"], clone, env)
    # a generate run whose budget the store meets: it sends nothing and says so
    met = run([py, "-m", "stages.generate", f"dataset={VERIFIED}"], clone, env)
    met_line = next(line for line in met.splitlines() if "status=budget met" in line)
    turns = turns_before_after(clone, params, py, env)
    # the raised budget generated, as the plan above planned it (last: it rewrites the dataset's responses)
    t0 = time.monotonic()
    run([py, "-m", "stages.generate", f"dataset={VERIFIED}", raise_b3], clone, env)
    raised_s = time.monotonic() - t0
    raised = json.loads((clone / "data" / VERIFIED / "generate_metrics.json").read_text())
    result = {
        "commit": head,
        "machine": {"cpus": os.cpu_count(), "processor": processor()},
        "model": {
            "path": params["model"]["path"],
            "layers": model["num_hidden_layers"],
            "hidden": model["hidden_size"],
        },
        "install_s": install_s,
        "repro_s": round(repro_s, 1),
        "stages_run": sum("Running stage" in line for line in text),
        "kernel_lines": kernel,
        "kernel_built": bool(args.fresh_kernel),
        "dvc_empty_warnings": sum(" is empty." in line for line in text),
        "progress": eta_check(lines) | {"log_every_s": LOG_EVERY_S},
        "datasets": figures,
        "plan_command": f"draftdata plan {raise_b3}",
        "plan": plan.rstrip("\n"),
        "planned": next(d for d in planned["datasets"] if d["dataset"] == VERIFIED),
        "plan_bytes_per_token": planned["model"]["bytes_per_token"],
        "plan_one": plan_one.rstrip("\n"),
        "raised": {
            "budget": RAISED,
            "stage_s": round(raised_s, 1),
            **{k: raised[k] for k in ("responses", "newly_generated", "continued", "new_tokens")},
            **{k: raised[k] for k in ("continued_tokens", "prompt_tokens", "completion_tokens", "wall_s")},
        },
        "verify_dataset": VERIFIED,
        "verify": verify.rstrip("\n"),
        "exports": exported,
        "quoted_answer": quoted,
        "budget_met_line": met_line,
        "turns_all": turns,
        "second_repro_stages_run": sum("Running stage" in line for _, line in again),
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--install", action="store_true", help="time README's install line in a new venv")
    ap.add_argument("--fresh-kernel", action="store_true", help="build the decode-attention kernel from nothing")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed), for a look after")
    args = ap.parse_args()
    head = run(["git", "rev-parse", "HEAD"], ROOT, dict(os.environ)).strip()
    tmp = tempfile.mkdtemp(prefix="draftdata-demo-")
    print(f"clone: {tmp}/draftdata", flush=True)
    try:
        result = demo(Path(tmp), args, head)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(result, indent=2) + "\n"
    for leak in ("/root", "/home/", "/tmp/", "/work/"):
        if leak in text:
            sys.exit(f"error: the results hold a path of this machine ({leak}...): not written")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}: dvc repro {result['repro_s']} s, {result['stages_run']} stages")


if __name__ == "__main__":
    main()
