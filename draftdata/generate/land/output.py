"""The generate stage's outputs, from what the store holds for the run's prompts: the responses selected in prompt order
up to the budget (selection.py) as `responses.jsonl`, the run's figures (`generate_metrics.json`), its plots, and
the rejection ledger of the prompts the output holds no line of (rejected.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

from draftdata.config.schema import Config, DatasetConfig
from draftdata.generate.accounting import landing_rule
from draftdata.generate.land.rejected import reject_conversations, reject_prompts
from draftdata.generate.land.selection import select_responses
from draftdata.generate.plan.planning import Plan, conversation_figures, end_reasons
from draftdata.generate.request import Planned
from draftdata.generate.run.dispatcher import RunStats
from draftdata.generate.run.generation import RunResult
from draftdata.generate.store import CUT, ResponseStore, StoredResponse
from draftdata.util.files import write_csv, write_json, write_jsonl
from draftdata.util.log import log
from draftdata.util.plots import fill_rows, histogram
from draftdata.util.rejected import Rejections


@dataclass
class Written:
    """What the outputs hold: for the stage's closing lines."""

    responses: int
    total: int  # what they count toward the budget
    reused: int  # usable answers the store held before the run
    new: int  # complete answers this run generated
    generated: int  # completion tokens this run generated, and of them:
    in_output: int  # in the output
    parked: int  # in partials a later run continues
    # modes whose output falls short of their share of the budget: (mode, its tokens, its share)
    short: list[tuple[str, int, int]] = field(default_factory=list)
    # landing exact: the requests an output stopped before, short of its budget, for want of an answer (mode, prompt
    # id, why it failed)
    unanswered: list[tuple[str | None, str, str]] = field(default_factory=list)


@dataclass
class Part:
    """One mode's generation (`datasets.<D>.modes`; the whole dataset, `mode` None, where it has none): its config
    (the mode's settings and budget share), prompts, plan and run."""

    mode: str | None
    cfg: Config
    prompts: list[dict]
    plan: Plan
    run: RunResult
    tok: object = None  # its tokenizer: what counts the reasoning's tokens (reasoning_figures)

    @property
    def stats(self) -> RunStats:
        return self.run.stats


@dataclass
class PartOutput:
    """A part's output: the responses selected, what they count, why the others are left out, and why each
    conversation ends where its last line is."""

    part: Part
    selected: list[tuple[Planned, StoredResponse]]
    total: int
    skipped: Counter
    reasons: dict[str, str]
    unanswered: Planned | None = None  # landing exact: the request it stopped before, short of its budget

    @classmethod
    def of(cls, part: Part) -> PartOutput:
        s = select_responses(part.run.requests, part.run.stored, part.cfg.ds)
        reasons = {} if part.plan.convs is None else end_reasons(part.plan.convs, s.chosen, part.cfg.ds)
        return cls(part, s.chosen, s.total, s.skipped, reasons, s.unanswered)


def write_outputs(cfg: Config, out: Path, prompts: list[dict], parts: list[Part], store: ResponseStore, wall: float):
    """The stage's outputs from its parts: one, or one per mode, each landed on its share of the budget and merged
    in prompt order (each row naming its mode)."""
    landed = [PartOutput.of(part) for part in parts]
    lines = [(land, p, r) for land in landed for p, r in land.selected]
    if len(landed) > 1:  # the modes' outputs, merged in prompt order (a conversation's turns in order)
        order = {p["id"]: i for i, p in enumerate(prompts)}
        lines.sort(
            key=lambda x: (order[x[1].prompt.get("conversation", x[1].prompt["id"])], x[1].prompt.get("turn", 0))
        )
    selected = [(p, r) for _, p, r in lines]
    # the lines (made as the file is written: seconds at 100k) and the figures first, the writers together at the end
    records = (output_record(p, r, land.reasons.get(p.prompt["id"]), land.part.mode) for land, p, r in lines)
    stats = merged_stats([part.stats for part in parts])
    total = sum(land.total for land in landed)
    if len(landed) == 1 and landed[0].part.mode is None:
        metrics = part_metrics(landed[0], wall)
    else:
        skipped = sum((land.skipped for land in landed), Counter())
        duplicates = sum(part.plan.duplicates for part in parts)
        metrics = run_metrics(cfg.ds, selected, total, skipped, stats, stats.reused, duplicates, wall)
        metrics |= reasoning_figures(selected, parts[0].tok)
        metrics["modes"] = {land.part.mode: part_metrics(land, wall) for land in landed}
    # the arithmetic the output's answers were computed in, as their rows record it (null: a server's)
    metrics["compute_dtype"] = sorted({r.compute_dtype for _, r in selected if r.compute_dtype}) or None
    metrics["attention"] = sorted({r.attention for _, r in selected if r.attention}) or None  # ... and its attention
    lengths = histogram([r.completion_tokens for _, r in selected], cfg.ds.max_tokens)
    # a run that only reused the store fills the budget at its start: one point
    fill = fill_rows(stats.fill or [(0.0, total)], cfg.ds.token_budget)
    with Rejections(out / "generate_rejected.jsonl", "generate") as rejected:
        for land in landed:
            _reject(rejected, land, store)
    metrics["prompts"], metrics["prompts_in_output"] = len(prompts), len(prompts) - rejected.rows
    metrics["rejected"] = dict(sorted(rejected.counts.items()))
    log("generate", dataset=cfg.dataset, writing=out / "responses.jsonl")  # the writing begins (seconds at 100k)
    write_jsonl(out / "responses.jsonl", records)
    write_csv(out / "plots" / "completion_lengths.csv", lengths, ["length", "responses"])
    write_csv(out / "plots" / "budget_fill.csv", fill, ["seconds", "tokens", "budget"])
    write_json(out / "generate_metrics.json", metrics)
    return Written(
        len(selected),
        total,
        stats.reused,
        stats.new,
        stats.generated,
        metrics["new_in_output_tokens"],
        stats.parked_tokens,
        [
            (m.part.mode, m.total, m.part.cfg.ds.token_budget)
            for m in landed
            if m.part.mode and m.total < m.part.cfg.ds.token_budget
        ],
        [(m.part.mode, m.unanswered.prompt["id"], _why(m.unanswered, store)) for m in landed if m.unanswered],
    )


def _why(p: Planned, store: ResponseStore) -> str:
    """Why request `p` has no answer: its last failure as the store recorded it, or that it is still to be asked."""
    return store.failures([p.key]).get(p.key, "not answered yet")


def part_metrics(land: PartOutput, wall: float) -> dict:
    """A part's figures: a dataset's whole generate_metrics where it has no modes, a mode's row where it has."""
    part = land.part
    metrics = run_metrics(
        part.cfg.ds, land.selected, land.total, land.skipped, part.stats, part.stats.reused, part.plan.duplicates, wall
    )
    metrics |= conversation_figures(part.plan, land.reasons, land.selected, part.run.same_server_share)
    metrics |= reasoning_figures(land.selected, part.tok)
    # landing exact: the prompt whose request has no answer, which the output stops before short of the budget
    metrics["stopped_before"] = land.unanswered.prompt["id"] if land.unanswered else None
    if part.mode is not None:
        metrics["prompts"] = len(part.prompts)
    return metrics


THINK_END = "</think>"  # where a thinking template's answer (Qwen3's, DeepSeek-R1's) ends its reasoning


def reasoning_tokens(r: StoredResponse, tok) -> int:
    """The tokens of an answer's reasoning, where the server or the template separates it: the reasoning a server's
    parser moved out of the text, else the text up to the template's THINK_END, encoded (the answer's own ids are
    not split at it: a tokenizer may merge the marker with what is around it)."""
    text = r.reasoning or ""
    if not text and THINK_END in (r.text or ""):
        text = r.text[: r.text.index(THINK_END) + len(THINK_END)]
    return len(tok.encode(text, add_special_tokens=False)) if text and tok is not None else 0


def reasoning_figures(selected: list[tuple[Planned, StoredResponse]], tok) -> dict:
    """The output's reasoning tokens and their share of its completion tokens (thinking and non-thinking data
    matched to serving: docs/generation.md, modes)."""
    reasoning = sum(reasoning_tokens(r, tok) for _, r in selected)
    completion = sum(r.completion_tokens for _, r in selected)
    return {"reasoning_tokens": reasoning, "reasoning_share": round(reasoning / completion, 4) if completion else 0.0}


def merged_stats(stats: list[RunStats]) -> RunStats:
    """The parts' run figures as one run's: counts added, the budget-fill points one after another."""
    if len(stats) == 1:
        return stats[0]
    out = RunStats()
    for s in stats:
        for f in fields(RunStats):
            mine, theirs = getattr(out, f.name), getattr(s, f.name)
            if f.name == "fill":
                t0, n0 = mine[-1] if mine else (0.0, 0)
                mine.extend((round(t0 + t, 2), n0 + n) for t, n in theirs)
            elif isinstance(mine, bool):
                setattr(out, f.name, mine or theirs)
            elif isinstance(mine, (int, float, Counter)):
                setattr(out, f.name, mine + theirs)
            elif isinstance(mine, dict):
                mine.update(theirs)
    return out


def _reject(rejected: Rejections, land: PartOutput, store: ResponseStore) -> None:
    """A part's lines of the ledger of the prompts the output holds no line of (rejected.py)."""
    run, ds = land.part.run, land.part.cfg.ds
    failures = store.failures([p.key for p in run.requests if p.key not in run.stored])
    if land.part.plan.convs is None:
        reject_prompts(rejected, land.part.prompts, run.requests, run.stored, land.selected, ds, failures)
    else:
        reject_conversations(rejected, land.part.plan.convs, run.stored, land.selected, ds, failures)


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
        "landing": landing_rule(ds),  # the rule the output landed on the budget by (selection.py)
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
        "concurrency": ds.concurrency,  # the requests in flight at most: the rate's context (draftdata plan says it)
    }


def output_record(p: Planned, r: StoredResponse, end_reason: str | None = None, mode: str | None = None) -> dict:
    """A line of responses.jsonl; a conversation's turn (`turns: all`) also names its conversation and turn, and
    its conversation's last line why it ended; a dataset with modes, the row's mode."""
    rec = {"id": p.prompt["id"], "key": r.key, "messages": p.prompt["messages"]}
    if mode is not None:
        rec["mode"] = mode
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
