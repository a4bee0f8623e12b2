"""The dispatcher with a scripted in-process backend: at the budget (or on an interrupt) it stops the requests in
flight by signal (`GenRequest.stop`), commits an answer that completed meanwhile, parks the rest, and cancels a
request only when its backend ignored the signal for STOP_WAIT_S. The run's task is not left cancelling, so an
`asyncio.timeout` around the run, or after it, still works. (The backends' side of the stop: tests/test_backends.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftdata.config.schema import Config, DatasetConfig, OnBudget, RunConfig
from draftdata.generate.backends.protocol import GenRequest, GenResult, stopped_result
from draftdata.generate.request import Planned
from draftdata.generate.run import dispatcher as dispatcher_module
from draftdata.generate.run.budget.controller import BudgetController
from draftdata.generate.run.dispatcher import Dispatcher, Interrupted
from draftdata.generate.run.failfast import FailFastWindow
from draftdata.generate.run.ledger import Ledger
from draftdata.generate.run.work import WorkQueue
from draftdata.generate.store import CUT, INTERRUPTED, ResponseStore

pytestmark = pytest.mark.timeout(60)


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def not_left_cancelling() -> None:
    """The current task carries no cancellation request: the next asyncio.timeout fires as a TimeoutError."""
    assert asyncio.current_task().cancelling() == 0
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await asyncio.sleep(1)


# ---- the dispatcher -------------------------------------------------------------------------------------------- #


class Streaming:
    """A backend that streams one token per `step_s` until max_tokens, and records how each request ended.
    `honours_stop=False`: it ignores the signal (the dispatcher must cancel it); `finish_on_stop`: the answer
    completes during the stop (it must be committed)."""

    name = "scripted"
    takes_token_ids = True

    def __init__(self, step_s: float = 0.002, honours_stop: bool = True, finish_on_stop: bool = False):
        self.step_s, self.honours_stop, self.finish_on_stop = step_s, honours_stop, finish_on_stop
        self.cancelled: list[str] = []
        self.stopped: list[str] = []

    async def generate(self, req: GenRequest) -> GenResult:
        try:
            while req.partial.completion_tokens < req.max_tokens:
                if req.stopping and self.honours_stop:
                    return self._stopped(req)
                await asyncio.sleep(self.step_s)
                req.partial.output_ids.append(len(req.partial.output_ids) + 10)
                req.partial.text += "x"
                req.partial.completion_tokens += 1
            return self._answer(req)
        except asyncio.CancelledError:
            self.cancelled.append(req.rid)
            raise

    def _stopped(self, req: GenRequest) -> GenResult:
        self.stopped.append(req.rid)
        if self.finish_on_stop:
            return self._answer(req, extra=1)  # the last token came while the stop was on its way
        return stopped_result(req, self.name)

    def _answer(self, req: GenRequest, extra: int = 0) -> GenResult:
        ids = list(req.partial.output_ids) + [99] * extra
        return GenResult(req.rid, ids, "x" * len(ids), len(req.prompt_ids), len(ids), "length", server=self.name)


def dispatcher(tmp_path, backend, budget: int, on_budget=OnBudget.keep_partial, concurrency: int = 4) -> Dispatcher:
    """keep_partial by default: the tokens in flight count, so the budget is reached mid-answer."""
    max_tokens = 400
    ds = DatasetConfig(token_budget=budget, max_tokens=max_tokens, concurrency=concurrency, on_budget=on_budget)
    cfg = Config(
        dataset="d",
        datasets={"d": ds},
        run=RunConfig(store_path=str(tmp_path / "store.sqlite"), progress=False),
    )
    ctrl = BudgetController(budget, max_tokens, concurrency, keep_partial=on_budget == OnBudget.keep_partial)
    ledger, failfast = Ledger(ds, "d", ctrl, None, backend.name), FailFastWindow(cfg.run.fail_fast_after)
    return Dispatcher(backend, ctrl, ledger, failfast, ResponseStore(cfg.run.store_path), cfg, True, {})


def plan(n: int) -> list[Planned]:
    return [Planned({"id": f"p{i}", "messages": []}, f"{i:032x}", [1, 2, 3]) for i in range(n)]


def work(n: int) -> WorkQueue:
    return WorkQueue(plan(n))


def stored(d: Dispatcher) -> dict[str, str]:
    return {r.key: r.finish_reason for r in d.store.get_many(p.key for p in plan(50)).values()}


def test_the_budget_stops_requests_by_signal_inside_a_timeout(tmp_path):
    """Four requests of 400 tokens against a budget of 100: none completes, each is stopped at the budget and
    parked with its tokens, no task is cancelled, and the run's task is not left cancelling."""
    backend = Streaming()
    d = dispatcher(tmp_path, backend, budget=100)

    async def go():
        async with asyncio.timeout(30):
            stats = await d.run(work(4))
        await not_left_cancelling()
        return stats

    stats = run(go())
    assert backend.cancelled == [] and sorted(backend.stopped) == sorted(p.key for p in plan(4))
    assert stats.cancelled == 4 and stats.parked == stats.cut == 4 and stats.new == 0 and stats.lost == 0
    assert set(stored(d).values()) == {CUT} and stats.parked_tokens >= 100


def test_an_answer_that_completes_during_the_stop_is_committed(tmp_path):
    backend = Streaming(finish_on_stop=True)
    d = dispatcher(tmp_path, backend, budget=100)
    stats = run(d.run(work(4)))
    assert stats.new == 4 and stats.cancelled == 0 and stats.parked == 0 and set(stored(d).values()) == {"length"}


def test_a_backend_that_ignores_the_stop_is_cancelled_after_the_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatcher_module, "STOP_WAIT_S", 0.2)
    backend = Streaming(step_s=0.01, honours_stop=False)
    d = dispatcher(tmp_path, backend, budget=40)
    t0 = time.monotonic()
    stats = run(d.run(work(2)))
    assert time.monotonic() - t0 < 3  # not the 4 s the answers would take
    assert sorted(backend.cancelled) == sorted(p.key for p in plan(2)) and backend.stopped == []
    assert stats.cancelled == 2 and stats.parked == 2  # parked with what their partials held


def test_an_interrupt_parks_what_is_in_flight_as_interrupted(tmp_path):
    backend = Streaming(step_s=0.01)
    d = dispatcher(tmp_path, backend, budget=10_000, on_budget=OnBudget.cancel)

    async def go():
        asyncio.get_running_loop().call_later(0.2, d.interrupt)
        with pytest.raises(Interrupted):
            await d.run(work(4))
        await not_left_cancelling()

    run(go())
    assert backend.cancelled == [] and d.stats.cancelled == 4 and set(stored(d).values()) == {INTERRUPTED}


class FirstRound(Streaming):
    """keep_partial's cut that does not end the run: the first `n` requests stream nothing but spaces, so their
    cut partials are unusable, except `finisher`, whose answer completes during the stop; later requests stream
    "x" and fill the budget."""

    def __init__(self, first: list[str], finisher: str):
        super().__init__()
        self.first, self.finisher = set(first), finisher
        self.started: list[str] = []

    async def generate(self, req: GenRequest) -> GenResult:
        self.started.append(req.rid)
        res = await super().generate(req)
        if req.rid in self.first and req.rid != self.finisher:
            res.text = " " * len(res.text)
        return res

    def _stopped(self, req: GenRequest) -> GenResult:
        self.stopped.append(req.rid)
        if req.rid == self.finisher:
            return self._answer(req, extra=1)
        if req.rid in self.first:
            req.partial.text = " " * len(req.partial.text)
        return stopped_result(req, self.name)


def test_a_cut_that_goes_on_records_each_request_once(tmp_path):
    """keep_partial, the budget reached mid-answer, one answer completing during the stop, and the run going on
    after it (the other cut partials are only whitespace): the requests admitted next are each recorded once,
    none is abandoned, and the answer that completed during the stop is not collected again (a KeyError)."""
    first = [p.key for p in plan(4)]
    backend = FirstRound(first, finisher=first[0])
    d = dispatcher(tmp_path, backend, budget=100)
    put: list[str] = []
    put_many = d.store.put_many

    def spy(rows):
        put.extend(r.key for r in rows)
        return put_many(rows)

    d.store.put_many = spy
    stats = run(d.run(work(8)))
    keys = [p.key for p in plan(8)]
    assert backend.started == keys and backend.cancelled == []  # the second round was admitted, none cancelled
    assert sorted(put) == sorted(keys)  # each request recorded once
    assert sorted(backend.stopped) == sorted(keys)
    assert stats.new == 1 and stats.cut == stats.parked == 7 and stats.cancelled == 7
    s = stored(d)
    assert s.pop(first[0]) == "length" and set(s.values()) == {CUT} and len(s) == 7
    assert d.ctrl.reached() and d.flights == {} and d._finished == []


class DiesThenResets:
    """A server whose engine died: each request's first attempt was answered `engine_dead`, its retry found the
    connection reset (vLLM's API server exits after its engine), so each request ends `retries_exhausted`."""

    name = "dying"
    takes_token_ids = True

    async def generate(self, req: GenRequest) -> GenResult:
        req.attempt_errors += ["engine_dead", "connection"]
        return GenResult(req.rid, error="retries_exhausted", detail="connection: reset by peer", server=self.name)


def test_a_stop_after_a_dead_engine_names_the_death_and_what_to_do(tmp_path):
    """The requests that followed a dead engine fail with reset connections; the run's one line still says that the
    engine died and how to avoid it, beside the cause the window saw."""
    from draftdata.generate.run.dispatcher import RunFailed

    d = dispatcher(tmp_path, DiesThenResets(), budget=1000, on_budget=OnBudget.cancel)
    d.failfast = dispatcher_module.FailFastWindow(4)
    with pytest.raises(RunFailed) as failed:
        run(d.run(work(12)))
    message = str(failed.value)
    assert message.startswith("the last 4 requests all failed with retries_exhausted: connection: reset by peer")
    assert "a server's engine died (engine_dead, " in message and "--max-num-batched-tokens" in message
    assert "\n" not in message


# ---- landing exact: a failure is a stop, never a hole ----------------------------------------------------------- #


class Answers:
    """A server that answers prompt k with `tokens[k]` tokens (default 10) after `delay_s[k]` seconds (default 1 ms),
    but fails prompt `fails` on its first `times` requests (each as a request whose retries ran out); `failing`: the
    same per prompt."""

    name = "answers"
    takes_token_ids = True

    def __init__(self, fails: str = "", times: int = 0, tokens=None, delay_s=None, failing=None):
        self.failing = dict(failing or {}) | ({fails: times} if fails else {})
        self.tokens, self.delay_s = tokens or {}, delay_s or {}
        self.asked: list[str] = []

    async def generate(self, req: GenRequest) -> GenResult:
        await asyncio.sleep(self.delay_s.get(req.rid, 0.001))
        self.asked.append(req.rid)
        if self.asked.count(req.rid) <= self.failing.get(req.rid, 0):
            return GenResult(req.rid, error="retries_exhausted", detail="http 500", server=self.name)
        n = self.tokens.get(req.rid, 10)
        return GenResult(req.rid, list(range(10, 10 + n)), "x" * n, 3, n, "stop", server=self.name)


def exact_run(tmp_path, backend, budget: int, keys="abcd", concurrency: int = 4):
    """One generation run under `landing: exact` over the store in `tmp_path`, as run.py drives it (the plan's
    settled run from the store first); the output as the stage selects it."""
    from draftdata.generate.accounting import needs_request
    from draftdata.generate.land.selection import select_responses
    from draftdata.generate.run.settled import Landed

    ds = DatasetConfig(token_budget=budget, max_tokens=40, concurrency=concurrency, on_budget=OnBudget.cancel)
    cfg = Config(dataset="d", datasets={"d": ds}, run=RunConfig(store_path=str(tmp_path / "s.sqlite"), progress=False))
    store = ResponseStore(cfg.run.store_path)
    planned = [Planned({"id": k, "messages": []}, k, [1, 2, 3]) for k in keys]
    held = store.get_many(keys)
    landed = Landed.of(planned, held, ds)
    ctrl = BudgetController(budget, 40, concurrency, committed=0, landed=landed.total())
    ledger, failfast = Ledger(ds, "d", ctrl, None, backend.name), FailFastWindow(cfg.run.fail_fast_after)
    d = Dispatcher(backend, ctrl, ledger, failfast, store, cfg, False, {}, landed)
    if not ctrl.reached():
        run(d.run(WorkQueue([p for p in planned if needs_request(held.get(p.key))])))
    out = select_responses(planned, store.get_many(keys), ds)
    store.close()
    return out, d


def test_a_request_that_fails_for_good_ends_the_exact_output_before_it_never_leaves_a_hole(tmp_path):
    """Keys a-d of 10 tokens, a budget of 25, and b fails: the run asks b again, and when it fails again the output
    is {a}, short of the budget, not {a, c, d}. The run after b answers writes {a, b, c}: what a run without the
    failure writes at once, and each a prefix of the larger budget's."""
    out, d = exact_run(tmp_path / "1", Answers("b", times=99), 25)
    assert [p.key for p, _ in out.chosen] == ["a"] and out.total == 10
    assert out.unanswered is not None and out.unanswered.key == "b"
    assert d.backend.asked.count("b") == 2 and d.halted  # asked once more within the run, then the stop
    assert d.stats.failed == {"retries_exhausted": 2}

    again, _ = exact_run(tmp_path / "1", Answers(), 25)  # b answers now: the output goes on past it
    clean, _ = exact_run(tmp_path / "2", Answers(), 25)
    assert [p.key for p, _ in again.chosen] == [p.key for p, _ in clean.chosen] == ["a", "b", "c"]
    assert again.unanswered is None and again.total == clean.total == 30
    smaller, _ = exact_run(tmp_path / "2", Answers(), 15)
    assert [p.key for p, _ in smaller.chosen] == ["a", "b"]


def test_a_request_that_fails_once_is_asked_again_within_the_run(tmp_path):
    """One failure is not a stop: the request is asked again in the same run and the output is the clean one."""
    out, d = exact_run(tmp_path, Answers("b", times=1), 25)
    assert [p.key for p, _ in out.chosen] == ["a", "b", "c"] and out.unanswered is None
    assert d.backend.asked.count("b") == 2 and not d.halted


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    data=st.data(),
    budget=st.integers(1, 200),
    concurrency=st.integers(1, 5),
)
def test_any_order_of_completions_failures_and_stored_rows_gives_a_prefix_of_the_same_output(
    sizes, data, budget, concurrency
):
    """The same plan, whatever finishes first, fails (once: asked again; twice: a stop) or the store already holds
    from another run: the output is the start of the fault-free output, and all of it unless a request in it failed
    twice; the run after, fault-free, writes that output; a smaller budget's output is the start of it."""
    import tempfile

    keys = [f"k{i}" for i in range(len(sizes))]
    tokens = dict(zip(keys, sizes))
    failing = {k: data.draw(st.sampled_from([0, 0, 1, 2]), label=f"fails {k}") for k in keys}
    delay = {k: data.draw(st.sampled_from([0.0, 0.001, 0.004]), label=f"delay {k}") for k in keys}
    held = data.draw(st.sets(st.sampled_from(keys)), label="stored before")
    smaller = data.draw(st.integers(1, budget), label="smaller budget")
    with tempfile.TemporaryDirectory() as tmp:
        clean, _ = exact_run(Path(tmp) / "clean", Answers(tokens=tokens), budget, keys, concurrency)
        want = [p.key for p, _ in clean.chosen]
        if held:  # another run answered these first
            exact_run(Path(tmp) / "faulty", Answers(tokens=tokens), 10**6, sorted(held, key=keys.index), 1)
        out, _ = exact_run(
            Path(tmp) / "faulty", Answers(tokens=tokens, delay_s=delay, failing=failing), budget, keys, concurrency
        )
        got = [p.key for p, _ in out.chosen]
        assert got == want[: len(got)]
        stop = next((i for i, k in enumerate(want) if failing[k] >= 2 and k not in held), None)
        assert got == want[:stop] if stop is not None else got == want
        assert (out.unanswered is not None) == (stop is not None)
        assert stop is None or out.total < budget
        after, _ = exact_run(Path(tmp) / "faulty", Answers(tokens=tokens), budget, keys, concurrency)
        assert [p.key for p, _ in after.chosen] == want and after.total == clean.total
        less, _ = exact_run(Path(tmp) / "faulty", Answers(tokens=tokens), smaller, keys, concurrency)
        assert [p.key for p, _ in less.chosen] == want[: len(less.chosen)]
