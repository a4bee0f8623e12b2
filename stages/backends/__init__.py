"""One client interface for every kind of server.

A backend turns a `GenRequest` into a `GenResult` and never raises for a failed request: the failure is a result
with `error` set (the registry style of vLLM's bench), so the caller's bookkeeping has one path. Cancelling the
asyncio task that awaits `generate` must stop the work on the server (abort / disconnect / cancel_request); with
`stream=True` what was produced until then is in `req.partial`, which the backend updates as tokens arrive.

Error codes: `http_<status>` (a status that is not retried), `connection`, `timeout` (when retries are off),
`retries_exhausted` (the last cause in `detail`), `bad_response` (unparseable answer), `engine_error` (the server
reported a failure inside a 200 answer). `finish_reason` is always `stop`, `length` or `abort`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from stages.config import BackendKind, Config


@dataclass
class Partial:
    """What a streaming request has produced so far; the caller keeps it when it cancels the request."""

    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0

    def clear(self) -> None:
        """In place, so a caller holding this object sees the restart of a retried request."""
        self.output_ids, self.text, self.completion_tokens = [], "", 0


@dataclass
class GenRequest:
    rid: str  # the store key: unique per (model, prompt, sampling)
    prompt_ids: Optional[list[int]]
    messages: list[dict]
    tools: Optional[list[dict]]
    max_tokens: int
    sampling: dict
    stream: bool = False
    partial: Partial = field(default_factory=Partial)


@dataclass
class GenResult:
    rid: str
    output_ids: Optional[list[int]] = None
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"  # stop | length | abort
    error: Optional[str] = None  # a short reason code when the request failed
    detail: str = ""
    server: str = ""
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)
    # The prompt as the server tokenized it, when it says (vLLM's return_token_ids); None: as sent. Differs from
    # the request's prompt_ids only when the server applied its own chat template or re-tokenized text.
    prompt_ids: Optional[list[int]] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Backend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def generate(self, req: GenRequest) -> GenResult: ...

    async def close(self) -> None: ...


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
