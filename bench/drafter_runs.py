"""`python -m bench.drafter`'s runs, one per (variant, seed, steps), each kept as it ends and keyed by everything its
figures depend on, so that a long bench can be cut and the same command goes on where it stopped.

A run's key hashes: the variant (its export, layers, final state, family), the seed and steps, the training settings
(max_len, lr, max_anchors, threads, device), the training export's fingerprint and the rows trained on, the held-out
export's fingerprint and rows, the layers it is judged at, its draft vocabulary's file, the trainers' versions and the
code that trains and judges (bench/drafter_train.py). An export's fingerprint hashes its marker, its table of ids and
masks (the arrow files), and the capture's index (the model's fingerprint, the layers, the dtype): the states follow
from those.

Kept in the workdir's `runs/`: `<key>.json` (the run's figures), `<key>.pt` (an EAGLE-3 drafter's trained weights),
`<key>.verify-<hash>.json` (its draft-and-verify figures) and `<key>.vllm-<hash>.json` (vLLM's, serving it). The
results file (`--out`) holds every finished run by key too, written while the runs go on: on another machine, where
the data is made again (the same params give the same data), a run whose key is there is taken from it instead of
being trained again.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from pathlib import Path

from draftdata.util.files import sha256_of
from draftdata.util.hashing import content_hash

HERE = Path(__file__).resolve().parent
TRAIN_CODE, VERIFY_CODE = HERE / "drafter_train.py", HERE / "drafter_verify.py"


def digest(obj) -> str:
    return content_hash(obj, 20)


def export_fingerprint(path: Path, capture_index: Path) -> str:
    """An export's identity: its table files (ids and masks, as `datasets` wrote them), its marker and the capture's
    index it was cut from (the states' model fingerprint, layers and dtype), not the state files themselves (GBs).
    The marker and index are read without the paths they name (where the target and the workdir lie), so that the
    same data made in another workdir or on another machine has the same fingerprint."""
    # not datasets' state.json: its `_fingerprint` is drawn anew at every save
    tables = {p.name: sha256_of(p) for p in sorted(path.glob("*.arrow"))}
    marker, index = (json.loads(p.read_text()) for p in (path / "draftdata_export.json", capture_index))
    return digest(tables | {"marker": without_paths(marker), "capture": without_paths(index)})


def without_paths(obj):
    """`obj` without its `path` entries, at any depth."""
    if isinstance(obj, dict):
        return {k: without_paths(v) for k, v in obj.items() if k != "path"}
    if isinstance(obj, list):
        return [without_paths(v) for v in obj]
    return obj


def trainers_versions(python: str) -> dict:
    code = "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
    code += "('torch', 'speculators', 'specforge', 'transformers')}))"
    return json.loads(subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=True).stdout)


def plan(spec: dict, curve: list[int], fingerprints: dict, versions: dict) -> list[dict]:
    """The runs: `correct`'s learning curve (its first seed at each of `curve`'s steps), then every variant at each
    seed and the spec's steps, seed-major, so that every variant has a figure before any has its last seed."""
    common = {k: spec[k] for k in ("hidden_size", "max_len", "lr", "max_anchors", "threads", "device")}
    common |= {k: spec[k] for k in ("eval_layers", "block_layers")}
    ev = spec["eval"]
    common |= {"eval": [fingerprints[ev["export"]], ev["rows"]], "versions": versions}
    common["code"] = sha256_of(TRAIN_CODE)
    vocab = {name: sha256_of(Path(p)) for name, p in spec["vocab_mappings"].items()}
    by_name = {v["name"]: v for v in spec["variants"]}
    wanted = [(v, s, spec["steps"]) for s in spec["seeds"] for v in by_name]
    if "correct" in by_name:  # first: the short runs that say whether the steps are enough
        wanted = [("correct", spec["seeds"][0], steps) for steps in curve if steps != spec["steps"]] + wanted
    runs = []
    for name, seed, steps in wanted:
        variant = by_name[name]
        export = variant["export"]
        what = common | {"variant": variant, "seed": seed, "steps": steps, "vocab": vocab.get(export)}
        what |= {"train": [fingerprints[export], spec["train_rows"][export]]}
        runs.append({"key": digest(what), "variant": variant, "seed": seed, "steps": steps})
    return runs


def verify_suffix(loop: dict, code: Path = VERIFY_CODE) -> str:
    """What a draft-and-verify result (or vLLM's, `code` bench/drafter_vllm.py) depends on besides its run: the
    prompts, the loop's settings, its code."""
    return digest(loop | {"code": sha256_of(code)})


def adopt(out: Path, runs_dir: Path, runs: list[dict], suffixes: dict) -> int:
    """Runs that an earlier results file holds (by key) written to `runs_dir` where it lacks them, with their
    speculation figures (`suffixes`: kind -> the hash of its loop; `verify`, the draft-and-verify loop's, `vllm`,
    vLLM's) where those are of the same loop; how many."""
    if not out.exists():
        return 0
    kept = {r["key"]: r for r in json.loads(out.read_text()).get("runs", [])}
    n = 0
    for run in runs:
        old, path = kept.get(run["key"]), runs_dir / f"{run['key']}.json"
        if old is None or path.exists():
            continue
        path.write_text(json.dumps(old["result"], indent=1))
        for kind, suffix in suffixes.items():
            if old.get(kind, {}).get("suffix") == suffix:
                extra = runs_dir / f"{run['key']}.{kind}-{suffix}.json"
                extra.write_text(json.dumps(old[kind]["result"], indent=1))
        n += 1
    return n


def unverifiable(runs_dir: Path, to_verify: list[dict], suffix: str) -> int:
    """Runs to speculate with whose figures are kept but whose weights are not (taken from a results file before
    their draft-and-verify loop ran, or with another loop): their figures are dropped, so they are trained again.
    How many."""
    n = 0
    for run in to_verify:
        key = run["key"]
        kept = (runs_dir / f"{key}.json").exists() and not (runs_dir / f"{key}.pt").exists()
        if kept and not (runs_dir / f"{key}.verify-{suffix}.json").exists():
            (runs_dir / f"{key}.json").unlink()
            n += 1
    return n


def finished(runs_dir: Path, runs: list[dict], suffixes: dict) -> list[dict]:
    """The planned runs whose figures are kept: each with its result and, where done, its speculation figures of
    each kind (`suffixes`, as `adopt` reads them)."""
    out = []
    for run in runs:
        path = runs_dir / f"{run['key']}.json"
        if path.exists():
            entry = {"key": run["key"], "variant": run["variant"]["name"], "seed": run["seed"], "steps": run["steps"]}
            entry["spec"] = run["variant"]
            entry["result"] = json.loads(path.read_text())
            for kind, suffix in suffixes.items():
                extra = runs_dir / f"{run['key']}.{kind}-{suffix}.json"
                if extra.exists():
                    entry[kind] = {"suffix": suffix, "result": json.loads(extra.read_text())}
            out.append(entry)
    return out


def summary(results: list[dict]) -> dict:
    """Mean and spread (max - min over the seeds) of every accuracy and the accepted length."""
    keys = [k for k in results[0] if k.startswith(("accepted_length", "full_acc", "cond_acc", "position_"))]
    out = {}
    for k in keys:
        xs = [r[k] for r in results]
        out[k] = {"mean": statistics.fmean(xs), "spread": max(xs) - min(xs)}
    return out


def by_variant(done: list[dict], steps: int) -> dict:
    """Per variant, its runs at the spec's steps (the learning curve's apart), as the report reads them: `runs`
    sorted by seed, their summary, and the recipe and target shift its runs recorded."""
    out: dict = {}
    for entry in sorted(done, key=lambda e: e["seed"]):
        if entry["steps"] == steps:
            out.setdefault(entry["variant"], []).append(entry["result"])
    variants = {}
    for name, results in out.items():
        spec = next(e["spec"] for e in done if e["variant"] == name)
        v = {"variant": spec, "runs": results, **summary(results)}
        for extra in ("drafter", "target_shift", "samples"):
            found = [r[extra] for r in results if extra in r]
            if found:
                v[extra] = found[0]
        variants[name] = v
    return variants


def slope_per_doubling(points: list[tuple[float, float]]) -> dict:
    """Least squares of accepted length on log2(trained tokens) over every (tokens, figure) point: the slope (accepted
    length gained per doubling of the data) with its standard error, from the residuals."""
    if len(points) < 3 or len({x for x, _ in points}) < 2:  # a line and its error need three points, two sizes
        return {"slope": None, "stderr": None, "points": len(points)}
    xs, ys = [math.log2(x) for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return {"slope": b, "stderr": math.sqrt(resid / (len(points) - 2) / sxx), "points": len(points)}


def compare(variants: dict, better: str, worse: str) -> dict | None:
    """`better` against `worse` on the same seeds: the means' difference, the larger spread, whether the difference
    exceeds 3 times it (None while either has one seed: no spread yet), and the per-seed differences (the same seed:
    the same initial weights and pack order)."""
    if better not in variants or worse not in variants:
        return None
    b, w = variants[better], variants[worse]
    seeds = {r["seed"]: r["accepted_length"] for r in w["runs"]}
    per_seed = [round(r["accepted_length"] - seeds[r["seed"]], 4) for r in b["runs"] if r["seed"] in seeds]
    diff = b["accepted_length"]["mean"] - w["accepted_length"]["mean"]
    spread = max(b["accepted_length"]["spread"], w["accepted_length"]["spread"])
    judged = min(len(b["runs"]), len(w["runs"])) > 1  # one seed has no spread: no verdict yet
    return {
        "better": better,
        "worse": worse,
        "difference": round(diff, 4),
        "larger_spread": round(spread, 4),
        "beats_by_3_spreads": diff > 3 * spread if judged else None,
        "per_seed": per_seed,
        "every_seed": bool(per_seed) and min(per_seed) > 0,
    }
