"""Stage `generate@D`: prompts → responses, landed on the dataset's token budget.

Responses live in the response store (draftdata/generate/store.py) and are committed as they arrive; this stage only
sends what the store lacks, and stops once the budget is met. Its DVC output, `data/<D>/responses.jsonl`, is
materialised from the store in prompt order, landed on the budget (draftdata/generate/land/selection.py), so lowering a
budget costs no generation and raising it generates only the difference. Every prompt the output holds no line of
is listed with its reason in `generate_rejected.jsonl`.
"""

from __future__ import annotations

import time

from draftdata.config.load import cli
from draftdata.config.modes import mode_warnings, split_rows
from draftdata.config.schema import Config
from draftdata.errors import Incomplete, UserError
from draftdata.generate.land.output import Part, write_outputs
from draftdata.generate.plan.planning import Plan, check_turns
from draftdata.generate.run.generation import run_generation
from draftdata.generate.run.preflight import preflight
from draftdata.generate.store import ResponseStore
from draftdata.model.target import load_target
from draftdata.util.files import data_dir, read_jsonl
from draftdata.util.log import log
from draftdata.util.sqlite import hash_cache_path, resolve_store_path


def main(cfg: Config) -> None:
    t0 = time.time()
    if (note := cfg.concurrency_note()) is not None:  # the first line: a fleet run at a laptop's concurrency
        log("generate", warning=note)
    out = data_dir(cfg.dataset)
    if not (out / "prompts.jsonl").exists():
        raise UserError(
            f"{out / 'prompts.jsonl'}: not found; run the prompts stage first (dvc repro prompts@{cfg.dataset})"
        )
    prompts = list(read_jsonl(out / "prompts.jsonl"))
    check_turns(prompts, cfg, out / "prompts.jsonl")
    for line in mode_warnings(cfg, cfg.dataset):  # also check_params's, for modes set on the command line
        log("generate", warning=line)
    split = split_rows(cfg, prompts)  # one part, or one per mode
    store_path = resolve_store_path(cfg.run.store_path)
    hashes = hash_cache_path(store_path)
    # each part's target, before the store opens: found, its tokenizer and template checked, its fingerprints
    targets = [load_target(sub, hashes) for _, sub, _ in split]
    store = ResponseStore(store_path)
    try:
        # every part planned (its prompts rendered and checked) before any request
        plans = [
            (mode, sub, rows, target, Plan.make(sub, rows, target, store))
            for (mode, sub, rows), target in zip(split, targets)
        ]
        for mode, sub, _, target, plan in plans:  # every part's requests checked before the first part sends one
            preflight(sub, target, plan, store, out / "generate_metrics.json", mode)
        parts = [
            Part(mode, sub, rows, plan, run_generation(sub, target, plan, store, mode), target.tok)
            for mode, sub, rows, target, plan in plans
        ]
        written = write_outputs(cfg, out, prompts, parts, store, time.time() - t0)
    finally:
        store.close()
    for mode, tokens, share in written.short:  # its prompts ran out (or failed): the rest of its share is not spent
        log(
            "generate",
            dataset=cfg.dataset,
            warning=f"mode {mode}: its share of the budget not met ({tokens:,} of {share:,} tokens); the "
            "remainder is left unspent, not given to the other modes",
        )
    budget = cfg.ds.token_budget
    if written.total < budget and not written.unanswered:
        log(
            "generate",
            dataset=cfg.dataset,
            warning="budget not met: the source ran out of prompts or requests "
            "failed (failed prompts are retried on the next run)",
            budget_tokens=written.total,
            budget=budget,
        )
    log(
        "generate",
        dataset=cfg.dataset,
        responses=written.responses,
        budget_tokens=written.total,
        new=written.new,
        reused=written.reused,
        # where this run's tokens went: the rest are complete answers past the output's end (stored: a larger
        # budget's output holds them) or lost
        generated=written.generated,
        kept=written.in_output,
        parked=written.parked,
        wall_s=round(time.time() - t0, 1),
    )
    if written.unanswered:
        raise Incomplete(unanswered_line(cfg.dataset, written.unanswered, written.total, budget))


def unanswered_line(dataset: str, unanswered: list[tuple[str | None, str, str]], total: int, budget: int) -> str:
    """The one line a run whose output stopped before a failed request ends with."""
    stops = "; ".join(f"{f'mode {m}: ' if m else ''}prompt {pid} ({why})" for m, pid, why in unanswered)
    return (
        f"generate@{dataset}: budget not met ({total:,} of {budget:,} tokens): a request failed twice in this run, "
        f"and the output, exact, stops before it: {stops}. Everything generated is in the store; run again "
        f"(dvc repro) to ask it again and go on. A prompt that fails for good (a server's content filter) stops it "
        f"there every time: drop it from the source, or set datasets.{dataset}.landing: finished"
    )


if __name__ == "__main__":
    cli(main)
