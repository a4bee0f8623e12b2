"""The response store (real SQLite) and the pure budget controller."""

from __future__ import annotations

import json
import math
import random
import sqlite3
from pathlib import Path

import pytest

from draftdata.config.schema import DatasetConfig, Landing
from draftdata.generate.land.selection import landing, select_responses
from draftdata.generate.request import Planned, request_key, request_keys
from draftdata.generate.run.budget.controller import BudgetController
from draftdata.generate.run.budget.lengths import LengthModel
from draftdata.generate.store import CUT, ResponseStore, StoredResponse
from draftdata.util.hashing import canonical_json, ids_json


def resp(key: str, n: int = 5) -> StoredResponse:
    return StoredResponse(
        key=key,
        dataset="D",
        prompt_id="p" + key,
        text="hi",
        prompt_tokens=3,
        completion_tokens=n,
        finish_reason="stop",
        server="s",
        latency_s=0.1,
        prompt_ids=[1, 2, 3],
        output_ids=list(range(n)),
    )


def test_store_round_trip_survives_reopen_and_never_duplicates(tmp_path):
    path = tmp_path / "s.sqlite"
    store = ResponseStore(path)
    store.put(resp("a"))
    store.put(resp("b", 7))
    store.put(resp("a", 99))  # a second answer for the same key is ignored, not duplicated
    store.close()
    store = ResponseStore(path)
    got = store.get_many(["a", "b", "missing"])
    assert set(got) == {"a", "b"}
    assert got["a"].completion_tokens == 5 and got["a"].output_ids == [0, 1, 2, 3, 4]
    assert got["b"].prompt_ids == [1, 2, 3]
    assert store.count() == 2
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_commit_is_answered_with_the_row_the_store_holds(tmp_path):
    """Two runs committing the same keys (two connections): each is told what every later run will read, its own
    row where the store took it, the other's complete answer (or longer partial) where the store kept that."""
    from dataclasses import replace

    path = tmp_path / "s.sqlite"
    first, second = ResponseStore(path), ResponseStore(path)
    theirs = [resp("a"), resp("b", 7), replace(resp("c", 3), finish_reason="budget_cut")]
    assert first.put_many(theirs) == theirs
    ours = [resp("a", 9), resp("new", 2), replace(resp("c", 2), finish_reason="budget_cut"), resp("b", 7)]
    held = second.put_many(ours)
    assert held == [theirs[0], ours[1], theirs[2], theirs[1]]  # a and b answered first, c longer: theirs kept
    assert held == [second.get_many([r.key])[r.key] for r in ours]
    assert held[1] is ours[1]  # taken: not read
    complete = resp("c", 4)
    assert second.put(complete) is complete  # a complete answer replaces a partial
    first.close()
    second.close()


def test_store_get_many_handles_more_keys_than_sqlite_binds(tmp_path):
    store = ResponseStore(tmp_path / "s.sqlite")
    for i in range(1200):
        store.put(resp(f"k{i}"))
    assert len(store.get_many(f"k{i}" for i in range(1300))) == 1200


# Store keys as the code before request_keys made them: a changed definition would orphan every stored response
FROZEN_KEYS = [
    (("fp", [1, 2, 3], {"temperature": 0.8, "top_p": 0.95, "top_k": -1}, 48), "a48d303bff25dfbef9e2d0b1c164602d"),
    (
        (
            "3c" * 16,
            [151644, 872, 198, 0, 99999],
            {
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 20,
                "min_p": 0.05,
                "extra": {"prompt_ids": [], "stop": ["Ω\n"], 'n"x': 1},  # the field's name inside a value
            },
            1024,
        ),
        "97bda1989d998fd1b7b95a8321a2bbf9",
    ),
]


def test_request_keys_from_the_ids_text_are_the_keys_stores_hold():
    for (fp, ids, sampling, max_tokens), key in FROZEN_KEYS:
        assert request_key(fp, ids, sampling, max_tokens) == key
        assert request_keys(fp, sampling, max_tokens)(ids_json(ids)) == key
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(200_000) for _ in range(rng.randrange(0, 50))]
        sampling = {"temperature": rng.random(), "top_p": 1.0, "top_k": rng.choice([-1, 20])}
        if rng.random() < 0.5:
            sampling["extra"] = {"prompt_ids": ids[:3], "text": rng.choice(['"prompt_ids":[]', "é\\", "\u2028"])}
        fp = rng.choice(["x", "a" * 32, '"prompt_ids":[]'])
        assert request_keys(fp, sampling, 7)(ids_json(ids)) == request_key(fp, ids, sampling, 7)


def test_ids_text_is_canonical_json_and_a_plan_decodes_it_on_demand():
    rng = random.Random(1)
    for ids in ([], [0], [151643, 7, 0, 2**31 - 1], [rng.randrange(10**6) for _ in range(500)]):
        text = ids_json(ids)
        assert text == canonical_json(ids) == json.dumps(ids, separators=(",", ":"))  # what earlier versions stored
        p = Planned({"id": "p"}, "k", text)
        assert p.prompt_tokens == len(ids)  # counted without decoding
        assert p.prompt_ids == ids and p.prompt_tokens == len(ids)
    assert Planned({"id": "p"}, "k", [4, 5]).prompt_ids == [4, 5]


def test_rendered_ids_are_read_back_by_lookup_or_by_scan_alike(tmp_path):
    store = ResponseStore(tmp_path / "s.sqlite")
    rendered = {f"p{i}": ids_json(list(range(i, i + i % 7))) for i in range(1200)}
    store.put_rendered("A", rendered)
    store.put_rendered("B", {pid: "[1]" for pid in list(rendered)[:300]})  # another tokenizer's renders
    few = [f"p{i}" for i in range(0, 1200, 10)] + ["missing"]  # a tenth of A's rows: looked up
    assert store.get_rendered("A", few) == {pid: rendered[pid] for pid in few if pid in rendered}
    assert store.get_rendered("A", [*rendered, "missing"]) == rendered  # all of them: scanned
    assert store.get_rendered("B", few) == {pid: "[1]" for pid in few if pid in rendered and int(pid[1:]) < 300}
    assert store.get_rendered("C", few) == {}
    store.close()


def fill(c: BudgetController, progress: list[int]) -> list[int]:
    """Admit until the controller holds; returns the in-flight progress list."""
    while c.can_admit(progress):
        progress.append(0)
    return progress


def test_length_model_prior_and_conditional_mean():
    m = LengthModel(max_tokens=1000)
    assert m.mean() == 500 and m.expected_final(700) == 700  # prior until 16 lengths are seen
    for n in [100] * 12 + [900] * 4:
        m.add(n)
    assert m.mean() == 300
    assert m.expected_final(0) == 300  # nothing known about a request that has not started
    assert m.expected_final(150) == 900  # past 100 tokens, only the long ones are left
    assert m.expected_final(950) == 975  # past everything seen: halfway to max_tokens


def test_censored_lengths_count_the_running_requests_as_not_yet_known():
    """The answers that complete first are the short ones: with half of the requests still running past every
    length seen, the lengths seen alone say 100, Kaplan-Meier says more, and the running ones are expected long."""
    m = LengthModel(max_tokens=1000)
    for _ in range(16):
        m.add(100)
    assert m.censored([])[0] == pytest.approx(100) and m.censored([])[2] == pytest.approx(0)
    mean, running, sd = m.censored([150] * 16)  # 16 running, each already past every length seen
    # half of the requests are known to pass 150 and nothing says where they end: the survival holds at 0.5 to 150,
    # then falls linearly to 0 at max_tokens, so a running one is expected halfway to it
    assert mean == pytest.approx(100 + 0.5 * (150 - 100) + 0.5 * (1000 - 150) / 2) and sd > 0
    assert running == pytest.approx(16 * (150 + 1000) / 2)
    # a running request short of the lengths seen is expected to end where they do
    assert m.censored([50])[1] == pytest.approx(100, rel=0.1)


def _wave(t: float) -> tuple[LengthModel, list[int], list[int], int]:
    """A wave's front: 8 servers, each decoding its 60 requests (started together) at its own pace, at time t; the
    running requests' progress is seen a token late, as a stream's is. The lengths model, the running requests'
    progress, every length, and the running requests' lengths summed."""
    rng = random.Random(3)
    m, running, lengths, rest = LengthModel(max_tokens=512), [], [], 0
    for server in range(8):
        pace = 40 + 5 * server
        for _ in range(60):
            n = min(512, max(1, round(rng.lognormvariate(4.85, 0.8))))
            lengths.append(n)
            if n <= pace * t:
                m.add(n)
            else:
                running.append(int(pace * t) - 1)
                rest += n
    return m, running, lengths, rest


@pytest.mark.parametrize("t", [1.0, 2.0, 6.0])
def test_censored_lengths_at_a_waves_front_are_not_cut_at_the_longest_seen(t):
    """Early in a wave the longest completions are the few that got past the running requests' progress: the last
    of them took the survival to 0, so 400 running requests were expected to end by the 80 lengths seen (the mean
    read 68 for a true 163, and a fleet admitted 35 % past what its budget needed). Where few requests were at risk
    the lengths are now left unknown: the estimate errs long (under-admits) early, and is unchanged once most are
    in."""
    m, running, lengths, rest = _wave(t)
    mean, tails, _ = m.censored(running)
    truth = sum(lengths) / len(lengths)
    assert 0.95 * truth <= mean <= (1.5 if t < 2 else 1.1) * truth
    assert 0.9 * rest <= tails <= (1.5 if t < 2 else 1.1) * rest


def test_censored_prior_starts_from_the_lengths_seen():
    m = LengthModel(max_tokens=1000)
    assert m.censored([])[0] == 500  # nothing seen: max_tokens / 2
    m.add(100)  # the run's own first answers are its shortest: they do not move the prior
    assert m.censored([])[0] == 500
    m = LengthModel(max_tokens=1000)
    m.add_stored([100] * 8)  # half of MIN_OBSERVED, e.g. a smaller budget's answers in the store
    assert m.censored([])[0] == pytest.approx((8 * 100 + 8 * 500) / 16)
    m.add(100)
    assert m.censored([])[0] == pytest.approx((8 * 100 + 8 * 500) / 16)
    assert m.censored([700])[1] == 700  # a request past the prior is expected at least where it is


def test_exact_landing_admits_what_the_budget_needs_from_the_first_request():
    """landing exact: a request past the output's end is waste, so a small budget gets what it needs of a batch,
    not the batch (the demo: 16 slots, budgets of a few answers)."""
    c = BudgetController(budget=1_000, max_tokens=400, concurrency=16, landed=0)
    # 1,000 tokens / 200 (the prior, max_tokens / 2) = 5, and one more: the five may sum EXACT_MARGIN standard
    # deviations short (falling short costs a request admitted at the end, waited for whole)
    assert len(fill(c, [])) == 6
    c = BudgetController(budget=1_000, max_tokens=400, concurrency=16)  # landing finished fills the batch
    assert len(fill(c, [])) == 16
    c = BudgetController(budget=1_000, max_tokens=400, concurrency=16, landed=0)
    c.lengths.add_stored([50] * 16)  # the store holds this dataset's answers of 50 tokens: they are the lengths
    assert len(fill(c, [])) == 16


def test_blind_controller_admits_expected_fit_plus_slack():
    c = BudgetController(budget=10_000, max_tokens=200, concurrency=1000, admit_slack=0.0)
    assert len(fill(c, [])) == 100  # 100 in flight × 100 expected tokens = the budget
    c = BudgetController(budget=10_000, max_tokens=200, concurrency=50, admit_slack=1.0)
    assert len(fill(c, [])) == 50  # capped by concurrency, well inside one batch of slack


def full_batch(c: BudgetController, rng: random.Random, readings: int = 40, rate: float = 7500.0) -> None:
    for _ in range(readings):
        c.observe_rate(rate * (1 + rng.gauss(0, 0.02)), 150)


def test_throughput_model_tells_a_fixed_rate_server_within_seconds_of_the_drain():
    rng = random.Random(1)
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    full_batch(c, rng)
    assert c.throughput.floor() == 0  # nothing learned yet: draining allowed
    seen = 0
    for n in range(149, 100, -2):  # each request decodes at 50 tok/s: the aggregate falls with every idle slot
        c.observe_rate(50.0 * n * (1 + rng.gauss(0, 0.02)), n)
        seen += 1
        if c.throughput.floor():
            break
    assert c.throughput.floor() == 150 and seen <= 8  # refill to a full batch after a few readings


def test_throughput_model_is_not_fooled_by_noise_on_a_compute_bound_server():
    """The field's failure: with 2 % noise the old rule took the maximum reading as "full" and any reading below it
    as a loss, so it never drained. Here a drain that keeps the throughput stays free, an outlier moves nothing,
    and the knee is found where the throughput really falls."""
    rng = random.Random(2)
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    full_batch(c, rng)
    c.observe_rate(7500 * 0.92, 149)  # one reading 8 % low: an outlier, not a loss
    for n in range(148, 16, -1):
        c.observe_rate(7500 * (1 + rng.gauss(0, 0.02)), n)
        assert c.throughput.floor() == 0, n
    for n in (15, 14, 13, 12, 11):  # below the knee of 16 the aggregate falls
        c.observe_rate(7500 * n / 16 * (1 + rng.gauss(0, 0.02)), n)
    assert 16 <= c.throughput.floor() <= 24


def test_a_loss_shows_through_a_slow_stretch_of_a_server_that_shares_its_machine():
    """Another job on the server's machine halves its rate as the drain starts: against the full batch read before,
    every drain reading looks like half the throughput, which neither "flat" nor any knee explains (the fit clips
    them alike), and a fixed-rate server's loss went unseen for the whole stretch. Read against the level the
    server runs at now, the loss shows within seconds."""
    rng = random.Random(6)
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    full_batch(c, rng)
    seen = 0
    for n in range(149, 100, -2):
        c.observe_rate(0.5 * 50.0 * n * (1 + rng.gauss(0, 0.02)), n)
        seen += 1
        if c.throughput.floor():
            break
    assert c.throughput.floor() == 150 and seen <= 12  # the reading at the edge is held out
    assert c.throughput.summary()["level_shifts"] == 1
    assert c.throughput.summary()["full_batch_tok_s"] == pytest.approx(3750, rel=0.1)  # the level it runs at now


def test_a_full_batch_read_in_a_slow_stretch_does_not_hide_the_loss_after_it():
    """The run starts while a neighbour slows the server, and the drain begins as it ends: its readings are twice
    the full batch's of the slow stretch, more than any knee allows."""
    rng = random.Random(7)
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    full_batch(c, rng, rate=3750.0)
    seen = 0
    for n in range(149, 100, -2):
        c.observe_rate(50.0 * n * (1 + rng.gauss(0, 0.02)), n)
        seen += 1
        if c.throughput.floor():
            break
    assert c.throughput.floor() == 150 and seen <= 8


def test_a_slow_stretch_in_a_free_drain_is_not_taken_for_a_knee():
    """A compute-bound server whose batch drains deep toward the budget's end, halved for a while: half the full
    batch's throughput at a batch of 40 would be a knee at 80, and refills cut at the budget would follow."""
    rng = random.Random(8)
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    full_batch(c, rng)
    for n in range(149, 16, -1):
        slow = 0.5 if 30 <= n < 70 else 1.0
        c.observe_rate(slow * 7500 * (1 + rng.gauss(0, 0.02)), n)
        assert c.throughput.floor() == 0, n
    assert c.throughput.summary()["level_shifts"] == 2


def test_a_lone_stall_or_spike_moves_no_level():
    rng = random.Random(9)
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    full_batch(c, rng)
    for n, factor in ((149, 1.0), (148, 0.3), (147, 1.0), (146, 1.0), (145, 1.8), (144, 1.0)):
        c.observe_rate(factor * 7500 * (1 + rng.gauss(0, 0.02)), n)
    assert c.throughput.summary()["level_shifts"] == 0
    assert c.throughput.floor() == 0


@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("disturbed", [(0.3, 1.7), (1.8, 0.4)], ids=["stall_then_catch_up", "spike_then_stall"])
def test_two_readings_off_the_level_either_way_move_no_level(disturbed, seed):
    """A stall and the catch-up after it (two readings off the level, either way) made two level shifts and moved
    the full batch's rate by up to 2.4 %, until the new level had readings of its own: now they are outliers."""
    rng = random.Random(seed)
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    full_batch(c, rng)
    before = c.throughput.full_rate
    for factor in (1.0, *disturbed, 1.0, 1.0, 1.0, 1.0):
        c.observe_rate(factor * 7500 * (1 + rng.gauss(0, 0.02)), 150)
    assert c.throughput.summary()["level_shifts"] == 0
    assert c.throughput.full_rate == pytest.approx(before, rel=0.01)  # the noise's reach, not a level's


def test_two_low_readings_as_the_drain_starts_do_not_hold_the_batch_full():
    """A compute-bound server whose drain starts seconds into a run (long answers in flight fill the budget), just
    after a neighbour halved its rate: five full readings make the level, and the drain's first two read 2 % and
    4.5 % low, noise the handful of readings happened to put at 1.3 %. Fitted at once, that was a loss at the full
    batch, never probed, and the batch was kept full to the end (the readings of a real bench run)."""
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    for rate in (7483, 7557, 7480, 7483):
        c.observe_rate(rate, 150)
    for rate in (4535, 3824, 3699, 3811, 3792, 3706):  # halved: the edge held out, then five full readings
        c.observe_rate(rate, 150)
    c.observe_rate(3711, 148.2)
    c.observe_rate(3623, 142.5)
    assert c.throughput.floor() == 0
    rng = random.Random(10)
    for n in range(140, 60, -3):  # the drain goes on, flat: no knee where it starts
        c.observe_rate(3790 * (1 + rng.gauss(0, 0.02)), n)
        assert c.throughput.floor() == 0, n


def test_a_probe_whose_own_readings_take_the_knee_away_is_not_judged():
    """A knee is probed with three readings below it; the third made the fit flat, and judging the probe against a
    knee of 0 divided by zero (a bench run on a shared server hit it)."""
    c = BudgetController(budget=10**6, max_tokens=10_240, concurrency=150, observes_rate=True)
    for i in range(12):
        c.observe_rate(1000 * (1 + 0.01 * (-1) ** i), 150)
    for i in range(4):  # a loss of 10 % at a batch of 100: a knee near 110
        c.observe_rate(900 * (1 + 0.01 * (-1) ** i), 100)
    assert c.throughput.probe_target()
    for _ in range(3):  # the dip reads no loss at all
        c.observe_rate(980, 60)
    assert c.throughput.floor() == 0 and not c.throughput.probe_target()


def test_controller_refills_to_the_floor_except_near_the_end():
    c = BudgetController(budget=1_000_000, max_tokens=10_240, concurrency=150, observes_rate=True)
    for n in range(200, 8200, 200):
        c.finished(n, counted=False)  # the length statistics only
    c.committed = 600_000  # the batch in flight is expected to bring the rest: draining
    progress = [1000] * 150
    assert c.admit_count(progress) == 0  # full
    full_batch(c, random.Random(3))
    for n in range(149, 130, -2):
        c.observe_rate(50.0 * n, n)
    assert c.throughput.floor() == 150
    progress = [1000] * 140
    assert c.admit_count(progress) == 10  # a server that loses throughput: keep it full
    c.committed = 990_000  # 10k tokens to go: a new request would decode ~70 tokens before the end
    assert c.admit_count(progress) == 0  # it could not finish: it would only be cancelled


def draining(seed: int, committed: int) -> tuple[BudgetController, random.Random]:
    """A controller past the point where the batch in flight is expected to bring the rest of the budget."""
    rng = random.Random(seed)
    c = BudgetController(budget=1_000_000, max_tokens=10_240, concurrency=150, observes_rate=True)
    for n in range(200, 8200, 200):
        c.finished(n, counted=False)
    c.committed = committed
    full_batch(c, rng)
    return c, rng


def test_a_knee_fitted_near_the_full_batch_is_probed_before_the_batch_is_held_there():
    """The field's failure: a compute-bound server whose drain read a loss near the full batch (a slight slope, a
    transient) was fitted a knee there, and the batch held at it had its refills cut at the budget. A dip below the
    fitted knee shows whether the loss grows as a knee would have it; if not, the knee moves down."""
    c, rng = draining(4, 700_000)
    for n in range(149, 109, -1):  # readings that fit a knee of about 120
        c.observe_rate(7500 * min(1.0, n / 120) * (1 + rng.gauss(0, 0.005)), n)
    knee = c.throughput.floor()
    assert 110 < knee < 140
    assert c.admit_count([1000] * 110) == 0  # not refilled: first a few readings at 70 % of the knee
    dip = int(0.7 * knee)
    assert c.admit_count([1000] * dip) == 0
    for _ in range(3):  # the dip shows the throughput no lower than at 110: no knee at 120
        c.observe_rate(7500 * 0.92 * (1 + rng.gauss(0, 0.005)), dip)
    assert c.throughput.floor() < knee - 20


def test_a_knee_confirmed_below_is_refilled_to():
    c, rng = draining(5, 700_000)
    for n in range(100, 4100, 20):  # mostly short answers: a refill now is likely to complete
        c.finished(n, counted=False)
    for n in range(149, 30, -3):  # a true knee of 64 (flat above, falling below)
        c.observe_rate(7500 * min(1.0, n / 64) * (1 + rng.gauss(0, 0.02)), n)
    assert 64 <= c.throughput.floor() <= 80
    assert c.admit_count([3000] * 32) == math.ceil(c.throughput.floor()) - 32  # the dip confirmed it: refill


def test_controller_stops_when_met_and_counts_only_kept_tokens():
    c = BudgetController(budget=100, max_tokens=50, concurrency=3)
    c.finished(60, counted=False)  # not kept (e.g. dropped truncation): statistics only
    assert c.committed == 0 and c.lengths.n == 1
    c.finished(100, counted=True)
    assert c.reached() and not c.can_admit([])


def test_the_output_lands_on_the_budget_with_the_shortest_response_that_reaches_it():
    # prompt order: 900 and 200 fit; the long 7,000 would pass the budget by 6,900 (it stays in the store), and of
    # the rest that reach the 100 left, the shortest (150, past the budget by 50) takes its place
    assert landing([900, 200, 7000, 40, 500, 150], 1_200) == [0, 1, 5]
    assert landing([600, 600, 9000], 1_200) == [0, 1]  # met exactly: nothing crosses
    assert landing([300, 300], 1_200) == [0, 1]  # short of the budget: everything there is
    # through the generate stage's selection (landing: finished), in prompt order, every unusable response counted
    ds = DatasetConfig(token_budget=1_200, landing=Landing.finished)
    plan = [Planned({"id": k}, k, [1, 2, 3]) for k in "abcdef"]
    stored = {p.key: resp(p.key, n) for p, n in zip(plan, [900, 200, 7000, 40, 500, 150])}
    stored["d"].finish_reason = CUT  # parked: not in the output
    out = select_responses(plan, stored, ds)
    assert [p.key for p, _ in out.chosen] == ["a", "b", "f"] and out.total == 1_250
    assert out.skipped == {"cut_by_budget": 1}


def test_keep_partial_keeps_the_server_full_until_tokens_in_flight_reach_the_budget():
    c = BudgetController(budget=1_000, max_tokens=200, concurrency=8, keep_partial=True)
    assert len(fill(c, [])) == 8
    assert not c.reached([100] * 8)
    assert c.reached([100] * 8 + [200]) and not c.can_admit([100] * 8 + [200])
    c.cut(400)
    assert c.committed == 400 and c.reached([600])


def test_store_parked_partials_give_way_to_longer_or_complete_answers(tmp_path):
    store = ResponseStore(tmp_path / "s.sqlite")

    def put(key: str, n: int, finish: str) -> None:
        r = resp(key, n)
        r.finish_reason = finish
        store.put(r)

    def got(key: str) -> tuple[str, int]:
        r = store.get_many([key])[key]
        return r.finish_reason, r.completion_tokens

    put("a", 5, "budget_cut")
    put("a", 3, "interrupted")  # shorter: the parked 5 tokens stay
    assert got("a") == ("budget_cut", 5)
    put("a", 8, "interrupted")  # its continuation, cut again
    assert got("a") == ("interrupted", 8)
    put("a", 12, "length")  # complete
    assert got("a") == ("length", 12)
    put("a", 20, "budget_cut")  # a partial never replaces a complete response
    assert got("a") == ("length", 12)
    put("b", 0, "stop")  # an empty answer stored by an earlier version ...
    put("b", 6, "stop")  # ... gives way to a real one
    assert got("b") == ("stop", 6)
    put("c", 4, "abort")  # an aborted answer stored by an earlier version is a partial to continue
    assert store.get_many(["c"])["c"].continuable()
    put("c", 9, "stop")
    assert got("c") == ("stop", 9) and store.count() == 3


def test_total_unit_keeps_prompts_and_completions_apart():
    """budget_unit total: completion lengths (bounded by max_tokens) feed the length model, and each request's
    prompt is added on top. Fed totals, the model would expect 450-token completions from a 100-token limit."""
    ctrl = BudgetController(budget=10_000, max_tokens=100, concurrency=100, prompt_mean=400.0)
    for _ in range(20):
        ctrl.finished(450, counted=False, length=50)  # a 400-token prompt and a 50-token completion
    assert ctrl.lengths.mean() == 50
    assert ctrl.admit_count() == 10_000 // 450  # 22 requests of 450 budget tokens, not 100 of 50
    # in flight: 10 requests 20 tokens into their completions, each with its 400-token prompt counted
    expected = 10 * (400 + ctrl.lengths.expected_final(20))
    assert ctrl.admit_count([20] * 10, [400] * 10) == int((10_000 - expected) // 450)
    # keep_partial counts the prompts of the requests in flight toward the budget
    keep = BudgetController(budget=1_000, max_tokens=100, concurrency=8, keep_partial=True, prompt_mean=400.0)
    assert not keep.reached([50], [0]) and keep.reached([50, 50], [400, 500])


def test_fs_type_reads_the_mount_table():
    from draftdata.util.sqlite import fs_type

    assert fs_type(Path("/proc/self")) == "proc"  # the longest mount point that holds the path wins over "/"
    assert fs_type(Path("/")) not in ("", "proc")


def test_a_store_on_a_network_file_system_leaves_wal_with_a_warning(tmp_path, monkeypatch, capsys):
    import draftdata.util.sqlite
    from draftdata.hidden.state_store import StateStore

    local = ResponseStore(tmp_path / "local" / "store.sqlite")
    assert local.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    local.close()
    assert "network file system" not in capsys.readouterr().out
    monkeypatch.setattr(draftdata.util.sqlite, "fs_type", lambda path: "nfs4")
    for db in (ResponseStore(tmp_path / "nfs" / "store.sqlite").db, StateStore(tmp_path / "nfs" / "states").db):
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        db.close()
    out = capsys.readouterr().out
    assert out.count("network file system (nfs4)") == 2 and "run.store_path" in out


def test_stores_open_side_by_side_from_several_processes(tmp_path):
    """torchrun ranks open one new store at the same moment: none may fail with "database is locked"."""
    import subprocess
    import sys

    from conftest import ROOT

    code = (
        "import sys; from pathlib import Path; from draftdata.hidden.state_store import StateStore; "
        "from draftdata.generate.store import ResponseStore; StateStore(Path(sys.argv[1]) / 'states').close(); "
        "ResponseStore(Path(sys.argv[1]) / 'store.sqlite').close()"
    )
    for attempt in range(3):
        root = tmp_path / str(attempt)
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(root)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
            for _ in range(6)
        ]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, errors


def test_the_batch_shrinks_with_what_is_left_where_the_server_keeps_its_throughput():
    """Completions come short ones first, so the lengths seen understate the tail: the requests still running count
    as long. A batch larger than (budget - committed) / that length would have its long requests cancelled at the
    budget; where the server loses nothing with fewer requests it is not refilled past it."""
    c = BudgetController(budget=1_000_000, max_tokens=10_240, concurrency=150, observes_rate=True)
    for n in range(100, 2100, 100):  # 20 short answers seen so far; 149 still running
        c.finished(n, counted=True)
    full_batch(c, random.Random(6))  # the server read, no loss seen
    progress = [500] * 149
    assert c.lengths.quantile(0.9, running=149) == 10_240
    assert c.admit_count(progress) == 0  # 1M left / 10,240 is a batch of 97: no refill
    for n in range(149, 140, -1):  # a fixed-rate server: the dip shows the loss within seconds
        c.observe_rate(50.0 * n, n)
    assert c.throughput.floor() == 150
    assert c.admit_count(progress) == 1  # refilled to the full batch


def test_a_refill_below_a_knee_weighs_tokens_not_requests():
    """Seven in ten answers short, three in ten long reasoning: by count a refill usually completes, but most of
    the tokens it decodes before the budget belong to the long ones, which are cancelled."""
    c, rng = draining(7, 900_000)
    for i in range(300):
        c.finished(400 if i % 10 < 7 else 8000, counted=False)
    for n in range(149, 30, -3):  # a knee of 64
        c.observe_rate(7500 * min(1.0, n / 64) * (1 + rng.gauss(0, 0.02)), n)
    floor = c.throughput.floor()
    assert 64 <= floor < 150
    reach = 100_000 / floor  # what a refill decodes before the budget
    assert c.lengths.share_within(reach) > 0.6  # by count it would pass
    assert c.lengths.useful_share(reach, running=32) < 0.5
    assert c.admit_count([9000] * 32) == 0


def test_a_drained_batch_short_of_the_budget_gets_one_more_request():
    """A batch drained to nothing with less than a mean response left: the expected fit rounds to none, and no
    loss was seen so no refill either; without one more request the run would end short of the budget."""
    c = BudgetController(budget=1_000_000, max_tokens=10_240, concurrency=150, observes_rate=True)
    for _ in range(100):
        c.finished(3000, counted=False)
    c.committed = 998_500
    full_batch(c, random.Random(8))
    assert c.admit_count([]) == 1
