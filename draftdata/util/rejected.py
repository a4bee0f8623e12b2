"""The rejection ledger: every row a stage does not keep, with its reason, one JSON line each, so that the rows a stage
keeps and the rows it rejects add up to the rows it read (`data/<D>/<stage>_rejected.jsonl`; the summary stage
joins a dataset's into `data/<D>/rejected.jsonl`).

A line names its stage, its reason and what finds the row again: `where` (the source's file:line), `id` (a prompt's,
a response's), `conversation` and `turn` (a regenerated conversation's). `unit` says what was rejected: a `row` (a
source row, or all that came of it) or a `turn` of a conversation that is kept without it; only rows enter the sum.
Lines are streamed to a temp file and renamed into place when the stage's ledger closes whole: a source of millions
of rows is never held in memory.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from draftdata.util.files import atomic_path
from draftdata.util.log import log

ROW, TURN = "row", "turn"


class Tally:
    """Rows not kept, counted by reason (`counts`, rows; `turns`, turns within kept rows), nothing written."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.turns: Counter = Counter()

    def add(self, reason: str, unit: str = ROW, **row) -> None:
        (self.counts if unit == ROW else self.turns)[reason] += 1

    @property
    def rows(self) -> int:
        return sum(self.counts.values())


class Rejections(Tally):
    """A stage's ledger, open for writing (a context manager): a line per row not kept, and the counts."""

    def __init__(self, path: Path | str, stage: str):
        super().__init__()
        self.path, self.stage = Path(path), stage
        self._stack = ExitStack()
        self._file = None

    def __enter__(self) -> Rejections:
        tmp = self._stack.enter_context(atomic_path(self.path))
        self._file = self._stack.enter_context(open(tmp, "w", encoding="utf-8"))
        return self

    def __exit__(self, *exc) -> bool:
        suppressed = self._stack.__exit__(*exc)
        if exc[0] is None and not self.counts and not self.turns:  # DVC warns "'<path>' is empty.": this is why
            log(self.stage, rejected=0, ledger=f"{self.path} is empty (DVC's warning of it: nothing was rejected)")
        return suppressed

    def add(self, reason: str, unit: str = ROW, **row) -> None:
        super().add(reason, unit)
        line = {"stage": self.stage, "unit": unit, "reason": reason, **{k: v for k, v in row.items() if v is not None}}
        self._file.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")
