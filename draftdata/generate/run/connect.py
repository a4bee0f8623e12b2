"""The backend a run is configured with: the in-process engine (generate/embedded/) or a server's client
(generate/backends/). The protocol they all speak is generate/backends/protocol.py."""

from __future__ import annotations

from draftdata.config.schema import BackendKind, Config
from draftdata.generate.backends.protocol import Backend
from draftdata.model.target import Target


def make_backend(cfg: Config, target: Target) -> Backend:
    """The configured backend, for the target as load_target found it (its tokenizer, what its template does)."""
    # before any connection is opened (loading the config checked it too, and that the dataset's sampling is all sent)
    cfg.backend.check("backend")
    kind = cfg.backend.kind
    if kind == BackendKind.embedded:
        from draftdata.generate.embedded.backend import EmbeddedBackend

        return EmbeddedBackend(cfg, target)
    if kind == BackendKind.sglang:
        from draftdata.generate.backends.sglang import SGLangBackend

        return SGLangBackend(cfg, target)
    from draftdata.generate.backends.openai import OpenAIBackend

    return OpenAIBackend(cfg, target)
