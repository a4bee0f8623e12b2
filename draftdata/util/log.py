"""One `key=value` line per event."""

from __future__ import annotations

import sys
from typing import Any


def log(stage: str, **fields: Any) -> None:
    """One `key=value` line per event, greppable in CI logs and `dvc repro` output."""
    parts = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
    # one write of the whole line: processes sharing a pipe (torchrun's ranks) cannot split a line between them
    # the way print's separate writes of text and newline can when output is unbuffered
    sys.stdout.write(f"{stage} {parts}\n")
    sys.stdout.flush()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)
