"""The budget over conversations (`turns: all`): the controller counts what started conversations will still ask
before it admits new ones, keeps the batch their turns make as a request's near the end, and the output lands on
the budget without a conversation's later turn standing alone."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from draftdata.config.schema import DatasetConfig, Landing
from draftdata.generate.accounting import continuation, expected_turns
from draftdata.generate.land.selection import landing, select_responses
from draftdata.generate.request import Planned
from draftdata.generate.run.budget.controller import BudgetController, Pending
from draftdata.generate.store import StoredResponse


def seen(c: BudgetController, length: int = 1000, n: int = 16) -> BudgetController:
    """Completion lengths seen (none counted toward the budget), so the mean is `length`."""
    for _ in range(n):
        c.finished(length, counted=False)
    return c


def test_started_conversations_turns_to_come_count_before_new_conversations_are_admitted():
    c = seen(BudgetController(budget=100_000, max_tokens=4000, concurrency=50, admit_slack=0.0))
    # 10 conversations in flight, each with 3 source turns after its current one; next in line, 4-turn ones
    pending = Pending(started=[(1, 3, 0)] * 10, upcoming=[(0, 4, 0)] * 40)
    progress = [0] * 10
    assert pending.tokens(1000) == 30_000
    # in flight 10 × 1,000 expected, their turns to come 30,000; a new conversation costs its 4 turns
    assert c.admit_count(progress, (), pending) == (100_000 - 10_000 - 30_000) // 4000 == 15
    assert c.admit_count(progress) == 40  # as single requests: as many as there is room for


def test_under_budget_unit_total_each_turn_to_come_counts_what_its_prompt_adds_to_the_sample():
    """A conversation's sample holds each token once: a turn to come adds its answer (1,000) and the source's next
    turn (100); the turns and answers before it, which its prompt holds too, are counted already."""
    in_flight = Pending(started=[(1, 2, 500)], growth=100, prompts=True)  # the turn adding 500 is in flight
    assert in_flight.tokens(1000) == (1000 + 100) + (1000 + 100)
    waiting = Pending(started=[(0, 2, 500)], growth=100, prompts=True)  # it waits for a slot: it adds 500 itself
    assert waiting.tokens(1000) == (1000 + 500) + (1000 + 100)
    assert Pending(started=[(1, 2, 500)], growth=100).tokens(1000) == 2000  # completions only: the answers


def test_under_landing_exact_turns_to_come_are_weighted_by_the_share_that_went_on():
    """A conversation started late is a whole chain the exact output waits for: the turns to come are expected at
    the share of turns that went on to the next so far (three in four here), not every source turn; the finished
    rule keeps the upper bound."""
    assert continuation(0, 0) == 1.0  # nothing seen: every source turn
    assert continuation(30, 40) == pytest.approx((30 + 8) / (40 + 8))
    assert expected_turns(0, 3, 0.5) == 1 + 0.5 + 0.25  # the first waits for a slot: surely requested
    assert expected_turns(1, 3, 0.5) == 0.5 + 0.25 + 0.125  # the turn before is in flight: each goes on or not
    assert expected_turns(1, 3) == 3
    pending = Pending(started=[(1, 3, 0)] * 10, upcoming=[(0, 4, 0)] * 40, carry=0.5)
    exact = BudgetController(budget=100_000, max_tokens=4000, concurrency=200, landed=0)
    exact.lengths.add_stored([1000] * 16)  # every answer 1,000 long: no spread, no margin
    # in flight 10 × 1,000; their turns to come 10 × 0.875 × 1,000; a new conversation 1.875 × 1,000
    assert exact.admit_count([0] * 10, (), pending) == (100_000 - 10_000 - 8_750) // 1_875 == 43
    finished = seen(BudgetController(budget=100_000, max_tokens=4000, concurrency=50, admit_slack=0.0))
    assert finished.admit_count([0] * 10, (), pending) == 15  # as without `carry`


def test_a_conversation_admitted_while_the_server_is_not_read_fills_the_batch_with_the_slack():
    """1M tokens are 63 conversations of 4.5 turns: admitted by the budget alone they would hold a batch of 150
    at 63 until the server is read."""
    c = seen(BudgetController(budget=1_000_000, max_tokens=10_240, concurrency=150, observes_rate=True), 3500)
    pending = Pending(upcoming=[(0, 4, 0), (0, 5, 0)] * 75)
    assert 0 < 1_000_000 // pending.new_cost(3500) < 150
    assert c.admit_count([], (), pending) == 150


def test_turns_fill_the_batch_until_a_server_that_keeps_its_throughput_drains_near_the_end():
    c = BudgetController(budget=1_000_000, max_tokens=10_240, concurrency=150, observes_rate=True)
    assert c.turn_count([100] * 40) == 110  # the server not read yet: every slot
    for n in range(100, 2100, 100):
        c.finished(n, counted=True)
    rng = random.Random(3)
    for _ in range(40):
        c.observe_rate(7500 * (1 + rng.gauss(0, 0.02)), 150)
    c.committed = 990_000  # 10,000 left: a batch of one long answer
    assert c.turn_count([500] * 3) == 0  # the turns waiting would be cut at the budget: the batch drains
    assert c.turn_count([]) == 10_000 // 1900  # nothing running: the lengths seen (0.9-quantile 1,900) fit 5
    for n in range(149, 140, -1):  # a server whose requests decode at a fixed rate: the batch stays full
        c.observe_rate(50.0 * n, n)
    assert c.turn_count([500] * 3) == 147
    c.committed = 1_000_000
    assert c.turn_count([500] * 3) == 0  # the budget is met
    kp = BudgetController(budget=1_000_000, max_tokens=10_240, concurrency=150, keep_partial=True, committed=990_000)
    assert kp.turn_count([500] * 3) == 147  # keep_partial keeps the server full to the budget


def test_a_conversations_later_turn_never_lands_without_the_turns_before_it():
    # conversations A (turns 0-2) and B (turns 0-1); 900 + 200 fit a budget of 1,200, A's turn 2 (7,000) passes it.
    # Of the rest, B's turn 1 (150) is the shortest that reaches it, but alone it would train one answer on a prompt
    # holding B's turn 0: B's turn 0 (500) takes the place
    sizes, heads = [900, 200, 7000, 500, 150], [True, False, False, True, False]
    assert landing(sizes, 1_200) == [0, 1, 4]
    assert landing(sizes, 1_200, heads) == [0, 1, 3]
    assert landing([900, 200, 150, 500], 1_200, [True, False, False, True]) == [0, 1, 2]  # the next turn: it fits on
    # through the generate stage's selection: a conversation's turns name their turn
    turns = [("A", 0), ("A", 1), ("A", 2), ("B", 0), ("B", 1)]
    plan = [Planned({"id": f"{c}{t}", "conversation": c, "turn": t}, f"{c}{t}", [1, 2]) for c, t in turns]
    stored = {p.key: answer(p.key, n) for p, n in zip(plan, sizes)}
    out = select_responses(plan, stored, DatasetConfig(token_budget=1_200, landing=Landing.finished))
    assert [p.key for p, _ in out.chosen] == ["A0", "A1", "B0"] and out.total == 1_600


def answer(key: str, n: int) -> StoredResponse:
    return StoredResponse(key, "D", key, "hi", 2, n, "stop", "s", 0.1, [1, 2], list(range(n)))


def test_the_work_queue_tells_what_started_and_upcoming_conversations_will_still_ask():
    from draftdata.generate.plan.conversations import Conversation
    from draftdata.generate.run.work import ConversationQueue

    def conversation(name: str, slots: int, prompt: int) -> Conversation:
        def walk():  # its turns as a replay yields them: turn 0 only, then it ends as a diverging call ends it
            yield Planned({"id": f"{name}0", "conversation": name, "turn": 0}, f"{name}0", [7] * prompt)
            return SimpleNamespace(ended="diverged")

        c = Conversation({"id": name, "slots": list(range(slots))}, walk())
        c.start(None)
        return c

    def asks(p: Pending) -> tuple[list, list]:
        return list(p.started), list(p.upcoming)

    queue = ConversationQueue([conversation("A", 3, 40), conversation("B", 5, 60)], None, {}, None)
    assert asks(queue.pending(2)) == ([], [(0, 3, 40), (0, 5, 60)])
    assert queue.next_new().key == "A0"  # A's turn 0 in flight: its 2 source turns after it are to come
    assert asks(queue.pending(2)) == ([(1, 2, 40)], [(0, 5, 60)])
    assert queue.pending(2).carry == 1.0  # no turn answered yet: every source turn is expected
    # A's first answer ends it (its replay has no turn after) with 2 source turns left: a turn that did not go on,
    # which `carry` (read under landing exact) counts
    flight = SimpleNamespace(p=SimpleNamespace(key="A0"), req=SimpleNamespace(prefer=None))
    queue.settled([(SimpleNamespace(error=None, server="s"), flight)], [(answer("A0", 5), flight)])
    assert queue.could_go_on == 1 and queue.went_on == 0
    assert queue.pending(2).carry == continuation(0, 1) == 8 / 9
