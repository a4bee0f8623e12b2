"""`draftdata verify dataset=<D> [verify.samples=3] [verify.engine=hf|vllm] [verify.batch_size=1]`: a few stored
hidden states of a dataset computed again, by another engine or at another batch size, and compared layer by layer
with what is stored; exit status 1, with one line, where an error is above the tolerance (not a DVC stage: run it
after the hidden_states stage, where the target can run).
"""

from __future__ import annotations

import sys

from draftdata.config.load import cli
from draftdata.config.schema import Config
from draftdata.hidden.verify import Report, verify
from draftdata.util.files import data_dir

SHOWN = 6  # sample ids listed; the rest counted


def render(r: Report) -> str:
    checked = ", ".join(f"{i} ({n:,} tokens)" for i, n in r.checked[:SHOWN])
    more = f" and {len(r.checked) - SHOWN:,} more" if len(r.checked) > SHOWN else ""
    width = max(len("layer"), *(len(e.name) for e in r.layers))
    lines = [
        f"verify: {r.path}: {len(r.checked)} of {r.total:,} samples recomputed by {r.engine} at batch size "
        f"{r.batch_size} (returned as {r.computed_dtype}), against the stored {r.stored_dtype}",
        f"samples: {checked}{more}",
        f"{'layer':<{width}}  {'max rel err':>11}  {'mean rel err':>12}  where the max is",
        *(f"{e.name:<{width}}  {e.max:>11.2e}  {e.mean:>12.2e}  {e.worst}" for e in r.layers),
    ]
    return "\n".join(lines)


def verdict(r: Report) -> str:
    w = r.worst
    if r.ok:
        return f"verify: ok: the largest error, {w.max:.2e} ({w.name}), is within the tolerance {r.tolerance:g}"
    return (
        f"error: verify: {r.path}: {w.name} is off by {w.max:.2e} relative at {w.worst}, above the tolerance "
        f"{r.tolerance:g}: the stored states or the engine ({r.engine}, batch size {r.batch_size}) are wrong"
    )


def main(cfg: Config) -> Report:
    report = verify(cfg, data_dir(cfg.dataset) / "hidden_states")
    print(render(report))
    print(verdict(report), file=sys.stdout if report.ok else sys.stderr)
    if not report.ok:
        sys.exit(1)
    return report


def run(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:  # what the command does, then the config's help
        print(__doc__.strip() + "\n")
    cli(main, argv=argv, prog="draftdata verify")
