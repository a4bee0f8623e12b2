"""`model.compute_dtype`: the in-process engines' arithmetic, chosen from the setting, the weights' dtype and the
hardware (never a timing), part of the request key where it is not the weights' own, and recorded on every stored
answer and in the metrics."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from draftdata.config.load import load_config
from draftdata.errors import ConfigError
from draftdata.model import compute


def test_auto_is_the_weights_dtype_where_the_hardware_has_it_else_float32(monkeypatch):
    assert compute.resolve("auto", "float32", on_gpu=False) == "float32"
    assert compute.resolve("auto", "bfloat16", on_gpu=True) == "bfloat16"
    assert compute.resolve("bfloat16", "float32", on_gpu=False) == "bfloat16"  # a setting is taken as it is
    monkeypatch.setattr(compute, "native_16bit", lambda dtype: False)
    assert compute.resolve("auto", "bfloat16", on_gpu=False) == "float32"
    monkeypatch.setattr(compute, "native_16bit", lambda dtype: dtype == "bfloat16")
    assert compute.resolve("auto", "bfloat16", on_gpu=False) == "bfloat16"
    assert compute.resolve("auto", "float16", on_gpu=False) == "float32"


def test_a_bad_compute_dtype_is_refused_naming_the_key(project):
    project.set("model.compute_dtype", "bf16")
    with pytest.raises(ConfigError) as err:
        load_config("B3", [], params_path=project.path / "params.yaml")
    assert "model.compute_dtype" in str(err.value)


def keys(project, *overrides: str) -> set[str]:
    from draftdata.generate.plan.planning import plan_requests
    from draftdata.model.target import load_target
    from draftdata.util.files import read_jsonl

    cfg = load_config("B3", list(overrides), params_path=project.path / "params.yaml")
    prompts = list(read_jsonl(project.data("B3") / "prompts.jsonl"))
    return {p.key for p in plan_requests(cfg, prompts, load_target(cfg, None))}


def test_an_arithmetic_other_than_the_weights_is_keyed_apart_and_a_server_s_is_not_ours(project):
    """The tiny target's weights are float32: computed in float32 its answers keep the keys they always had; in
    bfloat16 they are others' (one key held answers of either before). A server computes in its own dtype: the
    setting does not touch its keys."""
    project.run("prompts", "B3")
    own = keys(project, "model.compute_dtype=float32")
    assert keys(project) == own  # auto, on a float32 model
    assert keys(project, "model.compute_dtype=bfloat16").isdisjoint(own)
    served = ("backend.kind=sglang", "backend.urls=[http://127.0.0.1:9]")
    assert keys(project, *served, "model.compute_dtype=bfloat16") == keys(project, *served)


def generated(project, column: str) -> tuple[set, list | None]:
    """A small generate run: `column` of every stored answer, and the metrics' figure of the same name."""
    project.set("datasets.B3.token_budget", 120)
    project.run("prompts", "B3")
    project.run("generate", "B3")
    with sqlite3.connect(project.path / "store.sqlite") as db:
        stored = {row[0] for row in db.execute(f"SELECT {column} FROM responses")}
    return stored, json.loads((project.data("B3") / "generate_metrics.json").read_text())[column]


def test_every_stored_answer_and_the_metrics_name_the_arithmetic(project):
    assert generated(project, "compute_dtype") == ({"float32"}, ["float32"])


def test_states_computed_in_another_dtype_are_keyed_apart_and_vllm_s_are_not_ours(project):
    """The hf engine computes the target itself: its states in bfloat16 (the tiny target's weights are float32) are
    others than its float32 ones; vLLM's arithmetic is its own (its `dtype` option), not this setting's."""
    from draftdata.hidden.compute import state_settings

    def model_of(*overrides: str) -> str:
        cfg = load_config("B3", list(overrides), params_path=project.path / "params.yaml")
        return state_settings(cfg, [1, 3, 4])["model"]

    assert model_of() == model_of("model.compute_dtype=float32")
    assert model_of("model.compute_dtype=bfloat16") != model_of()
    vllm = "hidden_states.backend=vllm"
    assert model_of(vllm, "model.compute_dtype=bfloat16") == model_of(vllm)


def test_states_vllm_computes_quantized_or_in_another_dtype_are_keyed_apart(project):
    """`hidden_states.vllm_kwargs` that change vLLM's arithmetic (dtype, quantization, the KV cache's dtype) key its
    states apart: fp8 states are never reused as, or mixed with, the ones computed in the weights' dtype. vLLM's
    defaults (absent or auto) keep the weights' fingerprint, the one the hf engine's states have here."""
    from draftdata.hidden.compute import state_settings

    def model_of(**vllm_kwargs) -> str:
        overrides = ["hidden_states.backend=vllm"]
        overrides += [f"+hidden_states.vllm_kwargs.{k}={v}" for k, v in vllm_kwargs.items()]
        cfg = load_config("B3", overrides, params_path=project.path / "params.yaml")
        return state_settings(cfg, [1, 3, 4])["model"]

    default = model_of()
    hf = state_settings(load_config("B3", [], params_path=project.path / "params.yaml"), [1, 3, 4])["model"]
    assert default == hf == model_of(dtype="auto") == model_of(quantization="auto")
    assert model_of(dtype="float32") == default  # the tiny target's weights are float32: its own arithmetic
    others = [
        model_of(dtype="bfloat16"),
        model_of(quantization="fp8"),
        model_of(kv_cache_dtype="fp8"),
        model_of(quantization="fp8", kv_cache_dtype="fp8"),
    ]
    assert len({default, *others}) == 5
    assert model_of(dtype="half") == model_of(dtype="float16") != model_of(dtype="bfloat16")


def _fp8_copy(tiny_model, tmp_path):
    import shutil

    out = tmp_path / "fp8"
    shutil.copytree(tiny_model, out)
    conf = json.loads((out / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(conf))
    return out


def test_a_quantized_target_is_never_cast_by_an_in_process_engine(project, tiny_model, tmp_path, monkeypatch):
    """An FP8 checkpoint cast to another dtype loses its scales with no error: the embedded backend (which always
    casts and packs the weights itself) refuses it where its target is loaded, the hf engine refuses a compute dtype
    other than the weights', both before a weight is read; at the weights' own dtype the hf engine goes on to load
    it."""
    from draftdata.config.schema import ModelConfig
    from draftdata.hidden.engines.hf import HFEngine
    from draftdata.model import load
    from draftdata.model.target import load_target

    fp8 = _fp8_copy(tiny_model, tmp_path)
    assert compute.quantization_method(ModelConfig(path=str(fp8))) == "fp8"
    assert compute.quantization_method(ModelConfig(path=str(tiny_model))) is None
    loads = []
    monkeypatch.setattr(load, "load_model", lambda *a, **k: loads.append(a) or (_ for _ in ()).throw(RuntimeError))

    cfg = load_config("B3", [f"model.path={fp8}"], params_path=project.path / "params.yaml")
    with pytest.raises(ConfigError, match=r"^backend\.kind: embedded cannot run .*fp8.* \(fp8\)"):
        load_target(cfg, None)
    with pytest.raises(ConfigError, match=r"^model\.compute_dtype: .* is quantized \(fp8\): computing it in bfloat16"):
        HFEngine(ModelConfig(path=str(fp8), compute_dtype="bfloat16"), [1])
    assert not loads
    with pytest.raises(RuntimeError):  # its own dtype (the tiny target's float32): no refusal, the load is reached
        HFEngine(ModelConfig(path=str(fp8), compute_dtype="float32"), [1])
    assert len(loads) == 1


def test_the_attention_fallback_is_logged_once_and_every_row_names_the_path(project, monkeypatch, capsys):
    """Where the decode-attention kernel cannot be built, one line says so and why, once a process; every answer's
    row and the metrics name the path that computed it (the kernel and its reference round apart)."""
    from draftdata.generate.embedded import attention

    def no_compiler(source):
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(attention, "_library", no_compiler)
    monkeypatch.setattr(attention, "_built", {})
    assert attention.kernel() is None and attention.kernel() is None
    lines = [x for x in capsys.readouterr().out.splitlines() if "decode-attention kernel is not used" in x]
    assert len(lines) == 1 and "c++: command not found" in lines[0]

    assert generated(project, "attention") == ({"reference"}, ["reference"])


def test_the_kernel_build_is_said_once_a_machine(tmp_path, monkeypatch, capsys):
    """A build (about a minute on a small CPU) says so before it starts and when it is done; a cached library is
    loaded without a word."""
    from torch.utils import cpp_extension

    from draftdata.generate.embedded import attention

    def build(name, cpp_sources, extra_cflags, build_directory, is_python_module):  # the compiler's output, faked
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load_inline", build)
    first = attention._library("source")
    said = capsys.readouterr().out
    assert "building the decode-attention kernel" in said and "decode-attention kernel built in" in said
    assert attention._library("source") == first and first.exists()
    assert capsys.readouterr().out == ""
