"""One generation run: what the budget still needs, sent through a backend by the dispatcher (nothing where the store
already meets it).
"""

from __future__ import annotations

import asyncio
import signal

from draftdata.config.schema import BackendKind, Config, OnBudget
from draftdata.generate.accounting import Standing
from draftdata.generate.budget.controller import BudgetController
from draftdata.generate.connect import make_backend
from draftdata.generate.dispatcher import Dispatcher, Interrupted, RunStats
from draftdata.generate.planning import RunPlan
from draftdata.generate.progress import Progress
from draftdata.generate.request import Planned
from draftdata.generate.selection import Landed
from draftdata.generate.store import ResponseStore, StoredResponse
from draftdata.generate.work import ConversationQueue, WorkQueue
from draftdata.model.target import Target
from draftdata.util.log import log


async def _generate(
    cfg: Config,
    target: Target,
    todo: list[Planned] | WorkQueue,
    ctrl: BudgetController,
    store: ResponseStore,
    parked: dict[str, StoredResponse],
    landed: Landed | None,
    mode: str | None = None,
) -> RunStats:
    stream = cfg.ds.on_budget == OnBudget.keep_partial or cfg.backend.stream
    ctrl.observes_rate = stream
    backend = make_backend(cfg, target)
    await backend.start()  # health and model checks, before any prompt is sent
    progress = Progress(cfg, ctrl.committed, mode)
    dispatcher = Dispatcher(backend, ctrl, store, cfg, target.tok, stream, parked, progress, landed)
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
            **named(mode),
            new=s.new,
            parked=s.parked,
            continued=s.continued,
            cancelled=s.cancelled,
            failed=sum(s.failed.values()),
            lost_tokens=s.lost,
        )


def named(mode: str | None) -> dict[str, str]:
    """A line's `mode=` field, where the run generates a mode's share (datasets.<D>.modes)."""
    return {} if mode is None else {"mode": mode}


def run_generation(
    cfg: Config, target: Target, run: RunPlan, store: ResponseStore, mode: str | None = None
) -> RunStats:
    """Generate what the budget still needs over the store's answers (nothing where they meet it), then read back
    what the store holds for the run's prompts. `mode`: the mode whose share `cfg` holds, named in the lines."""
    ds, usable = cfg.ds, run.standing.usable
    if run.committed >= ds.token_budget:  # landing exact: the settled run from the first request decides
        status = f"budget met: {run.committed:,} >= {ds.token_budget:,} tokens from the store's answers"
        log("generate", dataset=cfg.dataset, **named(mode), status=status)
        return RunStats(reused=usable)
    stats = generate_missing(cfg, target, run.plan, run.stored, store, run.standing, run.queue, run.landed, mode)
    stats.reused = usable
    run.reread(store)
    return stats


def check_before_requests(cfg: Config, target: Target, todo: list[Planned]) -> None:
    """What only the requests to send can show wrong, refused before any is sent: a chat-format server's answers
    that tokenize could not render as the model wrote them (check_chat_rendering)."""
    if cfg.backend.kind == BackendKind.openai and todo:
        # imported here, as make_backend imports the backends: a run that sends nothing does not import aiohttp
        from draftdata.generate.backends.openai import check_chat_rendering

        check_chat_rendering(cfg, target, [p.prompt for p in todo])


def generate_missing(
    cfg: Config,
    target: Target,
    plan: list[Planned],
    stored: dict[str, StoredResponse],
    store: ResponseStore,
    standing: Standing,
    conversations: ConversationQueue | None = None,
    landed: Landed | None = None,
    mode: str | None = None,
) -> RunStats:
    """Generate what the budget still needs. Parked partials are continued rather than counted: the budget counts
    complete responses, and keep_partial's cut ones only once no more generation is wanted. `standing`: what the
    stored rows count (accounting.standing, read where the run was planned; check_before_requests has passed its
    `todo`). `conversations` (`turns: all`): `plan` holds their answered turns and the next one of each, and the
    queue steps them on."""
    ds = cfg.ds
    ctrl = BudgetController(
        ds.token_budget,
        ds.max_tokens,
        cfg.concurrency,
        keep_partial=ds.on_budget == OnBudget.keep_partial,
        committed=standing.complete,
        landed=None if landed is None else landed.total(),
    )
    ctrl.lengths.add_stored(standing.lengths)
    todo = standing.todo
    if standing.prompt_mean is not None:
        ctrl.prompt_mean = standing.prompt_mean
    parked = {k: r for k, r in stored.items() if r.partial}
    if conversations is not None:
        conversations.parked = parked  # partials met while stepping over stored turns are continued too
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
        work = todo if conversations is None else conversations
        return asyncio.run(_generate(cfg, target, work, ctrl, store, parked, landed, mode))
    except Interrupted:
        log(
            "generate",
            dataset=cfg.dataset,
            status="interrupted: in-flight requests aborted and parked, every committed response kept in the store",
        )
        raise KeyboardInterrupt from None  # the entry point (config.load.cli) ends with status 130
