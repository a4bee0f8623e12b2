"""Hidden states: layers, the shard format, the state store, the engines that compute them, and the reader.

The reader is the API a trainer imports, `from draftdata.hidden import HiddenStates`; it pulls in neither DVC, Hydra
nor an engine (the import contracts in pyproject.toml keep it so). It loads on first use, so that importing a module
of this package (the vLLM worker does, in a Python that has only vLLM) costs nothing more.
"""

from __future__ import annotations

__all__ = ["HiddenStates", "Sample"]


def __getattr__(name: str):
    if name in __all__:
        from draftdata.hidden import reader

        return getattr(reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
