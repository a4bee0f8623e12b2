"""A rerun of `generate@D` whose budget is already met, over many prompts: what it costs with the store's cache of
rendered prompt ids, without it, and the floor under both.

    python -m bench.noop [--prompts 100000] [--runs 3]
    python -m bench.noop --turns 3 --prompts 20000      # `turns: all` over conversations of 3 user turns

Setup, in a temp directory: the demo target (draftdata/model/tiny.py), a magicoder_oss source of that many
distinct prompts (with `--turns N`, a `messages` source of that many distinct conversations of N user turns, every
turn regenerated), the prompts stage, and one short stored response for every planned key, every turn of every
conversation (the budget is met, so generate sends nothing). Each figure is the wall and the CPU time (user +
system) of the stage's own process, `python -m stages.generate dataset=S`, Python's start and imports included;
other jobs on a shared machine stretch the wall clock, hardly the CPU time. The runs take turns in each round, so
the machine's changing speed hits all alike:

- cached: the rendered ids come from the store (table `rendered`; `turn_rendered` for the turns of
  conversations), as on any rerun;
- uncached: that table emptied first, so every prompt (every turn) is rendered again (what each rerun cost before
  the cache);
- floor: a process that only starts Python, imports the stage, reads the config and loads the target's tokenizer
  (what any run pays before it reads a prompt).

Writes bench/results/noop.json (with `--turns`: noop_turns.json).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FLOOR = (
    "import stages.generate; from draftdata.config.load import load_config; "
    "from draftdata.model.tokenizer import end_of_turn_ids, load_tokenizer; cfg = load_config('S', []); "
    "end_of_turn_ids(load_tokenizer(cfg.model), cfg.model, cfg.template_kwargs)"
)


def setup(work: Path, prompts: int, turns: int = 1) -> None:
    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import build_target

    build_target(TinyModelConfig(path=str(work / "tiny"), corpus_dir=str(ROOT / "sources" / "demo")))
    with gzip.open(work / "src.jsonl.gz", "wt", compresslevel=1) as f:
        for i in range(prompts):
            f.write(json.dumps(_row(i, turns)))
            f.write("\n")
    dataset = {
        "source": {"shape": "magicoder_oss" if turns == 1 else "messages", "path": "src.jsonl.gz"},
        "max_prompts": prompts,
        "token_budget": 400,
        "max_tokens": 48,
        **({"turns": "all"} if turns > 1 else {}),
    }
    params = {"model": {"path": str(work / "tiny")}, "run": {"store_path": "store.sqlite"}, "datasets": {"S": dataset}}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    stage(work, "-m", "stages.prompts", "dataset=S")
    stage(work, "-c", f"from bench.noop import fill{'' if turns == 1 else '_turns'} as fill; fill()")


def _row(i: int, turns: int) -> dict:
    """Source row i: a magicoder_oss problem, or a conversation of `turns` user turns, each answered."""
    problem = f"Write a function number {i} that adds {i} to its input."
    if turns == 1:
        return {"problem": problem, "solution": "x"}
    asks = [problem, *(f"Now make it add {i + t} instead, as step {t}." for t in range(1, turns))]
    return {
        "messages": [
            m for ask in asks for m in ({"role": "user", "content": ask}, {"role": "assistant", "content": "x"})
        ]
    }


def fill() -> None:
    """One short response for every planned key (run in the work directory): the budget is met."""
    from draftdata.config.load import load_config
    from draftdata.generate.plan.planning import plan_requests
    from draftdata.generate.store import ResponseStore, StoredResponse
    from draftdata.model.target import load_target
    from draftdata.util.files import read_jsonl
    from draftdata.util.sqlite import hash_cache_path

    cfg = load_config("S", [])
    store = ResponseStore("store.sqlite")
    target = load_target(cfg, hash_cache_path(Path("store.sqlite")))
    plan = plan_requests(cfg, list(read_jsonl("data/S/prompts.jsonl")), target, store)
    store.put_many(
        [StoredResponse(p.key, "S", p.prompt["id"], "ok fine", p.prompt_tokens, 8, "stop", "", 0) for p in plan]
    )
    store.close()


def fill_turns() -> None:
    """`--turns`: one short answer (its ids, the end of turn last) to every turn of every conversation, a turn
    depth at a time: each walk finds the next turns, answered before the next walk."""
    from draftdata.config.load import load_config
    from draftdata.generate.plan.planning import plan_conversations
    from draftdata.generate.store import ResponseStore, StoredResponse
    from draftdata.model.target import load_target
    from draftdata.util.files import read_jsonl
    from draftdata.util.sqlite import hash_cache_path

    cfg = load_config("S", [])
    target, store = load_target(cfg, hash_cache_path(Path("store.sqlite"))), ResponseStore("store.sqlite")
    tok = target.tok
    prompts = list(read_jsonl("data/S/prompts.jsonl"))
    ids = tok.encode("ok fine", add_special_tokens=False) + [tok.eos_token_id]
    while todo := {c.next.key: c.next for c in plan_conversations(cfg, prompts, target, store, None)[0] if c.next}:
        rows = [
            StoredResponse(p.key, "S", p.prompt["id"], "ok fine", p.prompt_tokens, len(ids), "stop", "", 0)
            for p in todo.values()
        ]
        for r in rows:
            r.output_ids = ids
        store.put_many(rows)
    store.close()


def stage(work: Path, *args: str) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one process: on a shared machine other jobs stretch the first."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=work, env=env, check=True, capture_output=True)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def forget_renders(work: Path) -> None:
    import sqlite3

    with sqlite3.connect(work / "store.sqlite") as db:
        db.execute("DELETE FROM rendered")
        db.execute("DELETE FROM turn_rendered")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.noop", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--turns", type=int, default=1, help="user turns a conversation (over 1: turns: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    out = args.out or RESULTS / ("noop.json" if args.turns == 1 else "noop_turns.json")
    runs: dict[str, list[tuple[float, float]]] = {"cached": [], "uncached": [], "floor": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        setup(work, args.prompts, args.turns)
        for _ in range(args.runs):
            runs["cached"].append(stage(work, "-m", "stages.generate", "dataset=S"))
            forget_renders(work)
            runs["uncached"].append(stage(work, "-m", "stages.generate", "dataset=S"))  # renders and caches again
            runs["floor"].append(stage(work, "-c", FLOOR))
        metrics = json.loads((work / "data" / "S" / "generate_metrics.json").read_text())
    assert metrics["budget_met"] and metrics["newly_generated"] == 0, metrics  # a no-op run, as measured
    result = {"settings": {"prompts": args.prompts, "runs": args.runs, "reused": metrics["reused_from_store"]}}
    if args.turns > 1:
        result["settings"]["turns"] = args.turns
    for i, unit in enumerate(("wall", "cpu")):
        result[f"{unit}_s"] = {k: [round(r[i], 2) for r in v] for k, v in runs.items()}
        median = result[f"median_{unit}_s"] = {k: round(statistics.median(r[i] for r in v), 2) for k, v in runs.items()}
        result[f"uncached_over_cached_{unit}"] = round(median["uncached"] / median["cached"], 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
