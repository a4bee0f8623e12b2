"""Every bad value fails before any work with one line that names the key."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from draftdata.config.load import load_config
from draftdata.errors import ConfigError


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("datasets.B3.token_budget=-5", "datasets.B3.token_budget", "positive"),
        ("datasets.B3.token_budget=0", "datasets.B3.token_budget", "positive"),
        ("datasets.B3.token_budget=lots", "datasets.B3.token_budget", "Integer"),
        ("datasets.B3.max_tokens=0", "datasets.B3.max_tokens", "positive"),
        ("datasets.B3.concurrency=-1", "datasets.B3.concurrency", "positive"),
        ("backend.concurrency_per_server=0", "backend.concurrency_per_server", "positive"),
        ("datasets.B3.source.shape=csv_rows", "datasets.B3.source.shape", "unknown source shape"),
        ("datasets.B3.source.path=missing.jsonl", "datasets.B3.source.path", "file not found"),
        ("datasets.B3.on_bad_record=maybe", "datasets.B3.on_bad_record", "fail, skip"),
        ("datasets.B3.on_budget=stop", "datasets.B3.on_budget", "cancel, keep_partial"),
        ("datasets.B3.token_budgte=5", "datasets.B3.token_budgte", "unknown key"),
        ("datasets.B3.sampling.top_p=1.5", "datasets.B3.sampling.top_p", "(0, 1]"),
        ("dataset=B9", "dataset", "unknown dataset"),
        ("tokenize.on_too_long=wrap", "tokenize.on_too_long", "drop, truncate"),
        ("hidden_states.dtype=int4", "hidden_states.dtype", "bfloat16"),
        ("hidden_states.vllm_path=hooks", "hidden_states.vllm_path", "auto, extract or hook"),
        ("run.fail_fast_after=-1", "run.fail_fast_after", ">= 0"),
        ("datasets.B3.template_kwargs=thinking", "datasets.B3.template_kwargs", "Cannot assign str to Dict"),
        ("+datasets.B3.token_budgt=5", "datasets.B3.token_budgt", "did you mean datasets.B3.token_budget?"),
        # a misspelled section is mended as a leaf is
        ("hidden_state.layers=[1,2,3]", "hidden_state.layers", "did you mean hidden_states.layers?"),
        ("+datasets.B3.samplng.top_p=0.5", "datasets.B3.samplng.top_p", "did you mean datasets.B3.sampling.top_p?"),
        ("hidden_states.layers=[]", "hidden_states.layers", "is empty"),
        ("hidden_states.layers=[1,-2]", "hidden_states.layers", "0-based integers"),
        ("model.chat_template=chatmlx", "model.chat_template", "a preset: chatml, hermes_tools, llama3"),
    ],
)
def test_bad_override_names_the_key(project, override, key, words):
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["dataset=B3", override], params_path=project.path / "params.yaml")
    msg = str(exc.value)
    assert msg.startswith(f"{key}:"), msg
    assert words in msg and "\n" not in msg


def test_a_fleets_concurrency_grows_with_its_servers(project):
    """A dataset that sets no `concurrency` gets backend.concurrency_per_server for each server; one that sets it
    keeps it, over all servers."""
    del project.params["datasets"]["B3"]["concurrency"]
    project.save()
    urls = "backend.urls=[http://a:1,http://b:1,http://c:1]"
    fleet = load_config("B3", ["backend.kind=sglang", urls], params_path=project.path / "params.yaml")
    assert fleet.concurrency == 3 * 64
    per = ["backend.kind=sglang", urls, "backend.concurrency_per_server=150"]
    assert load_config("B3", per, params_path=project.path / "params.yaml").concurrency == 450
    assert load_config("B3", params_path=project.path / "params.yaml").concurrency == 64  # embedded: one engine
    own = load_config("B3", [*per, "datasets.B3.concurrency=100"], params_path=project.path / "params.yaml")
    assert own.concurrency == 100


def test_typo_in_params_file_names_key_and_file(project):
    project.params["datasets"]["B3"]["max_tokns"] = 10
    project.save()
    with pytest.raises(
        ConfigError,
        match=r"^datasets\.B3\.max_tokns: unknown key .*; did you mean datasets\.B3\.max_tokens\? .*params\.yaml",
    ):
        load_config("B3", params_path=project.path / "params.yaml")
    # no key of run is near `concurency` (concurrency is a dataset's and the backend's): no guess
    del project.params["datasets"]["B3"]["max_tokns"]
    project.params["run"]["concurency"] = 3
    project.save()
    with pytest.raises(ConfigError, match=r"^run\.concurency: unknown key \([^;]*\) \[from .*params\.yaml\]$"):
        load_config("B3", params_path=project.path / "params.yaml")


def test_missing_budget_is_an_error(project):
    del project.params["datasets"]["B3"]["token_budget"]
    project.save()
    with pytest.raises(ConfigError, match=r"^datasets\.B3\.token_budget:"):
        load_config("B3", params_path=project.path / "params.yaml")


def test_invalid_yaml_names_file_and_line(project):
    (project.path / "params.yaml").write_text("datasets:\n  B3: {source: [unclosed\n")
    with pytest.raises(ConfigError, match=r"params\.yaml:\d+: invalid YAML"):
        load_config("B3", params_path=project.path / "params.yaml")


def test_source_needs_exactly_one_of_path_and_hf_name(project):
    with pytest.raises(ConfigError, match=r"^datasets\.B3\.source: set exactly one"):
        load_config("B3", ["datasets.B3.source.hf_name=org/name"], params_path=project.path / "params.yaml")


def test_values_compose_in_order(project):
    """schema default < params.yaml < command line."""
    cfg = load_config("B3", params_path=project.path / "params.yaml")
    assert cfg.ds.token_budget == 400 and cfg.ds.budget_unit.value == "completion"
    assert cfg.backend.kind.value == "embedded" and cfg.tokenize.max_seq_len == 1024
    cfg = load_config(
        "B3", ["datasets.B3.token_budget=123", "backend=sglang"], params_path=project.path / "params.yaml"
    )
    assert cfg.ds.token_budget == 123 and cfg.backend.kind.value == "sglang" and cfg.backend.urls


def test_cli_prints_one_line_and_exits_2(project):
    proc = subprocess.run(
        [sys.executable, "-m", "stages.prompts", "dataset=B3", "datasets.B3.token_budget=-1"],
        cwd=project.path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: datasets.B3.token_budget: must be a positive integer, got -1"]
    assert not (project.path / "data").exists()  # nothing was produced


def test_shipped_params_compose(monkeypatch):
    """The repository's own params.yaml is valid for every dataset it lists."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(None, params_path=ROOT / "params.yaml", need_dataset=False)
    assert len(cfg.datasets) == 8
    for name in cfg.datasets:
        load_config(name, params_path=ROOT / "params.yaml")


def test_backend_kind_in_params_brings_its_preset(project):
    project.params["backend"] = {"kind": "sglang", "urls": ["http://10.0.0.1:30000"]}
    project.save()
    cfg = load_config("B3", params_path=project.path / "params.yaml")
    assert cfg.backend.kind.value == "sglang" and cfg.backend.urls == ["http://10.0.0.1:30000"]
    assert cfg.backend.startup_timeout_s == 900  # from conf/backend/sglang.yaml
    project.params["backend"] = {"kind": "vllm"}
    project.save()
    with pytest.raises(ConfigError, match=r"^backend\.kind: unknown backend 'vllm'"):
        load_config("B3", params_path=project.path / "params.yaml")
    project.params["backend"] = {"kind": "openai", "urls": ["localhost:8000"]}
    project.save()
    with pytest.raises(ConfigError, match=r"^backend\.urls\[0\]: must start with http"):
        load_config("B3", params_path=project.path / "params.yaml")


def test_missing_model_names_the_key(monkeypatch):
    from draftdata.config.schema import ModelConfig
    from draftdata.model.load import load_model
    from draftdata.model.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for load in (load_model, load_tokenizer):
        # a hub id loads from its cached snapshot: one that is not cached is refused, with the download command
        with pytest.raises(ConfigError, match=r"^model\.path: hub id 'no/such-model-dir' .* hf download "):
            load(ModelConfig(path="no/such-model-dir"))


@pytest.mark.parametrize("override", ["backend=sglang", "backend.kind=sglang"])
def test_backend_on_command_line_selects_its_preset(project, override):
    """The command line's kind wins over params.yaml's, brings its preset's defaults, and params.yaml's other
    backend keys still apply on top."""
    project.params["backend"] = {"kind": "embedded", "urls": ["http://10.0.0.1:30000"]}
    project.save()
    cfg = load_config("B3", [override], params_path=project.path / "params.yaml")
    assert cfg.backend.kind.value == "sglang"
    assert cfg.backend.request_timeout_s == 1800  # conf/backend/sglang.yaml; the schema says 600
    assert cfg.backend.urls == ["http://10.0.0.1:30000"]


def test_both_command_line_forms_compose_the_same(project):
    project.params["backend"] = {"kind": "sglang", "urls": ["http://10.0.0.1:30000"], "max_retries": 2}
    project.save()
    params = project.path / "params.yaml"
    by_group = load_config("B3", ["backend=openai"], params_path=params)
    by_key = load_config("B3", ["backend.kind=openai"], params_path=params)
    assert by_group.backend == by_key.backend
    assert by_group.backend.kind.value == "openai" and by_group.backend.api_key_env == "OPENAI_API_KEY"
    assert by_group.backend.max_retries == 2 and by_group.backend.urls == ["http://10.0.0.1:30000"]
    # one kind named twice is not a conflict
    assert load_config("B3", ["backend=openai", "backend.kind=openai"], params_path=params).backend == by_key.backend


def test_params_backend_keys_are_checked_for_the_chosen_kind(project):
    project.params["backend"] = {"kind": "embedded", "urls": []}
    project.save()
    with pytest.raises(ConfigError, match=r"^backend\.urls: backend\.kind=sglang needs at least one server URL"):
        load_config("B3", ["backend=sglang"], params_path=project.path / "params.yaml")


@pytest.mark.parametrize(
    "kind, name, error",
    [
        ("embedded", "X-Session-Id", "the embedded backend sends no HTTP request"),
        ("sglang", "X Session", "must be an HTTP header name"),
        ("openai", "authorization", "authorization is a header draftdata or HTTP sets itself"),
    ],
)
def test_a_session_header_is_a_header_an_http_backend_can_add(project, kind, name, error):
    urls = [] if kind == "embedded" else ["http://127.0.0.1:30000"]
    project.params["backend"] = {"kind": kind, "urls": urls, "session_header": name}
    project.save()
    with pytest.raises(ConfigError, match=rf"^backend\.session_header: {error}"):
        load_config("B3", [], params_path=project.path / "params.yaml")
    project.set("backend.session_header", None if kind == "embedded" else "X-Session-Id")
    assert load_config("B3", [], params_path=project.path / "params.yaml").backend.session_header in (
        None,
        "X-Session-Id",
    )


@pytest.mark.parametrize("override, key", [("backend=foo", "backend"), ("backend.kind=foo", "backend.kind")])
def test_unknown_backend_on_command_line_is_refused(project, override, key):
    with pytest.raises(ConfigError) as exc:
        load_config("B3", [override], params_path=project.path / "params.yaml")
    msg = str(exc.value)
    assert msg.startswith(f"{key}: unknown backend 'foo'; known: embedded, openai, sglang"), msg
    assert "\n" not in msg


def test_two_backends_on_command_line_are_refused(project):
    with pytest.raises(ConfigError) as exc:
        load_config("B3", ["backend=sglang", "backend.kind=openai"], params_path=project.path / "params.yaml")
    msg = str(exc.value)
    assert msg.startswith("backend: the command line names two backends"), msg
    assert "backend=sglang" in msg and "backend.kind=openai" in msg and "\n" not in msg


def test_cli_refuses_unknown_backend_before_any_work(project):
    proc = subprocess.run(
        [sys.executable, "-m", "stages.prompts", "dataset=B3", "backend=foo"],
        cwd=project.path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: backend: unknown backend 'foo'; known: embedded, openai, sglang [from command line]"
    ]
    assert not (project.path / "data").exists()


@pytest.mark.parametrize(
    "path", ["./models/tiny-lama", "models/tiny-lama", "/nowhere/tiny-llama", "a/b/c", "~/no-such-model-dir"]
)
def test_a_mistyped_local_model_path_fails_at_once(tmp_path, monkeypatch, path):
    """Not after the hub's retries with an error about connecting: the path is named as a missing directory."""
    from draftdata.config.schema import ModelConfig
    from draftdata.model.fingerprint import model_fingerprint
    from draftdata.model.load import load_model
    from draftdata.model.tokenizer import load_tokenizer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # `models/x` then names a local directory, not a hub org
    for call in (
        lambda: load_tokenizer(ModelConfig(path=path)),
        lambda: load_model(ModelConfig(path=path)),
        lambda: model_fingerprint(path, None),
    ):
        with pytest.raises(ConfigError) as err:
            call()
        assert err.value.key == "model.path" and "no such directory" in str(err.value)


def test_hub_ids_still_look_like_hub_ids(tmp_path, monkeypatch):
    from draftdata.model.load import looks_local

    monkeypatch.chdir(tmp_path)
    assert not looks_local("Qwen/Qwen3-8B") and not looks_local("gpt2")
    assert looks_local("./gpt2") and looks_local("/models/x") and looks_local("org/name/sub")


def test_a_section_that_is_not_a_mapping_is_named(tmp_path):
    import yaml

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    cases = [(dict(params, datasets=["B"]), "datasets"), (dict(params, tokenize="drop"), "tokenize")]
    for value in ("enable_thinking", ["enable_thinking"]):  # a dataset's template_kwargs, of any dataset
        bad = copy.deepcopy(params)
        bad["datasets"]["B7_sharegpt"]["template_kwargs"] = value
        cases.append((bad, "datasets.B7_sharegpt.template_kwargs"))
    for bad, key in cases:
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError) as err:
            load_config(None, [], params_path=tmp_path / "params.yaml", need_dataset=False)
        assert err.value.key == key and "mapping" in str(err.value)


def test_top_k_below_minus_one_is_refused():
    from draftdata.config.schema import SamplingConfig

    with pytest.raises(ConfigError) as err:
        SamplingConfig(top_k=-7).check("datasets.D.sampling")
    assert err.value.key == "datasets.D.sampling.top_k"
    for ok in (-1, 0, 50):
        SamplingConfig(top_k=ok).check("datasets.D.sampling")


def test_a_store_path_that_cannot_be_a_store_is_named(tmp_path):
    from draftdata.generate.store import ResponseStore

    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "file" / "store.sqlite", tmp_path):  # under a file; a directory
        with pytest.raises(ConfigError) as err:
            ResponseStore(path)
        assert err.value.key == "run.store_path"


def test_out_of_disk_is_one_line_naming_the_file(tmp_path, capsys):
    import errno
    import sqlite3

    from draftdata.config.load import cli
    from draftdata.util.files import DiskFull, atomic_path

    target = tmp_path / "samples.parquet"
    target.write_text("earlier")
    with pytest.raises(DiskFull) as err:
        with atomic_path(target) as tmp:
            tmp.write_text("partial")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(target) in str(err.value) and target.read_text() == "earlier"
    assert [p.name for p in tmp_path.iterdir()] == ["samples.parquet"]  # no temp file left

    def full(_cfg):
        raise sqlite3.OperationalError("database or disk is full")

    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    import os
    import sys

    cwd, argv = os.getcwd(), sys.argv
    os.chdir(tmp_path)
    sys.argv = ["stage"]
    try:
        with pytest.raises(SystemExit) as exit_:
            cli(full, need_dataset=False)
    finally:
        os.chdir(cwd)
        sys.argv = argv
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err_lines) == 1
    assert "No space left on device" in err_lines[0] and "run.store_path" in err_lines[0]


def test_the_context_follows_rope_scaling_as_servers_do():
    from draftdata.model.load import _context

    assert _context({"max_position_embeddings": 32768}) == 32768
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert _context({"max_position_embeddings": 32768, "rope_scaling": yarn}) == 131072
    llama31 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert _context({"max_position_embeddings": 131072, "rope_scaling": llama31}) == 131072


@pytest.mark.parametrize(
    "backend,setting",
    [
        ({"kind": "embedded"}, {"min_p": 0.1}),
        ({"kind": "embedded"}, {"frequency_penalty": 0.5}),
        ({"kind": "embedded"}, {"extra": {"min_tokens": 4}}),
        ({"kind": "openai", "urls": ["http://127.0.0.1:8000"], "openai_fields_only": True}, {"top_k": 20}),
    ],
)
def test_a_sampling_setting_the_backend_cannot_send_is_refused(tmp_path, backend, setting):
    """No backend drops a setting silently: what it cannot send stops the run at validation."""
    from draftdata.config.schema import BackendConfig, Config, DatasetConfig, SamplingConfig, validate

    name = next(iter(setting))
    cfg = Config(
        datasets={"D": DatasetConfig(sampling=SamplingConfig(**setting))},
        dataset="D",
        backend=BackendConfig(**backend),
    )
    (tmp_path / "p.jsonl").write_text("")
    cfg.ds.source.shape, cfg.ds.source.path, cfg.ds.token_budget = "messages", str(tmp_path / "p.jsonl"), 10
    with pytest.raises(ConfigError) as err:
        validate(cfg, need_dataset=True)
    assert err.value.key == f"datasets.D.sampling.{name}"


def _hub_source(revision):
    return {"shape": "glaive", "hf_name": "glaiveai/glaive-function-calling-v2", "revision": revision}


def test_an_unpinned_hub_source_is_a_warning_of_check_params(project, capsys):
    """DVC hashes the params, not the hub's rows: a source without a commit is named, one line each; a pinned
    source and a local file are not."""
    from conftest import dataset_params

    project.params["datasets"]["B1"] = dataset_params("B1_glaive", "glaive", source=_hub_source(None))
    project.params["datasets"]["B2"] = dataset_params("B1_glaive", "glaive", source=_hub_source("main"))
    project.params["datasets"]["B4"] = dataset_params("B1_glaive", "glaive", source=_hub_source("0123abcd" * 5))
    project.save()
    capsys.readouterr()
    project.run("check_params", None)
    warned = [line for line in capsys.readouterr().out.splitlines() if "warning=" in line]
    assert len(warned) == 2
    assert warned[0].startswith("config warning=datasets.B1.source.revision is None, not a commit hash")
    assert warned[1].startswith("config warning=datasets.B2.source.revision is 'main', not a commit hash")
    assert all("pin the dataset's commit" in line for line in warned)

    del project.params["datasets"]["B1"], project.params["datasets"]["B2"]
    project.save()
    project.run("check_params", None)
    assert "warning=" not in capsys.readouterr().out  # B3 is a local file, B4 a commit


def _lengths_config(tmp_path, **ds):
    """Two datasets (the demo source), a target whose config.json states a context of 1,024, max_seq_len 900."""
    import json

    from conftest import DEMO

    from draftdata.config.schema import Config, DatasetConfig, ModelConfig, SourceConfig, TokenizeConfig

    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    source = SourceConfig(shape="magicoder_oss", path=str(DEMO / "B3_magicoder.jsonl.gz"))
    fits = DatasetConfig(source=source, token_budget=100, max_prompt_tokens=512, max_tokens=256)
    return Config(
        model=ModelConfig(path=str(model)),
        tokenize=TokenizeConfig(max_seq_len=900),
        datasets={"fits": fits, "D": DatasetConfig(source=source, token_budget=100, **ds)},
    )


def test_check_params_warns_of_samples_longer_than_max_seq_len(tmp_path, capsys, monkeypatch):
    """The budget is met on responses and tokenize drops the longer samples, up to max_skip_pct of them without
    failing: check_params says so in one line naming the keys (a warning; the run may accept drops)."""
    from stages.check_params import main

    monkeypatch.chdir(tmp_path)

    main(_lengths_config(tmp_path, max_prompt_tokens=700, max_tokens=256))
    out = capsys.readouterr().out.splitlines()
    (warning,) = [line for line in out if "warning=" in line]
    assert warning.startswith("check_params warning=datasets.D.max_prompt_tokens + datasets.D.max_tokens = 956 ")
    assert "exceeds tokenize.max_seq_len (900)" in warning and "tokenize.max_skip_pct=5%" in warning
    assert out[-1] == "check_params datasets=2 ok=True"

    # longer than the target's context too (read from the local config.json): a second line, for generate
    main(_lengths_config(tmp_path / "b", max_prompt_tokens=900, max_tokens=256))
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning=" in line]
    assert len(warnings) == 2 and "exceeds the target's context (1,024, model.path)" in warnings[1]
    assert "refuses prompts longer than 768" in warnings[1]

    # no limit on prompts: any sample may be too long
    main(_lengths_config(tmp_path / "c", max_prompt_tokens=None, max_tokens=256))
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if "warning=" in line]
    assert "datasets.D.max_prompt_tokens is null" in warning and "may exceed tokenize.max_seq_len (900)" in warning
    assert warning.endswith("set it to at most 644")


def test_check_params_is_quiet_when_every_sample_fits(tmp_path, capsys, monkeypatch):
    from stages.check_params import main

    monkeypatch.chdir(tmp_path)

    main(_lengths_config(tmp_path, max_prompt_tokens=644, max_tokens=256))
    assert capsys.readouterr().out.splitlines() == ["check_params datasets=2 ok=True"]


def test_a_template_ending_the_turn_where_the_target_does_not_stop_fails_first(project, harmony_model):
    """A chat template whose final assistant message ends with gpt-oss's <|end|> (not an eos of the target): the
    first stage of the pipeline, check_params, says so in one line naming the key, the token and the fix, and
    generate refuses it before any request (no store opened)."""
    from conftest import HARMONY_SPECIAL, HARMONY_TEMPLATE

    project.set("model.path", str(harmony_model))
    project.set("hidden_states.layers", [0, 1])  # its two layers: too few for EAGLE-3's default
    project.run("check_params", None)  # the target's own template ends with <|return|>: fine
    closes_with_end = project.path / "closes_with_end.jinja"
    closes_with_end.write_text(HARMONY_TEMPLATE.replace("'<|return|>'", "'<|end|>'"))
    project.set("model.chat_template", str(closes_with_end))
    with pytest.raises(ConfigError) as err:
        project.run("check_params", None)
    message = str(err.value)
    assert message.startswith("model.chat_template: the chat template ends an assistant turn with '<|end|>'")
    end = HARMONY_SPECIAL.index("<|end|>")  # the trainer gives the special tokens the first ids
    assert f"add {end} to eos_token_id in generation_config.json" in message and "\n" not in message

    project.run("prompts", "B3")
    with pytest.raises(ConfigError) as again:
        project.run("generate", "B3")
    assert str(again.value) == message
    assert not (project.path / "store.sqlite").exists()


def test_the_end_of_turn_check_reads_each_datasets_template_kwargs(project, harmony_model):
    """A template that ends the turn with <|end|> only under a kwarg: check_params checks every dataset's kwargs
    (another dataset's too), and generate its own, before any request."""
    from conftest import HARMONY_TEMPLATE

    project.set("model.path", str(harmony_model))
    closes = project.path / "closes.jinja"
    closes.write_text(HARMONY_TEMPLATE.replace("'<|return|>'", "('<|end|>' if close_with_end else '<|return|>')"))
    project.set("model.chat_template", str(closes))
    project.params["datasets"]["B3_end"] = dict(
        project.params["datasets"]["B3"], template_kwargs={"close_with_end": True}
    )
    project.save()
    for dataset in ("B3", "B3_end"):
        project.run("prompts", dataset)
    project.run("generate", "B3", "datasets.B3.token_budget=10")  # its own kwargs end the turn on <|return|>
    for stage, dataset in (("check_params", None), ("generate", "B3_end")):
        with pytest.raises(ConfigError) as err:
            project.run(stage, dataset)
        assert str(err.value).startswith("model.chat_template: the chat template ends an assistant turn with '<|end|>'")


def test_a_mapping_replaces_a_free_form_mapping_from_the_command_line(project):
    """`model.template_kwargs={enable_thinking: false}`, params.yaml's own example, failed with "unknown key"."""
    cfg = load_config(
        None,
        ["model.template_kwargs={enable_thinking: false}", "datasets.B3.sampling.extra={min_tokens: 8}"],
        params_path=project.path / "params.yaml",
        need_dataset=False,
    )
    assert cfg.model.template_kwargs == {"enable_thinking": False}
    assert cfg.datasets["B3"].sampling.extra == {"min_tokens": 8}


def test_a_preset_template_is_taken_by_its_name(tiny_model):
    from draftdata.config.schema import ModelConfig
    from draftdata.model.tokenizer import load_tokenizer

    by_name = load_tokenizer(ModelConfig(path=str(tiny_model), chat_template="chatml"))
    by_file = load_tokenizer(ModelConfig(path=str(tiny_model), chat_template=str(ROOT / "conf/templates/chatml.jinja")))
    assert by_name.chat_template == by_file.chat_template == (ROOT / "conf/templates/chatml.jinja").read_text()


def test_check_params_says_which_token_ends_a_turn(project, capsys, tiny_model):
    from draftdata.config.load import load_config as load
    from stages.check_params import main

    main(load(None, [], params_path=project.path / "params.yaml", need_dataset=False))
    out = capsys.readouterr().out.splitlines()
    assert (
        "check_params end of turn: '<|im_end|>' (2), as the chat template writes it; generation stops on "
        in "\n".join(out)
    )


def test_a_template_for_another_model_is_refused_naming_its_marker(project, tiny_model):
    """Llama 3's template on a ChatML model: `<|eot_id|>` is not one of its tokens, so nothing would stop on it."""
    from draftdata.config.schema import ModelConfig
    from draftdata.model.tokenizer import check_local_target

    model = ModelConfig(path=str(tiny_model), chat_template="llama3")
    with pytest.raises(
        ConfigError, match=r"^model.chat_template: .*'<\|eot_id\|>', which this tokenizer does not hold"
    ):
        check_local_target(model, [{}])


def test_check_params_refuses_a_mistyped_model_path_and_waits_for_one_a_stage_makes(project, tmp_path):
    """`models/smollm2-135m-instuct` where models/ holds the target: refused by check_params, naming the key, before
    DVC deletes any stage's outputs to rerun it; a path dvc.yaml's stage makes (a fresh clone's) passes."""
    (tmp_path / "models").mkdir()
    project.set("model.path", "models/smollm2-135m-instuct")
    with pytest.raises(ConfigError, match=r"^model.path: models/smollm2-135m-instuct: no such directory"):
        project.run("check_params", None)
    stage = {"stages": {"build": {"cmd": "make", "outs": ["models/smollm2-135m-instuct"]}}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(stage))
    project.run("check_params", None)
    assert yaml.safe_load((tmp_path / "data" / "params_checked.json").read_text())["ok"] is True


def test_check_params_refuses_layer_ids_the_target_does_not_have(project):
    """`hidden_states.layers: [1, 3, 40]` on the tiny target: refused by check_params, before any stage's outputs go."""
    project.set("hidden_states.layers", [1, 3, 40])
    with pytest.raises(ConfigError, match=r"^hidden_states\.layers: layer ids \[40\] out of range for the target's"):
        project.run("check_params", None)


def test_a_model_path_one_letter_off_a_directory_names_it(tmp_path, monkeypatch):
    """`models/smollm2-135m-instruc` is a typo of the directory beside it, not a hub id: said at once."""
    from draftdata.model.load import check_model_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^model\.path: .*did you mean models/smollm2-135m-instruct\?"):
        check_model_path("models/smollm2-135m-instruc")
    check_model_path("models/smollm2-135m-instruct")  # the directory itself passes
    check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id with no folder of that name here passes
    (tmp_path / "gpt").mkdir()
    check_model_path("gpt2")  # a bare name is a hub id, though a folder beside it is one letter off
