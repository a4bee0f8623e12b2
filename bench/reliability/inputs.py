"""Bad inputs and params, each run through the real stage: refused in one clear line, or counted as a skip.

Every case runs `python -m stages.<stage> dataset=B` as a subprocess in a project directory of its own (its own
params.yaml, as the tests use), with the generate backend pointed at a loopback OpenAI-compatible server that
counts requests, so "refused before any request" is checked, not assumed. A case is clear when the stage exits
non-zero with exactly one `error: ...` line on stderr (no traceback) that names the file and line or the config
key the case expects, with no generation request sent and no earlier file changed; or, where the config asks for
skipping, when it exits 0 and its metrics count the skip. The rules are in inputs_check.py, the cases in
inputs_cases.py. Figures: bad_inputs (cases run) and bad_inputs_unclear (cases handled otherwise); goal: at
least 30 cases, none unclear.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from bench.reliability.inputs_check import run_case

MIN_CASES = 30
COLUMNS = (("case", 36), ("stage", 13), ("expected", 42), ("got", 66), ("s", 5), ("req", 3), ("ok", 3))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="run only the cases whose name contains TEXT (repeatable; the figures then cover those)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary projects (their path is printed)")


def run(args: argparse.Namespace) -> dict:
    from bench.reliability.inputs_cases import all_cases
    from bench.reliability.inputs_workspace import Assets

    root = Path(tempfile.mkdtemp(prefix="draftdata-inputs-"))
    print(f"building the tiny target, the servers and the base project in {root} ...", flush=True)
    assets = Assets(root)
    rows = []
    try:
        cases = [c for c in all_cases(assets) if not args.only or any(t in c.name for t in args.only)]
        print(_line({c: c for c, _ in COLUMNS}))
        print(_line({c: "-" * w for c, w in COLUMNS}))
        for case in cases:
            row = run_case(case, assets)
            rows.append(row)
            print(
                _line(
                    {
                        **row,
                        "case": row["name"],
                        "s": row["seconds"],
                        "req": row["requests"],
                        "ok": "yes" if row["ok"] else "NO",
                    }
                ),
                flush=True,
            )
    finally:
        assets.close()
        if args.keep:
            print(f"projects kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    unclear = [r for r in rows if not r["ok"]]
    figures = {"bad_inputs": len(rows), "bad_inputs_unclear": len(unclear)}
    print(f"\n{len(rows)} bad inputs, {len(unclear)} handled unclearly")
    for r in unclear:
        print(f"  {r['name']} ({r['stage']}; {r['what']}): {'; '.join(r['problems'])}\n    seen: {r['got']}")
    for r in rows:
        if r.get("disk") == "tmpfs":
            print(f"  note: {r['name']} wrote to a small tmpfs filled up (a real ENOSPC)")
        elif r.get("disk"):
            print(
                f"  note: {r['name']} filled no real disk: mounting a tmpfs was not permitted, so the run had a "
                f"per-file size limit (RLIMIT_FSIZE: EFBIG 'File too large', not ENOSPC)",
                file=sys.stderr,
            )
    return {
        "figures": figures,
        "rows": rows,
        "goal_met": figures["bad_inputs"] >= MIN_CASES and figures["bad_inputs_unclear"] == 0,
    }


def _line(row: dict) -> str:
    return "| " + " | ".join(_cell(str(row.get(c, "")), w) for c, w in COLUMNS) + " |"


def _cell(text: str, width: int) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text.ljust(width) if len(text) <= width else text[: width - 1] + "…"
