"""vLLM's hidden-states KV connector for a KV cache in host memory (vLLM's CPU build); loaded by vLLM by module
path (`kv_connector_module_path`) in the process that owns the model, for the vllm engine's extract path and for a
`vllm serve` that speculators' online training asks for states (docs/hidden-states.md). Imports vLLM at the top:
only the vLLM side imports it.

vLLM's `extract_hidden_states` method writes the chosen layers' states into the KV cache of a cache-only layer, and
its `ExampleHiddenStatesConnector` copies them out to one safetensors file per finished request. That copy goes
through a CUDA stream into pinned memory (`_submit_async_write`, vllm 0.32.0
distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:386-408), which a CPU build has neither of
("pin_memory=True requires a CUDA or other accelerator backend"). Here the same slots are read into the same file,
under the same lock, synchronously; a KV cache on a GPU takes vLLM's own path unchanged.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Copied:
    """Stands for the CUDA event vLLM polls in `get_finished`: the copy is done when the file is written."""

    def query(self) -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader waiting in load_hidden_states
        self._req_copy_events[pending.req_id] = _Copied()
