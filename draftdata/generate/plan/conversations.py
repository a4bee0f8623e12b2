"""A conversation's place (`turns: all`): the turns the store answers, the one to request next, or why it ended;
and the walk of many conversations over the turns the store holds (`step_over_stored`), one store query per turn
depth for all of them. Planning starts each conversation where the store leaves it; a run steps it on from there
(run/work.py), and the output reads where it stopped.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

from draftdata.generate.accounting import is_empty, link, needs_request
from draftdata.generate.request import Planned
from draftdata.generate.store import ResponseStore, StoredResponse

# Why a conversation ended, besides conversation.py's: its turn's prompt and max_tokens exceed the target's context,
# its turn's answer was empty, its turn's request failed, or the run stopped at the budget with turns left.
CONTEXT, EMPTY, FAILED, BUDGET = "context", "empty", "failed", "budget"


@dataclass
class Conversation:
    """A conversation's place: the turns answered, the one to request next, or why it ended."""

    rec: dict
    walk: Generator[Planned, StoredResponse | None, object]
    done: list[tuple[Planned, StoredResponse]] = field(default_factory=list)
    next: Planned | None = None
    ended: str | None = None
    server: str | None = None  # the server that answered its last turn in this run
    first: Planned | None = None  # turn 0
    every_turn: bool = True  # tokenize trains every turn (`tokenize.train_on`): what its samples hold
    unanswered: str = BUDGET  # why `next` was not answered: the run stopped first, or its request failed

    def start(self, room: int | None) -> None:
        self._moved(lambda: next(self.walk), room)
        self.first = self.next

    def answer(self, r: StoredResponse, room: int | None) -> None:
        """Give the turn waiting its (usable) answer and step to the next turn."""
        assert self.next is not None and not needs_request(r)
        if is_empty(r):  # nothing to train on, nor to go on from: the sample ends before it
            self.end(EMPTY)
            return
        self.done.append((self.next, r))
        self._moved(lambda: self.walk.send(r), room)

    def end(self, reason: str) -> None:
        self.next, self.ended = None, reason
        self.walk.close()

    def _moved(self, step, room: int | None) -> None:
        try:
            self.next = step()
        except StopIteration as stop:
            self.next, self.ended = None, stop.value.ended
            return
        if self.done:  # how its prompt holds the turns before it: what its samples hold (accounting.py)
            self.next.link = link(self.next, self.done, self.every_turn)
        # a later turn the target cannot answer ends the conversation: a shorter sample (turn 0's are checked
        # before any work, as every prompt is)
        if self.done and room is not None and self.next.prompt_tokens > room:
            self.end(CONTEXT)

    def turns(self) -> list[Planned]:
        """Its answered turns and the one to request next."""
        return [p for p, _ in self.done] + ([self.next] if self.next is not None else [])

    def left(self) -> int:
        """The source turns from its next one on."""
        return len(self.rec["slots"]) - len(self.done)

    def growth(self, since: int) -> list[int]:
        """What each turn's prompt adds to the previous turn's prompt and answer (the source's user and tool turns,
        the template's markers), for the turns after answered turn `since`."""
        planned = self.turns()
        return [
            planned[i + 1].prompt_tokens - planned[i].prompt_tokens - self.done[i][1].completion_tokens
            for i in range(since, len(planned) - 1)
        ]


def step_over_stored(
    convs: list[Conversation],
    store: ResponseStore,
    parked: dict[str, StoredResponse],
    room: int | None,
    met: dict[str, StoredResponse] | None = None,
) -> list[tuple[Planned, StoredResponse]]:
    """Step each conversation over the turns the store holds answers for: one query per round for all of them.
    Parked partials met on the way are added to `parked` (the dispatcher continues them), and every row of a turn
    a conversation stops at to `met` (its partial or empty answer). Returns the turns stepped over, with their
    answers."""
    waiting, stepped = [c for c in convs if c.next is not None], []
    while waiting:
        stored = store.get_many({c.next.key for c in waiting})
        moved = []
        for c in waiting:
            r = stored.get(c.next.key)
            if needs_request(r):
                if r is not None and r.partial:
                    parked[r.key] = r
                if r is not None and met is not None:
                    met[r.key] = r
                continue
            stepped.append((c.next, r))
            c.answer(r, room)
            if c.next is not None:
                moved.append(c)
        waiting = moved
    return stepped
