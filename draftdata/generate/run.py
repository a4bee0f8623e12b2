"""One generation run: what the budget still needs, sent through a backend by the dispatcher (nothing where the store
already meets it).
"""

from __future__ import annotations

import asyncio
import signal

from draftdata.config.schema import Config, OnBudget
from draftdata.generate.budget.controller import BudgetController
from draftdata.generate.connect import make_backend
from draftdata.generate.dispatcher import Dispatcher, Figures, Interrupted, RunStats
from draftdata.generate.failfast import FailFastWindow
from draftdata.generate.ledger import Ledger
from draftdata.generate.planning import RunPlan
from draftdata.generate.preflight import named
from draftdata.generate.progress import Progress
from draftdata.generate.selection import SettledRun
from draftdata.generate.store import ResponseStore, StoredResponse
from draftdata.generate.work import WorkQueue
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


def run_generation(
    cfg: Config, target: Target, run: RunPlan, store: ResponseStore, mode: str | None = None
) -> RunStats:
    """Generate what the budget still needs over the store's answers (nothing where they meet it), then take into
    the plan the rows the store holds for what the run committed. `mode`: the mode whose share `cfg` holds, named in
    the lines."""
    ds, usable = cfg.ds, run.standing.usable
    if run.output_tokens >= ds.token_budget:  # landing exact: the settled run from the first request decides
        status = f"budget met: {run.output_tokens:,} >= {ds.token_budget:,} tokens from the store's answers"
        log("generate", dataset=cfg.dataset, **named(mode), status=status)
        return RunStats(reused=usable)
    stats = generate_missing(cfg, target, run, store, mode)
    stats.reused = usable
    run.after_run(store)
    return stats


def generate_missing(
    cfg: Config, target: Target, run: RunPlan, store: ResponseStore, mode: str | None = None
) -> RunStats:
    """Generate what the budget still needs. Parked partials are continued rather than counted: the budget counts
    complete responses, and keep_partial's cut ones only once no more generation is wanted. `run`: planned
    (`RunPlan.make`), its standing read there (what the stored rows count, and what to send: `run.queue`, which
    with `turns: all` steps each conversation on from its stored turns); preflight.py has passed its requests."""
    ds, standing = cfg.ds, run.standing
    ctrl = BudgetController(
        ds.token_budget,
        ds.max_tokens,
        cfg.concurrency,
        keep_partial=ds.on_budget == OnBudget.keep_partial,
        committed=standing.complete,
        landed=None if run.landed is None else run.output_tokens,  # landing exact: the settled run's total
    )
    ctrl.lengths.add_stored(standing.lengths)
    todo = standing.todo
    if standing.prompt_mean is not None:
        ctrl.prompt_mean = standing.prompt_mean
    parked = {k: r for k, r in run.stored.items() if r.partial}
    if run.convs is not None:  # a conversation queue: the partials it meets stepping over stored turns go on too
        run.queue.parked = parked
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
        return asyncio.run(_generate(cfg, target, run.queue, ctrl, store, parked, run.landed, mode))
    except Interrupted:
        log(
            "generate",
            dataset=cfg.dataset,
            status="interrupted: in-flight requests aborted and parked, every committed response kept in the store",
        )
        raise KeyboardInterrupt from None  # the entry point (config.load.cli) ends with status 130
