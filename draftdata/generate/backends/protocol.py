"""The client interface every backend speaks: requests, results, partials and stops.

A backend turns a `GenRequest` into a `GenResult` and never raises for a failed request: the failure is a result
with `error` set (the registry style of vLLM's bench), so the caller's bookkeeping has one path. With `stream=True`
what was produced so far is in `req.partial`, which the backend keeps current.

Stopping: the caller calls `req.stop(reason)`; the backend stops the work on the server once (SGLang's abort, a
closed connection, the embedded manager's cancel_request), reads on for its grace period and RETURNS: the complete
answer when the server finished it meanwhile (a response like any other), else a stopped result (`res.stopped`)
carrying what the request had produced. No CancelledError is part of that. Cancelling the task that awaits
`generate` (a caller that does not use `stop`) is taken as a stop: the task then ends cancelled, with the partial
kept in `req.partial`, or with the complete answer if it finished during the grace.

Continuations: `req.partial` may start non-empty (a response cut earlier, parked in the store). A backend that
takes token ids (`takes_token_ids`) then sends prompt + those output ids with the remaining `max_tokens`, and the
result's `output_ids` are the whole response: the parked part and the new one. A failed attempt whose partial has
token ids is continued the same way by the next attempt, so a server abort or a dropped stream costs no tokens.

Error codes: `http_<status>` (a status that is not retried), `connection`, `timeout` (when retries are off),
`aborted` (the server aborted the request: its restart, an operator's `abort_request`; retried),
`empty` (an answer with no tokens; retried), `retries_exhausted` (the last cause in `detail`), `bad_response`
(unparseable answer, or an OpenAI answer with a missing or unknown finish reason), `content_filter` (an OpenAI
server's filter withheld or cut the answer), `unrenderable` (a chat answer with a part, moved out of its text by a
server parser, that the chat template cannot render), `engine_error` (the server reported a failure inside a 200
answer), `engine_dead` (the server says its engine died: it leaves the rotation; the detail says what to do). A
successful result's `finish_reason` is `stop` or `length`, never `abort`: an aborted answer is not a response.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Partial:
    """What a request has produced so far, its parked prefix included; the caller parks it when it stops it."""

    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    # A chat answer's parts that a server's parsers take out of `text` (see `backends/openai.py`): the thinking
    # (`--reasoning-parser`) and the tool calls (`--tool-call-parser`), OpenAI-shaped, arguments a JSON string.
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def clear(self) -> None:
        """In place, so a caller holding this object sees the restart of a retried request."""
        self.output_ids, self.text, self.completion_tokens = [], "", 0
        self.reasoning, self.tool_calls = "", []

    def continuable(self) -> bool:
        """Token ids for every token produced: the next attempt can go on from here."""
        return self.completion_tokens > 0 and len(self.output_ids) == self.completion_tokens


# What to do when a server says its engine died (a failure `engine_dead`): said by the backend's failure, and by
# the run's stop where the requests that followed the death failed otherwise (the server reset their connections).
DEAD_ENGINE_HINT = (
    "the server's engine died: restart it (its log has the cause). vLLM's CPU build dies so on a seeded request "
    "whose prefill is chunked ('CPU Generator does not use offset'): serve it with --max-num-batched-tokens of at "
    "least the longest prompt plus max_tokens (e.g. 32768)"
)


@dataclass
class GenRequest:
    rid: str  # the logical request (the store key); every attempt sends its own unique id (`attempt_rid`)
    prompt_ids: list[int] | None
    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int
    sampling: dict
    stream: bool = False
    partial: Partial = field(default_factory=Partial)
    seed: int | None = None  # base sampling seed; an attempt uses `attempt_seed`
    prefer: str | None = None  # the server to send it to when it can (a conversation's previous turn's server)
    session: str | None = None  # its conversation's id (a prompt's, turns: last), sent in backend.session_header
    # filled in by the backend for the caller's accounting
    attempt_errors: list[str] = field(default_factory=list)  # the code of every failed attempt
    discarded_tokens: int = 0  # streamed, then thrown away because the next attempt could not go on from them
    stop_reason: str | None = None  # set by `stop`: the caller wants no more of this request
    _stop_signal: asyncio.Future | None = field(default=None, repr=False, compare=False)

    def stop(self, reason: str) -> None:
        """Ask the backend to stop this request and return what it has (see the module docstring). Idempotent: the
        first reason stands."""
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        if self._stop_signal is not None and not self._stop_signal.done():
            self._stop_signal.set_result(reason)

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None

    def stop_signal(self) -> asyncio.Future:
        """A future that completes on `stop`, for a backend to wait on beside its work (made on first use, in the
        running loop: a request is built before it meets one)."""
        loop = asyncio.get_running_loop()
        if self._stop_signal is None or self._stop_signal.get_loop() is not loop:
            self._stop_signal = loop.create_future()
            if self.stop_reason is not None:
                self._stop_signal.set_result(self.stop_reason)
        return self._stop_signal

    def attempt_seed(self, done: int) -> int | None:
        """The seed of an attempt that continues after `done` tokens: a function of the request and where it
        resumes, so a rerun samples the same tokens where the server's kernels allow it."""
        return None if self.seed is None else (self.seed + done) & 0x7FFFFFFF


@dataclass
class GenResult:
    rid: str
    output_ids: list[int] | None = None
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"  # stop | length; STOPPED: the caller stopped it (see `stopped`)
    error: str | None = None  # a short reason code when the request failed
    detail: str = ""
    server: str = ""
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)
    # The prompt as the server tokenized it, when it says (vLLM's return_token_ids); None: as sent. Differs from
    # the request's prompt_ids only when the server applied its own chat template or re-tokenized text.
    prompt_ids: list[int] | None = None
    continued_from: int = 0  # output tokens that came from the parked partial or an earlier attempt
    reasoning: str = ""  # a chat answer's thinking and tool calls, when a server parser moved them out of `text`
    tool_calls: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """A response: complete, to commit. Neither a failure nor a stopped request's partial."""
        return self.error is None and self.finish_reason != STOPPED

    @property
    def stopped(self) -> bool:
        """The caller stopped the request before it finished: the fields hold what it had produced."""
        return self.error is None and self.finish_reason == STOPPED


STOPPED = "stopped"  # the finish_reason of a stopped result: never a response's (stop | length)


def stopped_result(req: GenRequest, server: str, latency_s: float = 0.0) -> GenResult:
    """What a stopped request had produced, its parked prefix included: a copy of the partial, which the backend
    leaves as it was."""
    p = req.partial
    return GenResult(
        req.rid,
        output_ids=list(p.output_ids),
        text=p.text,
        prompt_tokens=len(req.prompt_ids) if req.prompt_ids is not None else 0,
        completion_tokens=p.completion_tokens,
        finish_reason=STOPPED,
        server=server,
        latency_s=latency_s,
        reasoning=p.reasoning,
        tool_calls=list(p.tool_calls),
    )


async def cancel_as_stop(req: GenRequest, work: Awaitable[GenResult]) -> GenResult:
    """Run a backend's `work` for `req` so that cancelling the awaiting task is taken as `req.stop`: the backend
    stops as it would when signalled. Its stopped result re-raises the cancellation (the caller asked for it, and
    the partial is in `req.partial`); a complete answer that came during the grace is returned, the cancellation
    withdrawn with `uncancel`, so the task is not left cancelling (an `asyncio.timeout` around it still works). A
    cancel that comes when the request is already stopping (a backend that does not honour the stop, or a
    second cancel) ends the work at once."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if req.stopping:
            task.cancel()
        req.stop("cancelled")
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():  # cancelled again while it stopped: no more waiting
                task.cancel()
        if task.cancelled() or task.exception() is not None or task.result().stopped:
            raise
        _uncancel()
        return task.result()


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):  # Python 3.11+: the count that asyncio.timeout reads
        task.uncancel()


def seed_of(key: str) -> int:
    """A 31-bit sampling seed derived from the store key (SGLang, vLLM and torch all take it). Store keys are
    already hex digests: their first 8 digits are the seed; another key is hashed first."""
    try:
        return int(key[:8], 16) & 0x7FFFFFFF
    except ValueError:
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") & 0x7FFFFFFF


class Backend(Protocol):
    name: str
    takes_token_ids: bool  # can continue a partial response (token-id prompts)

    async def start(self) -> None: ...

    async def generate(self, req: GenRequest) -> GenResult: ...

    async def close(self) -> None: ...
