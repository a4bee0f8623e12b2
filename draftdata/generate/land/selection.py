"""What the output keeps: the usable responses selected in prompt order up to the budget, by what each response
counts (accounting.py), landed on it by the dataset's rule (`landing`).

- `exact` (the default): the output is the shortest run of the run's requests, in prompt order (under `turns: all`
  each conversation's turns in order, conversation after conversation), whose usable answers reach the budget. It is
  a function of the params and the stored answers of the prompts it holds: the same params give the same output
  whatever the timing or the store's history, and a smaller budget's output is the start of a larger one's. A run
  ends once that run of requests is settled (`Landed`): every request in it answered, so everything still in
  flight then lies past the output's end and is parked. A request that fails is sent again within the run; one that
  fails again is a stop, never a hole: the output ends before it (a prefix of what a run without the failure
  writes), the budget is not met and the stage exits with EXIT_INCOMPLETE; the next run asks it again and goes on.
  It overshoots the budget by less than its last response (at most max_tokens, and that response's prompt under
  `budget_unit: total`).
- `finished`: the answers that finished first, in prompt order, then the shortest of the rest that reaches the budget
  (`landing`). The run stops as soon as the answers it holds reach the budget, so it ends sooner; but what it holds
  depends on which requests finished first, and the long answers still running at the budget are left out.
  `on_budget: keep_partial` always lands this way (its cut answers are where the budget found them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from draftdata.config.schema import DatasetConfig
from draftdata.generate.accounting import counted, lands_exact, needs_request, unusable_reason
from draftdata.generate.request import Planned
from draftdata.generate.store import StoredResponse


@dataclass(frozen=True)
class Selection:
    """What the output holds: the usable responses chosen in prompt order, what they count toward the budget, the
    unusable answers by reason, and under `exact` the request the output stopped before, short of the budget, for
    want of an answer (None: it reached the budget, or the plan ran out)."""

    chosen: list[tuple[Planned, StoredResponse]]
    total: int
    skipped: Counter
    unanswered: Planned | None = None


def select_responses(plan: list[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig) -> Selection:
    """Usable responses in prompt order, landed on the budget by the dataset's rule (exact: the shortest run from
    the first that reaches it, ending before a request with no answer; finished: `landing`, those that fit, then
    the shortest that reaches it, a conversation's later turn only after the turns before it); every unusable one is
    counted by reason."""
    exact = lands_exact(ds)
    line: list[tuple[Planned, StoredResponse | None]] = []  # usable answers, and (exact) the requests unanswered
    skipped: Counter = Counter()
    for p in plan:
        r = stored.get(p.key)
        reason = None if r is None else unusable_reason(r, ds)
        if reason:
            skipped[reason] += 1
        if exact and needs_request(r):  # missing, parked or failed: the output cannot pass it
            line.append((p, None))
        elif r is not None and reason is None:
            line.append((p, r))
    sizes = [None if r is None else counted(p, r, ds.budget_unit) for p, r in line]
    if exact:
        chosen = exact_landing(sizes, ds.token_budget)
    else:
        heads = [p.prompt.get("turn", 0) == 0 for p, _ in line]  # a turn of a conversation (`turns: all`) names it
        chosen = landing(sizes, ds.token_budget, heads)
    total = sum(sizes[i] for i in chosen)
    stop = len(chosen) < len(line) and total < ds.token_budget  # the next in line has no answer
    return Selection([line[i] for i in chosen], total, skipped, line[len(chosen)][0] if stop else None)


def exact_landing(tokens: Sequence[int | None], budget: int) -> list[int]:
    """The exact rule (the module docstring): the shortest run from the first response whose count reaches the
    budget (all of them where they do not), ending before a request with no answer (None): never past a hole."""
    total = 0
    for end, n in enumerate(tokens):
        if total >= budget or n is None:
            return list(range(end))
        total += n
    return list(range(len(tokens)))


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
