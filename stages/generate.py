"""Stage `generate@D`: prompts → responses, landed on the dataset's token budget.

Responses live in the response store (stages/store.py) and are committed as they arrive; this stage only sends what
the store lacks, and stops once the budget is met. Its DVC output, `data/<D>/responses.jsonl`, is materialised from
the store in prompt order up to the budget, so lowering a budget costs no generation and raising it generates only
the difference. The admission and stop decisions are the budget controller's (stages/budget.py); this module does
the I/O around them.

Nothing wrong is kept and nothing generated is lost:
- only `stop` and `length` answers (and, under `on_budget: keep_partial`, partials cut at the budget) are responses;
  a server's abort, an error or an empty answer is a failure, retried (the backend goes on from the tokens it had);
- a request stopped before it finished (by the budget, Ctrl-C, a failure) is PARKED in the store with its token
  ids, and the next run that needs it continues it (prompt ids + partial ids, the remaining max_tokens);
- a request that finishes while the budget's cancel is under way is committed like any other.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from stages.artifacts import data_dir, log, read_jsonl, write_json, write_jsonl
from stages.backends import Backend, GenRequest, GenResult, Partial, make_backend, seed_of, takes_token_ids
from stages.budget import BudgetController
from stages.config import BudgetUnit, Config, ConfigError, DatasetConfig, OnBudget, OnTruncation, UserError, cli
from stages.plots import histogram, write_csv
from stages.store import CUT, INTERRUPTED, ResponseStore, StoredResponse, hash_cache_path, resolve_store_path
from stages.target import (
    check_tokenizer_fits,
    content_hash,
    load_tokenizer,
    model_fingerprint,
    model_limits,
    render_prompt_ids,
)

TICK_S = 0.05  # how often the loop looks at streamed progress between completions
READING_S = 1.0  # the interval of one throughput reading for the controller


class Interrupted(Exception):
    """SIGINT/SIGTERM: admission stopped, in-flight requests aborted and parked, everything committed kept."""


class RunFailed(UserError):
    """The recent requests all failed with one cause: sending more would only repeat it."""


@dataclass
class Planned:
    prompt: dict
    key: str
    prompt_ids: list[int]  # rendered with the chat template: exactly what the target is sent


@dataclass
class Flight:
    """A request in flight: its prompt, what it started from (a parked partial's tokens) and when."""

    p: Planned
    req: GenRequest
    prefix: int
    t0: float


@dataclass
class RunStats:
    """What this run did. Tokens are the ones this run generated, unless said otherwise."""

    new: int = 0  # complete responses committed
    parked: int = 0  # partial responses parked (cut by the budget or interrupted)
    cut: int = 0  # ... of which cut by the budget
    continued: int = 0  # requests that went on from a parked partial
    cancelled: int = 0  # requests in flight when the run stopped
    generated: int = 0
    kept: int = 0  # in complete responses
    completed_len: int = 0  # the full completion lengths of this run's complete responses (continued ones whole)
    parked_tokens: int = 0  # in parked partials (reusable: a later run continues them)
    continued_tokens: int = 0  # parked by earlier runs and carried on by this one (not generated here)
    lost: int = 0  # generated but neither kept nor parked
    lost_estimated: bool = False  # a plain (non-streamed) request was cancelled: its tokens are estimated
    estimated: int = 0  # responses whose length the server did not report (no usage, no ids): counted from the text
    failed: Counter = field(default_factory=Counter)  # requests that ended failed, by reason
    attempt_failures: Counter = field(default_factory=Counter)  # failed attempts (retried or not), by reason
    new_by_key: dict = field(default_factory=dict)  # key -> tokens this run generated for it
    server: dict = field(default_factory=dict)  # what the controller learned of the server's throughput
    fill: list = field(default_factory=list)  # (seconds since generation began, tokens counted) about every second


def request_key(model_fp: str, prompt_ids: list[int], sampling: dict, max_tokens: int) -> str:
    """Same model + same exact prompt tokens (template and its kwargs included) + same sampling = same key,
    whichever run or dataset asks."""
    return content_hash(
        {"model": model_fp, "prompt_ids": prompt_ids, "sampling": sampling, "max_tokens": max_tokens}, n=32
    )


def tokens_of(prompt_tokens: int, completion_tokens: int, unit: BudgetUnit) -> int:
    return completion_tokens + (prompt_tokens if unit == BudgetUnit.total else 0)


def unusable_reason(r: StoredResponse, ds: DatasetConfig) -> Optional[str]:
    """Why a stored response does not enter the output (None: it does)."""
    if r.partial and not (r.finish_reason == CUT and ds.on_budget == OnBudget.keep_partial):
        return "cut_by_budget" if r.finish_reason == CUT else "interrupted"  # parked: continued when needed
    if r.completion_tokens == 0 or not r.text.strip():  # text is decoded without special tokens
        return "empty"
    if r.finish_reason == "length" and ds.on_truncation == OnTruncation.drop:
        return "truncated_dropped"
    return None


def needs_request(r: Optional[StoredResponse]) -> bool:
    """Whether a run that generates sends this prompt: missing, parked (to continue), or an empty answer stored by an
    earlier version."""
    return r is None or r.partial or r.completion_tokens == 0


def select(plan: list[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig):
    """Prompt order, usable responses only, until the budget is reached (the last one may cross it)."""
    selected: list[tuple[Planned, StoredResponse]] = []
    skipped: Counter = Counter()
    total = 0
    for p in plan:
        r = stored.get(p.key)
        if r is None:
            continue
        reason = unusable_reason(r, ds)
        if reason:
            skipped[reason] += 1
            continue
        if total >= ds.token_budget:
            break
        selected.append((p, r))
        total += tokens_of(r.prompt_tokens, r.completion_tokens, ds.budget_unit)
    return selected, total, skipped


class Dispatcher:
    """Admits requests while the controller allows, commits each response as it arrives, stops at the budget."""

    def __init__(
        self,
        backend: Backend,
        ctrl: BudgetController,
        store: ResponseStore,
        cfg: Config,
        tok,
        stream: bool,
        parked: dict[str, StoredResponse],
        progress,
    ):
        self.backend, self.ctrl, self.store, self.cfg, self.tok = backend, ctrl, store, cfg, tok
        self.ds = cfg.ds
        self.stream = stream
        self.parked = parked  # key -> a partial to continue (from the store)
        self.progress = progress
        self.stats = RunStats()
        self.flights: dict[asyncio.Task, Flight] = {}
        self.stop = asyncio.Event()
        self.failing: Optional[str] = None  # set when the recent requests all failed with one cause
        self._recent: deque = deque(maxlen=max(1, cfg.run.fail_fast_after))
        self._speeds: list[float] = []  # tokens/s of single requests that completed (plain requests' estimate)
        # Finished tasks are pushed here by their done-callbacks and a ticker wakes the loop every TICK_S, so a
        # wake-up costs O(finished), not O(in flight) as asyncio.wait over every task would.
        self._finished: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        now = time.monotonic()
        self._t_last, self._area = now, 0.0  # ∫ in-flight dt, for the time-averaged batch of a reading
        self._rate_mark = (now, 0, 0.0)  # (time, tokens generated, area) at the last reading

    def in_flight_progress(self) -> list[int]:
        """Completion tokens of each request in flight so far."""
        return [f.req.partial.completion_tokens for f in self.flights.values()]

    def in_flight_prompts(self) -> list[int]:
        """The prompt tokens each request in flight counts toward the budget (budget_unit total; else none)."""
        if self.ds.budget_unit != BudgetUnit.total:
            return []
        return [len(f.p.prompt_ids) for f in self.flights.values()]

    async def run(self, todo: list[Planned]) -> RunStats:
        ticker = asyncio.create_task(self._tick())
        try:
            await self._loop(iter(todo))
        except BaseException:  # e.g. the store cannot take a commit (disk full): stop what is in flight first
            await self._abandon()
            raise
        finally:
            ticker.cancel()
        if self.stop.is_set():
            await self._cancel_all(INTERRUPTED)
            if self.failing:
                raise RunFailed(self.failing)
            raise Interrupted()
        return self.stats

    async def _loop(self, queue) -> None:
        progress, prompts = self.in_flight_progress(), self.in_flight_prompts()
        while not self.stop.is_set():
            for _ in range(self.ctrl.admit_count(progress, prompts)):
                if (p := next(queue, None)) is None:
                    break
                self._admit(p)
            if not self.flights:
                return
            await self._wake.wait()
            self._wake.clear()
            self._observe_rate()
            finished, self._finished = self._finished, []
            self._record_all([(task.result(), self.flights.pop(task)) for task in finished])
            progress, prompts = self.in_flight_progress(), self.in_flight_prompts()
            if self.ctrl.reached(progress, prompts):
                await self._cancel_all(CUT)
                if self.ctrl.reached():
                    return
                # keep_partial: some cut partials were unusable (e.g. nothing but whitespace), so go on
                progress, prompts = [], []
            self.progress.update(self)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._wake.set()

    def interrupt(self) -> None:
        self.stop.set()
        self._wake.set()

    def _on_done(self, task: asyncio.Task) -> None:
        if not task.cancelled():  # cancelled tasks are collected by _cancel_all
            self._finished.append(task)
            self._wake.set()

    def _admit(self, p: Planned) -> None:
        partial = Partial()
        parked = self.parked.get(p.key)
        if parked is not None and self.backend.takes_token_ids and parked.continuable():
            partial = Partial(list(parked.output_ids), parked.text, parked.completion_tokens)
            self.stats.continued += 1
            self.stats.continued_tokens += parked.completion_tokens
        req = GenRequest(
            p.key,
            p.prompt_ids,
            p.prompt["messages"],
            p.prompt.get("tools"),
            self.ds.max_tokens,
            self.ds.sampling.as_dict(),
            stream=self.stream,
            partial=partial,
            seed=seed_of(p.key),
        )
        task = asyncio.create_task(self.backend.generate(req))
        task.add_done_callback(self._on_done)
        self.flights[task] = Flight(p, req, partial.completion_tokens, time.monotonic())

    def _observe_rate(self) -> None:
        """The aggregate decode rate over the last reading interval and the time-averaged batch it ran with, so the
        controller learns how the server's throughput scales with the batch."""
        now = time.monotonic()
        self._area += len(self.flights) * (now - self._t_last)
        self._t_last = now
        if not self.stream:
            return
        t0, tokens0, area0 = self._rate_mark
        if now - t0 >= READING_S:
            tokens = self.stats.generated + sum(
                max(0, f.req.partial.completion_tokens - f.prefix) for f in self.flights.values()
            )
            self.ctrl.observe_rate((tokens - tokens0) / (now - t0), (self._area - area0) / (now - t0))
            self._rate_mark = (now, tokens, self._area)

    # ---- bookkeeping ----------------------------------------------------------------------------------------- #

    def _record_all(self, done: list[tuple[GenResult, Flight]]) -> None:
        """Commit what finished since the last wake-up in one transaction, then tell the controller."""
        rows: list[tuple[StoredResponse, Flight]] = []
        for res, f in done:
            if f.req.attempt_errors:
                self.stats.attempt_failures.update(f.req.attempt_errors)
            if f.req.discarded_tokens:
                self._lose(f.req.discarded_tokens)
            self._recent.append(res.error)
            if res.ok:
                self.stats.estimated += bool(res.extra.get("completion_tokens_estimated"))
                rows.append((self._complete(res, f), f))
                continue
            self.store.put_failure(f.p.key, self.cfg.dataset, f.p.prompt["id"], res.error, res.detail, res.server)
            self.stats.failed[res.error] += 1
            if (parked := self._partial_row(f, INTERRUPTED)) is not None:
                rows.append((parked, f))
        self._commit(rows)
        self._check_failing(done)

    def _complete(self, res: GenResult, f: Flight) -> StoredResponse:
        text = res.text
        if res.continued_from and res.output_ids is not None:  # decoded whole: no seam at the continuation point
            text = self.tok.decode(res.output_ids, skip_special_tokens=True)
        prompt_ids = f.p.prompt_ids if res.continued_from else res.prompt_ids
        if res.latency_s > 0:
            self._speeds.append((res.completion_tokens - f.prefix) / res.latency_s)
        return self._row(
            f.p,
            text,
            res.output_ids,
            res.prompt_tokens,
            res.completion_tokens,
            res.finish_reason,
            res.server,
            res.latency_s,
            prompt_ids=prompt_ids,
        )

    def _partial_row(self, f: Flight, reason: str) -> Optional[StoredResponse]:
        """What a stopped request produced, to park; None when there is nothing worth keeping (counted as lost)."""
        part = f.req.partial
        new = part.completion_tokens - f.prefix
        if new <= 0:
            return None
        if not part.continuable() and not (reason == CUT and self.ctrl.keep_partial):
            self._lose(new)  # text only: no run can go on from it, and only keep_partial uses it as it is
            return None
        ids = list(part.output_ids) if part.continuable() else None
        return self._row(
            f.p,
            part.text,
            ids,
            len(f.p.prompt_ids),
            part.completion_tokens,
            reason,
            self.backend.name,
            time.monotonic() - f.t0,
        )

    def _commit(self, rows: list[tuple[StoredResponse, Flight]]) -> None:
        if not rows:
            return
        self.store.put_many([r for r, _ in rows])
        for r, f in rows:
            new = r.completion_tokens - f.prefix
            self.stats.generated += new
            self.stats.new_by_key[r.key] = new
            tokens = tokens_of(r.prompt_tokens, r.completion_tokens, self.ds.budget_unit)
            if r.partial:
                self.stats.parked += 1
                self.stats.parked_tokens += new
                if r.finish_reason == CUT:
                    self.stats.cut += 1
                    if unusable_reason(r, self.ds) is None:
                        self.ctrl.cut(tokens)
                continue
            self.stats.new += 1
            self.stats.kept += new
            self.stats.completed_len += r.completion_tokens
            self.ctrl.finished(tokens, counted=unusable_reason(r, self.ds) is None, length=r.completion_tokens)

    def _lose(self, tokens: int) -> None:
        self.stats.generated += tokens
        self.stats.lost += tokens

    def _check_failing(self, done: list[tuple[GenResult, Flight]]) -> None:
        """Stop when the last `run.fail_fast_after` requests all failed with one cause: the next ones would too.
        The message is made once, from the batch that showed it (the cancel's own batch may hold no failure)."""
        if (
            self.failing
            or self.cfg.run.fail_fast_after <= 0
            or len(self._recent) < self._recent.maxlen
            or self._recent[-1] is None
        ):
            return
        causes = set(self._recent)
        if len(causes) == 1 and None not in causes:
            cause = causes.pop()
            detail = next((res.detail for res, _ in reversed(done) if res.error == cause), "")
            self.failing = (
                f"the last {len(self._recent)} requests all failed with {cause}: {detail} "
                f"({self.stats.new} responses committed this run are in the store)"
            )
            self.interrupt()

    def _row(
        self,
        p: Planned,
        text,
        output_ids,
        prompt_tokens,
        completion_tokens,
        finish_reason,
        server,
        latency,
        prompt_ids=None,
    ) -> StoredResponse:
        """`prompt_ids`: the prompt as the server tokenized it, when it said (else the ids we rendered)."""
        return StoredResponse(
            key=p.key,
            dataset=self.cfg.dataset,
            prompt_id=p.prompt["id"],
            text=text,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            server=server,
            latency_s=latency,
            prompt_ids=prompt_ids or p.prompt_ids,
            output_ids=output_ids,
        )

    async def _cancel_all(self, reason: str) -> None:
        """Cancel the real tasks (the backends abort on the server); answers that finished meanwhile are committed,
        the rest are parked with what they produced (`reason`: cut by the budget, or interrupted)."""
        self._finished = []  # collected below with the others
        tasks = list(self.flights)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        done, rows = [], []
        for task, result in zip(tasks, results):
            f = self.flights.pop(task)
            if isinstance(result, GenResult):  # it finished before or during the cancel: a response (or failure)
                done.append((result, f))
                continue
            self.stats.cancelled += 1
            self.stats.attempt_failures.update(f.req.attempt_errors)
            self._lose(f.req.discarded_tokens)
            if not self.stream and f.req.partial.completion_tokens == f.prefix:
                self._lose_unseen(f)
            elif (row := self._partial_row(f, reason)) is not None:
                rows.append((row, f))
        self._record_all(done)
        self._commit(rows)

    async def _abandon(self) -> None:
        """Cancel every request in flight and wait for them, committing nothing: the run is failing, and requests
        left running would outlive the backend's connections (and bury the one line that says why)."""
        tasks = list(self.flights)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.flights.clear()

    def _lose_unseen(self, f: Flight) -> None:
        """A plain request cancelled on a server that does not answer an abort with its tokens: estimate what it had
        generated from the decode speed of the requests that completed."""
        self.stats.lost_estimated = True
        if self._speeds:
            elapsed = time.monotonic() - f.t0
            self._lose(min(self.ds.max_tokens - f.prefix, round(elapsed * statistics.median(self._speeds))))


class Progress:
    """A tqdm bar toward the budget on a terminal, a log line every `run.log_every_s` otherwise, both in the form
    users read elsewhere: `8,353/9,000 tok (93%) | 61 resp (0 err) 0.5 req/s | 68 tok/s | avg_comp=137tok | ETA 12s`.
    Rates are measured over the last RATE_WINDOW_S of generation, and there is no ETA before there is a rate (the
    first seconds, loading and the first tokens, would otherwise predict hours for a run of minutes)."""

    RATE_WINDOW_S = 30.0
    MIN_RATE_SPAN_S = 3.0

    def __init__(self, cfg: Config, committed: int):
        from tqdm import tqdm

        self.cfg, self.ds = cfg, cfg.ds
        self.t0 = time.monotonic()
        self.last_log = self.t0
        self.marks: deque = deque()  # (time, tokens generated, responses) of recent updates
        self.tty = cfg.run.progress and sys.stderr.isatty()
        self.bar = tqdm(
            total=self.ds.token_budget,
            initial=min(committed, self.ds.token_budget),
            unit="tok",
            desc=f"generate {cfg.dataset}",
            disable=not self.tty,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tok {postfix}",
        )

    def update(self, d: Dispatcher, final: bool = False) -> None:
        now = time.monotonic()
        s = d.stats
        self._mark(now, s.generated, s.new)
        if final or not s.fill or now - self.t0 - s.fill[-1][0] >= 1.0:  # the budget-fill plot's points
            s.fill.append((round(now - self.t0, 2), d.ctrl.committed))
        if not final and now - self.last_log < (0.2 if self.tty else self.cfg.run.log_every_s):
            return
        self.last_log = now
        line = self.line(d.ctrl.committed, s, len(d.flights))
        if self.tty:
            if d.ctrl.committed > self.bar.total:  # the last response may cross the budget: the bar ends there
                self.bar.total = d.ctrl.committed
            self.bar.n = d.ctrl.committed
            self.bar.set_postfix_str(line.split(" | ", 1)[1], refresh=True)
        else:
            print(f"generate {self.cfg.dataset}: {line}", flush=True)

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

    def line(self, committed: int, s: RunStats, in_flight: int) -> str:
        budget = self.ds.token_budget
        rates = self.rates()
        errors = sum(s.failed.values())
        parts = [
            f"{committed:,}/{budget:,} tok ({100 * committed / budget:.0f}%)",
            f"{s.new} resp ({errors} err)" + (f" {rates[1]:.1f} req/s" if rates else ""),
        ]
        if rates:
            parts.append(f"{rates[0]:,.0f} tok/s")
        if s.new:
            parts.append(f"avg_comp={s.completed_len / s.new:,.0f}tok")
        parts.append(f"in_flight={in_flight}")
        if rates and rates[0] > 0 and committed < budget:
            parts.append(f"ETA {_duration((budget - committed) / rates[0])}")
        return " | ".join(parts)

    def close(self, d: Dispatcher | None = None) -> None:
        if d is not None:
            self.update(d, final=True)  # the last figures, not the last throttled ones
        self.bar.close()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3600:.1f}h"


def check_context(plan: list[Planned], cfg: Config, context: int | None) -> None:
    """Before any request: a prompt and its max_tokens must fit the target's context, or every such request would
    come back an error (or be cut short) after costing a round trip."""
    if context is None:
        return
    key = f"datasets.{cfg.dataset}"
    if cfg.ds.max_tokens >= context:
        raise ConfigError(
            f"{key}.max_tokens",
            f"{cfg.ds.max_tokens:,} leaves no room for a prompt in the target's context of {context:,} tokens",
        )
    room = context - cfg.ds.max_tokens
    over = [p for p in plan if len(p.prompt_ids) > room]
    if over:
        first = over[0]
        raise UserError(
            f"{first.prompt.get('where', first.prompt['id'])}: a prompt of {len(first.prompt_ids):,} "
            f"tokens + max_tokens {cfg.ds.max_tokens:,} exceeds the target's context of {context:,} "
            f"({len(over)} prompts like it); set {key}.max_prompt_tokens to at most {room:,} (the "
            "prompts stage then drops them) or lower max_tokens"
        )


def plan_requests(cfg: Config, prompts: list[dict], tok) -> list[Planned]:
    ds, kwargs = cfg.ds, dict(cfg.model.template_kwargs)
    fp = model_fingerprint(cfg.model.path, cfg.model.revision, hash_cache_path(cfg.run.store_path))
    plan = []
    for rec in prompts:
        ids = render_prompt_ids(tok, rec["messages"], rec.get("tools"), kwargs)
        plan.append(Planned(rec, request_key(fp, ids, ds.sampling.as_dict(), ds.max_tokens), ids))
    return plan


async def _generate(
    cfg: Config,
    tok,
    todo: list[Planned],
    ctrl: BudgetController,
    store: ResponseStore,
    parked: dict[str, StoredResponse],
) -> RunStats:
    stream = cfg.ds.on_budget == OnBudget.keep_partial or cfg.backend.stream
    ctrl.observes_rate = stream
    backend = make_backend(cfg, tok)
    await backend.start()  # health and model checks, before any prompt is sent
    progress = Progress(cfg, ctrl.committed)
    dispatcher = Dispatcher(backend, ctrl, store, cfg, tok, stream, parked, progress)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, dispatcher.interrupt)
    try:
        return await dispatcher.run(todo)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        dispatcher.stats.server = ctrl.throughput.summary() if stream else {}
        progress.close(dispatcher)
        await backend.close()
        s = dispatcher.stats
        log(
            "generate",
            dataset=cfg.dataset,
            new=s.new,
            parked=s.parked,
            continued=s.continued,
            cancelled=s.cancelled,
            failed=sum(s.failed.values()),
            lost_tokens=s.lost,
        )


def main(cfg: Config) -> None:
    ds, out = cfg.ds, data_dir(cfg.dataset)
    t0 = time.time()
    prompts_path = out / "prompts.jsonl"
    if not prompts_path.exists():
        raise UserError(f"{prompts_path}: not found; run the prompts stage first (dvc repro prompts@{cfg.dataset})")
    tok = load_tokenizer(cfg.model)
    limits = model_limits(cfg.model)
    check_tokenizer_fits(tok, cfg.model, limits)
    plan = plan_requests(cfg, list(read_jsonl(prompts_path)), tok)
    check_context(plan, cfg, limits.context)
    store = ResponseStore(resolve_store_path(cfg.run.store_path))
    try:
        stored = store.get_many(p.key for p in plan)
        usable = {k: r for k, r in stored.items() if unusable_reason(r, ds) is None}
        committed = sum(tokens_of(r.prompt_tokens, r.completion_tokens, ds.budget_unit) for r in usable.values())
        stats = RunStats()
        if committed >= ds.token_budget:
            log(
                "generate",
                dataset=cfg.dataset,
                status=f"budget met: {committed:,} >= {ds.token_budget:,} tokens from {len(usable):,} responses",
            )
        else:
            stats = _run(cfg, tok, plan, stored, store)
            stored = store.get_many(p.key for p in plan)
        selected, total, skipped = select(plan, stored, ds)
        write_jsonl(out / "responses.jsonl", (_output_record(p, r) for p, r in selected))
        write_plots(
            out / "plots", [r.completion_tokens for _, r in selected], ds.max_tokens, stats.fill or [(0.0, total)]
        )
        write_json(
            out / "generate_metrics.json", _metrics(ds, selected, total, skipped, stats, len(usable), time.time() - t0)
        )
    finally:
        store.close()
    if total < ds.token_budget:
        log(
            "generate",
            dataset=cfg.dataset,
            warning="budget not met: the source ran out of prompts or requests "
            "failed (failed prompts are retried on the next run)",
            budget_tokens=total,
            budget=ds.token_budget,
        )
    log(
        "generate",
        dataset=cfg.dataset,
        responses=len(selected),
        budget_tokens=total,
        new=stats.new,
        reused=len(usable),
        wall_s=round(time.time() - t0, 1),
    )


def _run(cfg: Config, tok, plan: list[Planned], stored: dict[str, StoredResponse], store: ResponseStore) -> RunStats:
    """Generate what the budget still needs. Parked partials are continued rather than counted: the budget counts
    complete responses, and keep_partial's cut ones only once no more generation is wanted."""
    ds = cfg.ds
    complete = [r for r in stored.values() if not r.partial and unusable_reason(r, ds) is None]
    ctrl = BudgetController(
        ds.token_budget,
        ds.max_tokens,
        ds.concurrency,
        keep_partial=ds.on_budget == OnBudget.keep_partial,
        committed=sum(tokens_of(r.prompt_tokens, r.completion_tokens, ds.budget_unit) for r in complete),
    )
    for r in complete:
        ctrl.lengths.add(r.completion_tokens)  # completion lengths only: bounded by max_tokens, whatever the unit
    todo = [p for p in plan if needs_request(stored.get(p.key))]
    if ds.budget_unit == BudgetUnit.total and todo:
        ctrl.prompt_mean = sum(len(p.prompt_ids) for p in todo) / len(todo)
    parked = {k: r for k, r in stored.items() if r.partial}
    log(
        "generate",
        dataset=cfg.dataset,
        committed=ctrl.committed,
        budget=ds.token_budget,
        stored=len(complete),
        parked=sum(p.key in parked for p in todo),
        to_send=len(todo),
        backend=cfg.backend.kind.value,
        continues=takes_token_ids(cfg),
    )
    try:
        return asyncio.run(_generate(cfg, tok, todo, ctrl, store, parked))
    except Interrupted:
        log(
            "generate",
            dataset=cfg.dataset,
            status="interrupted: in-flight requests aborted and parked, every committed response kept in the store",
        )
        sys.exit(130)


def _metrics(
    ds: DatasetConfig, selected, total: int, skipped: Counter, stats: RunStats, reused: int, wall: float
) -> dict:
    in_output = sum(stats.new_by_key.get(r.key, 0) for _, r in selected)
    return {
        "responses": len(selected),
        "completion_tokens": sum(r.completion_tokens for _, r in selected),
        "prompt_tokens": sum(r.prompt_tokens for _, r in selected),
        "budget": ds.token_budget,
        "budget_unit": ds.budget_unit.value,
        "budget_tokens": total,
        "budget_met": total >= ds.token_budget,
        "overshoot_tokens": max(0, total - ds.token_budget),
        "overshoot_pct": round(100.0 * max(0, total - ds.token_budget) / ds.token_budget, 4),
        "truncated": sum(r.finish_reason == "length" for _, r in selected),
        "cut_by_budget": sum(r.finish_reason == CUT for _, r in selected),
        "skipped": dict(sorted(skipped.items())),
        "failed": dict(sorted(stats.failed.items())),
        "attempt_failures": dict(sorted(stats.attempt_failures.items())),
        "cancelled_in_flight": stats.cancelled,
        "reused_from_store": reused,
        "newly_generated": stats.new + stats.parked,
        "continued": stats.continued,
        "new_tokens": stats.generated,
        "kept_tokens": stats.kept,
        "parked_tokens": stats.parked_tokens,
        "continued_tokens": stats.continued_tokens,
        "lost_tokens": stats.lost,
        "lost_estimated": stats.lost_estimated,
        "completion_tokens_estimated": stats.estimated,  # responses counted from streamed text (no usage, no ids)
        # generated by this run but not in the output: parked, lost, or past the budget (kept in the store)
        "wasted_tokens": stats.generated - in_output,
        "new_in_output_tokens": in_output,  # the output's completion tokens this run generated (the rest reused)
        "server": stats.server,
        "wall_s": round(wall, 2),
        "new_tok_per_s": round(stats.generated / wall, 1) if wall > 0 else 0.0,
    }


def write_plots(out: Path, lengths: list[int], max_tokens: int, fill: list[tuple[float, int]]) -> None:
    write_csv(out / "completion_lengths.csv", histogram(lengths, max_tokens), ["length", "responses"])
    write_csv(out / "budget_fill.csv", [{"seconds": t, "tokens": n} for t, n in fill], ["seconds", "tokens"])


def _output_record(p: Planned, r: StoredResponse) -> dict:
    rec = {"id": p.prompt["id"], "key": r.key, "messages": p.prompt["messages"]}
    if p.prompt.get("tools"):
        rec["tools"] = p.prompt["tools"]
    rec.update(
        prompt_ids=r.prompt_ids,
        output_ids=r.output_ids,
        text=r.text,
        prompt_tokens=r.prompt_tokens,
        completion_tokens=r.completion_tokens,
        finish_reason=r.finish_reason,
    )
    return rec


if __name__ == "__main__":
    cli(main)
