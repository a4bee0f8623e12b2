"""Secrets and untrusted input: an API key goes only to the server, a template runs sandboxed, a model's own
code runs only when asked for, a server URL or key setting that cannot be right is refused in one line."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from bench.fake_server import FakeServer
from draftdata.config.schema import BackendConfig, BackendKind, ModelConfig
from draftdata.errors import ConfigError


def test_a_planted_key_reaches_the_server_and_nowhere_else(project, capfd, tiny_model, monkeypatch):
    """The key is named in params.yaml by its variable; after the whole chain, it is in no file the project holds
    (params, outputs, metrics, both stores) nor in anything printed, yet every request carried it."""
    secret = f"sk-planted-{uuid.uuid4().hex}"
    monkeypatch.setenv("DRAFTDATA_PLANTED_KEY", secret)
    server = FakeServer(model_path=str(tiny_model), stop_after=6).start()
    try:
        project.params["backend"] = {"kind": "sglang", "urls": [server.url], "api_key_env": "DRAFTDATA_PLANTED_KEY"}
        project.set("datasets.B3.token_budget", 60)
        for stage in ("prompts", "generate", "tokenize", "hidden_states"):
            project.run(stage, "B3")
    finally:
        server.stop()
    assert server.authorizations and set(server.authorizations) == {f"Bearer {secret}"}
    files = [p for p in project.path.rglob("*") if p.is_file()]
    assert any(p.name == "store.sqlite" for p in files) and any(p.suffix == ".safetensors" for p in files)
    leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
    printed = capfd.readouterr()
    assert not leaked and secret not in printed.out + printed.err


@pytest.mark.parametrize("value", ["sk-abc123def456", "Bearer xyz", "my key"])
def test_a_key_pasted_into_api_key_env_is_refused_without_echo(value):
    cfg = BackendConfig(kind=BackendKind.openai, urls=["http://127.0.0.1:8000"], api_key_env=value)
    with pytest.raises(ConfigError) as err:
        cfg.check("backend")
    assert err.value.key == "backend.api_key_env" and value not in str(err.value) and "NAME" in str(err.value)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("127.0.0.1:8000", "http:// or https://"),
        ("ftp://host:1", "http:// or https://"),
        ("http://", "no host"),
        ("http://host:port", "port"),
        ("http://host:99999", "port"),
        ("http://host :8000", "without spaces"),
        ("http://host:8000/?x=1", "base URL"),
    ],
)
def test_server_urls_are_validated(url, says):
    cfg = BackendConfig(kind=BackendKind.sglang, urls=["http://127.0.0.1:30000", url])
    with pytest.raises(ConfigError) as err:
        cfg.check("backend")
    assert err.value.key == "backend.urls[1]" and says in str(err.value) and "\n" not in str(err.value)
    BackendConfig(kind=BackendKind.sglang, urls=["http://127.0.0.1:30000", "https://gpu-3.cluster:8443/sglang"]).check(
        "backend"
    )


def test_chat_templates_render_in_a_sandbox(tiny_model, tmp_path):
    """A template (a file from a model repository or params) cannot reach Python internals."""
    from jinja2.exceptions import SecurityError

    from draftdata.model.tokenizer import load_tokenizer, render_prompt_ids

    evil = tmp_path / "evil.jinja"
    evil.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    tok = load_tokenizer(ModelConfig(path=str(tiny_model), chat_template=str(evil)))
    with pytest.raises(SecurityError):
        render_prompt_ids(tok, [{"role": "user", "content": "hi"}], None, {})


def test_a_model_s_own_code_runs_only_when_trusted(tiny_model, tmp_path):
    """A checkpoint that ships Python (auto_map) is refused with the key to set; with it set, its code runs."""
    from draftdata.model.load import load_model

    model = tmp_path / "custom"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "custom_config.CustomConfig",
        "AutoModelForCausalLM": "custom_model.CustomForCausalLM",
    }
    config["model_type"] = "custom_llama"
    (model / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran.txt"
    (model / "custom_config.py").write_text(
        "from pathlib import Path\nfrom transformers import LlamaConfig\n"
        f"Path({str(marker)!r}).write_text('ran')\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom_llama'\n"
    )
    (model / "custom_model.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .custom_config import CustomConfig\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(path=str(model)))
    assert err.value.key == "model.trust_remote_code" and not marker.exists()
    net = load_model(ModelConfig(path=str(model), trust_remote_code=True))
    assert type(net).__name__ == "CustomForCausalLM" and marker.read_text() == "ran"
