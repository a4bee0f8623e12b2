"""One generation run: what the budget still needs is sent through a backend by the dispatcher; the figures of the
run for the metrics and plots.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

from draftdata.config.schema import BackendKind, BudgetUnit, Config, DatasetConfig, OnBudget
from draftdata.generate.accounting import needs_request, prompt_count, stored_total, unusable_reason
from draftdata.generate.budget.controller import BudgetController
from draftdata.generate.connect import make_backend, takes_token_ids
from draftdata.generate.dispatcher import Dispatcher, Interrupted, RunStats
from draftdata.generate.progress import Progress
from draftdata.generate.request import Planned
from draftdata.generate.store import CUT, ResponseStore, StoredResponse
from draftdata.generate.work import ConversationQueue, WorkQueue
from draftdata.util.log import log
from draftdata.util.plots import histogram, write_csv


async def _generate(
    cfg: Config,
    tok,
    todo: list[Planned] | WorkQueue,
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


def generate_missing(
    cfg: Config,
    tok,
    plan: list[Planned],
    stored: dict[str, StoredResponse],
    store: ResponseStore,
    conversations: ConversationQueue | None = None,
) -> RunStats:
    """Generate what the budget still needs. Parked partials are continued rather than counted: the budget counts
    complete responses, and keep_partial's cut ones only once no more generation is wanted. `conversations`
    (`turns: all`): `plan` holds their answered turns and the next one of each, and the queue steps them on."""
    ds = cfg.ds
    ctrl = BudgetController(
        ds.token_budget,
        ds.max_tokens,
        ds.concurrency,
        keep_partial=ds.on_budget == OnBudget.keep_partial,
        committed=stored_total(plan, stored, ds, partial=False)[0],
    )
    complete = [r for r in stored.values() if not r.partial and unusable_reason(r, ds) is None]
    for r in complete:
        ctrl.lengths.add(r.completion_tokens)  # completion lengths only: bounded by max_tokens, whatever the unit
    todo = [p for p in plan if needs_request(stored.get(p.key))]
    if cfg.backend.kind == BackendKind.openai and todo:  # before any request
        # imported here, as make_backend imports the backends: aiohttp costs a run that sends nothing 0.1 s
        from draftdata.generate.backends.openai import check_chat_rendering

        check_chat_rendering(cfg, tok, [p.prompt for p in todo])
    if ds.budget_unit == BudgetUnit.total and todo:
        ctrl.prompt_mean = sum(prompt_count(p) for p in todo) / len(todo)
    parked = {k: r for k, r in stored.items() if r.partial}
    if conversations is not None:
        conversations.parked = parked  # partials met while stepping over stored turns are continued too
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
        work = todo if conversations is None else conversations
        return asyncio.run(_generate(cfg, tok, work, ctrl, store, parked))
    except Interrupted:
        log(
            "generate",
            dataset=cfg.dataset,
            status="interrupted: in-flight requests aborted and parked, every committed response kept in the store",
        )
        raise KeyboardInterrupt from None  # the entry point (config.load.cli) ends with status 130


def run_metrics(
    ds: DatasetConfig,
    selected,
    total: int,
    skipped: Counter,
    stats: RunStats,
    reused: int,
    duplicates: int,
    wall: float,
) -> dict:
    # each answer once: conversations that share a turn each hold it in the output, but it was generated once
    in_output = sum(stats.new_by_key.get(key, 0) for key in {r.key for _, r in selected})
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
        # prompts whose rendered ids (hence store key) an earlier prompt had: asked and output once, the first's
        "duplicate_after_template": duplicates,
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


def output_record(p: Planned, r: StoredResponse, end_reason: str | None = None) -> dict:
    """A line of responses.jsonl; a conversation's turn (`turns: all`) also names its conversation and turn, and
    its conversation's last line why it ended."""
    rec = {"id": p.prompt["id"], "key": r.key, "messages": p.prompt["messages"]}
    if "conversation" in p.prompt:
        rec.update(conversation=p.prompt["conversation"], turn=p.prompt["turn"])
        if end_reason is not None:
            rec["end_reason"] = end_reason
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
    if r.reasoning:  # the key HF chat templates read
        rec["reasoning_content"] = r.reasoning
    if r.tool_calls:
        rec["tool_calls"] = r.tool_calls
    return rec
