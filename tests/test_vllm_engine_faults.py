"""The vllm hidden-states engine's failure paths, with stand-in workers: they need no vLLM, so they run in every
test run (a worker failure that only the optional `-m vllm` suite could see went unseen before)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from draftdata.config.schema import ModelConfig

# A worker whose start-up reply is the real worker's, field by field (vllm_worker.py's protocol: `start` and `main`),
# less the keys in DROP; it then dies on its first batch.
FAKE_WORKER = """
import json, os, sys, torch
from safetensors.torch import save_file
settings = json.loads(sys.argv[-1])
x = torch.randn(4, 8)
save_file({"weight": torch.ones(8), "probe_in": x,
           "probe_out": x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)}, settings["norm_file"])
reply = {"ok": True, "norm_file": settings["norm_file"], "n_layers": 8, "hidden_size": 8, "vocab_size": 100,
         "norm": {"kind": "rms", "eps": 1e-6, "weight_offset": 0.0, "class": "LlamaRMSNorm"},
         "max_len": 64, "path": "hook", "fallback": "the CPU build", "mode": "hooks"}
for key in DROP:
    del reply[key]
print(json.dumps(reply), flush=True)
sys.stdin.readline()
print("RuntimeError: CUDA error: an illegal memory access was encountered", file=sys.stderr)
os._exit(3)
"""


@pytest.mark.parametrize("behaviour", ["silent", "exits", "dies_in_batch", "lacks_a_key"])
def test_vllm_engine_never_hangs_on_a_dead_worker(tmp_path, behaviour):
    """A worker that never answers, exits at start-up, dies during a batch, or replies without a key the engine
    needs (a worker of another version): one UserError line naming the worker's log, promptly."""
    from draftdata.errors import UserError
    from draftdata.hidden.engines.vllm import VLLMEngine

    script = {
        "silent": "import time; time.sleep(600)",
        "exits": "import sys; print('RuntimeError: CUDA out of memory', file=sys.stderr); sys.exit(3)",
        "dies_in_batch": "DROP = []\n" + FAKE_WORKER,
        "lacks_a_key": "DROP = ['path']\n" + FAKE_WORKER,
    }[behaviour]
    (tmp_path / "fake.py").write_text(script)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake.py"} "$@"\n')
    python.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(UserError) as e:
        engine = VLLMEngine(ModelConfig(path=str(tmp_path)), [1], python=str(python), startup_timeout_s=5)
        engine.forward([[1, 2, 3]])
    message = str(e.value)
    assert "\n" not in message and time.monotonic() - start < 30, message
    expected = {
        "silent": "no answer from the worker in 5s",
        "exits": "status 3) while loading the model: RuntimeError: CUDA out of memory",
        "dies_in_batch": "status 3) while running a batch: RuntimeError: CUDA error",
        "lacks_a_key": "the worker's start-up reply lacks 'path' while loading the model",
    }[behaviour]
    assert expected in message, message
    Path(re.search(r"log: (\S+?)\)", message).group(1)).unlink()
