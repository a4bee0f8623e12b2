"""One client interface for every kind of server.

A backend turns a `GenRequest` into a `GenResult` and never raises for a failed request: the failure is a result
with `error` set (the registry style of vLLM's bench), so the caller's bookkeeping has one path. Cancelling the
asyncio task that awaits `generate` must stop the work on the server (abort / disconnect / cancel_request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from stages.config import BackendKind, Config


@dataclass
class GenRequest:
    rid: str  # the store key: unique per (model, prompt, sampling)
    prompt_ids: Optional[list[int]]
    messages: list[dict]
    tools: Optional[list[dict]]
    max_tokens: int
    sampling: dict


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

    @property
    def ok(self) -> bool:
        return self.error is None


class Backend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def generate(self, req: GenRequest) -> GenResult: ...

    async def close(self) -> None: ...


def make_backend(cfg: Config, tokenizer) -> Backend:
    kind = cfg.backend.kind
    if kind == BackendKind.embedded:
        from stages.backends.embedded import EmbeddedBackend

        return EmbeddedBackend(cfg, tokenizer)
    raise NotImplementedError(f"backend.kind={kind.value} is not available yet; use backend=embedded")
