"""Compare experiments at a glance: `draftdata compare [dataset=<D> ...]`.

`dvc exp show` names every column by its file and key (`data/B3_magicoder/summary.json:tokens`), so a budget sweep
of one dataset is hundreds of columns wide. This reads the same data (`dvc exp show --json`) and prints, for each
dataset, one short row per experiment: the figures of its `summary.json` (stages/summary.py), and beneath it a row per
mode where the dataset has modes (its share, tokens and overshoot). Without `dataset=`, the datasets whose figures
differ between the rows are shown. Nothing is run or changed.
"""

from __future__ import annotations

import json
import subprocess
import sys

COLUMNS = ("budget", "tokens", "over_pct", "samples", "skipped", "trained", "trained_share", "new", "reused")


def experiments(doc: list) -> list[tuple[str, dict]]:
    """(name, {dataset: summary}) per row of `dvc exp show --json`: the workspace, each baseline commit and its
    experiments, in DVC's order."""
    rows = []
    for base in doc:
        rev = base["rev"]
        rows.append((base.get("name") or (rev if rev == "workspace" else rev[:7]), _summaries(base.get("data"))))
        for exp in base.get("experiments") or []:
            rev = exp["revs"][0]
            rows.append((f"  {exp.get('name') or rev['rev'][:7]}", _summaries(rev.get("data"))))
    return [(name, s) for name, s in rows if s]


def _summaries(data: dict | None) -> dict:
    out = {}
    for path, value in ((data or {}).get("metrics") or {}).items():
        parts = path.split("/")
        if path.endswith("/summary.json") and len(parts) >= 2 and "data" in value:
            out[parts[-2]] = value["data"]
    return out


def changed(rows: list[tuple[str, dict]]) -> list[str]:
    names = sorted({d for _, s in rows for d in s})
    return [d for d in names if len({json.dumps(s.get(d), sort_keys=True) for _, s in rows}) > 1]


def table(rows: list[tuple[str, dict]], dataset: str) -> list[str]:
    modes = {m for _, s in rows for m in ((s.get(dataset) or {}).get("modes") or {})}
    width = max(len("experiment"), *(len(name) for name, _ in rows), *(len(f"  mode {m}") for m in modes))
    cells = [max(10, len(c) + 2) for c in COLUMNS]
    lines = [f"{dataset}", f"{'experiment':<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(COLUMNS, cells))]
    for name, s in rows:
        figures = s.get(dataset)
        if figures is not None:
            figures = with_overshoot(figures)
            lines.append(f"{name:<{width}}" + "".join(f"{_fmt(figures.get(c)):>{w}}" for c, w in zip(COLUMNS, cells)))
            for mode, m in (figures.get("modes") or {}).items():  # each mode's share, beneath (datasets.<D>.modes)
                m = with_overshoot(m)
                lines.append(
                    f"{'  mode ' + mode:<{width}}" + "".join(f"{_fmt(m.get(c)):>{w}}" for c, w in zip(COLUMNS, cells))
                )
    return lines


def with_overshoot(figures: dict) -> dict:
    """summary.json leaves the overshoot to be read from `tokens` and `budget` (`dvc metrics show` has no room for
    it); older summaries hold it as `over_pct`, computed the same way."""
    if "over_pct" in figures or not figures.get("budget"):
        return figures
    over = max(0, figures["tokens"] - figures["budget"]) / figures["budget"]
    return dict(figures, over_pct=round(100 * over, 2))


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def run(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return
    wanted = [a.split("=", 1)[1] for a in argv if a.startswith("dataset=")]
    proc = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: dvc exp show failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    rows = experiments(json.loads(proc.stdout))
    known = sorted({d for _, s in rows for d in s})
    unknown = [d for d in wanted if d not in known]
    if unknown:  # an empty table and status 0 would read as "nothing differs"
        sys.exit(
            f"error: dataset: no summary.json of {', '.join(unknown)} in any experiment or the workspace; "
            f"known: {', '.join(known) or 'none (run dvc repro first)'}"
        )
    for dataset in wanted or changed(rows) or known:
        print("\n".join(table(rows, dataset)) + "\n")
