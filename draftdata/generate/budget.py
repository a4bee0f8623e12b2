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

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# Before this many responses have completed, lengths are assumed to be max_tokens / 2.
MIN_OBSERVED = 16
# Throughput readings (ThroughputModel): how many recent full-batch readings make the reference, how many it needs
# at least, the smallest relative noise assumed (a noise-free simulation must not divide by zero), how strong the
# evidence of a loss must be (in noise standard deviations) and how wide the knee's confidence interval is.
FULL_WINDOW = 60
MIN_FULL_READINGS = 5
MIN_NOISE = 0.005
NOISE_READINGS = 10  # below this many full readings the noise is a rough guess (ThroughputModel._fit)
DETECT_SIGMAS = 4.0
DETECT_SIGMAS_NEAR_FULL = 2.5
CI_SIGMAS = 3.0
CLIP_SIGMAS = 3.0
FULL_SNAP = 0.95
# Probes (ThroughputModel.probe_target): a knee is checked by letting the batch dip to PROBE_DEPTH of it for
# PROBE_READINGS readings (one would be clipped as an outlier). Below a true knee the probe costs at most
# 1 - PROBE_DEPTH of the throughput for those few seconds, once; above a false one (a slight slope, a noisy drain)
# it costs nothing and moves the knee down.
PROBE_DEPTH = 0.7
PROBE_READINGS = 3
# Level shifts (Levels): a change from one reading to the next that neither the batch's change nor JUMP_SIGMAS noise
# deviations (of the difference of two readings) explain, and at least JUMP_MIN (in log rate: about 10 %), is the
# server's whole rate moving (another job on its machine, a shared GPU), not the batch's doing.
JUMP_SIGMAS = 5.0
JUMP_MIN = 0.1
JUMP_REFERENCE = 3
# A refill request is admitted near the end only if at least this share of responses is short enough to complete
# before the budget is reached (BudgetController._can_finish).
MIN_FINISH_CHANCE = 0.05
# ... and below a knee short of the full batch, when at least this share of the tokens it is expected to decode
# before the budget would be in a complete response (a cancelled token weighs as much as a kept one)
KNEE_USEFUL_SHARE = 0.5
# Where the server keeps its throughput with fewer requests, the batch shrinks toward the budget's end so that this
# share of the requests admitted can complete before it (BudgetController._finishing_room).
FINISH_QUANTILE = 0.9


@dataclass
class LengthModel:
    """Running distribution of completed response lengths, for E[final length | already generated p].

    Queries read a sorted snapshot with suffix sums (a bisect each); the snapshot is rebuilt only once the
    lengths seen have grown by 2 %, so a busy loop does not re-sort thousands of lengths per completion."""

    max_tokens: int
    _lengths: list[int] = field(default_factory=list)
    _sum: int = 0
    _snapshot: list[int] = field(default_factory=list)
    _suffix: list[int] = field(default_factory=list)  # _suffix[i] = sum(_snapshot[i:])

    def add(self, length: int) -> None:
        self._lengths.append(length)
        self._sum += length

    @property
    def n(self) -> int:
        return len(self._lengths)

    def mean(self) -> float:
        if self.n < MIN_OBSERVED:
            return self.max_tokens / 2
        return self._sum / self.n

    def expected_final(self, progress: int) -> float:
        """Mean of the observed lengths longer than `progress`; a request past every observed length is assumed
        to end halfway between where it is and max_tokens."""
        if self.n < MIN_OBSERVED:
            return max(float(progress), self.max_tokens / 2)
        if not self._snapshot or self.n - len(self._snapshot) > len(self._snapshot) // 50:  # inline: a hot path
            self._rebuild()
        i = bisect.bisect_right(self._snapshot, progress)
        if i == len(self._snapshot):
            return (progress + self.max_tokens) / 2
        return self._suffix[i] / (len(self._snapshot) - i)

    def quantile(self, q: float, running: int = 0) -> float:
        """The q-quantile of the lengths, counting the `running` requests not yet complete as max_tokens long: the
        responses that complete first are the short ones, so the lengths seen alone understate the long tail
        (in a heavy-tailed family, by a factor of several until late in a short run)."""
        if self.n < MIN_OBSERVED:
            return float(self.max_tokens)
        self._fresh()
        i = int(q * (len(self._snapshot) + running))
        return float(self._snapshot[i]) if i < len(self._snapshot) else float(self.max_tokens)

    def share_within(self, length: float) -> float:
        """The share of responses no longer than `length` (0.5 before enough have been seen: no opinion)."""
        if self.n < MIN_OBSERVED:
            return 0.5
        self._fresh()
        return bisect.bisect_right(self._snapshot, length) / len(self._snapshot)

    def useful_share(self, reach: float, running: int = 0) -> float:
        """Of the tokens a new request decodes in its first `reach`, the expected share in a complete response:
        the ones that end within `reach` bring their length, the longer ones (the `running` counted among them, see
        `quantile`) decode `reach` tokens and are cancelled. 0.5 before enough have been seen: no opinion."""
        if self.n < MIN_OBSERVED:
            return 0.5
        self._fresh()
        i = bisect.bisect_right(self._snapshot, reach)
        useful = (self._suffix[0] if self._snapshot else 0) - (self._suffix[i] if i < len(self._suffix) else 0)
        cut = reach * (len(self._snapshot) - i + running)
        return useful / (useful + cut) if useful + cut else 0.5

    def _fresh(self) -> None:
        if not self._snapshot or self.n - len(self._snapshot) > len(self._snapshot) // 50:
            self._rebuild()

    def _rebuild(self) -> None:
        self._snapshot = sorted(self._lengths)
        suffix = list(itertools.accumulate(reversed(self._snapshot)))
        suffix.reverse()
        self._suffix = suffix


@dataclass
class Levels:
    """The server's whole rate over time, in segments between level shifts: a drain is compared with the full batch
    of its own segment. A server that shares its machine (another job halving its rate for tens of seconds, a shared
    GPU) would otherwise make a drain inside a slow stretch look like a loss and one after it like more than the full
    batch, which no knee explains: the fit clips both, and a real loss in between goes unseen.

    A jump from the last readings beyond what the batch's change explains (any knee scales the rate by between 1 and
    the ratio of the batches) and the noise starts a segment: that reading is held out (the edge may fall inside its
    interval) and the next one, against the last readings kept, says by how much the level moved; a lone outlier (a
    stall) comes back and moves nothing. A segment's level is the median of its full-batch readings where it has
    enough (then no error carries from one segment to the next), else the level it was entered from times its jump."""

    _full: list[deque] = field(default_factory=lambda: [deque(maxlen=FULL_WINDOW)])  # per segment
    _jumps: list[float] = field(default_factory=lambda: [0.0])  # per segment, the log jump into it
    # (tokens/s, in flight) of the last readings kept in the segment: a jump is measured against each and the median
    # taken, so a reading whose interval held the edge of the last jump does not set the next level
    _recent: deque = field(default_factory=lambda: deque(maxlen=JUMP_REFERENCE))
    _held: bool = False  # the last reading jumped: held out, the next one says whether the level moved

    @property
    def segment(self) -> int:
        """The current segment's index: the level shifts so far."""
        return len(self._jumps) - 1

    @property
    def full_readings(self) -> int:
        """Full-batch readings kept, over every segment."""
        return sum(map(len, self._full))

    def add(self, tokens_per_s: float, in_flight: float, full: bool, knee: float = 0.0) -> int | None:
        """The segment of a reading, None for one held out. `knee`: the model's knee now (0: flat), by which the
        size of a jump is told from the batch's change."""
        if self._recent:
            unexplained = [self._unexplained(tokens_per_s, in_flight, r, n) for r, n in self._recent]
            if abs(statistics.median(unexplained)) > max(JUMP_SIGMAS * math.sqrt(2) * self.noise(), JUMP_MIN):
                if not self._held:
                    self._held = True
                    return None
                self._jumps.append(
                    statistics.median(self._jump(tokens_per_s, in_flight, *rn, knee) for rn in self._recent)
                )
                self._full.append(deque(maxlen=FULL_WINDOW))
                self._recent.clear()
        self._held = False
        self._recent.append((tokens_per_s, in_flight))
        if full:
            self._full[-1].append(tokens_per_s)
        return self.segment

    @staticmethod
    def _unexplained(rate: float, n: float, before: float, n_before: float) -> float:
        """The part of the change in log rate from (before, n_before) to (rate, n) that no knee explains (any knee
        scales the rate by between 1 and n / n_before): what tells a jump."""
        change, batch = math.log(rate / before), math.log(n / n_before)
        return change - min(max(change, min(0.0, batch)), max(0.0, batch))

    @staticmethod
    def _jump(rate: float, n: float, before: float, n_before: float, knee: float) -> float:
        """The jump's size: the change in log rate less what the model's knee makes of the batch's change (taking
        the most a knee could explain would shrink every fall and no rise, and the levels would drift)."""
        batch = math.log(min(1.0, n / knee) / min(1.0, n_before / knee)) if knee else 0.0
        return math.log(rate / before) - batch

    def known(self) -> bool:
        """Some segment has enough full-batch readings to anchor every level."""
        return any(len(f) >= MIN_FULL_READINGS for f in self._full)

    def levels(self) -> list[float]:
        """Each segment's full-batch rate (tokens/s); 0 for all while none is known."""
        own = [statistics.median(f) if len(f) >= MIN_FULL_READINGS else 0.0 for f in self._full]
        if not any(own):
            return own
        out = list(own)
        first = next(i for i, level in enumerate(own) if level)
        for i in range(first - 1, -1, -1):  # before the first anchor: back from it
            out[i] = out[i + 1] / math.exp(self._jumps[i + 1])
        for i in range(first + 1, len(out)):  # after it: each unanchored one from the one before
            out[i] = out[i] or out[i - 1] * math.exp(self._jumps[i])
        return out

    def noise(self) -> float:
        """The readings' relative noise: the median absolute deviation of the recent full-batch readings (FULL_WINDOW
        of them, from the latest segments back) from their segment's median, 0 while unknown."""
        dev = self._deviations()
        return statistics.median(dev) * 1.4826 if dev else 0.0

    def noise_readings(self) -> int:
        """How many full-batch readings `noise` is read from."""
        return len(self._deviations())

    def _deviations(self) -> list[float]:
        out: list[float] = []
        for f in reversed(self._full):  # a long run's many segments: the recent ones, as many as one window holds
            if len(out) >= FULL_WINDOW:
                break
            if len(f) >= MIN_FULL_READINGS:
                m = statistics.median(f)
                out += (abs(r / m - 1) for r in f)
        return out


@dataclass
class ThroughputModel:
    """How the server's aggregate throughput depends on the batch, learned from noisy readings.

    Model: throughput(n) = full × min(1, n / K), a roofline with an unknown knee K in [1, concurrency]: K =
    concurrency for a server whose requests decode at a fixed rate, a small K for a compute-bound one; a server in
    between fits a K in between. `full` is the median of recent full-batch readings at the server's level when the
    reading was taken (Levels: another job on its machine moves it) and the noise their relative spread (median
    absolute deviation), so one outlier moves neither. Readings of a smaller batch (the drain) are
    fitted by least squares over every K, and `floor` says how far the batch may drain: all the way while no loss
    shows (a drain that keeps the throughput is free); once a loss is established (the best K explains the readings
    better than "flat" by DETECT_SIGMAS² noise variances), down to the largest K the readings still allow (within
    CI_SIGMAS), so an uncertain fit errs toward keeping the server fuller. A server whose requests decode at a fixed
    rate shows its loss within seconds of the drain: the deficit grows with every idle slot.

    A knee below the full batch is probed before the batch is held at it (`probe_target`): a real server is no
    roofline (a few percent lost early in the drain, flat below), and a knee fitted to that loss would hold the
    batch, its refills cut at the budget, where draining further costs nothing more. If the readings of the dip
    show no further loss, the level they show becomes the reference and only readings below the dip are fitted."""

    concurrency: int
    _levels: Levels = field(default_factory=Levels)
    _drain_n: list[float] = field(default_factory=list)
    _drain_rate: list[float] = field(default_factory=list)
    _drain_segment: list[int] = field(default_factory=list)
    _floor: float = 0.0
    _dirty: bool = True
    # (in flight, rate, segment) read below a probe's target
    _probe: list[tuple[float, float, int]] = field(default_factory=list)
    _confirmed: bool = False  # a probe saw the loss grow below the knee: no more probes
    _plateau_n: float = math.inf  # after a refuted knee: the fit reads only batches up to the dip's
    _plateau: float = 1.0  # and measures them against the dip's level (a share of the full batch's)

    def observe(self, tokens_per_s: float, in_flight: float) -> None:
        if tokens_per_s <= 0 or in_flight <= 0:  # a stall, or nothing running: says nothing of the batch
            return
        target = self.probe_target()
        full = in_flight >= self.concurrency - 0.5
        segment = self._levels.add(tokens_per_s, in_flight, full, self.floor())
        if segment is None:
            return
        if not full:
            self._drain_n.append(in_flight)
            self._drain_rate.append(tokens_per_s)
            self._drain_segment.append(segment)
            if target and in_flight <= target:
                self._probe.append((in_flight, tokens_per_s, segment))
        self._dirty = True
        if len(self._probe) >= PROBE_READINGS:
            self._judge_probe()

    def _judge_probe(self) -> None:
        """A knee K predicts n / K of the reference at a batch of n: if the dip reads closer to no further loss than
        to that, the knee is refuted; else confirmed. A knee the probe's own readings already took away (the fit is
        flat now) leaves nothing to judge."""
        if not self.floor():
            self._probe.clear()
            return
        levels = self._levels.levels()
        n = statistics.median(p[0] for p in self._probe)
        level = statistics.median(p[1] / levels[p[2]] for p in self._probe) / self._plateau
        if level > (1 + n / self.floor()) / 2:
            self._plateau_n = max(p[0] for p in self._probe)
            self._plateau *= level
        else:
            self._confirmed = True
        self._probe.clear()
        self._dirty = True

    @property
    def known(self) -> bool:
        """Enough full-batch readings to compare a drain against."""
        return self._levels.known()

    @property
    def full_rate(self) -> float:
        """The full batch's throughput at the server's level now (tokens/s); 0 while unknown."""
        return self._levels.levels()[-1]

    def summary(self) -> dict:
        """What was learned of the server, for the run's metrics."""
        return {
            "full_batch_tok_s": round(self.full_rate, 1),
            "noise_pct": round(100 * self._levels.noise(), 2),
            "full_readings": self._levels.full_readings,
            "level_shifts": self._levels.segment,
            "drain_readings": len(self._drain_n),
            "floor": self.floor(),
        }

    def floor(self) -> float:
        """The smallest batch to keep the server at while the batch drains (refill below it)."""
        if self._dirty:
            self._dirty = False
            self._floor = self._fit()
        return self._floor

    def probe_target(self) -> float:
        """The batch to let the drain dip to before refilling up to the floor, 0 when none is due. A knee below the
        full batch is fitted from readings that may not reach below it (a drain that shows a slight loss, a noisy
        reading), and holding the batch there cancels its refills at the budget: until a reading below the knee
        confirms it, the batch dips to PROBE_DEPTH of it. A knee at the full batch (requests decode at a fixed rate,
        an idle slot costs) is never probed."""
        floor = self.floor()
        if self._confirmed or not 0 < floor < self.concurrency:
            return 0.0
        return PROBE_DEPTH * floor

    def _fit(self) -> float:
        import numpy as np

        c = self.concurrency
        if not self._drain_n or not self.known:
            return 0.0
        # While the noise is read from a handful of full readings (low as often as not), a loss waits for
        # PROBE_READINGS drain readings: two as the drain starts can pass for a loss at the full batch, which is
        # never probed (the batch is held full for good).
        if len(self._drain_n) < PROBE_READINGS and self._levels.noise_readings() < NOISE_READINGS:
            return 0.0
        var = max(self._levels.noise(), MIN_NOISE) ** 2
        n = np.asarray(self._drain_n)
        # each reading against the full batch of its own segment (Levels)
        levels = np.asarray(self._levels.levels())[np.asarray(self._drain_segment)]
        q = np.asarray(self._drain_rate) / (levels * self._plateau)
        below = n <= self._plateau_n
        n, q = n[below], q[below]
        if not len(n):
            return 0.0
        knees = np.arange(1, c + 1, dtype=float)
        # squared residuals capped at CLIP_SIGMAS noise deviations: one wild reading (a stall, a hiccup) weighs no
        # more than a few ordinary ones, so only a loss that persists across readings is taken for one
        cap = CLIP_SIGMAS**2 * var
        sse = np.minimum((q[None, :] - np.minimum(1.0, n[None, :] / knees[:, None])) ** 2, cap).sum(axis=1)
        best = float(sse.min())
        # A loss right below the full batch asks less evidence: it shows within seconds of the drain and missing it
        # costs GPU time on every idle slot; a knee deep in the drain costs little to find a reading later.
        detect = DETECT_SIGMAS_NEAR_FULL if knees[int(sse.argmin())] >= FULL_SNAP * c else DETECT_SIGMAS
        if float(np.minimum((q - 1.0) ** 2, cap).sum()) - best < detect**2 * var:  # "flat" fits about as well
            return 0.0
        knee = float(knees[sse <= best + CI_SIGMAS**2 * var].max())
        # within a few percent of the full batch a slot or two is below what the readings can tell: keep it full
        return float(c) if knee >= FULL_SNAP * c else knee


def landing(tokens: Sequence[int], budget: int, heads: Sequence[bool] | None = None) -> list[int]:
    """Which responses make the output, as indices into `tokens` (each one's count toward the budget, in prompt
    order): in prompt order while they fit within the budget; then, in place of the next one, which would pass it,
    the shortest of the rest that reaches it. So the output passes the budget by as little as one response can,
    not by whichever comes next (up to max_tokens: a long reasoning answer among short ones), and a lower budget's
    output is still the start of a higher one's, all but its last response. The responses left out stay in the
    store for a larger budget.

    `heads` (`turns: all`, where `tokens` lists each conversation's turns in order): which responses may stand in
    the output without the turns before them, a conversation's first turns. The one that reaches the budget is the
    next in line or a head, never a later turn alone: its prompt holds the turns before it, answers included, as
    context the drafter would pay for and train nothing on, and a conversation's output stays its turns from the
    first."""
    total, end = 0, 0
    while end < len(tokens) and total + tokens[end] <= budget:
        total += tokens[end]
        end += 1
    if total == budget or end == len(tokens):
        return list(range(end))  # exactly on the budget, or short of it with everything there is
    gap = budget - total  # tokens[end] passes it: some response reaches it
    rest = range(end, len(tokens)) if heads is None else [end, *(j for j in range(end + 1, len(tokens)) if heads[j])]
    crossing = min((j for j in rest if tokens[j] >= gap), key=tokens.__getitem__)
    return [*range(end), crossing]


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

    Every source turn is expected: an upper bound where conversations end early (a diverging call, a truncated
    answer), so new conversations are admitted late rather than early. Weighting the turns by the share that went
    on to the next made the benchmark's multi-turn rows no better, with a quarter of the turns ending their
    conversation: near the budget the batch is set by the server (`turn_count`, the refills), not by the fit."""

    started: Sequence[tuple[int, int, int]] = ()
    upcoming: Sequence[tuple[int, int, int]] = ()
    growth: float = 0.0
    prompts: bool = False

    def tokens(self, completion: float) -> float:
        """Expected tokens of the started conversations' turns not yet requested (the controller's `pending`)."""
        return sum(self._turns(c, completion) for c in self.started)

    def new_cost(self, completion: float) -> float:
        """Expected tokens of one conversation admitted now: the mean over those next in line."""
        return sum(self._turns(c, completion) for c in self.upcoming) / len(self.upcoming)

    def _turns(self, conv: tuple[int, int, int], completion: float) -> float:
        """Turn k after the one that adds `prompt` (k = first, first + 1, ...) adds a completion and, when prompts
        count, what its prompt adds to the sample: `prompt` for that turn itself (k = 0), a source step after."""
        first, turns, prompt = conv
        if not self.prompts or turns <= 0:
            return turns * completion
        return turns * (completion + self.growth) + (prompt - self.growth if first == 0 else 0)


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
        mean = self.lengths.mean() + self.prompt_mean  # what a new request adds to the budget
        expected = self.committed + sum(prompts) + sum(self.lengths.expected_final(p) for p in progress)
        if pending is not None:  # the started conversations' turns to come are as good as in flight
            expected += pending.tokens(self.lengths.mean())
            if pending.upcoming:
                mean = pending.new_cost(self.lengths.mean())
        fit = int((self.budget - expected) // mean) if expected < self.budget else 0  # each new one adds `mean`
        if not progress:  # nothing in flight and the budget not met: one more, or the run would end short of it
            fit = max(fit, 1)
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

    def held(self, tokens: int) -> None:
        """An answer the run reached without generating it (a conversation stepped over a turn the store holds)."""
        self.committed += tokens

    def cut(self, tokens: int) -> None:
        """A partial response kept at the budget (keep_partial)."""
        self.committed += tokens
