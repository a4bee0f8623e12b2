"""Optional, marked both `vllm` and `trainers`: speculators' online training against a live vLLM server.

The `speculators_online` export holds the samples and no states; speculators' `ArrowDataset` (`on_missing=
"generate"`) sends each row's ids to vLLM, which computes the states as it serves them (the `extract_hidden_states`
method and a hidden-states KV connector, flags built by `extraction_config`, the vllm engine's own settings). What
the trainer gets so must equal what it reads from the offline `speculators` export of the same samples, whose states
the hf backend computed. Runs where `DRAFTDATA_VLLM_PYTHON` and `DRAFTDATA_TRAINERS_PYTHON` are set (see
tests/test_vllm.py and tests/test_export.py for the two venvs).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
import torch
from conftest import ROOT
from test_export import TRAINERS_PYTHON, export, read_dump, samples_of
from test_vllm import VLLM_PYTHON, build, metric, serve

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.trainers,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not VLLM_PYTHON, reason="set DRAFTDATA_VLLM_PYTHON to a Python with vLLM"),
    pytest.mark.skipif(
        not TRAINERS_PYTHON, reason="set DRAFTDATA_TRAINERS_PYTHON to a Python with specforge and speculators"
    ),
]

# Runs under DRAFTDATA_TRAINERS_PYTHON: every sample of both exports through speculators' ArrowDataset, dumped.
READ_BOTH = textwrap.dedent("""
    import sys
    from pathlib import Path

    from safetensors.torch import save_file
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    online, offline, endpoint, out = sys.argv[1:5]
    BIG = 1 << 20  # max_len: no truncation

    def dump(name, ds):
        tensors = {}
        for i in range(len(ds)):
            item = ds[i]
            if isinstance(item, SampleUnavailable):
                sys.exit(f"{name} sample {i}: {item.reason}")
            tensors.update({f"{i}/{k}": v.contiguous() for k, v in item.items()})
        save_file(tensors, str(Path(out) / f"{name}.safetensors"))

    # online: no stored states, so each sample is a round trip to vLLM; a failed one ends the run here rather than
    # being retried and skipped, as training would
    dump("online", ArrowDataset(max_len=BIG, datapath=online, vllm_endpoint=endpoint, on_missing="generate",
                                generation_validation_retries=0, max_consecutive_generation_failures=1))
    dump("offline", ArrowDataset(max_len=BIG, datapath=offline, on_missing="raise"))
""")


def server_flags(offline, model, states_dir) -> list[str]:
    """`vllm serve`'s flags for the export, as speculators' scripts/launch_vllm.py builds them: the aux layer ids a
    speculators draft config names (the export marker's, vLLM's numbering), then the last layer's, whose output is
    the verifier's pre-norm state (`--include-last-layer`); float32, as the vllm engine's comparisons with hf run."""
    from draftdata.hidden.engines.vllm_worker import extraction_config
    from draftdata.hidden.export import MARKER

    aux = json.loads((offline / MARKER).read_text())["aux_layer_ids"]
    n_layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    cfg = extraction_config([*aux, n_layers], str(states_dir), cuda=False)
    return [
        "--dtype",
        "float32",
        "--speculative-config",
        json.dumps(cfg["speculative_config"]),
        "--kv-transfer-config",
        json.dumps(cfg["kv_transfer_config"]),
    ]


def test_speculators_online_reads_from_a_live_vllm_what_the_offline_export_stores(project, tmp_path):
    model = build(tmp_path / "tiny-vllm", mean_response_tokens=24)
    project.params["model"]["path"] = str(model)
    project.save()
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    offline, online = export(project, "speculators"), export(project, "speculators_online")
    assert (offline / "hidden_states").is_dir() and not (online / "hidden_states").exists()
    rows = samples_of(project, "B3")
    assert len(rows) > 5

    states_dir = tmp_path / "vllm-states"
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (tmp_path / "read_both.py").write_text(READ_BOTH)
    # PYTHONPATH: vLLM's engine process imports the CPU build's connector by module path
    with serve(
        model, tmp_path / "vllm.log", *server_flags(offline, model, states_dir), env={"PYTHONPATH": str(ROOT)}
    ) as url:
        r = subprocess.run(
            [TRAINERS_PYTHON, str(tmp_path / "read_both.py"), str(online), str(offline), url + "/v1", str(dumps)],
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert r.returncode == 0, r.stderr[-4000:]
        prompt_tokens = metric(url, "vllm:prompt_tokens_total")

    got, want = read_dump(dumps / "online.safetensors"), read_dump(dumps / "offline.safetensors")
    assert sorted(got) == sorted(want) == list(range(len(rows)))
    largest = dict.fromkeys(("hidden_states", "verifier_last_hidden_states"), 0.0)
    for i, row in enumerate(rows):
        g, w = got[i], want[i]
        assert g["input_ids"].tolist() == w["input_ids"].tolist() == row["input_ids"], i
        assert g["loss_mask"].tolist() == w["loss_mask"].tolist() == row["loss_mask"], i
        for key in largest:  # the aux layers flattened; the pre-norm state
            assert g[key].shape == w[key].shape, (i, key)
            largest[key] = max(largest[key], float((g[key].float() - w[key].float()).abs().max()))
            # vLLM in float32 against hf's states stored in bf16: bf16's tolerance, as the vllm engine's tests
            torch.testing.assert_close(
                g[key].float(), w[key].float(), atol=2e-2, rtol=2e-2, msg=lambda m, k=key, j=i: f"{k} {j}: {m}"
            )
    print(f"\n{len(rows)} samples read online and offline; largest difference: {largest}")
    # every sample's states were computed by vLLM as it was read, and each file was read and removed by speculators
    assert prompt_tokens == sum(len(row["input_ids"]) for row in rows)
    assert states_dir.is_dir() and not list(states_dir.glob("*.safetensors"))
