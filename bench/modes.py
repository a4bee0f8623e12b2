"""Modes by weight, landed: a dataset with think 0.7 / plain 0.3 (`datasets.<D>.modes`) on the tiny target with the
shipped qwen3_thinking template, generated in process. How close each mode's output comes to its share of the
budget, and that a raised budget's output holds the smaller one's rows, each in its mode.

    python -m bench.modes [--budgets 12000 16000 20000] [--max-tokens 128]

Setup, in a temp directory: the demo target (draftdata/model/tiny.py) and a `messages` source of real prompts: the
first user turn of every record the eight demo datasets' prompts stages keep (code, chat, reasoning, agent tasks;
those with tools left out). Then the prompts stage, and generate at each budget in turn, one store (each raise
generates what it adds). Under `landing: exact` a share is passed by less than its last answer (`bound_pct`:
max_tokens over the share): each share's overshoot is checked against its last answer and measured against 0.5 %,
which a share under 200 × its last answer cannot promise. Each output is checked to hold the smaller budget's rows,
each in its mode. The tiny target's answers are short (about 17 tokens with thinking off, 33 with it on), so the
source's prompts hold about 25k tokens: the budgets stay under that.

Writes bench/results/modes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODES = {
    "think": {"weight": 0.7, "template_kwargs": {"enable_thinking": True}},
    "plain": {"weight": 0.3, "template_kwargs": {"enable_thinking": False}, "sampling": {"temperature": 0.6}},
}
GOAL_PCT = 0.5


def stage(work: Path, module: str, *overrides: str) -> float:
    """Seconds one stage process takes (its output kept for a failure's message)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *overrides], cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {module} {' '.join(overrides)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def first_turns(work: Path) -> list[dict]:
    """The first user turn (after any system message) of each record the demo datasets' prompts stages keep."""
    rows, seen = [], set()
    for path in sorted((work / "data").glob("B*/prompts.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("tools"):
                continue
            head = []
            for m in rec["messages"]:
                head.append({"role": m["role"], "content": m["content"]})
                if m["role"] == "user":
                    break
            key = json.dumps(head)
            if head[-1]["role"] == "user" and key not in seen:
                seen.add(key)
                rows.append({"messages": head})
    return rows


def setup(work: Path, budget: int, max_tokens: int) -> int:
    """The tiny target, the mixed source and its prompts stage; the source's prompts."""
    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import build_target

    build_target(TinyModelConfig(path=str(work / "tiny"), corpus_dir=str(ROOT / "sources" / "demo")))
    demo = yaml.safe_load((ROOT / "params.yaml").read_text())["datasets"]
    sources = {
        name: {
            "source": {**ds["source"], "path": str(ROOT / ds["source"]["path"])},
            "max_prompts": None,
            "token_budget": 1,
        }
        for name, ds in demo.items()
    }
    params = {"model": {"path": str(work / "tiny")}, "run": {"store_path": "store.sqlite"}, "datasets": sources}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    for name in sources:
        stage(work, "stages.prompts", f"dataset={name}")
    rows = first_turns(work)
    with open(work / "mixed.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    params["model"]["chat_template"] = str(ROOT / "conf" / "templates" / "qwen3_thinking.jinja")
    params["datasets"] = {
        "M": {
            "source": {"shape": "messages", "path": "mixed.jsonl"},
            "max_prompts": None,
            "token_budget": budget,
            "max_tokens": max_tokens,
            "modes": MODES,
        }
    }
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    stage(work, "stages.prompts", "dataset=M")
    return len(rows)


def read(work: Path) -> tuple[dict, dict[str, str]]:
    """generate_metrics.json, with each mode's last answer's tokens (the one that crossed its share) added to its
    row; and each output row's mode."""
    out = work / "data" / "M"
    metrics = json.loads((out / "generate_metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    for r in rows:  # in prompt order: the last of each mode's is its last answer
        metrics["modes"][r["mode"]]["last_answer_tokens"] = r["completion_tokens"]
    return metrics, {r["id"]: r["mode"] for r in rows}


def share_rows(metrics: dict, max_tokens: int) -> dict[str, dict]:
    rows = {}
    for name, m in metrics["modes"].items():
        over = m["budget_tokens"] - m["budget"]
        rows[name] = {
            "share": m["budget"],
            "tokens": m["budget_tokens"],
            "responses": m["responses"],
            "prompts": m["prompts"],
            "overshoot_tokens": over,
            "overshoot_pct": round(100 * over / m["budget"], 4),
            "last_answer_tokens": m["last_answer_tokens"],  # the overshoot is under it
            "bound_pct": round(100 * max_tokens / m["budget"], 4),  # and it is at most max_tokens
            "new_tokens": m["new_tokens"],
            "new_in_output_tokens": m["new_in_output_tokens"],
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[12_000, 16_000, 20_000])
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    budgets = sorted(args.budgets)
    runs = []
    with tempfile.TemporaryDirectory(prefix="draftdata-modes-") as tmp:
        work = Path(tmp)
        sources = setup(work, budgets[0], args.max_tokens)
        for budget in budgets:  # one store: each raise generates what the larger budget adds
            wall = stage(work, "stages.generate", "dataset=M", f"datasets.M.token_budget={budget}")
            metrics, modes = read(work)
            runs.append((budget, wall, metrics, modes))
    rows = []
    for i, (budget, wall, metrics, modes) in enumerate(runs):
        before = runs[i - 1][3] if i else {}
        rows.append(
            {
                "budget": budget,
                "shares": share_rows(metrics, args.max_tokens),
                "rows": len(modes),
                # the smaller budget's rows all here, each in its mode
                "holds_the_smaller_output": all(modes.get(k) == m for k, m in before.items()),
                "generated_per_kept": round(metrics["new_tokens"] / max(1, metrics["new_in_output_tokens"]), 3),
                "wall_s": round(wall, 1),
            }
        )
    shares = [s for r in rows for s in r["shares"].values()]
    within = all(0 <= s["overshoot_pct"] <= GOAL_PCT for s in shares)
    result = {
        "setup": {
            "target": "tiny (draftdata/model/tiny.py), embedded engine",
            "template": "conf/templates/qwen3_thinking.jinja",
            "modes": MODES,
            "source_prompts": sources,
            "max_tokens": args.max_tokens,
        },
        "budgets": rows,
        "goals": {
            "each_share_passed_by_less_than_its_last_answer": all(
                0 <= s["overshoot_tokens"] < s["last_answer_tokens"] for s in shares
            ),
            f"each_share_within_{GOAL_PCT}pct": within,
            "each_output_holds_the_smaller_ones_rows_in_their_modes": all(r["holds_the_smaller_output"] for r in rows),
        },
    }
    result["all_goals_met"] = all(result["goals"].values())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "modes.json").write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        shares = "; ".join(
            f"{name} {s['tokens']:,} of {s['share']:,} (+{s['overshoot_pct']:.3f} %, bound {s['bound_pct']:.3f} %)"
            for name, s in r["shares"].items()
        )
        print(f"budget {r['budget']:,}: {shares}; generated/kept {r['generated_per_kept']}; {r['wall_s']} s")
    print(json.dumps(result["goals"]))


if __name__ == "__main__":
    main()
