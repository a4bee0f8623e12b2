"""How a server's aggregate throughput depends on the batch, learned from noisy readings (the meter's, one a second):
the server's level over time (`Levels`: another job on its machine moves it) and the knee below which a draining
batch loses throughput (`ThroughputModel`). The budget controller drains the batch toward the budget's end only
as far as the server keeps its throughput (draftdata/generate/run/budget/controller.py)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

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
# ... once this many readings in a row are off it the same way: a stall, or a stall and its catch-up (the readings
# either side of a hiccup), moves nothing. Two stalls in a row look like a real two-second shift and are taken for
# one: a third reading would tell them apart at a reading's delay on every real shift, which cost bench.budget's
# compute-bound noisy-neighbour row 3.6 % of time at 1M (docs/benchmarks.md).
JUMP_CONFIRM = 2


@dataclass
class Levels:
    """The server's whole rate over time, in segments between level shifts: a drain is compared with the full batch
    of its own segment. A server that shares its machine (another job halving its rate for tens of seconds, a shared
    GPU) would otherwise make a drain inside a slow stretch look like a loss and one after it like more than the full
    batch, which no knee explains: the fit clips both, and a real loss in between goes unseen.

    A jump from the last readings beyond what the batch's change explains (any knee scales the rate by between 1 and
    the ratio of the batches) and the noise is held out; JUMP_CONFIRM such readings in a row, off the same way, start
    a segment, the ones after the first (whose interval may hold the edge) saying by how much the level moved against
    the last readings kept. A stall, or a stall and its catch-up (off either way), comes back and moves nothing. A
    segment's level is the median of its full-batch readings where it has enough (then no error carries from one
    segment to the next), else the level it was entered from times its jump."""

    _full: list[deque] = field(default_factory=lambda: [deque(maxlen=FULL_WINDOW)])  # per segment
    _jumps: list[float] = field(default_factory=lambda: [0.0])  # per segment, the log jump into it
    # (tokens/s, in flight) of the last readings kept in the segment: a jump is measured against each and the median
    # taken, so a reading whose interval held the edge of the last jump does not set the next level
    _recent: deque = field(default_factory=lambda: deque(maxlen=JUMP_REFERENCE))
    _held: list = field(default_factory=list)  # readings off the level, in a row, held out until they agree

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
        reading = (tokens_per_s, in_flight)
        limit = max(JUMP_SIGMAS * math.sqrt(2) * self.noise(), JUMP_MIN)
        if self._recent and abs(self._off(reading, self._recent)) > limit:
            # off the level: held out until JUMP_CONFIRM readings in a row agree on a new one; one off the other way
            # (a stall, then its catch-up) starts the count again
            if self._held and (self._off(reading, self._recent) > 0) != (self._off(self._held[-1], self._recent) > 0):
                self._held.clear()
            self._held.append(reading)
            if len(self._held) < JUMP_CONFIRM:
                return None
            self._shift(knee)
        self._held.clear()
        self._recent.append(reading)
        if full:
            self._full[-1].append(tokens_per_s)
        return self.segment

    def _shift(self, knee: float) -> None:
        """A new segment at the level the held readings agree on. The first of them may hold the edge inside its
        interval: the jump is measured from the others, against each of the last readings kept (the median)."""
        settled = self._held[1:]
        self._jumps.append(statistics.median(self._jump(*r, *rn, knee) for r in settled for rn in self._recent))
        self._full.append(deque(maxlen=FULL_WINDOW))
        self._recent.clear()
        self._recent.extend(settled[:-1])  # the reading being added goes in after

    def _off(self, reading: tuple[float, float], refs) -> float:
        """How far `reading` is from `refs`' level, beyond what the batch's change explains (the median over them)."""
        return statistics.median(self._unexplained(*reading, r, n) for r, n in refs)

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
