"""Reliability and integrity, in three suites anyone can rerun:

    python -m bench.reliability kill [--trials 93]    SIGKILL in every stage's work and writing, restart, check
    python -m bench.reliability faults                a fault server on loopback: errors, resets, stalls, restarts
    python -m bench.reliability inputs                bad inputs and params, each refused in one clear line

Each suite prints a table and writes its figures into bench/results/reliability.json (the other suites' figures
there are kept): kill_trials, kill_effective, kill_lost, kill_duplicated, kill_stale; fault_scenarios,
fault_failed; bad_inputs, bad_inputs_unclear; and per suite the rows behind them. Goal: every loss and failure
count 0 (and the kills at least 50 that land while a stage works or writes).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "reliability.json"
SUITES = ("kill", "faults", "inputs")
# The suites' work directories (tempfile prefixes in kill.py, faults.py, inputs.py), named the same on every machine
_WORKDIR = re.compile(re.escape(tempfile.gettempdir()) + r"/(?:draftdata-kill-|draftdata-inputs-|faults-)[\w]+")


def portable(value):
    """`value` with this machine's paths taken out of every string: the project's root made relative, a suite's
    temp work directory written `<workdir>`. Committed results then read the same from any checkout."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, str):
        return _WORKDIR.sub("<workdir>", value.replace(f"{ROOT}/", ""))
    return value


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="suite", required=True)
    for name in SUITES:
        module = importlib.import_module(f"bench.reliability.{name}")
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0])
        p.add_argument("--out", type=Path, default=RESULTS)
        module.add_arguments(p)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = importlib.import_module(f"bench.reliability.{args.suite}").run(args)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    doc = json.loads(args.out.read_text()) if args.out.exists() else {}
    doc[args.suite] = portable(res)
    for name in SUITES:  # the goal figures at the top level, from each suite's latest run
        doc.update(doc.get(name, {}).get("figures", {}))
    doc["all_goals_met"] = all(s in doc and doc[s].get("goal_met") for s in SUITES)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"{args.suite}: goal met: {res.get('goal_met')}; wrote {args.out} in {res['wall_s']}s")


if __name__ == "__main__":
    main()
