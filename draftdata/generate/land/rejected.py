"""generate's rejection ledger (`data/<D>/generate_rejected.jsonl`, util/rejected.py): every prompt record (a
conversation, under `turns: all`) the output holds no line of, with why:

- `duplicate_after_template`: the chat template renders it as an earlier prompt (one request, one output line);
- `not_needed`: never answered, the budget met before its turn came (it waits in line for a larger budget);
- `over_budget`: answered and usable, kept in the store for a larger budget: the output stops before it;
- `failed:<code>`: its request failed (retried by the next run);
- a stored answer's unusable reason (`empty`, `truncated_dropped`, a parked `cut_by_budget` or `interrupted`);
- a conversation that ended before a usable turn: why it ended (`empty`, `context`, `truncated`, ...).

The prompts in and the records the output holds a line of add up with these to the prompts stage's output.
"""

from __future__ import annotations

from collections.abc import Iterable

from draftdata.config.schema import DatasetConfig
from draftdata.generate.accounting import unusable_reason
from draftdata.generate.plan.conversations import Conversation
from draftdata.generate.request import Planned
from draftdata.generate.store import StoredResponse
from draftdata.util.rejected import Tally

DUPLICATE, NOT_NEEDED, OVER_BUDGET = "duplicate_after_template", "not_needed", "over_budget"


def reject_prompts(
    out: Tally,
    prompts: Iterable[dict],
    plan: list[Planned],
    stored: dict[str, StoredResponse],
    selected: list[tuple[Planned, StoredResponse]],
    ds: DatasetConfig,
    failures: dict[str, str],
) -> None:
    """`turns: last`: each prompt the output has no line of."""
    planned = {p.prompt["id"]: p for p in plan}
    kept = {p.prompt["id"] for p, _ in selected}
    for rec in prompts:
        if rec["id"] in kept:
            continue
        p = planned.get(rec["id"])
        reason = DUPLICATE if p is None else _why(p, stored.get(p.key), ds, failures)
        out.add(reason, id=rec["id"], where=rec.get("where"))


def reject_conversations(
    out: Tally,
    convs: list[Conversation],
    stored: dict[str, StoredResponse],
    selected: list[tuple[Planned, StoredResponse]],
    ds: DatasetConfig,
    failures: dict[str, str],
) -> None:
    """`turns: all`: each conversation the output has no turn of."""
    kept = {p.prompt["conversation"] for p, _ in selected}
    for c in convs:
        if c.rec["id"] in kept:
            continue
        if any(unusable_reason(r, ds) is None for _, r in c.done):
            reason = OVER_BUDGET
        elif c.next is None:
            reason = c.ended or NOT_NEEDED
        else:
            reason = _why(c.next, stored.get(c.next.key), ds, failures)
        out.add(reason, id=c.rec["id"], where=c.rec.get("where"))


def _why(p: Planned, r: StoredResponse | None, ds: DatasetConfig, failures: dict[str, str]) -> str:
    if r is None:
        return f"failed:{failures[p.key]}" if p.key in failures else NOT_NEEDED
    return unusable_reason(r, ds) or OVER_BUDGET
