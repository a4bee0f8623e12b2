"""The budget controller: a pure decision core, no I/O, so the benchmark can simulate it (bench/budget.py).

Inputs: the budget, the tokens committed so far, the progress (tokens generated so far) of each request in flight
and, from a streaming client, readings of the server's aggregate throughput. Decisions: admit another request or
hold, and whether the budget is reached (then the caller stops what is in flight and parks it).

- `on_budget=cancel` (complete responses only): admit while committed + the expected final length of every
  request in flight (given how far it has got) + one more response stays under the budget; past that point the
  batch drains, and what is still running when the budget is reached is cancelled. The expectation uses the
  lengths of responses completed so far, bounded by max_tokens.
  Whether draining pays depends on the server. On a compute-bound server a draining batch speeds up and keeps
  the aggregate throughput, so the drain is free and wastes nothing; on a server whose requests decode at a fixed
  rate an idle slot costs as much GPU time as a cancelled request's tokens, so the batch must stay full. The
  controller learns which from the drain itself (`ThroughputModel`): it drains, compares the throughput of the
  shrinking batch with the full batch's, and as soon as a loss is statistically established it refills up to the
  smallest batch that still keeps the full throughput. Readings are noisy (1-2 % per second on real servers), so
  the full-batch rate is a median, the noise is measured, and a loss counts only when the readings of the whole
  drain fit "throughput falls below a knee" far better than "flat" (a single low reading moves nothing).
  The drain does not wait for the expected fit to close: toward the end the batch is kept at what is left of the
  budget over a long response (`_finishing_room`), so what runs at the budget is little; shrinking the batch is
  itself the probe that tells the two servers apart, within seconds, wherever it starts in the run. A knee below
  the full batch is confirmed by a dip under it before the batch is held there (`ThroughputModel.probe_target`).
  Without rate readings (a backend that does not stream) it allows `admit_slack` batches of slack instead.
- `on_budget=keep_partial`: keep the server full until committed + tokens in flight reach the budget, then stop
  everything and keep each partial response, cut at the budget: nothing generated is thrown away.
- Conversations (`turns: all`): a started conversation's next turns are not admitted against the budget, so what
  they will add is counted in before new conversations are admitted (`Pending`: each started conversation's source
  turns not yet requested, priced at the mean completion length, plus what their prompts add to the conversation's
  sample under budget_unit total), a new conversation costs its source turns, not one response, and near the end the
  batch the turns make is kept as a batch of requests is (`turn_count`).

bench/budget.py measures all of this on servers with knees from 8 requests to the full batch and saturating ones,
on four length families (the constants were tuned on one, lognormal), with and without noise, at 1M and 10M tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from draftdata.generate.accounting import turns_cost
from draftdata.generate.run.budget.lengths import LengthModel
from draftdata.generate.run.budget.throughput import ThroughputModel

# A refill request is admitted near the end only if at least this share of responses is short enough to complete
# before the budget is reached (BudgetController._can_finish).
MIN_FINISH_CHANCE = 0.05
# ... and below a knee short of the full batch, when at least this share of the tokens it is expected to decode
# before the budget would be in a complete response (a cancelled token weighs as much as a kept one)
KNEE_USEFUL_SHARE = 0.5
# Where the server keeps its throughput with fewer requests, the batch shrinks toward the budget's end so that this
# share of the requests admitted can complete before it (BudgetController._finishing_room).
FINISH_QUANTILE = 0.9
# landing exact: admit as if the requests in flight will be this many standard deviations of their summed lengths
# shorter than expected (BudgetController.admit_count)
EXACT_MARGIN = 1.0


@dataclass(frozen=True)
class Pending:
    """What a run's conversations (`turns: all`) will still ask, as the work queue sees them: source turns, not tokens
    (the controller prices them with the lengths it has seen, `tokens`).

    `started`: per started, unfinished conversation, (first, turns, prompt): `turns` source turns not yet requested,
    the first of them `first` turns after the one whose prompt adds `prompt` tokens to its sample (1: that one is in
    flight; 0: it is that turn, waiting for a slot). `upcoming`: the same of the conversations next in line to start
    (first 0).
    `growth`: the tokens a turn's prompt adds to the previous prompt and answer (the source's user and tool turns,
    the template's markers), on average; `prompts`: whether prompts count toward the budget (budget_unit total).

    Under landing finished every source turn is expected: an upper bound where conversations end early (a diverging
    call, a truncated answer), so new conversations are admitted late rather than early. Weighting the turns by the
    share that went on to the next (`carry`) made the benchmark's multi-turn rows no better there, with a quarter of
    the turns ending their conversation: near the budget the batch is set by the server (`turn_count`, the
    refills), not by the fit. Under landing exact the output waits for each conversation it holds, turn after turn,
    so one started late costs its whole chain: there the turns are weighted (bench/budget.py, ours_exact)."""

    started: Sequence[tuple[int, int, int]] = ()
    upcoming: Sequence[tuple[int, int, int]] = ()
    growth: float = 0.0
    prompts: bool = False
    # the share of turns that went on to the next source turn so far (accounting.continuation); read under landing
    # exact only, where a conversation started late is a whole chain of turns the output waits for
    carry: float = 1.0

    def tokens(self, completion: float, carry: float = 1.0) -> float:
        """Expected tokens of the started conversations' turns not yet requested (the controller's `pending`)."""
        return sum(self._turns(c, completion, carry) for c in self.started)

    def new_cost(self, completion: float, carry: float = 1.0) -> float:
        """Expected tokens of one conversation admitted now: the mean over those next in line."""
        return sum(self._turns(c, completion, carry) for c in self.upcoming) / len(self.upcoming)

    def _turns(self, conv: tuple[int, int, int], completion: float, carry: float) -> float:
        return turns_cost(*conv, completion, self.growth, self.prompts, carry)


@dataclass
class BudgetController:
    budget: int
    max_tokens: int
    concurrency: int
    keep_partial: bool = False
    admit_slack: float = 1.0  # in full batches of mean-length responses, used while the server is unobserved
    observes_rate: bool = False  # True when the caller feeds observe_rate (streaming backends)
    committed: int = 0  # tokens counted toward the budget: stored responses + new ones
    lengths: LengthModel = None  # type: ignore[assignment]  # completion lengths, whatever the budget's unit
    # budget_unit total: the prompt tokens a new request adds to the budget, on average (0 when only completions
    # count); prompts and completions are kept apart, as only completions are bounded by max_tokens
    prompt_mean: float = 0.0
    # landing exact: what the settled run of requests from the first counts (selection.Landed), which alone says
    # the budget is met; None: the finished rule, where `committed` does
    landed: int | None = None

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = LengthModel(self.max_tokens)
        self.throughput = ThroughputModel(self.concurrency)

    def observe_rate(self, tokens_per_s: float, in_flight: float) -> None:
        """The aggregate decode rate the server kept while `in_flight` requests ran (time-averaged over the
        reading's interval)."""
        self.throughput.observe(tokens_per_s, in_flight)

    def reached(self, progress: Sequence[int] = (), prompts: Sequence[int] = ()) -> bool:
        """True once the budget is met; with keep_partial the tokens in flight count too."""
        if self.landed is not None:
            return self.landed >= self.budget
        in_flight = sum(progress) + sum(prompts) if self.keep_partial else 0
        return self.committed + in_flight >= self.budget

    def can_admit(self, progress: Sequence[int] = (), prompts: Sequence[int] = ()) -> bool:
        """`progress`: completion tokens generated so far by each request in flight (zeros when the backend does not
        stream); `prompts`: the prompt tokens each one counts toward the budget (budget_unit total; else none)."""
        return self.admit_count(progress, prompts) > 0

    def admit_count(
        self, progress: Sequence[int] = (), prompts: Sequence[int] = (), pending: Pending | None = None
    ) -> int:
        """How many requests (with `pending`, conversations) may be admitted now. One pass over the requests in flight
        per call, so a loop that admits a batch at once does not pay for it once per request."""
        room = self.concurrency - len(progress)
        if room <= 0 or self.reached(progress, prompts):
            return 0
        if self.keep_partial:
            return room
        if self.landed is None:
            completion = self.lengths.mean()
            running = sum(self.lengths.expected_final(p) for p in progress)
        else:
            # landing exact: an admission past the budget's need is waste, so the lengths are read unbiased, and the
            # requests in flight are expected EXACT_MARGIN standard deviations of their sum shorter than their mean:
            # falling short costs a request admitted at the end, which the output then waits for whole
            completion, running, sd = self.lengths.censored(progress)
            running -= EXACT_MARGIN * sd * len(progress) ** 0.5
        mean = completion + self.prompt_mean  # what a new request adds to the budget
        expected = self.committed + sum(prompts) + running
        if pending is not None:  # the started conversations' turns to come are as good as in flight
            carry = pending.carry if self.landed is not None else 1.0
            expected += pending.tokens(completion, carry)
            if pending.upcoming:
                mean = pending.new_cost(completion, carry)
        fit = int((self.budget - expected) // mean) if expected < self.budget else 0  # each new one adds `mean`
        if not progress:  # nothing in flight and the budget not met: one more, or the run would end short of it
            fit = max(fit, 1)
        if self.landed is not None:
            # the run ends once the answers before the output's end are in: what the budget is expected to need is
            # admitted as soon as a slot is free (no finishing room, as each of those is waited for anyway), and
            # nothing past it (a request past the output's end is generated for a larger budget, not this one).
            # Refilling a server whose idle slot costs as much as a request would buy back time with such requests
            return min(room, fit)
        blind = not self.observes_rate or not self.throughput.known
        # while the server is not read, up to `admit_slack` full batches past the budget
        slack = int((self.budget + self.admit_slack * self.concurrency * mean - expected) // mean)
        if fit > 0:
            if pending is not None and blind:
                # a conversation costs all its turns, so what fits the budget may be a fraction of a batch (1M
                # tokens: 63 conversations of 4.5 turns of 3.5k): the slack, which fills the batch so that the
                # server is read, applies from the start, or a server that needs a full batch idles until then
                fit = max(fit, slack)
            return min(room, fit, self._finishing_room(len(progress)))
        if blind:
            return min(room, max(0, slack))
        floor = math.ceil(self.throughput.floor())  # how far the batch may drain (see ThroughputModel)
        if self.throughput.probe_target():  # a probe below the knee is under way: no refill until it is read
            return 0
        want = max(0, min(room, floor - len(progress)))
        return want if want and self._can_finish(floor, len(progress)) else 0

    def turn_count(self, progress: Sequence[int] = (), prompts: Sequence[int] = ()) -> int:
        """How many started conversations' next turns may be sent now (`turns: all`), ahead of new conversations.
        Their tokens are counted already (`Pending`), so they are not admitted against the budget as new ones are;
        but the batch they make is kept as the requests' is near the end (`_finishing_room`): where the server keeps
        its throughput with fewer requests it shrinks with what is left, so few turns run to be cut at the budget
        (a turn that waits leaves its conversation with its finished turns), and where it needs a full batch it
        stays full. Sent whenever a slot is free, the turns would keep any server full to the budget, and cut
        there a full batch of them (bench/budget.py's multi-turn rows on the compute-bound server)."""
        room = self.concurrency - len(progress)
        if room <= 0 or self.reached(progress, prompts):
            return 0
        if self.keep_partial:
            return room
        return min(room, self._finishing_room(len(progress)))

    def _finishing_room(self, batch: int) -> int:
        """How many requests may join a batch of `batch` so that nearly every one (FINISH_QUANTILE of the lengths)
        completes before the budget is reached. A request in a batch of n decodes about (budget - committed) / n
        tokens before then (the batch commits about its whole throughput), so the batch is kept at most
        (budget - committed) / that length: a batch shrinking with what is left, never below the floor the server
        needs (ThroughputModel). Shrinking it is the probe that tells whether the server keeps its throughput: a
        server that loses it shows within seconds, its floor becomes the full batch and nothing is held back
        again; one that keeps it gets the budget's end with few requests in flight, so few are cancelled. Unknown
        until the server has been read (a backend that does not stream, the first seconds): no limit."""
        if not self.observes_rate or not self.throughput.known:
            return self.concurrency
        length = self.lengths.quantile(FINISH_QUANTILE, batch)
        # at least one: a budget not yet met always gets a request, or the run would end short of it
        target = max(math.ceil(self.throughput.floor()), int(self._left_to_decode() // length), 1)
        return max(0, target - batch)

    def still_to_decode(self, progress: Sequence[int] = (), new_left: int | None = None) -> tuple[float, float]:
        """For the progress line's ETA: the completion tokens the run is still expected to decode before it ends, and
        the most that one request in flight is expected to have left (the run's tail, decoded at one request's pace).

        The requests in flight finish their expected lengths (given how far each got), and new requests (or started
        conversations' next turns) decode what the budget still needs past them: no more, as the run ends at the
        budget whatever turns its conversations have left. Not the budget minus what is committed and streamed: a
        request in flight decodes to its end, not to the budget's (with keep_partial alone it is cut there).
        `new_left`: the new requests the run still has (a budget past what the prompts give ends when they run
        out)."""
        streamed = sum(progress)
        if self.keep_partial:
            return max(0.0, self._left_to_decode() - streamed), 0.0
        ends = [self.lengths.expected_end(p) for p in progress]
        rest = [max(0.0, end - p) for end, p in zip(ends, progress, strict=True)]
        new = max(0.0, self._left_to_decode() - sum(ends))
        if new_left is not None:
            new = min(new, new_left * self.lengths.mean())
        return sum(rest) + new, max(rest, default=0.0)

    def _left_to_decode(self) -> float:
        """Completion tokens still to commit before the budget is reached."""
        left = self.budget - self.committed
        if self.prompt_mean:  # budget_unit total: only the completions' share of what is left is decoded
            completion = self.lengths.mean()
            left *= completion / (completion + self.prompt_mean)
        return left

    def _can_finish(self, batch: int, running: int) -> bool:
        """Whether a request admitted now to refill the batch has a fair chance to complete before the budget is
        reached. Near the end it has none: the batch commits about `full` tokens per second, so the budget is
        (budget - committed) / full seconds away, in which a new request decodes full / batch tokens per second.
        A refill that cannot finish would only be cancelled, its tokens wasted, at no gain in time. Below a knee
        short of the full batch, more of the tokens it decodes must be kept than cancelled: its cancelled tokens
        are waste, while draining there costs only the slots below the knee, for the end's seconds (weighed by
        tokens, not by requests: a mix of short answers and long reasoning passes a count, and its long ones are
        the ones cancelled)."""
        reach = self._left_to_decode() / max(batch, 1)  # tokens a new request decodes before the budget
        if batch >= self.concurrency:
            return self.lengths.share_within(reach) >= MIN_FINISH_CHANCE
        return self.lengths.useful_share(reach, running) >= KNEE_USEFUL_SHARE

    def finished(self, tokens: int, counted: bool, length: int | None = None) -> None:
        """A response completed. `tokens` (in the budget's unit) count when the policies keep it; `length` is its
        completion length for the running statistics (defaults to `tokens`, as when only completions count)."""
        self.lengths.add(tokens if length is None else length)
        if counted:
            self.committed += tokens

    def reused(self, tokens: int) -> None:
        """An answer the run reached without generating it (a conversation stepped over a turn the store holds)."""
        self.committed += tokens

    def cut(self, tokens: int) -> None:
        """A partial response kept at the budget (keep_partial)."""
        self.committed += tokens
