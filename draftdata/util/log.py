"""One `key=value` line per event."""

from __future__ import annotations

from typing import Any


def log(stage: str, **fields: Any) -> None:
    """One `key=value` line per event, greppable in CI logs and `dvc repro` output."""
    parts = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
    print(f"{stage} {parts}", flush=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)
