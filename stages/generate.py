"""Stage `generate@D`: prompts → responses, landed on the dataset's token budget.

Responses live in the response store (stages/store.py) and are committed one by one as they arrive; this stage
only sends what the store lacks, and stops once the budget is met. Its DVC output, `data/<D>/responses.jsonl`,
is materialised from the store in prompt order up to the budget, so lowering a budget costs no generation and
raising it generates only the difference.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from stages.artifacts import data_dir, log, read_jsonl, write_json, write_jsonl
from stages.backends import Backend, GenRequest, GenResult, make_backend
from stages.budget import BudgetController
from stages.config import BudgetUnit, Config, DatasetConfig, OnTruncation, UserError, cli
from stages.store import ResponseStore, StoredResponse
from stages.target import content_hash, load_tokenizer, model_fingerprint, render_prompt_ids


@dataclass
class Planned:
    prompt: dict
    key: str
    prompt_ids: Optional[list[int]]


@dataclass
class RunStats:
    new: int = 0
    new_tokens: int = 0
    failed: Counter = field(default_factory=Counter)
    cancelled: int = 0


def request_key(model_fp: str, prompt_ids: Optional[list[int]], prompt: dict, template_kwargs: dict,
                sampling: dict, max_tokens: int) -> str:
    """Same model + same exact prompt + same sampling = same key, whichever run or dataset asks."""
    what = {"prompt_ids": prompt_ids} if prompt_ids is not None else {
        "messages": prompt["messages"], "tools": prompt.get("tools"), "template_kwargs": template_kwargs}
    return content_hash({"model": model_fp, **what, "sampling": sampling, "max_tokens": max_tokens}, n=32)


def tokens_of(r: StoredResponse, unit: BudgetUnit) -> int:
    return r.completion_tokens + (r.prompt_tokens if unit == BudgetUnit.total else 0)


def unusable_reason(r: StoredResponse, ds: DatasetConfig) -> Optional[str]:
    """Why a stored response does not enter the output (None: it does)."""
    if r.completion_tokens == 0 or not r.text.strip():  # text is decoded without special tokens
        return "empty"
    if r.finish_reason == "length" and ds.on_truncation == OnTruncation.drop:
        return "truncated_dropped"
    return None


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
        total += tokens_of(r, ds.budget_unit)
    return selected, total, skipped


def committed_tokens(plan: list[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig) -> int:
    return sum(tokens_of(r, ds.budget_unit) for p in plan if (r := stored.get(p.key)) and not unusable_reason(r, ds))


async def generate_missing(backend: Backend, todo: list[Planned], ctrl: BudgetController, store: ResponseStore,
                           cfg: Config, stats: RunStats) -> None:
    """Admit requests while the controller allows, commit each response as it arrives, cancel at the budget."""
    ds = cfg.ds
    queue = iter(todo)
    tasks: dict[asyncio.Task, Planned] = {}
    last_log = time.monotonic()
    while True:
        while ctrl.can_admit() and (p := next(queue, None)) is not None:
            req = GenRequest(p.key, p.prompt_ids, p.prompt["messages"], p.prompt.get("tools"), ds.max_tokens,
                             ds.sampling.as_dict())
            tasks[asyncio.create_task(backend.generate(req))] = p
            ctrl.admitted()
        if not tasks:
            return
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            _record(task.result(), tasks.pop(task), store, ctrl, cfg, stats)
        if ctrl.met and tasks:
            for task in tasks:  # real tasks: cancelling them reaches the backend's abort path
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            stats.cancelled += len(tasks)
            return
        if time.monotonic() - last_log >= cfg.run.log_every_s:
            last_log = time.monotonic()
            log("generate", dataset=cfg.dataset, committed=ctrl.committed, budget=ds.token_budget,
                in_flight=ctrl.in_flight, new=stats.new)


def _record(res: GenResult, p: Planned, store: ResponseStore, ctrl: BudgetController, cfg: Config,
            stats: RunStats) -> None:
    ds = cfg.ds
    if not res.ok:
        store.put_failure(p.key, cfg.dataset, p.prompt["id"], res.error, res.detail, res.server)
        stats.failed[res.error] += 1
        ctrl.failed()
        return
    r = StoredResponse(
        key=p.key, dataset=cfg.dataset, prompt_id=p.prompt["id"], text=res.text, prompt_tokens=res.prompt_tokens,
        completion_tokens=res.completion_tokens, finish_reason=res.finish_reason, server=res.server,
        latency_s=res.latency_s, prompt_ids=p.prompt_ids, output_ids=res.output_ids,
    )
    store.put(r)
    stats.new += 1
    stats.new_tokens += res.completion_tokens
    n = tokens_of(r, ds.budget_unit)
    ctrl.finished(n, counted=unusable_reason(r, ds) is None)


def plan_requests(cfg: Config, prompts: list[dict], tok) -> list[Planned]:
    ds, kwargs = cfg.ds, dict(cfg.model.template_kwargs)
    fp = model_fingerprint(cfg.model.path, cfg.model.revision)
    plan = []
    for rec in prompts:
        ids = render_prompt_ids(tok, rec["messages"], rec.get("tools"), kwargs)
        plan.append(Planned(rec, request_key(fp, ids, rec, kwargs, ds.sampling.as_dict(), ds.max_tokens), ids))
    return plan


async def _run(cfg: Config, tok, todo: list[Planned], ctrl: BudgetController, store: ResponseStore,
               stats: RunStats) -> None:
    backend = make_backend(cfg, tok)
    await backend.start()
    try:
        await generate_missing(backend, todo, ctrl, store, cfg, stats)
    finally:
        await backend.close()


def main(cfg: Config) -> None:
    ds, out = cfg.ds, data_dir(cfg.dataset)
    t0 = time.time()
    prompts_path = out / "prompts.jsonl"
    if not prompts_path.exists():
        raise UserError(f"{prompts_path}: not found; run the prompts stage first (dvc repro prompts@{cfg.dataset})")
    tok = load_tokenizer(cfg.model)
    plan = plan_requests(cfg, list(read_jsonl(prompts_path)), tok)
    store = ResponseStore(cfg.run.store_path)
    stored = store.get_many(p.key for p in plan)
    reused = len(stored)
    ctrl = BudgetController(ds.token_budget, ds.max_tokens, ds.concurrency,
                            committed=committed_tokens(plan, stored, ds))
    usable = sum(1 for r in stored.values() if not unusable_reason(r, ds))
    stats = RunStats()
    if ctrl.met:
        log("generate", dataset=cfg.dataset,
            status=f"budget met: {ctrl.committed:,} >= {ds.token_budget:,} tokens from {usable:,} responses")
    else:
        todo = [p for p in plan if p.key not in stored]
        log("generate", dataset=cfg.dataset, committed=ctrl.committed, budget=ds.token_budget, stored=reused,
            to_send=len(todo), backend=cfg.backend.kind.value)
        asyncio.run(_run(cfg, tok, todo, ctrl, store, stats))
        stored = store.get_many(p.key for p in plan)
    selected, total, skipped = select(plan, stored, ds)
    write_jsonl(out / "responses.jsonl", (_output_record(p, r) for p, r in selected))
    wall = time.time() - t0
    metrics = {
        "responses": len(selected),
        "completion_tokens": sum(r.completion_tokens for _, r in selected),
        "prompt_tokens": sum(r.prompt_tokens for _, r in selected),
        "budget": ds.token_budget,
        "budget_unit": ds.budget_unit.value,
        "budget_tokens": total,
        "budget_met": total >= ds.token_budget,
        "overshoot_tokens": max(0, total - ds.token_budget),
        "truncated": sum(r.finish_reason == "length" for _, r in selected),
        "skipped": dict(skipped),
        "failed": dict(stats.failed),
        "cancelled_in_flight": stats.cancelled,
        "reused_from_store": reused,
        "newly_generated": stats.new,
        "wall_s": round(wall, 2),
        "new_tok_per_s": round(stats.new_tokens / wall, 1) if wall > 0 else 0.0,
    }
    write_json(out / "generate_metrics.json", metrics)
    if not metrics["budget_met"]:
        log("generate", dataset=cfg.dataset, warning="budget not met: the source ran out of prompts or requests failed",
            budget_tokens=total, budget=ds.token_budget)
    log("generate", dataset=cfg.dataset, responses=len(selected), budget_tokens=total, new=stats.new,
        reused=reused, cancelled=stats.cancelled, wall_s=round(wall, 1))
    store.close()


def _output_record(p: Planned, r: StoredResponse) -> dict:
    rec = {"id": p.prompt["id"], "key": r.key, "messages": p.prompt["messages"]}
    if p.prompt.get("tools"):
        rec["tools"] = p.prompt["tools"]
    rec.update(prompt_ids=r.prompt_ids, output_ids=r.output_ids, text=r.text, prompt_tokens=r.prompt_tokens,
               completion_tokens=r.completion_tokens, finish_reason=r.finish_reason)
    return rec


if __name__ == "__main__":
    cli(main)
