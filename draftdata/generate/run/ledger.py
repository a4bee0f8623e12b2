"""The accounting of a generation run: what is committed, parked and lost, and which rows go to the store.

Pure bookkeeping: no event loop and no store. The dispatcher hands over what ended (each request's `GenResult` and
its `Flight`); `to_store` says which rows to put in the store and which failures to record, and once the store has
taken them `commit` counts them and tells the budget controller. Counting only after the store took a row keeps
the figures true when a commit fails (disk full): nothing is counted that is not stored.

The rules, so that nothing wrong is kept and nothing generated is lost unseen:
- only `stop` and `length` answers are responses; a failure is recorded, and what its attempts had produced is
  parked as interrupted (a later run continues it);
- a request stopped before it finished (by the budget, Ctrl-C, a failing run) is parked with what it produced, when
  that can be continued (token ids for every token) or, cut by the budget under keep_partial, used as it is;
  anything else it produced is lost, and counted;
- a plain (non-streamed) request stopped on a server that answers the stop with nothing is counted lost by an
  estimate: its time in flight at the median decode speed of this run's completed requests (`lost_estimated`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from draftdata.config.schema import DatasetConfig
from draftdata.generate.accounting import counted, unusable_reason
from draftdata.generate.backends.protocol import GenRequest, GenResult, Partial
from draftdata.generate.request import Planned
from draftdata.generate.run.budget.controller import BudgetController
from draftdata.generate.store import CUT, INTERRUPTED, StoredResponse


@dataclass
class Flight:
    """A request in flight: its prompt, what it started from (a parked partial's tokens) and when."""

    p: Planned
    req: GenRequest
    prefix: int
    t0: float


@dataclass
class RunStats:
    """What this run did. Tokens are the ones this run generated, unless said otherwise."""

    reused: int = 0  # usable answers the store held for the run's prompts before it
    new: int = 0  # complete responses committed
    parked: int = 0  # partial responses parked (cut by the budget or interrupted)
    cut: int = 0  # ... of which cut by the budget
    continued: int = 0  # requests that went on from a parked partial
    cancelled: int = 0  # requests in flight when the run stopped
    generated: int = 0
    kept: int = 0  # in complete responses
    completed_len: int = 0  # the full completion lengths of this run's complete responses (continued ones whole)
    parked_tokens: int = 0  # in parked partials (reusable: a later run continues them)
    continued_tokens: int = 0  # parked by earlier runs and carried on by this one (not generated here)
    lost: int = 0  # generated but neither kept nor parked
    lost_estimated: bool = False  # a plain (non-streamed) request was stopped unseen: its tokens are estimated
    estimated: int = 0  # responses whose length the server did not report (no usage, no ids): counted from the text
    failed: Counter = field(default_factory=Counter)  # requests that ended failed, by reason
    attempt_failures: Counter = field(default_factory=Counter)  # failed attempts (retried or not), by reason
    new_by_key: dict = field(default_factory=dict)  # key -> tokens this run generated for it
    server: dict = field(default_factory=dict)  # what the controller learned of the server's throughput
    fill: list = field(default_factory=list)  # (seconds since generation began, tokens counted) about every second


@dataclass
class ToStore:
    """What the store must take for a batch of ended requests: rows (one transaction), then `Ledger.commit`."""

    rows: list[tuple[StoredResponse, Flight]] = field(default_factory=list)
    failures: list[tuple[str, str, str, str, str, str]] = field(default_factory=list)  # put_failure's arguments


class Ledger:
    """The run's accounting (see the module docstring). `tok` decodes a continued response whole; `server` names
    the backend on parked rows;
    `compute_dtype` and `attention`: the in-process engine's arithmetic and decode-attention path (None: a server's),
    recorded on every row."""

    def __init__(
        self,
        ds: DatasetConfig,
        dataset: str,
        ctrl: BudgetController,
        tok,
        server: str,
        compute_dtype: str | None = None,
        attention: str | None = None,
    ):
        self.ds, self.dataset, self.ctrl, self.tok, self.server = ds, dataset, ctrl, tok, server
        self.compute_dtype, self.attention = compute_dtype, attention
        self.stats = RunStats()
        self._speeds: list[float] = []  # tokens/s of single requests that completed (the unseen loss's estimate)

    def resume(self, parked: StoredResponse | None, takes_token_ids: bool) -> Partial:
        """What a request starts from: a parked partial's tokens, when the backend can go on from token ids."""
        if parked is None or not takes_token_ids or not parked.continuable():
            return Partial()
        self.stats.continued += 1
        self.stats.continued_tokens += parked.completion_tokens
        return Partial(list(parked.output_ids), parked.text, parked.completion_tokens)

    def to_store(
        self,
        done: Iterable[tuple[GenResult, Flight]],
        stopped: Iterable[tuple[GenResult, Flight]] = (),
        reason: str = CUT,
        *,
        now: float,
    ) -> ToStore:
        """Requests that ended by `now` (time.monotonic's, as the flights' starts): `done` by themselves (a
        response or a failure), `stopped` by the caller for `reason` (CUT: the budget; INTERRUPTED: anything else).
        Losses and failures are counted here; rows once committed."""
        out = ToStore()
        for res, f in done:
            self._ended(res, f, out, now)
        for res, f in stopped:
            self._stopped(res, f, reason, out, now)
        return out

    def commit(self, rows: list[tuple[StoredResponse, Flight]], held: list[StoredResponse] | None = None) -> None:
        """The store has taken `rows`: count what this run generated in them, and tell the controller what now
        counts toward the budget, by the rows the store `held` for them (`put_many`'s answer: another run's row where
        it committed one first, which is what the output holds; default: ours)."""
        s, unit = self.stats, self.ds.budget_unit
        for (mine, f), r in zip(rows, held if held is not None else [r for r, _ in rows]):
            new = mine.completion_tokens - f.prefix
            s.generated += new
            # a request asked again in this run adds to what its parked partial had (landing exact's second ask)
            s.new_by_key[mine.key] = s.new_by_key.get(mine.key, 0) + new
            if mine.partial:
                s.parked += 1
                s.parked_tokens += new
                s.cut += mine.finish_reason == CUT
            else:
                s.new += 1
                s.kept += new
                s.completed_len += mine.completion_tokens
            usable = unusable_reason(r, self.ds) is None
            if not r.partial:
                self.ctrl.finished(counted(f.p, r, unit), counted=usable, length=r.completion_tokens)
            elif r.finish_reason == CUT and usable:  # keep_partial: a cut response counts as it is
                self.ctrl.cut(counted(f.p, r, unit))

    def reused(self, pairs: list[tuple[Planned, StoredResponse]]) -> None:
        """Answers that now count toward the budget without a request of this run (`WorkQueue.take_reused`)."""
        for p, r in pairs:
            if unusable_reason(r, self.ds) is None:
                self.ctrl.reused(counted(p, r, self.ds.budget_unit))

    # ---- the rules ------------------------------------------------------------------------------------------- #

    def _ended(self, res: GenResult, f: Flight, out: ToStore, now: float) -> None:
        if f.req.attempt_errors:
            self.stats.attempt_failures.update(f.req.attempt_errors)
        if f.req.discarded_tokens:
            self._lose(f.req.discarded_tokens)
        if res.ok:
            self.stats.estimated += bool(res.extra.get("completion_tokens_estimated"))
            out.rows.append((self._complete(res, f), f))
            return
        out.failures.append((f.p.key, self.dataset, f.p.prompt["id"], res.error, res.detail, res.server))
        self.stats.failed[res.error] += 1
        if (parked := self._partial_row(f, f.req.partial, INTERRUPTED, now)) is not None:
            out.rows.append((parked, f))

    def _stopped(self, res: GenResult, f: Flight, reason: str, out: ToStore, now: float) -> None:
        self.stats.cancelled += 1
        self.stats.attempt_failures.update(f.req.attempt_errors)
        self._lose(f.req.discarded_tokens)
        part = Partial(list(res.output_ids or []), res.text, res.completion_tokens, res.reasoning, res.tool_calls)
        if not f.req.stream and part.completion_tokens == f.prefix:  # nothing came back: how much was there?
            self._lose_unseen(f, now)
        elif (row := self._partial_row(f, part, reason, now)) is not None:
            out.rows.append((row, f))

    def _complete(self, res: GenResult, f: Flight) -> StoredResponse:
        text = res.text
        # decoded whole where it was continued (no seam at the continuation point), and from the ids where the server
        # sent ids and no text (SGLang's --skip-tokenizer-init): an answer with ids is judged by its ids
        no_text = not (res.text or res.reasoning or res.tool_calls)
        if res.output_ids and (res.continued_from or no_text):
            text = self.tok.decode(res.output_ids, skip_special_tokens=True)
        prompt_ids = f.p.prompt_ids if res.continued_from else res.prompt_ids
        if res.latency_s > 0:
            self._speeds.append((res.completion_tokens - f.prefix) / res.latency_s)
        return self._row(
            f.p,
            text,
            res.output_ids,
            res.prompt_tokens,
            res.completion_tokens,
            res.finish_reason,
            res.server,
            res.latency_s,
            prompt_ids=prompt_ids,
            parsed=res,
        )

    def _partial_row(self, f: Flight, part: Partial, reason: str, now: float) -> StoredResponse | None:
        """What a stopped or failed request produced, to park; None when there is nothing worth keeping (its new
        tokens, if any, counted as lost)."""
        new = part.completion_tokens - f.prefix
        if new <= 0:
            return None
        if not part.continuable() and not (reason == CUT and self.ctrl.keep_partial):
            self._lose(new)  # text only: no run can go on from it, and only keep_partial uses it as it is
            return None
        ids = list(part.output_ids) if part.continuable() else None
        return self._row(
            f.p,
            part.text,
            ids,
            len(f.p.prompt_ids),
            part.completion_tokens,
            reason,
            self.server,
            now - f.t0,
            parsed=part,
        )

    def _lose(self, tokens: int) -> None:
        self.stats.generated += tokens
        self.stats.lost += tokens

    def _lose_unseen(self, f: Flight, now: float) -> None:
        """A plain request stopped on a server that does not answer a stop with its tokens: estimate what it had
        generated from the decode speed of the requests that completed (none yet: nothing to go by, flagged)."""
        self.stats.lost_estimated = True
        if self._speeds:
            elapsed = now - f.t0
            self._lose(min(self.ds.max_tokens - f.prefix, round(elapsed * statistics.median(self._speeds))))

    def _row(
        self,
        p: Planned,
        text,
        output_ids,
        prompt_tokens,
        completion_tokens,
        finish_reason,
        server,
        latency,
        prompt_ids=None,
        parsed: GenResult | Partial | None = None,
    ) -> StoredResponse:
        """`prompt_ids`: the prompt as the server tokenized it, when it said (else the ids we rendered); `parsed`:
        what holds the thinking and tool calls a server's parsers moved out of the text."""
        return StoredResponse(
            key=p.key,
            dataset=self.dataset,
            prompt_id=p.prompt["id"],
            text=text,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            server=server,
            latency_s=latency,
            prompt_ids=prompt_ids or p.prompt_ids,
            output_ids=output_ids,
            reasoning=(parsed.reasoning or None) if parsed else None,
            tool_calls=(parsed.tool_calls or None) if parsed else None,
            compute_dtype=self.compute_dtype,
            attention=self.attention,
        )
