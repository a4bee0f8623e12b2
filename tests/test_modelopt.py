"""NVIDIA Model-Optimizer: `export.format=modelopt` (its offline `.pt` files for EAGLE-3, DFlash, DSpark, Domino)
read by its own dataset and collator and trained on, and `export.format=modelopt_policy` (the target's top-k policy,
its external draft's gzipped JSONL) checked against a plain forward's logits, shift included."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import textwrap

import pytest
import torch

from draftdata.errors import ConfigError
from draftdata.hidden.export import MARKER
from draftdata.hidden.reader import HiddenStates

MODELOPT_PYTHON = os.environ.get("DRAFTDATA_MODELOPT_PYTHON")


@pytest.fixture
def captured(project):
    """The tiny target's B3 states for EAGLE-3 and DFlash, with its top-20 policy beside them."""
    project.set("hidden_states.drafters", ["eagle3", "dflash"])
    project.set("hidden_states.policy_top_k", 20)
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    return project


def export(project, fmt: str, *overrides: str):
    project.run("export", "B3", f"export.format={fmt}", *overrides)


def test_modelopt_files_hold_the_family_s_layers_the_post_norm_state_and_its_command(captured):
    project = captured
    export(project, "modelopt")
    out = project.data("B3") / "export-modelopt-eagle3"
    hs = HiddenStates(project.data("B3") / "hidden_states")
    files = sorted(out.rglob("*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    assert len(files) == len(hs) and files[0].relative_to(out).as_posix() == "rows_0-2000/sample_0.pt"
    for path, s in zip(files, hs):
        r = torch.load(path, weights_only=True)  # as ModelOpt's OfflineSupervisedDataset loads it
        n = len(s.input_ids)
        assert r["conversation_id"] == s.id and r["hidden_states_prenorm"] is False
        assert torch.equal(r["input_ids"], s.input_ids) and torch.equal(r["loss_mask"], s.loss_mask)
        assert torch.equal(r["aux_hidden_states"], s.aux[:, [0, 2, 3]].reshape(n, -1).to(torch.bfloat16))
        assert torch.equal(r["hidden_states"], s.final_post_norm.to(torch.bfloat16))
    meta = json.loads((out / MARKER).read_text())
    assert meta["aux_layer_ids"] == [1, 3, 4] and meta["aux_layer_numbering"] == "physical"
    assert meta["final_state"] == "post_norm"
    assert meta["draft_config_key"] == "eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids"
    command = (out / "train_command.sh").read_text()
    # the recipe, the layers, and the loss mask read: EAGLE-3's recipe trains every token, the prompts' too
    assert "speculative_decoding/eagle3.yaml" in command and f"data.offline_data_path={out.resolve()}" in command
    assert "eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids=[1,3,4]" in command
    assert "training.answer_only_loss=true" in command
    export(project, "modelopt", "export.family=dflash")
    command = (project.data("B3") / "export-modelopt-dflash" / "train_command.sh").read_text()
    # one target layer per draft layer, or ModelOpt refuses the ids: the draft's depth goes with them
    assert "dflash.dflash_architecture_config.target_layer_ids=[1,2,3,4,5]" in command
    assert "dflash.dflash_architecture_config.num_hidden_layers=5" in command
    with pytest.raises(ConfigError, match="export.family: modelopt has no offline data path for peagle"):
        export(project, "modelopt", "export.family=peagle")
    for fmt in ("modelopt", "modelopt_policy"):
        with pytest.raises(ConfigError, match=f"export.draft_vocab_size: the {fmt} export writes no vocabulary"):
            export(project, fmt, "export.draft_vocab_size=64")


def test_the_policy_export_shifts_each_row_to_the_token_it_predicts(captured, tiny_model):
    """Record row j is the policy gen_ids[j] was drawn from: the target's logits at len(prompt_ids) + j - 1, cut
    top-k then top-p and renormalised over the kept slots, as ModelOpt's deployment_policy does. The row at the
    token itself (no shift) is another distribution: the check would catch the shift's loss."""
    from transformers import AutoModelForCausalLM

    project = captured
    export(project, "modelopt_policy")
    out = project.data("B3") / "export-modelopt_policy"
    meta = json.loads((out / MARKER).read_text())
    assert meta["policy"]["top_k"] == 20 and meta["records"] >= meta["samples"] > 0
    assert "external.external_top_k=20" in (out / "train_command.sh").read_text()
    records = [json.loads(line) for p in sorted(out.glob("policy-000-*.jsonl.gz")) for line in gzip.open(p, "rt")]
    assert len(records) == meta["records"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    shifted = unshifted = 0
    for r in records[:5]:
        ids = torch.tensor([r["prompt_ids"] + r["gen_ids"]])
        with torch.inference_mode():
            p = torch.softmax(model(input_ids=ids).logits[0].float(), -1)
        first = len(r["prompt_ids"])
        for j in range(len(r["gen_ids"])):
            tok, lp = torch.tensor(r["topk_tok"][j]), torch.tensor(r["topk_lp"][j])
            assert len(tok) == 20 and math.isclose(float(lp.exp().sum()), 1.0, rel_tol=1e-5)  # rows sum to 1
            got = dict(zip(tok.tolist(), lp.exp().tolist()))
            want = dict(zip(*(t.tolist() for t in deployment_policy(p[first + j - 1], 20, 0.95))))
            assert got.keys() == want.keys() and all(math.isclose(got[t], want[t], abs_tol=1e-5) for t in got)
            shifted += 1
            unshifted += set(tok.tolist()) == set(p[first + j].topk(20).indices.tolist())
    assert shifted > 20 and unshifted < shifted / 2


def deployment_policy(p, k: int, top_p: float):
    """ModelOpt's (examples' compute_sparse_policy_hf.py): top-k, renormalised, the nucleus with the crossing token,
    renormalised again; (ids, probabilities), zero where cut."""
    vals, ids = p.topk(k)
    vals = vals / vals.sum()
    vals = vals * ((vals.cumsum(0) - vals) < top_p)
    return ids, vals / vals.sum()


def test_a_capture_without_the_policy_refuses_its_export(project):
    project.set("hidden_states.drafters", ["eagle3"])
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    with pytest.raises(ConfigError, match="hidden_states.policy_top_k: is 0 for the states at .*: no policy was kept"):
        export(project, "modelopt_policy")
    assert not (project.data("B3") / "export-modelopt_policy").exists()


# Runs under DRAFTDATA_MODELOPT_PYTHON: the exports through ModelOpt's own offline data path
# (OfflineSupervisedDataset with answer_only_loss, EagleOfflineDataCollator), dumped; then its own offline EAGLE-3
# (the base loaded with its layers dropped, mtsp.convert with the export's aux layer ids) trained two steps on them.
READER = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import torch
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.utils import load_vlm_or_llm
    from safetensors.torch import save_file

    eagle, dflash, dump = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    items = {}
    for name, path in (("eagle3", eagle), ("dflash", dflash)):
        files = sorted(map(str, path.rglob("*.pt")))  # as its data module collects them
        ds = OfflineSupervisedDataset(files, answer_only_loss=True)
        for f, i in zip(files, range(len(ds))):
            item = ds[i]
            key = f"{name}/{Path(f).stem}"
            items |= {f"{key}/{k}": v.contiguous() for k, v in item.items() if torch.is_tensor(v)}
            assert item["base_hidden_prenorm"] is False
    save_file(items, str(dump / "items.safetensors"))

    meta = json.loads((eagle / "draftdata_export.json").read_text())
    files = sorted(map(str, eagle.rglob("*.pt")))[:4]
    ds = OfflineSupervisedDataset(files, answer_only_loss=True)
    batch = EagleOfflineDataCollator(train_len=256)([ds[i] for i in range(len(ds))])
    # the export holds bf16 states, as ModelOpt's dump writes them; the model here is float32 (bf16 is the GPU's)
    batch["base_model_outputs"] = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                   for k, v in batch["base_model_outputs"].items()}
    torch.manual_seed(0)
    model = load_vlm_or_llm(meta["model"]["path"], use_offline_training=True, dtype=torch.float32, device_map=None)
    mtsp.convert(model, [("eagle", {
        "eagle_offline": True, "eagle_use_torch_compile": False, "eagle_ttt_steps": 2,
        "eagle_architecture_config": {"num_hidden_layers": 1, "intermediate_size": 128, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "head_dim": 16,
                                      "eagle_aux_hidden_state_layer_ids": meta["aux_layer_ids"]},
    })])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    losses = []
    for _ in range(2):
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(json.dumps({"losses": losses, "aux_ids": list(model.eagle_config.eagle_aux_hidden_state_layer_ids),
                      "fc_in": model.eagle_module.fc.in_features}))
""")


@pytest.mark.modelopt
@pytest.mark.timeout(600)
@pytest.mark.skipif(not MODELOPT_PYTHON, reason="set DRAFTDATA_MODELOPT_PYTHON to a Python with nvidia-modelopt")
def test_modelopt_s_own_reader_loads_the_exports_and_its_eagle3_trains_on_them(captured, tmp_path):
    from safetensors.torch import load_file

    project = captured
    export(project, "modelopt")
    export(project, "modelopt", "export.family=dflash")
    eagle, dflash = (project.data("B3") / f"export-modelopt-{f}" for f in ("eagle3", "dflash"))
    (tmp_path / "reader.py").write_text(READER)
    r = subprocess.run(
        [MODELOPT_PYTHON, str(tmp_path / "reader.py"), str(eagle), str(dflash), str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-4000:]
    items = load_file(str(tmp_path / "items.safetensors"))
    hs = HiddenStates(project.data("B3") / "hidden_states")
    samples = list(hs)
    for name, positions, width in (("eagle3", [0, 2, 3], 3), ("dflash", [0, 1, 2, 3, 4], 5)):
        written = {k.split("/")[1] for k in items if k.startswith(f"{name}/")}
        kept = [s for s in samples if name == "eagle3" or any(a and b for a, b in zip(s.loss_mask, s.loss_mask[1:]))]
        assert len(written) == len(kept), name
        for i, s in enumerate(kept):
            g = {k.rsplit("/", 1)[1]: v for k, v in items.items() if k.startswith(f"{name}/sample_{i}/")}
            n = len(s.input_ids)
            assert torch.equal(g["input_ids"], s.input_ids) and torch.equal(g["loss_mask"], s.loss_mask)
            assert torch.equal(g["labels"][:-1], s.input_ids[1:])  # its own shift of the targets
            aux = s.aux[:, positions].reshape(n, width * hs.hidden_size).to(torch.bfloat16)
            assert torch.equal(g["aux_hidden_states"], aux), (name, i)
            assert torch.equal(g["base_model_hidden_states"], s.final_post_norm.to(torch.bfloat16)), (name, i)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["aux_ids"] == [1, 3, 4] and got["fc_in"] == 3 * hs.hidden_size  # the export's layers, read as such
    before, after = got["losses"]
    assert math.isfinite(before) and after < before, got["losses"]


def test_the_docs_policy_figures_are_the_shard_formula_s():
    """README's and docs/hidden-states.md's policy figures: the policy alone at k = 20 (with the token's id) against
    EAGLE-3's bf16 states (3 layers + the last) at hidden size 4,096, by the formula the shards are written to."""
    from conftest import ROOT

    from draftdata.hidden.shards import bytes_per_token

    policy = bytes_per_token(0, 0, "bfloat16", 20, states=False)
    states = bytes_per_token(3, 4096, "bfloat16")
    ratio = round(states / policy)
    assert (policy, ratio) == (164, 200)
    readme, doc = (" ".join((ROOT / p).read_text().split()) for p in ("README.md", "docs/hidden-states.md"))
    assert f"{policy} bytes a token at k = 20, {ratio}× less than EAGLE-3's states" in readme
    assert f"{policy} bytes a token at k = 20" in doc and f"are {states:,} in bf16: {ratio}× less" in doc
