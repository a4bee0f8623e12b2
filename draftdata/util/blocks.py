"""Generated blocks in hand-written pages: the text between two marker lines, rewritten by a command and checked by a
test (the configuration reference in docs/configuration.md, the benchmark figures in docs/benchmarks.md)."""

from __future__ import annotations


def between(text: str, start: str, end: str) -> str:
    """What stands between the markers, as `replace_between` writes it ('' when they are missing)."""
    i, j = text.find(start), text.find(end)
    return text[i + len(start) + 1 : j] if 0 <= i < j else ""


def replace_between(text: str, start: str, end: str, block: str, where: str) -> str:
    """`text` with the part between the markers replaced by `block`; `where` names the page in the error."""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"error: {where} has no {start} ... {end} block")
    return text[: i + len(start)] + "\n" + block + text[j:]
