"""generate/accounting.py: what a response counts toward the budget, decided as tokenize makes samples."""

from __future__ import annotations

import pytest

from draftdata.config.schema import BudgetUnit
from draftdata.generate.accounting import continues, counted, link, prompt_count
from draftdata.generate.request import Planned
from draftdata.generate.store import StoredResponse
from draftdata.model.tokenizer import prefix_stable
from draftdata.util.hashing import ids_json


def turn(ids: list[int], as_text: bool = False) -> Planned:
    return Planned({"id": "t"}, "k", ids_json(ids) if as_text else list(ids))


def answer(p: Planned, out: list[int]) -> StoredResponse:
    return StoredResponse("k", "D", "t", "x", p.prompt_tokens, len(out), "stop", "s", 0.0, p.prompt_ids, out)


def walk(prompts: list[list[int]], outs: list[list[int]], every_turn: bool = True, as_text: bool = False):
    """The turns of one conversation, each linked to those before it as the work queue links them."""
    done = []
    for ids, out in zip(prompts, outs):
        p = turn(ids, as_text)
        if done:
            p.link = link(p, done, every_turn)
        done.append((p, answer(p, out)))
    return done


def samples_hold(prompts, outs, every_turn: bool = True) -> int:
    """What tokenize's samples of the conversation hold: one sample (the last prompt and answer) where every turn
    continues the turn before, else one per trained turn."""
    turns = list(zip(prompts, outs))
    if not every_turn:
        return len(prompts[-1]) + len(outs[-1])
    if prefix_stable(turns):
        return len(prompts[-1]) + len(outs[-1])
    return sum(len(p) + len(o) for p, o in turns)


CONVERSATIONS = {
    # every turn's prompt holds the turn before and its answer: one sample
    "continued": ([[1, 2, 3], [1, 2, 3, 7, 8, 4, 5], [1, 2, 3, 7, 8, 4, 5, 9, 6]], [[7, 8], [9], [10, 11]]),
    # the template drops the answer's first token from the history at turn 2 (a think block): a sample per turn
    "rewritten": ([[1, 2, 3], [1, 2, 3, 8, 4, 5], [1, 2, 3, 8, 4, 5, 9, 6]], [[7, 8], [9], [10, 11]]),
    # continued to turn 2, rewritten at turn 3: the break restates the turns before it
    "broken_late": ([[1, 2, 3], [1, 2, 3, 7, 8, 4, 5], [1, 2, 3, 7, 8, 4, 5, 6]], [[7, 8], [9], [10, 11]]),
}


@pytest.mark.parametrize("every_turn", [True, False], ids=["all_turns", "last_turn"])
@pytest.mark.parametrize("as_text", [False, True], ids=["ids", "ids_text"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_a_conversation_counts_what_its_samples_hold(name, as_text, every_turn):
    prompts, outs = CONVERSATIONS[name]
    done = walk(prompts, outs, every_turn, as_text)
    assert sum(counted(p, r, BudgetUnit.total) for p, r in done) == samples_hold(prompts, outs, every_turn)
    # any first turns of it: the output may stop mid-conversation
    for k in range(1, len(done)):
        held = samples_hold(prompts[:k], outs[:k], every_turn)
        assert sum(counted(p, r, BudgetUnit.total) for p, r in done[:k]) == held
    assert sum(counted(p, r, BudgetUnit.completion) for p, r in done) == sum(map(len, outs))


def test_the_break_restates_the_prompts_counted_short_and_later_turns_count_whole():
    done = walk(*CONVERSATIONS["broken_late"])
    links = [p.link for p, _ in done]
    assert links[0] is None and links[1].grows and links[1].restated == 0
    # the second turn counted what it added to the first turn (7 - (3 + 2)); its own sample holds all 7: 3 + 2 more
    assert not links[2].grows and links[2].restated == 3 + 2
    assert prompt_count(done[2][0]) == 8 + 5


def test_an_answer_known_by_its_text_alone_continues_where_the_prompt_is_not_shorter():
    before = turn([1, 2, 3])
    text_only = StoredResponse("k", "D", "t", "hi", 3, 2, "stop", "s", 0.0, [1, 2, 3], None)
    assert continues(turn([1, 2, 3, 50, 51, 4]), before, text_only)
    assert not continues(turn([1, 2, 3, 4]), before, text_only)
