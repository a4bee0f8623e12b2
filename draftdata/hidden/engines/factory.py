"""The engine a run is configured for (`hidden_states.backend`), and the stage's lazy hold on it: the model is
loaded only when a sample is missing from the state store."""

from __future__ import annotations

import time

from draftdata.config.schema import Config
from draftdata.hidden.engines.base import Engine
from draftdata.hidden.policy import policy_spec
from draftdata.hidden.state_store import NormAndSizes, StateStore


def make_engine(cfg: Config, layers: list[int]) -> Engine:
    hs = cfg.hidden_states
    if hs.backend == "vllm":
        from draftdata.hidden.engines.vllm import VLLMEngine

        # vLLM packs sequences (no padding): a batch must hold the longest sample the tokenize stage lets through
        return VLLMEngine(
            cfg.model,
            layers,
            python=hs.vllm_python,
            tensor_parallel_size=hs.tensor_parallel_size,
            data_parallel_size=hs.data_parallel_size,
            llm_kwargs=dict(hs.vllm_kwargs),
            path=hs.vllm_path,
            max_batch_tokens=max(hs.batch_tokens, cfg.tokenize.max_seq_len + 1),
        )
    from draftdata.hidden.engines.hf import HFEngine

    return HFEngine(cfg.model, layers, device_map=hs.device_map, policy=policy_spec(hs))


class LazyEngine:
    """The engine is started only when a sample is missing: a run that finds everything in the store never loads
    the model. The target's norm and sizes are kept in the store the first time."""

    def __init__(self, cfg: Config, layers: list[int], store: StateStore, settings_hash: str):
        self.cfg, self.layers, self.store, self.settings_hash = cfg, layers, store, settings_hash
        self.engine: Engine | None = None
        self.load_s = 0.0  # seconds spent starting the engine, the target's load included (0: never started)

    def get(self) -> Engine:
        if self.engine is None:
            t0 = time.perf_counter()
            self.engine = make_engine(self.cfg, self.layers)
            self.load_s = time.perf_counter() - t0
            e = self.engine
            self.store.save_target(self.settings_hash, NormAndSizes(e.final_norm, e.n_layers, e.hidden_size))
        return self.engine

    @property
    def vllm_path(self) -> tuple[str, str | None] | None:
        """The vllm engine's path (extract or hook) and why not extract; None if no vllm engine ran."""
        path = getattr(self.engine, "vllm_path", None)
        return None if path is None else (path, getattr(self.engine, "fallback", None))

    @property
    def name(self) -> str:
        """What computes the states, as the state store records it per shard: `hf:<the dtype it computes in>`,
        `vllm:hook`, `vllm:extract`."""
        engine = self.get()
        path = getattr(engine, "vllm_path", None)
        return f"hf:{engine.compute_dtype}" if path is None else f"vllm:{path}"

    @property
    def pad_tokens(self) -> int:
        return self.engine.pad_tokens if self.engine is not None else 0

    def target(self) -> NormAndSizes:
        found = self.store.target(self.settings_hash)
        if found is None:  # never recorded (the states came from elsewhere): the engine reads it from the model
            self.get()
            found = self.store.target(self.settings_hash)
        return found

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
