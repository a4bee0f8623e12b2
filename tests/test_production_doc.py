"""docs/production.md's params.yaml loads with the project's schema for every dataset, passes every value check,
names the DVC params dvc.yaml declares, and agrees with the disk arithmetic written beside it."""

from __future__ import annotations

import json
import re
from urllib.parse import urlsplit

import pytest
import yaml
from conftest import ROOT

from draftdata.config.load import load_config
from draftdata.config.schema import BackendKind, BudgetUnit, check_all

DOC = ROOT / "docs" / "production.md"
DATASETS = [
    "B1_glaive",
    "B2_opencodeinstruct",
    "B3_magicoder",
    "B4_mixture_of_thoughts",
    "B5_openthoughts",
    "B6_ultrachat",
    "B7_sharegpt",
    "B8_sweagent",
]
HF_NAMES = {
    "glaiveai/glaive-function-calling-v2": "glaive",
    "nvidia/OpenCodeInstruct": "opencodeinstruct",
    "ise-uiuc/Magicoder-OSS-Instruct-75K": "magicoder_oss",
    "open-r1/Mixture-of-Thoughts": "messages",
    "open-thoughts/OpenThoughts-114k": "conversations",
    "HuggingFaceH4/ultrachat_200k": "messages",
    "Aeala/ShareGPT_Vicuna_unfiltered": "conversations",
    "nebius/SWE-agent-trajectories": "swe_agent",
}
HIDDEN_SIZE, AUX_LAYERS = 7168, 3  # the target the doc's arithmetic is for


def doc_yaml() -> str:
    blocks = re.findall(r"^```yaml\n(.*?)^```$", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, "docs/production.md must hold exactly one ```yaml block: the params.yaml"
    return blocks[0]


@pytest.fixture(scope="module")
def params_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("production") / "params.yaml"
    path.write_text(doc_yaml())
    return path


@pytest.fixture(scope="module")
def params(params_path) -> dict:
    return yaml.safe_load(params_path.read_text())


def test_the_eight_datasets_come_from_the_hub(params):
    assert list(params["datasets"]) == DATASETS
    sources = {ds["source"]["hf_name"]: ds["source"]["shape"] for ds in params["datasets"].values()}
    assert sources == HF_NAMES
    assert all("path" not in ds["source"] for ds in params["datasets"].values())


@pytest.mark.parametrize("dataset", DATASETS)
def test_loads_with_the_schema_and_passes_the_value_checks(params_path, dataset):
    # HF sources: DatasetConfig.check looks for no local file, so every value check runs here as in production
    cfg = load_config(dataset, params_path=params_path, need_dataset=True)
    assert cfg.dataset == dataset and cfg.ds.source.hf_name in HF_NAMES
    check_all(cfg)  # what the check_params stage runs: every dataset's values
    assert cfg.ds.budget_unit == BudgetUnit.total  # the disk arithmetic counts prompt + completion tokens
    # no sample is dropped for its length: the longest prompt plus the longest response fit max_seq_len
    assert cfg.ds.max_prompt_tokens + cfg.ds.max_tokens <= cfg.tokenize.max_seq_len


def test_production_settings(params_path):
    cfg = load_config(None, params_path=params_path, need_dataset=False)
    assert cfg.backend.kind == BackendKind.sglang and len(cfg.backend.urls) >= 1
    assert cfg.hidden_states.backend == "vllm"
    assert cfg.hidden_states.tensor_parallel_size * cfg.hidden_states.data_parallel_size == 8
    assert cfg.hidden_states.layers is None  # EAGLE-3's default: k = 3 aux layers, as the arithmetic assumes
    assert cfg.run.store_path == ".draftdata/store.sqlite"  # local, inside the project: same file system


def test_placeholders_are_only_the_model_path_and_the_server_urls(params):
    assert params["model"]["path"] == "/models/target"
    hosts = [urlsplit(url).hostname for url in params["backend"]["urls"]]
    assert hosts and all(re.fullmatch(r"gpu-node(-\d+)?", host) for host in hosts)
    text = DOC.read_text()
    assert not re.search(r"<(your|YOUR|path|host|bucket|model)[^>]*>", text)


def test_every_dvc_param_is_in_the_params(params):
    """DVC stops on a declared param that params.yaml lacks (the demo's tiny_model stage included)."""
    declared = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in declared.items():
        body = stage.get("do", stage)
        for key in sorted({k.replace("${key}", d) for k in body.get("params", []) for d in DATASETS}):
            node = params
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"{name}: params.yaml has no {key}"
                node = node[part]


def test_disk_arithmetic_matches_the_budgets(params):
    text = " ".join(DOC.read_text().split())  # sentences may wrap anywhere
    bf16 = 2 * (AUX_LAYERS + 1) * HIDDEN_SIZE
    fp8 = (AUX_LAYERS + 1) * HIDDEN_SIZE + 4 * (AUX_LAYERS + 1)
    assert f"{bf16:,} bytes a token" in text and f"{fp8:,} bytes a token" in text
    total = 0
    for name, ds in params["datasets"].items():
        budget = ds["token_budget"]
        total += budget
        row = f"| {name} | {budget:,} | {budget * bf16 / 1e9:,.1f} GB | {budget * fp8 / 1e9:,.1f} GB |"
        assert row in text, f"the disk table's row for {name} should read: {row}"
    assert (
        f"In all: {total:,} tokens, {total * bf16 / 1e9:,.1f} GB in bfloat16, {total * fp8 / 1e9:,.1f} GB in fp8"
        in text
    )


def test_every_source_says_to_pin_its_revision(params_path, capsys):
    """The recipe cannot know the commits to pin: each source's `revision` says so, and check_params names each."""
    lines = [line for line in doc_yaml().splitlines() if line.strip().startswith("revision:")]
    sources = [line for line in lines if line.startswith("      ")]
    assert len(sources) == len(DATASETS)
    assert all("pin: the dataset's commit hash" in line for line in sources)
    capsys.readouterr()
    check_all(load_config(None, params_path=params_path, need_dataset=False))
    warned = [line for line in capsys.readouterr().out.splitlines() if "warning=" in line]
    assert [line.split("warning=")[1].split(".source.revision")[0] for line in warned] == [
        f"datasets.{d}" for d in DATASETS
    ]


def test_time_arithmetic_is_what_plan_computes(params_path, monkeypatch, tmp_path):
    """Section 1's generation times are `draftdata plan plan.tok_s=10000`'s own, on an empty store (nothing to reuse,
    no prompts stage run: every budget is still to generate)."""
    from draftdata.cli.costs import Options, plan_dataset
    from draftdata.cli.plan_table import fmt_duration

    cfg = load_config(None, params_path=params_path, need_dataset=False)
    monkeypatch.chdir(tmp_path)  # no data/<D>/ here: nothing generated yet
    text = " ".join(DOC.read_text().split())
    total = 0.0
    for name in DATASETS:
        plan = plan_dataset(cfg, name, None, None, None, Options(tok_s=10_000))
        assert plan.to_generate == plan.budget
        total += plan.gpu_s
        duration = fmt_duration(plan.gpu_s)
        assert re.search(rf"{duration} for (\w+ and )?{name}\b", text), f"{name}: plan says {duration}"
    budgets = sum(ds.token_budget for ds in cfg.datasets.values())
    assert f"{fmt_duration(total)} in all, {budgets:,} ÷ 10,000 = {budgets // 10_000:,} s" in text
    assert f"{fmt_duration(2 * total)} with `plan.tok_s=5000`" in text
    # the capture's compute at section 5's rate, and eight loads of a 1 TB checkpoint at 2 GB/s
    assert f"{budgets:,} ÷ (N × R) seconds on N nodes: {budgets // 20_000:,} s" in text
    assert f"eight loads {8 * 10**12 // (2 * 10**9):,} s" in text


def test_the_moe_vllm_kwargs_example_loads(params_path, tmp_path):
    """Section 8's hidden_states example, put into the doc's params.yaml, loads and passes the checks; its
    vllm_kwargs are among the EngineArgs fields the section names."""
    text = DOC.read_text()
    blocks = [b for b in re.findall(r"^```text\n(.*?)^```$", text, re.S | re.M) if b.startswith("hidden_states:")]
    assert len(blocks) == 1
    example = yaml.safe_load(blocks[0])["hidden_states"]
    params = yaml.safe_load(params_path.read_text())
    params["hidden_states"].update(example)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    cfg = load_config(None, params_path=path, need_dataset=False)
    check_all(cfg)
    assert cfg.hidden_states.vllm_kwargs == example["vllm_kwargs"]
    named = re.search(
        r"a field of vLLM's `EngineArgs` \(`vllm/engine/arg_utils.py`\): ([^.]*)\.", " ".join(text.split())
    )
    assert named and set(example["vllm_kwargs"]) <= set(re.findall(r"`(\w+)`", named.group(1)))


def test_a_quantized_checkpoint_is_another_target(tmp_path):
    """Section 8: the stores key by the fingerprint of every file of model.path, so a checkpoint that differs only
    in config.json's quantization_config is another target; the same files elsewhere are the same one."""
    from draftdata.model.fingerprint import model_fingerprint

    config = {"model_type": "llama", "hidden_size": 64, "torch_dtype": "bfloat16"}
    fp = {}
    for name, quant in (("bf16", None), ("bf16-copy", None), ("fp8", {"quant_method": "fp8"})):
        folder = tmp_path / name
        folder.mkdir()
        conf = dict(config, **({"quantization_config": quant} if quant else {}))
        (folder / "config.json").write_text(json.dumps(conf))
        (folder / "model.safetensors").write_bytes(b"weights")
        fp[name] = model_fingerprint(str(folder), None)
    assert fp["bf16"] == fp["bf16-copy"] != fp["fp8"]


def test_the_capture_passes_trust_remote_code_on_to_vllm():
    """Section 8: model.trust_remote_code reaches vllm.LLM without a vllm_kwargs key of its own (one wins)."""
    from draftdata.config.schema import ModelConfig
    from draftdata.hidden.engines.vllm import engine_kwargs

    assert engine_kwargs(ModelConfig(path="m"), {"enable_expert_parallel": True}) == {"enable_expert_parallel": True}
    trusting = ModelConfig(path="m", trust_remote_code=True)
    assert engine_kwargs(trusting, None) == {"trust_remote_code": True}
    assert engine_kwargs(trusting, {"trust_remote_code": False}) == {"trust_remote_code": False}
    assert "`model.trust_remote_code: true`" in DOC.read_text()
