"""What the dispatcher sends next: a run's requests, or with `turns: all` the turns of its conversations.

`WorkQueue` hands out the requests of a run in prompt order (`turns: last`: one per prompt). `ConversationQueue`
keeps every started conversation going: when a turn's answer is committed, the conversation is stepped
(`conversation.turns`) to its next turn, which goes to the front of the queue, ahead of new conversations (its
history is warm in the server's prefix cache, and a finished conversation is a sample); a turn whose answer the
store already holds (another dataset or experiment reached the same state) is stepped over without a request;
the controller is told what it adds to the output (`take_reused`), as it is told of the answers it requested.
New conversations are taken as the budget controller admits them; the turns of started ones only need a free slot
and a budget not yet met, so the controller is told what they will still ask (`pending`: the source turns each
started conversation has not requested yet, and those of the conversations next in line) before it admits more.
Each next turn is sent to the server that answered the previous one.

Conversations live in the store: a run starts each one where the store leaves it (planning.py walks them over
their stored turns, `step_over_stored`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Iterable, Iterator

from draftdata.generate.accounting import continuation, needs_request, prompt_count
from draftdata.generate.backends.protocol import GenResult
from draftdata.generate.plan.conversations import BUDGET, FAILED, Conversation, step_over_stored
from draftdata.generate.plan.renders import Renders
from draftdata.generate.request import Planned
from draftdata.generate.run.budget.controller import Pending
from draftdata.generate.store import ResponseStore, StoredResponse

KEEP_RENDERS = 2_000  # turns rendered during a run are kept in batches of this many: a kill costs at most these


class WorkQueue:
    """The requests of a run, in order: no conversations, nothing to continue."""

    def __init__(self, todo: Iterable[Planned] = ()):
        self._new: Iterator[Planned] = iter(todo)
        self._left = len(todo) if isinstance(todo, Collection) else None  # new requests not handed out yet
        # key -> the store's row, for every request this run committed (`put_many`'s word: another run's answer where
        # it committed first) and every stored turn a conversation stopped at on the way: the run's rows, unread
        self.rows: dict[str, StoredResponse] = {}

    def next_ready(self) -> Planned | None:
        """A turn of a started conversation (never gated by the controller's admission: see the module docstring)."""
        return None

    def next_new(self) -> Planned | None:
        p = next(self._new, None)
        if p is not None and self._left:
            self._left -= 1
        return p

    def new_left(self) -> int | None:
        """How many new requests are still to hand out (None: not counted, as a stream of conversations)."""
        return self._left

    def prefer(self, p: Planned) -> str | None:
        """The server to send `p` to, if it can."""
        return None

    def pending(self, upcoming: int) -> Pending | None:
        """What started conversations will still ask, and the next `upcoming` new ones (None: no conversations)."""
        return None

    def settled(
        self,
        ended: list[tuple[GenResult, object]],
        rows: list[tuple[StoredResponse, object]],
        again: Collection[str] = (),
    ) -> None:
        """Requests that ended (`Flight`s with their results) and the rows the store holds for them now; `again`:
        the keys of failed ones the dispatcher asks once more."""
        self.rows.update((r.key, r) for r, _ in rows)

    def take_reused(self) -> list[tuple[Planned, StoredResponse]]:
        """Answers that count toward the budget since the last call without a request of their own: a turn
        stepped over (the store holds its answer), or a shared turn's answer for each further conversation that
        holds it (the output holds it once per conversation; its request was counted once)."""
        return []


class ConversationQueue(WorkQueue):
    """`turns: all`: see the module docstring. `parked` is the dispatcher's (partials it continues)."""

    def __init__(
        self,
        convs: list[Conversation],
        store: ResponseStore,
        parked: dict[str, StoredResponse],
        room: int | None,
        prompts_count: bool = False,
        renders: Renders | None = None,
    ):
        super().__init__(iter(()))  # new conversations come from _fresh: not counted in requests (new_left)
        self.store, self.parked, self.room, self.renders = store, parked, room, renders
        self.prompts_count = prompts_count  # budget_unit total: the controller prices turns' prompts too
        self._fresh = deque(c for c in convs if c.next is not None)  # not started in this run, in prompt order
        self._ready: deque[Conversation] = deque()
        # what a turn's prompt adds to the previous one and its answer, for the controller (budget_unit total)
        steps = [g for c in convs for g in c.growth(0)]
        self.growth_sum, self.growth_n = sum(steps), len(steps)
        self._waiting: dict[str, list[Conversation]] = {}  # key in flight -> the conversations waiting on it
        self._answered: set[str] = set()  # keys answered in this run
        self._reused: list[tuple[Planned, StoredResponse]] = []  # see take_reused
        self.went_on = self.could_go_on = 0  # answered turns with a source turn after: went on to it, all
        self.next_turns = 0  # turns after the first answered in this run with their predecessor's server known
        self.same_server = 0  # ... answered by that server

    def next_ready(self) -> Planned | None:
        while self._ready:
            if (p := self._send(self._ready.popleft())) is not None:
                return p
        return None

    def next_new(self) -> Planned | None:
        while self._fresh:
            if (p := self._send(self._fresh.popleft())) is not None:
                return p
        return None

    def pending(self, upcoming: int) -> Pending:
        started = [(1, c.left() - 1, prompt_count(c.next)) for waiting in self._waiting.values() for c in waiting]
        started += [(0, c.left(), prompt_count(c.next)) for c in self._ready]
        nxt = [(0, c.left(), prompt_count(c.next)) for c in itertools.islice(self._fresh, upcoming)]
        growth = self.growth_sum / self.growth_n if self.growth_n else 0.0
        return Pending(started, nxt, growth, self.prompts_count, continuation(self.went_on, self.could_go_on))

    def prefer(self, p: Planned) -> str | None:
        waiting = self._waiting.get(p.key)
        return waiting[0].server if waiting else None

    def _send(self, c: Conversation) -> Planned | None:
        """The conversation's next turn to request; None when that turn is in flight for another conversation
        (two conversations can share their first turns): this one waits for the same answer, or when it ended on a
        turn another conversation had answered since (stepped over, as a rerun steps over it: asked again, it
        would get an answer the store does not take, and the output would hold one a rerun's does not)."""
        if c.next.key in self._answered:
            self._reused += step_over_stored([c], self.store, self.parked, self.room, self.rows)
            if c.next is None:
                return None
        key = c.next.key
        sent = key in self._waiting
        self._waiting.setdefault(key, []).append(c)
        return None if sent else c.next

    def settled(
        self,
        ended: list[tuple[GenResult, object]],
        rows: list[tuple[StoredResponse, object]],
        again: Collection[str] = (),
    ) -> None:
        super().settled(ended, rows)
        answers = {r.key: r for r, _ in rows if not needs_request(r)}
        self._answered.update(answers)
        stepped, since = [], []
        for res, f in ended:
            key = f.p.key
            if key in again:  # asked once more: its conversations wait on
                continue
            for i, c in enumerate(self._waiting.pop(key, [])):
                r = answers.get(key)
                if r is None:  # stopped (at the budget, or interrupted) or failed: the turn waits for a rerun
                    c.unanswered = FAILED if res.error else BUDGET
                    continue
                if i:  # the request was sent for the first conversation waiting on it
                    self._reused.append((c.next, r))
                self._count_server(f.req.prefer, res.server)
                c.server = res.server
                since.append(len(c.done))
                more = c.left() > 1  # a source turn after this one: did the conversation go on to it?
                c.answer(r, self.room)
                self.could_go_on += more
                self.went_on += more and c.next is not None
                stepped.append(c)
        self._reused += step_over_stored(stepped, self.store, self.parked, self.room, self.rows)
        if self.renders is not None:
            self.renders.keep(self.store, KEEP_RENDERS)
        for c, answered in zip(stepped, since):
            steps = c.growth(answered)
            self.growth_sum += sum(steps)
            self.growth_n += len(steps)
        # started conversations first: their history is in the server's prefix cache
        self._ready.extendleft(reversed([c for c in stepped if c.next is not None]))

    def take_reused(self) -> list[tuple[Planned, StoredResponse]]:
        reused, self._reused = self._reused, []
        return reused

    def _count_server(self, prefer: str | None, server: str) -> None:
        if prefer:
            self.next_turns += 1
            self.same_server += server == prefer

    @property
    def same_server_share(self) -> float | None:
        return round(self.same_server / self.next_turns, 4) if self.next_turns else None
