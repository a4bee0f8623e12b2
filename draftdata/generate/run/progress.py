"""The progress display of generation: a bar on a terminal, a log line otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import deque

from draftdata.config.schema import Config
from draftdata.generate.run.dispatcher import Figures, RunStats


class Progress:
    """A tqdm bar toward the budget on a terminal, a log line every `run.log_every_s` otherwise, both in the form
    users read elsewhere: `8,353/9,000 tok (93%) | 16 generating (412 tok) | 61 resp (0 err) 0.5 req/s | 68 tok/s |
    avg_comp=137tok | ETA 12s`. The counts are the budget's (complete answers); the tokens streamed by the requests in
    flight are shown beside them, and the rate counts them as they stream (a run whose first answers take a minute
    reads its rate from its first tokens, not 0 tok/s). Rates are measured over the last RATE_WINDOW_S of generation,
    and there is no ETA before there is a rate (the first seconds, loading and the first tokens, would otherwise
    predict hours for a run of minutes); the ETA is what the budget still needs past the streamed tokens, at that
    rate."""

    RATE_WINDOW_S = 30.0
    MIN_RATE_SPAN_S = 3.0
    LOOK_S = 0.05  # how often `follow` reads the run's figures

    def __init__(self, cfg: Config, committed: int, mode: str | None = None):
        from tqdm import tqdm

        self.cfg, self.ds = cfg, cfg.ds
        # whose budget: the dataset's, or a mode's share of it (datasets.<D>.modes)
        self.name = cfg.dataset if mode is None else f"{cfg.dataset} [{mode}]"
        self.t0 = time.monotonic()
        self.last_log = self.t0
        self.marks: deque = deque()  # (time, tokens generated, responses) of recent updates
        self.tty = cfg.run.progress and sys.stderr.isatty()
        self.bar = tqdm(
            total=self.ds.token_budget,
            initial=min(committed, self.ds.token_budget),
            unit="tok",
            desc=f"generate {self.name}",
            disable=not self.tty,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tok {postfix}",
        )

    async def follow(self, figures: Figures, ended: asyncio.Event) -> None:
        """Show a run's figures (those its dispatcher posts) as it goes; once `ended` is set, its last figures (not
        the last throttled ones), and the bar closed."""
        while not ended.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), self.LOOK_S)
            self.update(figures)
        self.update(figures, final=True)
        self.bar.close()

    def update(self, f: Figures, final: bool = False) -> None:
        now = time.monotonic()
        self._mark(now, f.generated, f.stats.new)
        if not final and now - self.last_log < (0.2 if self.tty else self.cfg.run.log_every_s):
            return
        self.last_log = now
        line = self.line(f.committed, f.stats, f.in_flight, f.streaming)
        if self.tty:
            if f.committed > self.bar.total:  # the last response may cross the budget: the bar ends there
                self.bar.total = f.committed
            self.bar.n = f.committed
            self.bar.set_postfix_str(line.split(" | ", 1)[1], refresh=True)
        else:
            print(f"generate {self.name}: {line}", flush=True)

    def _mark(self, now: float, generated: int, responses: int) -> None:
        if generated == 0:
            return  # the rate starts with the first token, not with loading
        self.marks.append((now, generated, responses))
        while len(self.marks) > 2 and now - self.marks[1][0] >= self.RATE_WINDOW_S:
            self.marks.popleft()

    def rates(self) -> tuple[float, float] | None:
        """(tokens/s, responses/s) over the window, or None until it spans MIN_RATE_SPAN_S."""
        if len(self.marks) < 2 or self.marks[-1][0] - self.marks[0][0] < self.MIN_RATE_SPAN_S:
            return None
        (t0, g0, r0), (t1, g1, r1) = self.marks[0], self.marks[-1]
        return (g1 - g0) / (t1 - t0), (r1 - r0) / (t1 - t0)

    def line(self, committed: int, s: RunStats, in_flight: int, streaming: int = 0) -> str:
        budget = self.ds.token_budget
        rates = self.rates()
        errors = sum(s.failed.values())
        parts = [f"{committed:,}/{budget:,} tok ({100 * committed / budget:.0f}%)"]
        if in_flight:
            parts.append(f"{in_flight} generating ({streaming:,} tok)")
        parts.append(f"{s.new} resp ({errors} err)" + (f" {rates[1]:.1f} req/s" if rates else ""))
        if rates:
            parts.append(f"{rates[0]:,.0f} tok/s")
        if s.new:
            parts.append(f"avg_comp={s.completed_len / s.new:,.0f}tok")
        left = budget - committed - streaming
        if rates and rates[0] > 0 and committed < budget:
            parts.append(f"ETA {_duration(max(0, left) / rates[0])}")
        return " | ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3600:.1f}h"
