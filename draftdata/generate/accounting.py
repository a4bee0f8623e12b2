"""What a response counts toward its dataset's budget, and what its samples hold: the one rule that selection, the
dispatcher, the run's ledger, the budget controller and `draftdata plan` count by.

Usable. A stored response enters the output when it is complete (a parked partial is continued instead; under
`on_budget: keep_partial` one cut at the budget is used as it is), not empty, and not truncated under
`on_truncation: drop` (`unusable_reason`).

Counted. Under `budget_unit: completion` a response counts its completion tokens. Under `total` it counts every
token its samples hold, once: a single prompt's prompt and answer; a conversation's turns (`turns: all`) as tokenize
makes samples of them. Where every turn's prompt ids start with the turn before's prompt and answer ids, one sample
holds the whole conversation (its last prompt and answer), so a later turn counts what its prompt adds to the turn
before and its answer, and its answer; where a template rewrites the history (Qwen3's drops the reasoning, and with
`enable_thinking: false` the empty think block, of earlier turns), each turn is a sample of its own, exactly the ids
it was sent, and counts its whole prompt. tokenize decides that from the ids of the whole conversation: one turn
that does not continue the one before makes every turn its own sample, so that turn also counts the prompt tokens
the turns before it were not counted for (`Link.restated`). Decided from the ids as tokenize decides it, the count
is what the samples hold, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from draftdata.config.schema import BudgetUnit, DatasetConfig, Landing, OnBudget, OnTruncation
from draftdata.generate.request import Link, Planned
from draftdata.generate.store import CUT, StoredResponse
from draftdata.util.hashing import ids_json

# ---- usable ------------------------------------------------------------------------------------------------- #


def unusable_reason(r: StoredResponse, ds: DatasetConfig) -> str | None:
    """Why a stored response does not enter the output (None: it does)."""
    if r.partial and not (r.finish_reason == CUT and ds.on_budget == OnBudget.keep_partial):
        return "cut_by_budget" if r.finish_reason == CUT else "interrupted"  # parked: continued when needed
    if is_empty(r):
        return "empty"
    if r.finish_reason == "length" and ds.on_truncation == OnTruncation.drop:
        return "truncated_dropped"
    return None


def is_empty(r: StoredResponse) -> bool:
    """Nothing to train on: no token, or no text, thinking nor tool call (the text is decoded without special
    tokens, from the ids where a server sent ids and no text: an answer of the end-of-turn token alone is empty)."""
    return r.completion_tokens == 0 or not (r.text.strip() or r.reasoning or r.tool_calls)


def needs_request(r: StoredResponse | None) -> bool:
    """Whether a run that generates sends this prompt: missing, parked (to continue), or an empty answer stored by an
    earlier version."""
    return r is None or r.partial or r.completion_tokens == 0


# ---- counted ------------------------------------------------------------------------------------------------ #


def prompt_count(p: Planned, prompt_tokens: int | None = None) -> int:
    """The prompt tokens request `p` adds to its samples (of `prompt_tokens`, a stored answer's count; default the
    plan's): all of a single prompt's or a first turn's; of a later turn, what its prompt adds to the turn before and
    its answer while the conversation is one sample, else all of it (and, at the first turn that breaks the chain,
    what the turns before it now hold besides: `Link`)."""
    n = p.prompt_tokens if prompt_tokens is None else prompt_tokens
    if p.link is None:
        return n
    return (n - p.link.before if p.link.grows else n) + p.link.restated


def counted(p: Planned, r: StoredResponse, unit: BudgetUnit) -> int:
    """What response `r` to request `p` counts toward the budget."""
    return r.completion_tokens + (prompt_count(p, r.prompt_tokens) if unit == BudgetUnit.total else 0)


def in_flight_prompt(p: Planned, unit: BudgetUnit) -> int:
    """What a request in flight counts toward the budget before its answer: its prompt's share under `total`."""
    return prompt_count(p) if unit == BudgetUnit.total else 0


def stored_total(
    plan: Sequence[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig, partial: bool = True
) -> tuple[int, int]:
    """What the plan's usable stored answers count toward the budget, each as the output counts it (two
    conversations that share a turn each hold it), and how many answers hold them; `partial=False`: complete ones
    only (keep_partial's cut ones count once no more generation is wanted)."""
    pairs = [
        (p, r)
        for p in plan
        if (r := stored.get(p.key)) is not None and (partial or not r.partial) and unusable_reason(r, ds) is None
    ]
    return sum(counted(p, r, ds.budget_unit) for p, r in pairs), len(pairs)


@dataclass
class Standing:
    """What a run's stored rows count before it sends anything, by the rules above, read once where the run is
    planned: the run, its announcement of a change and the budget controller read these figures, not the rules."""

    counted: int  # what the usable stored answers count toward the budget (draftdata plan's "reusable")
    complete: int  # the same, keep_partial's cut ones left out: what the budget controller starts from
    usable: int  # stored answers the output can use
    lengths: list[int]  # completion lengths of the complete usable ones: the length model's first readings
    todo: list[Planned]  # what a run that generates sends: missing, parked, or empty (needs_request)
    prompt_mean: float | None  # the mean prompt tokens a request of `todo` adds (budget_unit total; else None)


def standing(plan: Sequence[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig) -> Standing:
    complete = [r for r in stored.values() if not r.partial and unusable_reason(r, ds) is None]
    todo = [p for p in plan if needs_request(stored.get(p.key))]
    total = ds.budget_unit == BudgetUnit.total and todo
    return Standing(
        counted=stored_total(plan, stored, ds)[0],
        complete=stored_total(plan, stored, ds, partial=False)[0],
        usable=sum(unusable_reason(r, ds) is None for r in stored.values()),
        # completion lengths only: bounded by max_tokens, whatever the unit
        lengths=[r.completion_tokens for r in complete],
        todo=todo,
        prompt_mean=sum(prompt_count(p) for p in todo) / len(todo) if total else None,
    )


# ---- a conversation's turns --------------------------------------------------------------------------------- #


def link(nxt: Planned, done: Sequence[tuple[Planned, StoredResponse]], every_turn: bool = True) -> Link:
    """How a conversation's next turn `nxt` holds its answered turns `done` (tokenize's rule, decided from the ids).
    `every_turn`: tokenize trains every turn (`tokenize.train_on: all_turns`); else it trains the last alone, whose
    sample is its prompt and answer whatever the template did to the history, so each turn counts what its prompt
    and answer add to the turn before's and the conversation counts its last turn's."""
    before, answer = done[-1]
    size = before.prompt_tokens + answer.completion_tokens
    chained = before.link is None or before.link.grows
    if not chained:
        return Link(size, False)
    if not every_turn or continues(nxt, before, answer):
        return Link(size, True)
    # the first break: every turn becomes its own sample, its whole prompt
    restated = sum(r.prompt_tokens - prompt_count(p, r.prompt_tokens) for p, r in done)
    return Link(size, False, restated)


def continues(nxt: Planned, before: Planned, answer: StoredResponse) -> bool:
    """Whether `nxt`'s prompt ids start with the turn before's prompt ids and its answer's ids, exactly (as the
    server took them: its own prompt ids where it said). An answer known by its text alone (no ids) is taken to
    continue where its prompt is not shorter: tokenize re-encodes it, and only its ids could tell."""
    head = answer.prompt_ids if answer.prompt_ids is not None else before.prompt_ids
    if answer.output_ids is None:
        return nxt.prompt_tokens >= len(head) + answer.completion_tokens
    if isinstance(nxt.rendered, list):
        n = len(head) + len(answer.output_ids)
        return nxt.rendered[: len(head)] == head and nxt.rendered[len(head) : n] == answer.output_ids
    # the ids' text as the store holds it: a prefix of canonical JSON ids is a prefix of the ids (no decoding)
    text = ids_json(head + answer.output_ids)
    return text == nxt.rendered or nxt.rendered.startswith(text[:-1] + ",")


# How many answered turns with a source turn after them, all going on to it, `continuation` starts from: the share
# is read from what the run sees, from "every source turn" at first
CONTINUATION_PRIOR = 8


def continuation(went_on: int, could: int) -> float:
    """The share of answered turns with a source turn after them whose conversation went on to it (the rest ended
    early: a diverging call, a truncated answer, a context full), with CONTINUATION_PRIOR turns that went on."""
    return (went_on + CONTINUATION_PRIOR) / (could + CONTINUATION_PRIOR)


def expected_turns(first: int, turns: int, carry: float = 1.0) -> float:
    """How many of a conversation's `turns` source turns not yet requested will be, each going on from the one
    before with chance `carry`: the first of them surely where it waits for a slot (`first` 0), with chance `carry`
    where the turn before is in flight (`first` 1)."""
    if carry >= 1.0 or turns <= 0:
        return float(max(turns, 0))
    start = carry if first else 1.0
    return start * (1.0 - carry**turns) / (1.0 - carry)


def turns_cost(
    first: int, turns: int, prompt: int, completion: float, growth: float, prompts: bool, carry: float = 1.0
) -> float:
    """Expected tokens of a conversation's `turns` source turns not yet requested, the first of them `first` turns
    after the one whose prompt adds `prompt` tokens (0: it is that turn): each adds a completion and, when prompts
    count (`total`), what its prompt adds to the sample: `prompt` for that turn itself, a source step (`growth`, the
    mean of what a turn's prompt adds to the turn before and its answer) after. `carry`: the chance that a turn goes
    on to the next (expected_turns; 1.0: every source turn is expected)."""
    n = expected_turns(first, turns, carry)
    if not prompts or turns <= 0:
        return n * completion
    return n * (completion + growth) + (prompt - growth if first == 0 else 0)


# ---- the landing rule -------------------------------------------------------------------------------------------- #


def lands_exact(ds: DatasetConfig) -> bool:
    """Whether the output lands by the exact rule (land/selection.py's docstring): `landing: exact`, unless
    `on_budget: keep_partial`, whose cut answers are where the budget found them."""
    return ds.landing == Landing.exact and ds.on_budget != OnBudget.keep_partial


def landing_rule(ds: DatasetConfig) -> str:
    """The rule the output landed by, as the metrics record it."""
    return Landing.exact.value if lands_exact(ds) else Landing.finished.value
