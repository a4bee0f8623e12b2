"""The ledger (draftdata/generate/run/ledger.py) alone: no event loop, no store, no server. Each case hands it what a
request ended with and checks the rows it asks the store to take and the figures it counts once they are taken."""

from __future__ import annotations

import pytest

from draftdata.config.schema import BudgetUnit, DatasetConfig, OnBudget
from draftdata.generate.backends.protocol import GenRequest, GenResult, Partial, stopped_result
from draftdata.generate.request import Planned
from draftdata.generate.run.budget.controller import BudgetController
from draftdata.generate.run.ledger import Flight, Ledger
from draftdata.generate.store import CUT, INTERRUPTED, StoredResponse

PROMPT_IDS = [1, 2, 3]


class Tok:
    """Decodes ids as words: a continued response's text is decoded whole, and this shows it was."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


NOW = 100.0  # when the requests in these cases ended (time.monotonic's, as the flights' starts)


def make(on_budget=OnBudget.cancel, unit=BudgetUnit.completion, max_tokens=64) -> Ledger:
    ds = DatasetConfig(token_budget=1000, max_tokens=max_tokens, on_budget=on_budget, budget_unit=unit)
    ctrl = BudgetController(1000, max_tokens, 8, keep_partial=on_budget == OnBudget.keep_partial)
    return Ledger(ds, "D", ctrl, Tok(), "embedded")


def flight(key="k1", stream=True, partial: Partial | None = None, t0=90.0) -> Flight:
    partial = partial or Partial()
    req = GenRequest(key, list(PROMPT_IDS), [], None, 64, {}, stream=stream, partial=partial)
    return Flight(
        Planned({"id": f"p-{key}", "messages": []}, key, list(PROMPT_IDS)), req, partial.completion_tokens, t0
    )


def answer(key="k1", ids=(7, 8, 9, 10), finish="stop", latency=2.0, **kw) -> GenResult:
    ids = list(ids)
    return GenResult(
        key,
        output_ids=ids,
        text="answer",
        prompt_tokens=len(PROMPT_IDS),
        completion_tokens=len(ids),
        finish_reason=finish,
        server="http://s",
        latency_s=latency,
        **kw,
    )


def produced(ids, text=None) -> Partial:
    return Partial(list(ids), "partial text" if text is None else text, len(ids))


def settle_and_commit(ledger: Ledger, done=(), stopped=(), reason=CUT):
    settled = ledger.to_store(list(done), list(stopped), reason, now=NOW)
    ledger.commit(settled.rows)
    return settled


# ---- requests that ended by themselves ------------------------------------------------------------------------- #


def test_a_complete_answer_is_a_row_counted_only_once_committed():
    ledger = make()
    f = flight()
    settled = ledger.to_store([(answer(), f)], now=NOW)
    assert settled.failures == [] and len(settled.rows) == 1
    row, with_flight = settled.rows[0]
    assert with_flight is f and not row.partial
    assert (row.key, row.dataset, row.prompt_id, row.finish_reason) == ("k1", "D", "p-k1", "stop")
    assert (row.output_ids, row.prompt_ids, row.completion_tokens, row.server) == (
        [7, 8, 9, 10],
        PROMPT_IDS,
        4,
        "http://s",
    )
    assert ledger.stats.new == 0 and ledger.ctrl.committed == 0  # not in the store yet: nothing counted
    ledger.commit(settled.rows)
    s = ledger.stats
    assert (s.new, s.kept, s.generated, s.completed_len, s.parked, s.lost) == (1, 4, 4, 4, 0, 0)
    assert s.new_by_key == {"k1": 4} and ledger.ctrl.committed == 4 and ledger.ctrl.lengths.n == 1


def test_the_budget_counts_the_row_the_store_kept_and_the_run_what_it_generated():
    """Two experiments on one store: the other committed its answer first, and the store kept it (`put_many`'s
    answer). The budget counts that row, which is what the output holds; this run's figures, what it generated."""
    ledger = make()
    settled = ledger.to_store([(answer(ids=range(20, 26)), flight())], now=NOW)
    theirs = StoredResponse("k1", "D", "p-k1", "theirs", 3, 2, "stop", "http://other", 1.0, list(PROMPT_IDS), [5, 6])
    ledger.commit(settled.rows, [theirs])
    assert ledger.ctrl.committed == 2 and ledger.ctrl.lengths.n == 1
    assert (ledger.stats.new, ledger.stats.kept, ledger.stats.generated) == (1, 6, 6)


def test_a_complete_answer_counts_its_prompt_when_the_budget_counts_totals():
    ledger = make(unit=BudgetUnit.total)
    settle_and_commit(ledger, done=[(answer(), flight())])
    assert ledger.ctrl.committed == 4 + len(PROMPT_IDS) and ledger.stats.kept == 4


def test_an_empty_text_is_stored_but_not_counted_toward_the_budget():
    ledger = make()
    res = answer()
    res.text = "  \n"
    settle_and_commit(ledger, done=[(res, flight())])
    assert ledger.stats.new == 1 and ledger.ctrl.committed == 0 and ledger.ctrl.lengths.n == 1


def test_a_failure_is_recorded_and_its_streamed_tokens_parked_as_interrupted():
    ledger = make()
    f = flight(partial=produced([5, 6, 7]))
    f.prefix = 0  # it started from nothing: the three tokens were streamed by this run
    f.req.attempt_errors = ["aborted", "http_400"]
    failed = GenResult("k1", error="http_400", detail="HTTP 400: bad", server="http://s")
    settled = settle_and_commit(ledger, done=[(failed, f)])
    assert settled.failures == [("k1", "D", "p-k1", "http_400", "HTTP 400: bad", "http://s")]
    (row, _), *more = settled.rows
    assert not more and row.finish_reason == INTERRUPTED and row.output_ids == [5, 6, 7] and row.server == "embedded"
    assert row.latency_s == pytest.approx(10.0)  # NOW, 100 s, less the flight's start at 90 s
    s = ledger.stats
    assert s.failed == {"http_400": 1} and s.attempt_failures == {"aborted": 1, "http_400": 1}
    assert (s.new, s.parked, s.parked_tokens, s.generated, s.lost, s.cancelled) == (0, 1, 3, 3, 0, 0)
    assert ledger.ctrl.committed == 0


def test_a_failure_with_nothing_produced_leaves_no_row_and_discarded_tokens_are_lost():
    ledger = make()
    f = flight()
    f.req.discarded_tokens = 6  # a text-only stream cut, then restarted from scratch
    settled = settle_and_commit(ledger, done=[(GenResult("k1", error="connection", detail="x"), f)])
    assert settled.rows == [] and len(settled.failures) == 1
    assert (ledger.stats.lost, ledger.stats.generated, ledger.stats.parked) == (6, 6, 0)


def test_a_response_without_a_reported_length_is_flagged_estimated():
    ledger = make()
    settle_and_commit(ledger, done=[(answer(extra={"completion_tokens_estimated": True}), flight())])
    assert ledger.stats.estimated == 1


# ---- requests the run stopped ---------------------------------------------------------------------------------- #


def test_a_request_cut_by_the_budget_is_parked_with_its_ids_and_not_counted():
    ledger = make()
    f = flight()
    f.req.partial = produced([4, 5, 6, 7, 8])
    settled = settle_and_commit(ledger, stopped=[(stopped_result(f.req, "embedded"), f)], reason=CUT)
    (row, _), *more = settled.rows
    assert not more and row.finish_reason == CUT and row.output_ids == [4, 5, 6, 7, 8] and row.partial
    assert row.prompt_tokens == len(PROMPT_IDS) and row.text == "partial text"
    s = ledger.stats
    assert (s.cancelled, s.parked, s.cut, s.parked_tokens, s.generated, s.new, s.lost) == (1, 1, 1, 5, 5, 0, 0)
    assert ledger.ctrl.committed == 0  # on_budget cancel: a cut partial is not a response


def test_an_interrupted_request_is_parked_as_interrupted():
    ledger = make()
    f = flight()
    f.req.partial = produced([4, 5])
    settled = settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=INTERRUPTED)
    assert [r.finish_reason for r, _ in settled.rows] == [INTERRUPTED] and ledger.stats.cut == 0
    assert ledger.stats.parked_tokens == 2


def test_keep_partial_counts_a_cut_text_only_partial_as_it_is():
    ledger = make(on_budget=OnBudget.keep_partial)
    f = flight()
    f.req.partial = Partial([], "some text", 3)  # text only: no ids to go on from
    settled = settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=CUT)
    (row, _), *more = settled.rows
    assert not more and row.output_ids is None and row.completion_tokens == 3 and row.text == "some text"
    assert ledger.ctrl.committed == 3 and ledger.stats.cut == 1 and ledger.stats.lost == 0


def test_keep_partial_parks_an_unusable_cut_without_counting_it():
    ledger = make(on_budget=OnBudget.keep_partial)
    f = flight()
    f.req.partial = Partial([9, 9], " ", 2)  # nothing but whitespace: no response, though parked
    settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=CUT)
    assert ledger.stats.parked == 1 and ledger.ctrl.committed == 0


@pytest.mark.parametrize("reason", [CUT, INTERRUPTED])
def test_a_text_only_partial_that_cannot_be_used_is_lost_and_counted(reason):
    ledger = make()  # on_budget cancel: a text-only partial can neither be continued nor used
    f = flight()
    f.req.partial = Partial([], "text", 5)
    f.req.attempt_errors = ["connection"]
    settled = settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=reason)
    s = ledger.stats
    assert settled.rows == [] and (s.lost, s.generated, s.parked, s.cancelled) == (5, 5, 0, 1)
    assert s.attempt_failures == {"connection": 1}


def test_an_answer_that_finished_during_the_stop_is_committed_like_any_other():
    ledger = make()
    finished, cut = flight("a"), flight("b")
    cut.req.partial = produced([1, 1])
    settled = settle_and_commit(
        ledger, done=[(answer("a"), finished)], stopped=[(stopped_result(cut.req, "x"), cut)], reason=CUT
    )
    assert sorted((r.key, r.finish_reason) for r, _ in settled.rows) == [("a", "stop"), ("b", CUT)]
    assert (ledger.stats.new, ledger.stats.parked, ledger.stats.cancelled) == (1, 1, 1) and ledger.ctrl.committed == 4


# ---- continuations --------------------------------------------------------------------------------------------- #


def parked_row(ids, finish=CUT) -> StoredResponse:
    return StoredResponse("k1", "D", "p-k1", "old text", 3, len(ids), finish, "s", 0.1, list(PROMPT_IDS), list(ids))


def test_resume_goes_on_from_a_continuable_parked_partial_only():
    ledger = make()
    assert ledger.resume(None, True) == Partial()
    assert ledger.resume(parked_row([1, 2]), False) == Partial()  # text prompts: cannot go on from ids
    text_only = parked_row([1, 2])
    text_only.output_ids = None
    assert ledger.resume(text_only, True) == Partial()
    assert (ledger.stats.continued, ledger.stats.continued_tokens) == (0, 0)
    part = ledger.resume(parked_row([1, 2, 3, 4]), True)
    assert part == Partial([1, 2, 3, 4], "old text", 4) and part.continuable()
    assert (ledger.stats.continued, ledger.stats.continued_tokens) == (1, 4)


def test_a_continued_response_counts_only_its_new_tokens_and_is_decoded_whole():
    ledger = make()
    part = ledger.resume(parked_row([1, 2, 3, 4]), True)
    f = flight(partial=part)
    assert f.prefix == 4
    res = answer(ids=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], finish="length", continued_from=4, prompt_ids=[99])
    settled = settle_and_commit(ledger, done=[(res, f)])
    (row, _), *more = settled.rows
    assert not more and row.text == " ".join(f"t{i}" for i in range(1, 11))  # not "answer": no seam
    assert row.prompt_ids == PROMPT_IDS  # our rendering: the server saw prompt + partial as its prompt
    s = ledger.stats
    assert (s.new, s.kept, s.generated, s.completed_len, s.new_by_key) == (1, 6, 6, 10, {"k1": 6})
    assert ledger.ctrl.committed == 10  # the whole response counts toward the budget


def test_a_continuation_stopped_before_a_new_token_adds_nothing():
    ledger = make()
    f = flight(partial=ledger.resume(parked_row([1, 2, 3]), True))
    settled = settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=CUT)
    s = ledger.stats
    assert settled.rows == [] and (s.generated, s.lost, s.parked, s.cancelled) == (0, 0, 0, 1)


def test_a_continuation_cut_again_is_parked_longer_with_only_the_new_tokens_counted():
    ledger = make()
    f = flight(partial=ledger.resume(parked_row([1, 2, 3]), True))
    f.req.partial.output_ids += [4, 5]
    f.req.partial.completion_tokens = 5
    settled = settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=CUT)
    (row, _), *more = settled.rows
    assert not more and row.output_ids == [1, 2, 3, 4, 5] and row.completion_tokens == 5
    assert (ledger.stats.parked_tokens, ledger.stats.generated) == (2, 2)


# ---- a plain request stopped unseen: the estimated loss --------------------------------------------------------- #


def test_a_plain_request_stopped_unseen_is_lost_by_the_speed_of_completed_ones():
    ledger = make()  # the requests end at NOW, 100 s
    # one completed at 8 tokens in 2 s (4 tok/s), one at 4 in 0.5 s (8 tok/s), one at 4 in 4 s (1 tok/s): median 4
    for key, ids, latency in (("a", range(8), 2.0), ("b", range(4), 0.5), ("c", range(4), 4.0)):
        settle_and_commit(ledger, done=[(answer(key, ids=ids, latency=latency), flight(key, stream=False))])
    f = flight("d", stream=False, t0=97.5)  # 2.5 s in flight: about 10 tokens
    settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=CUT)
    assert ledger.stats.lost_estimated and ledger.stats.lost == 10 and ledger.stats.parked == 0
    f = flight("e", stream=False, t0=0.0)  # 100 s: more than max_tokens could take; capped there
    settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=CUT)
    assert ledger.stats.lost == 10 + 64


def test_without_a_completed_request_the_unseen_loss_is_flagged_not_invented():
    ledger = make()
    f = flight(stream=False)
    settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=CUT)
    assert ledger.stats.lost_estimated and ledger.stats.lost == 0 and ledger.stats.cancelled == 1


def test_a_plain_request_whose_stop_brought_its_tokens_is_parked_not_estimated():
    ledger = make()
    f = flight(stream=False)
    f.req.partial = produced([3, 4, 5])  # SGLang answers an aborted plain request with what it produced
    settled = settle_and_commit(ledger, stopped=[(stopped_result(f.req, "x"), f)], reason=CUT)
    assert len(settled.rows) == 1 and not ledger.stats.lost_estimated and ledger.stats.parked_tokens == 3
