"""One client interface for every kind of server.

A backend turns a `GenRequest` into a `GenResult` and never raises for a failed request: the failure is a result
with `error` set (the registry style of vLLM's bench), so the caller's bookkeeping has one path. Cancelling the
asyncio task that awaits `generate` stops the work on the server (abort / disconnect / cancel_request); an answer
the server finished while the cancel was under way is still returned (the task then ends with a result, not
cancelled). With `stream=True` what was produced until then is in `req.partial`, which the backend keeps current.

Continuations: `req.partial` may start non-empty (a response cut earlier, parked in the store). A backend that
takes token ids (`takes_token_ids`) then sends prompt + those output ids with the remaining `max_tokens`, and the
result's `output_ids` are the whole response: the parked part and the new one. A failed attempt whose partial has
token ids is continued the same way by the next attempt, so a server abort or a dropped stream costs no tokens.

Error codes: `http_<status>` (a status that is not retried), `connection`, `timeout` (when retries are off),
`aborted` (the server aborted the request: its restart, an operator's `abort_request`; retried),
`empty` (an answer with no tokens; retried), `retries_exhausted` (the last cause in `detail`), `bad_response`
(unparseable answer), `engine_error` (the server reported a failure inside a 200 answer). A successful result's
`finish_reason` is `stop` or `length`, never `abort`: an aborted answer is not a response.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Protocol

from stages.config import BackendKind, Config


@dataclass
class Partial:
    """What a request has produced so far, its parked prefix included; the caller parks it when it cancels."""

    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0

    def clear(self) -> None:
        """In place, so a caller holding this object sees the restart of a retried request."""
        self.output_ids, self.text, self.completion_tokens = [], "", 0

    def continuable(self) -> bool:
        """Token ids for every token produced: the next attempt can go on from here."""
        return self.completion_tokens > 0 and len(self.output_ids) == self.completion_tokens


@dataclass
class GenRequest:
    rid: str  # the logical request (the store key); every attempt sends its own unique id (`attempt_rid`)
    prompt_ids: Optional[list[int]]
    messages: list[dict]
    tools: Optional[list[dict]]
    max_tokens: int
    sampling: dict
    stream: bool = False
    partial: Partial = field(default_factory=Partial)
    seed: Optional[int] = None  # base sampling seed; an attempt uses `attempt_seed`
    # filled in by the backend for the caller's accounting
    attempt_errors: list[str] = field(default_factory=list)  # the code of every failed attempt
    discarded_tokens: int = 0  # streamed, then thrown away because the next attempt could not go on from them
    cancelled: bool = False  # the caller cancelled it: what follows is the grace that collects its answer

    def attempt_seed(self, done: int) -> Optional[int]:
        """The seed of an attempt that continues after `done` tokens: a function of the request and where it
        resumes, so a rerun samples the same tokens where the server's kernels allow it."""
        return None if self.seed is None else (self.seed + done) & 0x7FFFFFFF


@dataclass
class GenResult:
    rid: str
    output_ids: Optional[list[int]] = None
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"  # stop | length
    error: Optional[str] = None  # a short reason code when the request failed
    detail: str = ""
    server: str = ""
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)
    # The prompt as the server tokenized it, when it says (vLLM's return_token_ids); None: as sent. Differs from
    # the request's prompt_ids only when the server applied its own chat template or re-tokenized text.
    prompt_ids: Optional[list[int]] = None
    continued_from: int = 0  # output tokens that came from the parked partial or an earlier attempt

    @property
    def ok(self) -> bool:
        return self.error is None


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


def takes_token_ids(cfg: Config) -> bool:
    """Whether the configured backend sends token-id prompts, so a partial response can be continued exactly (a text
    prompt would be re-tokenized, and a chat one rendered by the server)."""
    return cfg.backend.kind != BackendKind.openai or cfg.backend.prompt_format == "ids"


def make_backend(cfg: Config, tokenizer) -> Backend:
    cfg.backend.check("backend")  # before any connection is opened
    kind = cfg.backend.kind
    if kind == BackendKind.embedded:
        from stages.backends.embedded import EmbeddedBackend

        return EmbeddedBackend(cfg, tokenizer)
    if kind == BackendKind.sglang:
        from stages.backends.sglang import SGLangBackend

        return SGLangBackend(cfg, tokenizer)
    from stages.backends.openai import OpenAIBackend

    return OpenAIBackend(cfg, tokenizer)
