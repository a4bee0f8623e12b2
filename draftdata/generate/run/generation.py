"""One generation run: what the budget still needs, sent through a backend by the dispatcher (nothing where the store
already meets it).
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

from draftdata.config.schema import BudgetUnit, Config, OnBudget
from draftdata.generate.plan.planning import Plan, conversation_plan
from draftdata.generate.request import Planned
from draftdata.generate.run.budget.controller import BudgetController
from draftdata.generate.run.connect import make_backend
from draftdata.generate.run.dispatcher import Dispatcher, Figures, Interrupted, RunStats
from draftdata.generate.run.failfast import FailFastWindow
from draftdata.generate.run.ledger import Ledger
from draftdata.generate.run.preflight import named
from draftdata.generate.run.progress import Progress
from draftdata.generate.run.settled import SettledRun, output_tokens, settled_run
from draftdata.generate.run.work import ConversationQueue, WorkQueue
from draftdata.generate.store import ResponseStore, StoredResponse
from draftdata.model.target import Target
from draftdata.util.log import log


async def _generate(
    cfg: Config,
    target: Target,
    work: WorkQueue,
    ctrl: BudgetController,
    store: ResponseStore,
    parked: dict[str, StoredResponse],
    landed: SettledRun | None,
    mode: str | None = None,
) -> RunStats:
    stream = cfg.ds.on_budget == OnBudget.keep_partial or cfg.backend.stream
    ctrl.observes_rate = stream
    backend = make_backend(cfg, target)
    await backend.start()  # health and model checks, before any prompt is sent
    figures, ended = Figures(ctrl.committed), asyncio.Event()
    progress = Progress(cfg, ctrl.committed, mode)
    shown = asyncio.create_task(progress.follow(figures, ended))
    # an in-process engine's arithmetic and decode attention, on every row (None: a server's)
    arithmetic, attention = getattr(backend, "compute_dtype", None), getattr(backend, "attention", None)
    ledger = Ledger(cfg.ds, cfg.dataset, ctrl, target.tok, backend.name, compute_dtype=arithmetic, attention=attention)
    failfast = FailFastWindow(cfg.run.fail_fast_after)
    dispatcher = Dispatcher(backend, ctrl, ledger, failfast, store, cfg, stream, parked, landed, figures)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, dispatcher.interrupt)
    try:
        return await dispatcher.run(work)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        ended.set()
        await shown  # the run's last figures shown
        dispatcher.stats.server = ctrl.throughput.summary() if stream else {}
        await backend.close()
        s = dispatcher.stats
        log(
            "generate",
            dataset=cfg.dataset,
            **named(mode),
            new=s.new,
            parked=s.parked,
            continued=s.continued,
            cancelled=s.cancelled,
            failed=sum(s.failed.values()),
            lost_tokens=s.lost,
        )


@dataclass(frozen=True)
class RunResult:
    """What a run leaves for the output: its requests in order with the rows the store holds for them now (as the
    store answered each commit, `put_many`: another run's row where it committed one first, never this run's own
    instead), under `turns: all` each conversation's turns as far as they went with the row of the turn it stopped
    at; the run's figures; and (`turns: all`) the share of next turns it sent to the server that answered the one
    before (None: none sent)."""

    requests: list[Planned]
    stored: dict[str, StoredResponse]
    stats: RunStats
    same_server_share: float | None = None


def run_generation(cfg: Config, target: Target, plan: Plan, store: ResponseStore, mode: str | None = None) -> RunResult:
    """Generate what the budget still needs over the store's answers (nothing where they meet it). `mode`: the mode
    whose share `cfg` holds, named in the lines."""
    ds, usable = cfg.ds, plan.standing.usable
    if (counted := output_tokens(plan)) >= ds.token_budget:  # landing exact: the settled run from the first decides
        status = f"budget met: {counted:,} >= {ds.token_budget:,} tokens from the store's answers"
        log("generate", dataset=cfg.dataset, **named(mode), status=status)
        return RunResult(plan.requests, plan.stored, RunStats(reused=usable))
    result = generate_missing(cfg, target, plan, store, mode)
    result.stats.reused = usable
    return result


def generate_missing(
    cfg: Config, target: Target, plan: Plan, store: ResponseStore, mode: str | None = None
) -> RunResult:
    """Generate what the budget still needs. Parked partials are continued rather than counted: the budget counts
    complete responses, and keep_partial's cut ones only once no more generation is wanted. `plan`: made before any
    request (`Plan.make`), what its stored rows count read there; preflight.py has passed its requests. Under
    `turns: all` the queue steps each conversation on from its stored turns."""
    ds, standing = cfg.ds, plan.standing
    landed = settled_run(plan)
    parked = {k: r for k, r in plan.stored.items() if r.partial}
    queue = work_queue(plan, store, parked)
    ctrl = BudgetController(
        ds.token_budget,
        ds.max_tokens,
        cfg.concurrency,
        keep_partial=ds.on_budget == OnBudget.keep_partial,
        committed=standing.complete,
        landed=None if landed is None else landed.total(),  # landing exact: the settled run's total
    )
    ctrl.lengths.add_stored(standing.lengths)
    todo = standing.todo
    if standing.prompt_mean is not None:
        ctrl.prompt_mean = standing.prompt_mean
    log(
        "generate",
        dataset=cfg.dataset,
        **named(mode),
        committed=ctrl.committed,
        budget=ds.token_budget,
        stored=len(standing.lengths),  # the complete usable answers
        parked=sum(p.key in parked for p in todo),
        to_send=len(todo),
        backend=cfg.backend.kind.value,
        continues=cfg.backend.takes_token_ids(),
    )
    try:
        stats = asyncio.run(_generate(cfg, target, queue, ctrl, store, parked, landed, mode))
    except Interrupted:
        log(
            "generate",
            dataset=cfg.dataset,
            status="interrupted: in-flight requests aborted and parked, every committed response kept in the store",
        )
        raise KeyboardInterrupt from None  # the entry point (config.load.cli) ends with status 130
    return result_of(plan, queue, store, stats)


def work_queue(plan: Plan, store: ResponseStore, parked: dict[str, StoredResponse]) -> WorkQueue:
    """What the dispatcher sends, in order: the requests the store does not answer, or (`turns: all`) each
    conversation's next turns (the partials it meets stepping over stored turns join `parked`, to go on)."""
    if plan.convs is None:
        return WorkQueue(plan.standing.todo)
    prompts_count = plan.ds.budget_unit == BudgetUnit.total
    return ConversationQueue(plan.convs, store, parked, plan.room, prompts_count, plan.renders)


def result_of(plan: Plan, queue: WorkQueue, store: ResponseStore, stats: RunStats) -> RunResult:
    """The rows the store holds for the plan's requests now: the plan's and those the run committed (the queue's
    `rows`, as the store answered each commit: nothing is read back); under `turns: all` each conversation's turns
    as far as they went, with the row of the turn it stopped at."""
    rows = plan.stored | queue.rows
    if plan.convs is None:
        return RunResult(plan.requests, rows, stats)
    requests, answered = conversation_plan(plan.convs)
    nexts = {c.next.key for c in plan.convs if c.next is not None}
    if plan.renders is not None:
        plan.renders.keep(store)  # the turns rendered since the queue's last batch
    stored = answered | {key: r for key, r in rows.items() if key in nexts}
    return RunResult(requests, stored, stats, queue.same_server_share)
