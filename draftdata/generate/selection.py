"""What the output keeps: the usable responses selected in prompt order up to the budget, by what each response
counts (accounting.py), landed on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from draftdata.config.schema import DatasetConfig
from draftdata.generate.accounting import counted, unusable_reason
from draftdata.generate.request import Planned
from draftdata.generate.store import StoredResponse


def select_responses(plan: list[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig):
    """Usable responses in prompt order, landed on the budget (`landing`: those that fit, then the shortest that
    reaches it, a conversation's later turn only after the turns before it); every unusable one is counted by
    reason."""
    usable: list[tuple[Planned, StoredResponse]] = []
    skipped: Counter = Counter()
    for p in plan:
        r = stored.get(p.key)
        if r is None:
            continue
        reason = unusable_reason(r, ds)
        if reason:
            skipped[reason] += 1
        else:
            usable.append((p, r))
    sizes = [counted(p, r, ds.budget_unit) for p, r in usable]
    heads = [p.prompt.get("turn", 0) == 0 for p, _ in usable]  # a turn of a conversation (`turns: all`) names it
    chosen = landing(sizes, ds.token_budget, heads)
    return [usable[i] for i in chosen], sum(sizes[i] for i in chosen), skipped


def landing(tokens: Sequence[int], budget: int, heads: Sequence[bool] | None = None) -> list[int]:
    """Which responses make the output, as indices into `tokens` (each one's count toward the budget, in prompt
    order): in prompt order while they fit within the budget; then, in place of the next one, which would pass it,
    the shortest of the rest that reaches it. So the output passes the budget by as little as one response can,
    not by whichever comes next (up to max_tokens: a long reasoning answer among short ones), and a lower budget's
    output is still the start of a higher one's, all but its last response. The responses left out stay in the
    store for a larger budget.

    `heads` (`turns: all`, where `tokens` lists each conversation's turns in order): which responses may stand in
    the output without the turns before them, a conversation's first turns. The one that reaches the budget is the
    next in line or a head, never a later turn alone: its prompt holds the turns before it, answers included, as
    context the drafter would pay for and train nothing on, and a conversation's output stays its turns from the
    first."""
    total, end = 0, 0
    while end < len(tokens) and total + tokens[end] <= budget:
        total += tokens[end]
        end += 1
    if total == budget or end == len(tokens):
        return list(range(end))  # exactly on the budget, or short of it with everything there is
    gap = budget - total  # tokens[end] passes it: some response reaches it
    rest = range(end, len(tokens)) if heads is None else [end, *(j for j in range(end + 1, len(tokens)) if heads[j])]
    crossing = min((j for j in rest if tokens[j] >= gap), key=tokens.__getitem__)
    return [*range(end), crossing]
