"""The dispatcher of a generation run: it sends what the budget still needs through a backend, commits each
response to the response store (store.py) as it arrives, and stops once the budget is met.

The dispatcher only admits, waits and stops. The decisions are its parts': what to send next is the work queue's
(work.py: with `turns: all`, a started conversation's next turn before new ones), admission and the budget's end
are the budget controller's (budget.py), what is committed, parked or lost the ledger's (ledger.py), the throughput
readings the meter's (meter.py), and whether the run is failing the fail-fast window's (failfast.py). It is given
the controller, the ledger and the window of its run, and posts the run's figures (`Figures`) where a progress display
reads them: it calls no display.

Nothing wrong is kept and nothing generated is lost (the rules are the ledger's):
- only `stop` and `length` answers (and, under `on_budget: keep_partial`, partials cut at the budget) are responses;
  a server's abort, an error or an empty answer is a failure, retried (the backend goes on from the tokens it had);
- a request stopped before it finished (by the budget, Ctrl-C, a failure) is PARKED in the store with its token
  ids, and the next run that needs it continues it (prompt ids + partial ids, the remaining max_tokens);
- under `landing: exact` a request that failed is asked once more in this run (from what it had parked); one that
  fails again is a stop: nothing new is admitted, and the run ends once what is in flight has (the output stops
  before it: selection.py);
- a request that finishes while its stop is under way is committed like any other.

Requests are stopped by a signal (`GenRequest.stop`), never by cancelling them: the backend aborts on the server
and returns what it has. Only a request whose backend has not returned STOP_WAIT_S after the signal is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from draftdata.config.schema import BudgetUnit, Config
from draftdata.errors import UserError
from draftdata.generate.accounting import prompt_count, unusable_reason
from draftdata.generate.backends.protocol import (
    DEAD_ENGINE_HINT,
    Backend,
    GenRequest,
    GenResult,
    seed_of,
    stopped_result,
)
from draftdata.generate.request import Planned, key_sampling
from draftdata.generate.run.budget.controller import BudgetController
from draftdata.generate.run.failfast import FailFastWindow
from draftdata.generate.run.ledger import Flight, Ledger, RunStats
from draftdata.generate.run.meter import ThroughputMeter
from draftdata.generate.run.settled import SettledRun
from draftdata.generate.run.work import WorkQueue
from draftdata.generate.store import CUT, INTERRUPTED, ResponseStore, StoredResponse

__all__ = ["Dispatcher", "Figures", "Flight", "Interrupted", "RunFailed", "RunStats"]

TICK_S = 0.05  # how often the loop looks at streamed progress between completions
# How long stopped requests have to return. A backend that honours the stop takes at most its aborts' timeouts (5 s
# each: a timed-out attempt's, then the stop's) and its grace (1 s); one that has not returned by then is cancelled.
STOP_WAIT_S = 15.0


# What an unusable answer's reason says in the line a failing run stops with (a failure's detail is the server's)
UNUSABLE = {
    "empty": "answers with nothing in them (no text, thinking nor tool call)",
    "truncated_dropped": "answers cut at max_tokens, which on_truncation: drop leaves out",
}


@dataclass
class Figures:
    """A run's figures, posted by the dispatcher at every wake-up and once it ends; the progress display reads them
    (progress.py)."""

    committed: int = 0  # what the budget counts
    generated: int = 0  # tokens this run generated, those streamed so far by the requests in flight included
    in_flight: int = 0  # requests
    streaming: int = 0  # completion tokens the requests in flight hold
    stats: RunStats = field(default_factory=RunStats)
    # what the run is still expected to decode, and the most one request in flight has left (BudgetController.
    # still_to_decode): the ETA's, as the tokens streamed are not what the budget still needs
    to_decode: float = 0.0
    tail: float = 0.0


class Interrupted(Exception):
    """SIGINT/SIGTERM: admission stopped, in-flight requests aborted and parked, everything committed kept."""


class RunFailed(UserError):
    """The recent requests all failed with one cause: sending more would only repeat it."""


class Dispatcher:
    """Admits requests while the controller allows, commits each response as it arrives, stops at the budget."""

    def __init__(
        self,
        backend: Backend,
        ctrl: BudgetController,
        ledger: Ledger,
        failfast: FailFastWindow,
        store: ResponseStore,
        cfg: Config,
        stream: bool,
        parked: dict[str, StoredResponse],
        landed: SettledRun | None = None,
        figures: Figures | None = None,
    ):
        """Given its parts (the module docstring): the controller, the ledger and the fail-fast window of this run;
        `figures`: where it posts the run's figures (for a progress display)."""
        self.backend, self.ctrl, self.ledger, self.failfast = backend, ctrl, ledger, failfast
        self.store, self.cfg, self.ds = store, cfg, cfg.ds
        self.stream = stream
        self.parked = parked  # key -> a partial to continue (from the store)
        self.t0 = time.monotonic()  # the budget-fill plot's time origin
        self.landed = landed  # landing exact: the settled run of requests from the first (None: finished)
        self.stats = ledger.stats
        self.figures = figures  # None: nobody reads them, none are posted
        if figures is not None:
            figures.stats = self.stats
        self.meter = ThroughputMeter(time.monotonic())
        self.flights: dict[asyncio.Task, Flight] = {}
        self.work = WorkQueue()
        self.stop = asyncio.Event()
        self.failing: str | None = None  # set when the recent requests all failed with one cause
        self._again: deque[Planned] = deque()  # landing exact: failed requests to ask once more, first in line
        self._asked_again: set[str] = set()  # ... the keys asked again in this run
        self.halted = False  # landing exact: a request failed twice; nothing new is admitted
        # Finished tasks are pushed here by their done-callbacks and a ticker wakes the loop every TICK_S, so a
        # wake-up costs O(finished), not O(in flight) as asyncio.wait over every task would.
        self._finished: list[asyncio.Task] = []
        self._wake = asyncio.Event()

    def in_flight_progress(self) -> list[int]:
        """Completion tokens of each request in flight so far."""
        return [f.req.partial.completion_tokens for f in self.flights.values()]

    def in_flight_prompts(self) -> list[int]:
        """The prompt tokens each request in flight counts toward the budget (budget_unit total; else none)."""
        if self.ds.budget_unit != BudgetUnit.total:
            return []
        return [prompt_count(f.p) for f in self.flights.values()]

    async def run(self, work: WorkQueue) -> RunStats:
        """Send what `work` hands out until the budget is met, it runs dry, or the run is stopped."""
        self.work = work
        try:
            await self._run()
        finally:
            self._fill(final=True)
            self._post()
        return self.stats

    async def _run(self) -> None:
        ticker = asyncio.create_task(self._tick())
        try:
            await self._loop()
        except BaseException:  # e.g. the store cannot take a commit (disk full): stop what is in flight first
            await self._abandon()
            raise
        finally:
            ticker.cancel()
        if self.stop.is_set():
            await self._stop_all(INTERRUPTED)
            if self.failing:
                raise RunFailed(self.failing)
            raise Interrupted()

    def _post(self) -> None:
        """The run's figures now, where the progress display reads them."""
        if (f := self.figures) is None:
            return
        f.committed, f.generated, f.in_flight, f.streaming = (
            self.ctrl.committed,
            self.generated_so_far(),
            len(self.flights),
            self.streaming(),
        )
        f.to_decode, f.tail = self.ctrl.still_to_decode(self.in_flight_progress(), self.work.new_left())

    def _fill(self, final: bool = False) -> None:
        """A point of the budget-fill plot (generate_metrics' plots/budget_fill.csv): about one a second, and the
        last."""
        fill, now = self.stats.fill, round(time.monotonic() - self.t0, 2)
        if final or not fill or now - fill[-1][0] >= 1.0:
            fill.append((now, self.ctrl.committed))

    async def _loop(self) -> None:
        while not self.stop.is_set():
            if len(self.flights) < self.ctrl.concurrency:  # else nothing is admitted: no pass over what is in flight
                self._admit_work(self.in_flight_progress(), self.in_flight_prompts())
            if not self.flights:
                return
            await self._wake.wait()
            self._wake.clear()
            self._observe_rate()
            finished, self._finished = self._finished, []
            self._record([(task.result(), self.flights.pop(task)) for task in finished])
            # only partials kept at the budget count what is in flight toward it
            in_flight = (self.in_flight_progress(), self.in_flight_prompts()) if self.ctrl.keep_partial else ()
            if self.ctrl.reached(*in_flight):
                await self._stop_all(CUT)
                if self.ctrl.reached():
                    return
                # keep_partial: some cut partials were unusable (e.g. nothing but whitespace), so go on
            self._fill()
            self._post()

    def _admit_work(self, progress: list[int], prompts: list[int]) -> None:
        """Started conversations' next turns as many as the controller lets the batch hold, then new requests as
        many as it admits (the turns just admitted counted in, and the turns the started conversations will still
        ask)."""
        while self._again and len(self.flights) < self.cfg.concurrency:  # admitted once already
            self._admit(self._again.popleft())
        if self.halted:
            return
        admitted = False
        for _ in range(self.ctrl.turn_count(progress, prompts)):
            if (p := self._next(self.work.next_ready)) is None:
                break
            self._admit(p)
            admitted = True
        if admitted:
            progress, prompts = self.in_flight_progress(), self.in_flight_prompts()
        room = self.cfg.concurrency - len(self.flights)
        pending = self.work.pending(room) if room > 0 else None
        for _ in range(self.ctrl.admit_count(progress, prompts, pending)):
            if (p := self._next(self.work.next_new)) is None:
                break
            self._admit(p)

    def _next(self, take) -> Planned | None:
        """The next request from the queue, unless the answers it stepped over to find it met the budget."""
        p = take()
        self.ledger.reused(self.work.take_reused())
        self._land()  # a turn stepped over may settle a conversation
        return None if p is None or self.ctrl.reached() else p

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._wake.set()

    def interrupt(self) -> None:
        self.stop.set()
        self._wake.set()

    def _on_done(self, task: asyncio.Task) -> None:
        if task in self.flights:  # not one collected by _stop_flights
            self._finished.append(task)
            self._wake.set()

    def _admit(self, p: Planned) -> None:
        partial = self.ledger.resume(self.parked.get(p.key), self.backend.takes_token_ids)
        req = GenRequest(
            p.key,
            p.prompt_ids,
            p.prompt["messages"],
            p.prompt.get("tools"),
            self.ds.max_tokens,
            key_sampling(self.ds.sampling),
            stream=self.stream,
            partial=partial,
            seed=seed_of(p.key),
            prefer=self.work.prefer(p),
            session=p.prompt.get("conversation", p.prompt["id"]),
        )
        task = asyncio.create_task(self.backend.generate(req))
        task.add_done_callback(self._on_done)
        self.flights[task] = Flight(p, req, partial.completion_tokens, time.monotonic())

    def _observe_rate(self) -> None:
        """Feed the controller the meter's readings; only a streaming backend shows the progress they need."""
        if not self.stream:
            return
        reading = self.meter.observe(time.monotonic(), len(self.flights), self.generated_so_far)
        if reading is not None:
            self.ctrl.observe_rate(*reading)

    def generated_so_far(self) -> int:
        """Tokens this run generated: committed, lost, and streamed so far by the requests in flight."""
        return self.stats.generated + sum(
            max(0, f.req.partial.completion_tokens - f.prefix) for f in self.flights.values()
        )

    def streaming(self) -> int:
        """The completion tokens the requests in flight hold so far (a continued one's parked part included)."""
        return sum(f.req.partial.completion_tokens for f in self.flights.values())

    def _record(
        self,
        done: list[tuple[GenResult, Flight]],
        stopped: list[tuple[GenResult, Flight]] = (),
        reason: str = CUT,
        stopping: bool = False,
    ) -> None:
        """Store what ended since the last wake-up (the rows in one transaction), then count it, tell the
        controller and look whether the run is failing. The ledger counts what this run generated; the budget,
        the work queue and the landing take the rows the store holds (another run's answer where it committed one
        first), which are what the output and every later run read."""
        settled = self.ledger.to_store(done, stopped, reason, now=time.monotonic())
        for failure in settled.failures:
            self.store.put_failure(*failure)
        held = self.store.put_many([r for r, _ in settled.rows]) if settled.rows else []
        stored = [(h, f) for h, (_, f) in zip(held, settled.rows)]
        self.ledger.commit(settled.rows, held)
        again = set() if stopping else self._ask_again(done, stored)
        self.work.settled([*done, *stopped], stored, again)
        self.ledger.reused(self.work.take_reused())
        self._land(done, stored)
        # an answer the output cannot use (empty, truncated and dropped) is a failure to the fail-fast window too
        unusable = {f.p.key: unusable_reason(r, self.ds) for r, f in settled.rows if not r.partial}
        for res, f in done:
            self.failfast.record(res.error or unusable.get(f.p.key))
        self._check_failing(done)

    def _land(self, done: list[tuple[GenResult, Flight]] = (), rows: list[tuple[StoredResponse, Flight]] = ()) -> None:
        """landing exact: settle the requests that got their final answer, and tell the controller how far the
        settled run from the first request now counts (a failed request is not settled: it is asked again)."""
        if self.landed is None:
            return
        for r, f in rows:
            if not r.partial:
                self.landed.answered(f.p, r, self.ds)
        self.ctrl.landed = self.landed.total()

    def _ask_again(self, done: list[tuple[GenResult, Flight]], rows: list[tuple[StoredResponse, Flight]]) -> set[str]:
        """landing exact: the failed requests to ask once more, from what they parked (the keys); a second failure
        halts admission, since the output cannot pass it in this run."""
        if self.landed is None:
            return set()
        parked = {r.key: r for r, _ in rows if r.partial}
        again = set()
        for res, f in done:
            if not res.error:
                continue
            if f.p.key in self._asked_again:
                self.halted = True
                continue
            self._asked_again.add(f.p.key)
            again.add(f.p.key)
            if f.p.key in parked:
                self.parked[f.p.key] = parked[f.p.key]
            self._again.append(f.p)
        return again

    def _check_failing(self, done: list[tuple[GenResult, Flight]]) -> None:
        """Stop when the window shows one cause. The message is made once, from the batch that showed it (the
        stop's own batch may hold no failure)."""
        if self.failing or (cause := self.failfast.cause()) is None:
            return
        detail = next((res.detail for res, _ in reversed(done) if res.error == cause), "") or UNUSABLE.get(cause, "")
        self.failing = self.failfast.message(cause, detail, self.stats.new)
        died = self.stats.attempt_failures.get("engine_dead", 0)
        if died and cause != "engine_dead":  # what followed a dead engine (reset connections) hides the cause
            self.failing += f"; before them a server's engine died (engine_dead, {died} attempts): {DEAD_ENGINE_HINT}"
        self.interrupt()

    # ---- stopping ------------------------------------------------------------------------------------------- #

    async def _stop_all(self, reason: str) -> None:
        """Stop every request in flight: answers that finished meanwhile are committed, the rest are parked with
        what they produced (`reason`: cut by the budget, or interrupted)."""
        ended = await self._stop_flights(reason)
        done = [(res, f) for res, f in ended if not res.stopped]
        stopped = [(res, f) for res, f in ended if res.stopped]
        self._record(done, stopped, reason, stopping=True)

    async def _abandon(self) -> None:
        """Stop every request in flight and wait for them, committing nothing: the run is failing, and requests
        left running would outlive the backend's connections (and bury the one line that says why)."""
        await self._stop_flights(INTERRUPTED)

    async def _stop_flights(self, reason: str) -> list[tuple[GenResult, Flight]]:
        """Signal each request in flight to stop and wait for what its backend returns. A backend that has not
        returned after STOP_WAIT_S ignored the signal: only then is its task cancelled."""
        flights, self.flights = self.flights, {}
        self._finished = []  # collected below with the others
        for f in flights.values():
            f.req.stop(reason)
        if flights:
            _, late = await asyncio.wait(flights, timeout=STOP_WAIT_S)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        return [(self._outcome(task, f), f) for task, f in flights.items()]

    def _outcome(self, task: asyncio.Task, f: Flight) -> GenResult:
        """A stopped task's result. One that was cancelled, or raised on its way out, ended with what its
        partial holds."""
        if not task.cancelled() and task.exception() is None:
            return task.result()
        return stopped_result(f.req, self.backend.name)
