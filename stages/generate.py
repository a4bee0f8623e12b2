"""Stage `generate@D`: prompts → responses, landed on the dataset's token budget.

Responses live in the response store (draftdata/generate/store.py) and are committed as they arrive; this stage only
sends what the store lacks, and stops once the budget is met. Its DVC output, `data/<D>/responses.jsonl`, is
materialised from the store in prompt order, landed on the budget (draftdata/generate/budget.py `landing`), so
lowering a budget costs no generation and raising it generates only the difference.
"""

from __future__ import annotations

import time

from draftdata.config.load import cli
from draftdata.config.schema import Config
from draftdata.errors import UserError
from draftdata.generate.accounting import stored_total, unusable_reason
from draftdata.generate.dispatcher import RunStats
from draftdata.generate.run import generate_missing, output_record, run_metrics, write_plots
from draftdata.generate.selection import select_responses
from draftdata.generate.store import ResponseStore
from draftdata.generate.work import RunPlan
from draftdata.model.tokenizer import load_target_tokenizer
from draftdata.util.files import data_dir, read_jsonl, write_json, write_jsonl
from draftdata.util.log import log
from draftdata.util.sqlite import resolve_store_path


def main(cfg: Config) -> None:
    ds, out = cfg.ds, data_dir(cfg.dataset)
    t0 = time.time()
    prompts_path = out / "prompts.jsonl"
    if not prompts_path.exists():
        raise UserError(f"{prompts_path}: not found; run the prompts stage first (dvc repro prompts@{cfg.dataset})")
    # its ids fit the model, its template ends the turn where it stops
    tok, limits = load_target_tokenizer(cfg.model, cfg.template_kwargs)
    prompts = list(read_jsonl(prompts_path))
    store = ResponseStore(resolve_store_path(cfg.run.store_path))
    try:
        run = RunPlan.make(cfg, prompts, tok, store, limits.context)
        usable = {k: r for k, r in run.stored.items() if unusable_reason(r, ds) is None}
        committed = stored_total(run.plan, run.stored, ds)[0]
        stats = RunStats()
        if committed >= ds.token_budget:
            log(
                "generate",
                dataset=cfg.dataset,
                status=f"budget met: {committed:,} >= {ds.token_budget:,} tokens from {len(usable):,} responses",
            )
        else:
            stats = generate_missing(cfg, tok, run.plan, run.stored, store, run.queue)
            run.reread(store)
        selected, total, skipped = select_responses(run.plan, run.stored, ds)
        reasons = run.end_reasons(selected)
        # the writing of the outputs begins (100k responses take seconds)
        log("generate", dataset=cfg.dataset, writing=out / "responses.jsonl")
        write_jsonl(out / "responses.jsonl", (output_record(p, r, reasons.get(p.prompt["id"])) for p, r in selected))
        write_plots(
            out / "plots", [r.completion_tokens for _, r in selected], ds.max_tokens, stats.fill or [(0.0, total)]
        )
        write_json(
            out / "generate_metrics.json",
            run_metrics(ds, selected, total, skipped, stats, len(usable), run.duplicates, time.time() - t0)
            | run.metrics(reasons, selected),
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


if __name__ == "__main__":
    cli(main)
