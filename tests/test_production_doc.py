"""docs/production.md's params.yaml loads with the project's schema for every dataset, passes every value check,
names the DVC params dvc.yaml declares, and agrees with the disk arithmetic written beside it."""

from __future__ import annotations

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
