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
        judging(r),
        f"{'layer':<{width}}  {'max rel err':>11}  {'mean rel err':>12}  {'worst sample':>12}  {'tolerance':>9}  "
        "where the max is",
        *(
            f"{e.name:<{width}}  {e.max:>11.2e}  {e.mean:>12.2e}  {e.sample_max:>12.2e}  {e.tolerance:>9.2e}  {e.worst}"
            for e in r.layers
        ),
    ]
    return "\n".join(lines)


def judging(r: Report) -> str:
    """Which error is held to the tolerance, and why that one (draftdata/hidden/verify.py says more)."""
    if r.per_token:
        return f"judged: each token's error (both forwards in float32: the stored {r.stored_dtype}'s rounding alone)"
    return (
        f"judged: each sample's mean error ({r.forward_dtype} forwards round every layer: single tokens stray in "
        "either engine, a sample's mean stays within eps x sqrt(depth))"
    )


def verdict(r: Report) -> str:
    w = r.worst
    error, where = r.judged(w)
    what = "error" if r.per_token else "a sample's mean error"
    if r.ok:
        return (
            f"verify: ok: every layer is within its tolerance; the nearest, {w.name}: {what} {error:.2e}, within "
            f"{w.tolerance:.3g}"
        )
    return (
        f"error: verify: {r.path}: {w.name} is off by {error:.2e} relative at {where}, above the tolerance "
        f"{w.tolerance:.3g}: the stored states or the engine ({r.engine}, batch size {r.batch_size}) are wrong"
    )


def main(cfg: Config) -> Report:
    report = verify(cfg, data_dir(cfg.dataset) / "hidden_states")
    print(render(report))
    print(verdict(report), file=sys.stdout if report.ok else sys.stderr)
    if not report.ok:
        sys.exit(1)
    return report


def run(argv: list[str]) -> None:
    cli(main, argv=argv, prog="draftdata verify")  # `--help`: this module's docstring, then the config's help
