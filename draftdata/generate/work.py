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

Conversations live in the store: `plan_conversations` walks each one over its stored turns, one store query per
turn depth for all of them, to the first turn not stored (a parked partial there is continued) or to its end. The
turns' ids rendered on the way are kept in the store too (table `turn_rendered`, under the fingerprint of the
prompts' render cache), so the next run steps over stored turns without the chat template.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field

from draftdata.config.schema import BudgetUnit, Config, DatasetConfig, TrainOn, Turns
from draftdata.generate.accounting import is_empty, link, needs_request, prompt_count, unusable_reason
from draftdata.generate.backends.protocol import GenResult
from draftdata.generate.budget.controller import Pending
from draftdata.generate.conversation import TurnRendering, TurnRenders, turns
from draftdata.generate.request import Planned
from draftdata.generate.selection import check_context, fingerprints, plan_requests
from draftdata.generate.store import ResponseStore, StoredResponse

# Why a conversation ended, besides conversation.py's: its turn's prompt and max_tokens exceed the target's context,
# its turn's answer was empty, its turn's request failed, or the run stopped at the budget with turns left.
CONTEXT, EMPTY, FAILED, BUDGET = "context", "empty", "failed", "budget"
KEEP_RENDERS = 2_000  # turns rendered during a run are kept in batches of this many: a kill costs at most these


class WorkQueue:
    """The requests of a run, in order: no conversations, nothing to continue."""

    def __init__(self, todo: Iterable[Planned] = ()):
        self._new: Iterator[Planned] = iter(todo)

    def next_ready(self) -> Planned | None:
        """A turn of a started conversation (never gated by the controller's admission: see the module docstring)."""
        return None

    def next_new(self) -> Planned | None:
        return next(self._new, None)

    def prefer(self, p: Planned) -> str | None:
        """The server to send `p` to, if it can."""
        return None

    def pending(self, upcoming: int) -> Pending | None:
        """What started conversations will still ask, and the next `upcoming` new ones (None: no conversations)."""
        return None

    def settled(self, ended: list[tuple[GenResult, object]], rows: list[tuple[StoredResponse, object]]) -> None:
        """Requests that ended (`Flight`s with their results) and the rows the store took for them."""

    def take_reused(self) -> list[tuple[Planned, StoredResponse]]:
        """Answers that count toward the budget since the last call without a request of their own: a turn
        stepped over (the store holds its answer), or a shared turn's answer for each further conversation that
        holds it (the output holds it once per conversation; its request was counted once)."""
        return []


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


@dataclass
class Renders:
    """The turns' renders of a run under its render fingerprint, and where they are kept."""

    fingerprint: str
    turns: TurnRenders

    @classmethod
    def load(cls, fingerprint: str, store: ResponseStore, prompts: list[dict]) -> Renders:
        cached = store.get_turn_renders(
            fingerprint, (rec["id"] for rec in prompts), sum(len(r["slots"]) for r in prompts)
        )
        return cls(fingerprint, TurnRenders(cached))

    def keep(self, store: ResponseStore, at_least: int = 1) -> None:
        """Write the turns rendered since the last call, once there are `at_least`."""
        if len(self.turns.new) >= at_least:
            store.put_turn_renders(self.fingerprint, self.turns.take_new())


def plan_conversations(
    cfg: Config, prompts: list[dict], tok, store: ResponseStore, context: int | None
) -> tuple[list[Conversation], Renders]:
    """Every conversation walked over the turns the store holds, in prompt order, and the turns' renders (those
    made on the way are kept). `context`: the target's (None: unknown); a later turn that does not fit it with
    max_tokens ends its conversation."""
    ds = cfg.ds
    fp, render_fp = fingerprints(cfg, tok)
    renders = Renders.load(render_fp, store, prompts)
    kwargs = cfg.template_kwargs
    rendering = TurnRendering(tok, kwargs, fp, ds.sampling.as_dict(), ds.max_tokens, renders.turns)
    commands = ds.source.shape == "swe_agent"  # its actions are fenced shell commands in the text
    every_turn = cfg.tokenize.train_on == TrainOn.all_turns
    walks = [(rec, turns(rec, rendering, ds.on_tool_divergence.value, commands)) for rec in prompts]
    convs = [Conversation(rec, walk, every_turn=every_turn) for rec, walk in walks]
    for c in convs:
        c.start(None)
    room = None if context is None else context - ds.max_tokens
    step_over_stored(convs, store, {}, room)
    renders.keep(store)
    return convs, renders


def step_over_stored(
    convs: list[Conversation], store: ResponseStore, parked: dict[str, StoredResponse], room: int | None
) -> list[tuple[Planned, StoredResponse]]:
    """Step each conversation over the turns the store holds answers for: one query per round for all of them.
    Parked partials met on the way are added to `parked` (the dispatcher continues them). Returns the turns stepped
    over, with their answers."""
    waiting, stepped = [c for c in convs if c.next is not None], []
    while waiting:
        stored = store.get_many({c.next.key for c in waiting})
        moved = []
        for c in waiting:
            r = stored.get(c.next.key)
            if needs_request(r):
                if r is not None and r.partial:
                    parked[r.key] = r
                continue
            stepped.append((c.next, r))
            c.answer(r, room)
            if c.next is not None:
                moved.append(c)
        waiting = moved
    return stepped


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
        super().__init__()
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
        return Pending(started, nxt, growth, self.prompts_count)

    def prefer(self, p: Planned) -> str | None:
        waiting = self._waiting.get(p.key)
        return waiting[0].server if waiting else None

    def _send(self, c: Conversation) -> Planned | None:
        """The conversation's next turn to request; None when that turn is in flight for another conversation
        (two conversations can share their first turns): this one waits for the same answer, or when it ended on a
        turn another conversation had answered since (stepped over, as a rerun steps over it: asked again, it
        would get an answer the store does not take, and the output would hold one a rerun's does not)."""
        if c.next.key in self._answered:
            self._reused += step_over_stored([c], self.store, self.parked, self.room)
            if c.next is None:
                return None
        key = c.next.key
        sent = key in self._waiting
        self._waiting.setdefault(key, []).append(c)
        return None if sent else c.next

    def settled(self, ended: list[tuple[GenResult, object]], rows: list[tuple[StoredResponse, object]]) -> None:
        answers = {r.key: r for r, _ in rows if not needs_request(r)}
        self._answered.update(answers)
        stepped, since = [], []
        for res, f in ended:
            key = f.p.key
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
                c.answer(r, self.room)
                stepped.append(c)
        self._reused += step_over_stored(stepped, self.store, self.parked, self.room)
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


def conversation_plan(convs: list[Conversation], store: ResponseStore) -> tuple[list[Planned], dict]:
    """Every conversation's turns in order (answered ones, then the next), and the store's rows for them: the
    answers, and the parked partials of next turns (one query)."""
    rows = {p.key: r for c in convs for p, r in c.done}
    rows.update(store.get_many(c.next.key for c in convs if c.next is not None))
    return [p for c in convs for p in c.turns()], rows


def end_reasons(
    convs: list[Conversation], selected: list[tuple[Planned, StoredResponse]], ds: DatasetConfig
) -> dict[str, str]:
    """The turn id of each conversation's last line in the output -> why the conversation ends there: its own
    reason when every usable answered turn is in the output, else the budget (the output's, or the run's)."""
    last = {p.prompt["conversation"]: p for p, _ in selected}
    out = {}
    for c in convs:
        if (p := last.get(c.rec["id"])) is None:
            continue
        out[p.prompt["id"]] = c.unanswered  # its next turn is to come (or, under keep_partial, this is its cut one)
        if c.next is None:
            at = next(i for i, (q, _) in enumerate(c.done) if q is p)
            if all(unusable_reason(r, ds) for _, r in c.done[at + 1 :]):
                out[p.prompt["id"]] = c.ended
    return out


def ended_unsampled(
    convs: list[Conversation], selected: list[tuple[Planned, StoredResponse]], ds: DatasetConfig
) -> list[Conversation]:
    """Conversations that ended before any usable turn (turn 0's answer empty, or cut and dropped): no line of the
    output names them, yet the run took them and they ended. Only those the output reaches: every usable turn of the
    conversations before them is in it (a lower budget's output stops short of the later ones, as it does of the
    other conversations there)."""
    chosen = {p.prompt["id"] for p, _ in selected}
    out = []
    for c in convs:
        usable = [p for p, r in c.done if unusable_reason(r, ds) is None]
        if c.next is None and not usable:
            out.append(c)
        elif any(p.prompt["id"] not in chosen for p in usable):
            break  # the output stops in this conversation
    return out


def conversation_metrics(
    reasons: dict[str, str], turns_out: int, queue: ConversationQueue, unsampled: list[Conversation]
) -> dict:
    """generate_metrics' figures of `turns: all`: the output's turns (each one the target's answer) and
    conversations by end reason (those that ended before a usable turn included), and the share of next turns this
    run sent to the server that answered the previous one (null: none sent)."""
    ended = Counter(reasons.values()) + Counter(c.ended for c in unsampled)
    return {
        "turns_regenerated": turns_out,
        "conversations": len(reasons) + len(unsampled),
        "conversations_ended": dict(sorted(ended.items())),
        "same_server_share": queue.same_server_share,
    }


def turns_kept(
    convs: list[Conversation], reasons: dict[str, str], selected: list, unsampled: list[Conversation]
) -> dict:
    """Of the output's conversations that ended on their own (not at the budget, nor at a failed request), and
    those that ended before a usable turn (`ended_unsampled`: none of their turns kept), the share of their
    source's assistant turns the output holds: what a diverging call (`on_tool_divergence`), a cut or empty answer
    or the context took from them."""
    turns_out = Counter(p.prompt["conversation"] for p, _ in selected)
    ended = {p.prompt["conversation"]: reasons[p.prompt["id"]] for p, _ in selected if p.prompt["id"] in reasons}
    own = [c.rec for c in convs if c.rec["id"] in turns_out and ended.get(c.rec["id"]) not in (BUDGET, FAILED)]
    own += [c.rec for c in unsampled]
    source = sum(len(rec["slots"]) for rec in own)
    return {"turns_kept_share": round(sum(turns_out[rec["id"]] for rec in own) / source, 3) if source else None}


@dataclass
class RunPlan:
    """What a run asks: one request per prompt (`turns: last`), or each conversation's turns (`turns: all`), with
    the store's rows for them."""

    plan: list[Planned]
    stored: dict[str, StoredResponse]
    duplicates: int = 0  # prompts whose rendered ids an earlier prompt had (`turns: last`)
    convs: list[Conversation] | None = None
    queue: ConversationQueue | None = None
    ds: DatasetConfig | None = None

    @classmethod
    def make(cls, cfg: Config, prompts: list[dict], tok, store: ResponseStore, context: int | None) -> RunPlan:
        if cfg.ds.turns != Turns.all:
            plan = plan_requests(cfg, prompts, tok, store)  # one per key: prompts rendered alike are asked once
            check_context(plan, cfg, context)
            return cls(plan, store.get_many(p.key for p in plan), len(prompts) - len(plan))
        convs, renders = plan_conversations(cfg, prompts, tok, store, context)  # each walked over its stored turns
        check_context([c.first for c in convs if c.first is not None], cfg, context)
        run = cls(*conversation_plan(convs, store), convs=convs, ds=cfg.ds)
        room = None if context is None else context - cfg.ds.max_tokens
        run.queue = ConversationQueue(convs, store, {}, room, cfg.ds.budget_unit == BudgetUnit.total, renders)
        return run

    def reread(self, store: ResponseStore) -> None:
        """After generation: the rows the store holds now (and each conversation's turns as far as they went)."""
        if self.convs is None:
            self.stored = store.get_many(p.key for p in self.plan)
        else:
            self.plan, self.stored = conversation_plan(self.convs, store)
            if self.queue is not None and self.queue.renders is not None:
                self.queue.renders.keep(store)

    def end_reasons(self, selected: list[tuple[Planned, StoredResponse]]) -> dict[str, str]:
        return {} if self.convs is None else end_reasons(self.convs, selected, self.ds)

    def metrics(self, reasons: dict[str, str], selected: list) -> dict:
        """generate_metrics' figures of `turns: all` ({} under `turns: last`)."""
        if self.convs is None:
            return {}
        unsampled = ended_unsampled(self.convs, selected, self.ds)
        return conversation_metrics(reasons, len(selected), self.queue, unsampled) | turns_kept(
            self.convs, reasons, selected, unsampled
        )
