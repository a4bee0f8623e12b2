"""The progress display of generation: a bar on a terminal, a log line otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import deque

from draftdata.config.schema import Config
from draftdata.generate.run.dispatcher import Figures


class Progress:
    """A tqdm bar toward the budget on a terminal, a log line every `run.log_every_s` otherwise, both in the form
    users read elsewhere: `8,353/9,000 tok (93%) | 16 generating (412 tok) | 61 resp (0 err) 0.5 req/s | 68 tok/s |
    avg_comp=137tok | ETA 12s`. The counts are the budget's (complete answers); the tokens streamed by the requests in
    flight are shown beside them, and the token rate counts them as they stream (a run whose first answers take a
    minute reads its rate from its first tokens, not 0 tok/s). The token rate is measured over the last
    RATE_WINDOW_S of generation, the response rate since the first token (answers are few and far between: a window
    of seconds reads 0 between them), and there is no ETA before there is a rate (the first seconds, loading and the
    first tokens, would otherwise predict hours for a run of minutes).

    The ETA is the time to decode what the run still has to (`Figures.to_decode`: the requests in flight to their
    expected ends, then what the budget needs past them) at that rate, and at least the time the longest request in
    flight needs at one request's share of it (the rate over the requests in flight in the window, on average): a
    run's last request decodes alone, and the tokens it streamed are not the budget's until it ends."""

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
        self.marks: deque = deque()  # (time, tokens generated, responses, in flight) of recent updates
        self.first: tuple[float, int, int] | None = None  # ... of the first update with a token
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
        self._mark(now, f.generated, f.stats.new, f.in_flight)
        if not final and now - self.last_log < (0.2 if self.tty else self.cfg.run.log_every_s):
            return
        self.last_log = now
        line = self.line(f, final)
        if self.tty:
            if f.committed > self.bar.total:  # the last response may cross the budget: the bar ends there
                self.bar.total = f.committed
            self.bar.n = f.committed
            self.bar.set_postfix_str(line.split(" | ", 1)[1], refresh=True)
        else:
            print(f"generate {self.name}: {line}", flush=True)

    def _mark(self, now: float, generated: int, responses: int, in_flight: int = 0) -> None:
        if generated == 0:
            return  # the rates start with the first token, not with loading
        self.first = self.first or (now, generated, responses)
        self.marks.append((now, generated, responses, in_flight))
        while len(self.marks) > 2 and now - self.marks[1][0] >= self.RATE_WINDOW_S:
            self.marks.popleft()

    def rates(self) -> tuple[float, float] | None:
        """(tokens/s over the window, responses/s since the first token), or None until the window spans
        MIN_RATE_SPAN_S."""
        if len(self.marks) < 2 or self.marks[-1][0] - self.marks[0][0] < self.MIN_RATE_SPAN_S:
            return None
        (t0, g0, *_), (t1, g1, r1, _) = self.marks[0], self.marks[-1]
        tf, _, rf = self.first
        return (g1 - g0) / (t1 - t0), (r1 - rf) / (t1 - tf)

    def batch(self) -> float:
        """The requests in flight over the window, on average (0: none recorded): the token rate is theirs, so a
        request decodes at the rate over them."""
        return sum(m[3] for m in self.marks) / len(self.marks) if self.marks else 0.0

    def line(self, f: Figures, final: bool = False) -> str:
        budget, s = self.ds.token_budget, f.stats
        rates = self.rates()
        errors = sum(s.failed.values())
        parts = [f"{f.committed:,}/{budget:,} tok ({100 * f.committed / budget:.0f}%)"]
        if f.in_flight:
            parts.append(f"{f.in_flight} generating ({f.streaming:,} tok)")
        parts.append(f"{s.new} resp ({errors} err)" + (f" {_per_time(rates[1], 'req')}" if rates and rates[1] else ""))
        if rates:
            parts.append(f"{rates[0]:,.0f} tok/s")
        if s.new:
            parts.append(f"avg_comp={s.completed_len / s.new:,.0f}tok")
        if rates and rates[0] > 0 and not final and f.to_decode + f.tail > 0:
            eta = f.to_decode / rates[0]
            if f.in_flight:  # the longest request in flight, at a request's pace over the window
                eta = max(eta, f.tail * (self.batch() or f.in_flight) / rates[0])
            parts.append(f"ETA {_duration(eta)}")
        return " | ".join(parts)


def _per_time(rate: float, unit: str) -> str:
    """A rate in the unit that shows it: `0.5 req/s`, `3.2 req/min` (not 0.0 req/s)."""
    if rate >= 0.1:
        return f"{rate:.1f} {unit}/s"
    if rate * 60 >= 0.1:
        return f"{rate * 60:.1f} {unit}/min"
    return f"{rate * 3600:.1f} {unit}/h"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3600:.1f}h"
