"""Chat-format answers from a server that runs a tool-call or reasoning parser (bench/fake_server.py's `parsed`,
the fields and stream pieces vLLM and SGLang send): the tool calls and the thinking are stored with the response,
and tokenize renders them back through the chat template, so a sample is the answer the model gave. A template
that cannot render a part refuses the run rather than store another answer."""

from __future__ import annotations

import json
import sqlite3

import pyarrow.parquet as pq
import pytest
from conftest import dataset_params, expected_tokens, trained_text

from bench.fake_server import FakeModel, FakeServer
from draftdata.errors import UserError
from draftdata.generate.run.dispatcher import RunFailed
from draftdata.generate.store import ResponseStore, StoredResponse
from draftdata.model.tiny import CHAT_TEMPLATE
from draftdata.util.files import read_jsonl

CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
THINKING = "The user asks something. Let me think it through step by step."
# the tiny template, plus the thinking of an assistant turn as Qwen3's template writes it
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}",
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}{{- message.content or '' }}",
)
# a ChatML template that writes no tool calls
PLAIN_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture
def chat_project(project, tiny_model):
    servers: list[FakeServer] = []

    def start(parsed: dict, flavour: str = "vllm", stream: bool = False, template: str | None = None):
        if template is not None:
            (project.path / "template.jinja").write_text(template)
            project.set("model.chat_template", str(project.path / "template.jinja"))
        srv = FakeServer(FakeModel(stop_after=5), model_path=str(tiny_model), openai_flavour=flavour, parsed=parsed)
        servers.append(srv.start())
        project.params["backend"] = {
            "kind": "openai",
            "urls": [srv.url],
            "prompt_format": "chat",
            "return_token_ids": False,
            "stream": stream,
            "request_timeout_s": 30.0,
        }
        project.params["run"]["fail_fast_after"] = 4
        project.save()
        return srv

    project.params["datasets"] = {"B1": dataset_params("B1_glaive", "glaive", token_budget=60, max_prompts=30)}
    project.save()
    project.run("prompts", "B1")
    yield project, start
    for srv in servers:
        srv.stop()


def responses(project) -> list[dict]:
    return list(read_jsonl(project.data("B1") / "responses.jsonl"))


def samples(project) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(project.data("B1") / "samples.parquet").to_pylist()}


def tokenizer(project):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(project.params["model"]["path"])
    if project.params["model"].get("chat_template"):
        tok.chat_template = open(project.params["model"]["chat_template"]).read()
    return tok


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_tool_calls_are_stored_and_rendered_into_the_sample(chat_project, stream):
    project, start = chat_project
    start({"tool_calls": [CALL]}, stream=stream)
    project.run("generate", "B1")
    project.run("tokenize", "B1")
    tok, recs, built = tokenizer(project), responses(project), samples(project)
    with_tools = [r for r in recs if r.get("tools")]
    assert with_tools and len(built) == len(recs)
    for rec in recs:
        if not rec.get("tools"):  # no tools offered: no parser ran, the answer is its text
            assert "tool_calls" not in rec
            continue
        (call,) = rec["tool_calls"]
        assert call["type"] == "function" and call["function"] == CALL and call["id"].startswith("chatcmpl-tool-")
        assert rec["text"].strip()  # the prose before the call stays the text
        answer = {"role": "assistant", "content": rec["text"], "tool_calls": rec["tool_calls"]}
        assert built[rec["id"]]["input_ids"] == expected_tokens(tok, rec, answer)
        assert '"name": "get_weather"' in trained_text(tok, built[rec["id"]])


def test_tool_choice_goes_only_with_the_prompts_that_offer_tools(chat_project):
    """`sampling.extra.tool_choice` is a setting of the dataset (in its key), but a server refuses it on a request
    without tools: a dataset that mixes prompts with and without tools sends it with the first kind only."""
    project, start = chat_project
    project.params["datasets"]["B1"]["sampling"]["extra"] = {"tool_choice": "required"}
    srv = start({"tool_calls": [CALL]})
    project.run("generate", "B1")
    sent = [a.body for a in srv.log]
    assert {"tools" in b for b in sent} == {True, False}  # both kinds were sent
    assert all(("tool_choice" in b) == ("tools" in b) for b in sent)
    assert all(a.status == 0 for a in srv.log)
    assert any(r.get("tool_calls") for r in responses(project))


@pytest.mark.parametrize(
    "flavour,stream", [("vllm", False), ("vllm", True), ("sglang", True)], ids=["vllm", "vllm-streamed", "sglang"]
)
def test_reasoning_is_stored_and_rendered_into_the_sample(chat_project, flavour, stream):
    project, start = chat_project
    start({"reasoning": THINKING}, flavour=flavour, stream=stream, template=THINKING_TEMPLATE)
    project.run("generate", "B1")
    project.run("tokenize", "B1")
    tok, recs, built = tokenizer(project), responses(project), samples(project)
    assert recs and len(built) == len(recs)
    for rec in recs:
        assert rec["reasoning_content"] == THINKING
        answer = {"role": "assistant", "content": rec["text"], "reasoning_content": THINKING}
        assert built[rec["id"]]["input_ids"] == expected_tokens(tok, rec, answer)
        assert trained_text(tok, built[rec["id"]]).startswith(f"<think>\n{THINKING}\n</think>")


def test_reasoning_the_template_drops_is_refused_not_stored(chat_project):
    project, start = chat_project
    srv = start({"reasoning": THINKING})  # the tiny template writes no thinking
    with pytest.raises(RunFailed, match="unrenderable: a server parser moved the answer's reasoning"):
        project.run("generate", "B1")
    assert srv.log  # the answers came, and none was stored as its text alone
    with sqlite3.connect(project.path / "store.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 0
        assert {r for (r,) in db.execute("SELECT reason FROM failures")} == {"unrenderable"}


def test_tools_with_a_template_that_drops_tool_calls_are_refused_before_any_request(chat_project):
    project, start = chat_project
    srv = start({"tool_calls": [CALL]}, template=PLAIN_TEMPLATE)
    with pytest.raises(UserError, match="drops tool_calls") as info:
        project.run("generate", "B1")
    assert "\n" not in str(info.value) and not srv.log


def test_token_ids_back_need_no_rendering(chat_project):
    project, start = chat_project
    srv = start({"tool_calls": [CALL]}, template=PLAIN_TEMPLATE)
    project.set("backend.return_token_ids", True)  # the ids are the sample: nothing to render
    project.run("generate", "B1")
    assert srv.log and all(r["tool_calls"] for r in responses(project) if r.get("tools"))


def test_a_store_written_before_these_columns_opens_and_takes_them(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:  # the responses table as earlier versions made it
        db.execute(
            "CREATE TABLE responses (key TEXT PRIMARY KEY, dataset TEXT NOT NULL, prompt_id TEXT NOT NULL, "
            "prompt_ids TEXT, output_ids TEXT, text TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, "
            "completion_tokens INTEGER NOT NULL, finish_reason TEXT NOT NULL, server TEXT NOT NULL, "
            "latency_s REAL NOT NULL, created_at REAL NOT NULL)"
        )
        db.execute("INSERT INTO responses VALUES ('old', 'B1', 'p0', NULL, '[5]', 'hi', 3, 1, 'stop', 's', 0.1, 0)")
    store = ResponseStore(path)
    calls = [{"id": "c", "type": "function", "function": CALL}]
    store.put(StoredResponse("new", "B1", "p1", "", 3, 4, "stop", "s", 0.1, tool_calls=calls, reasoning="r"))
    got = store.get_many(["old", "new"])
    store.close()
    assert (got["old"].text, got["old"].tool_calls, got["old"].reasoning) == ("hi", None, None)
    assert (got["new"].tool_calls, got["new"].reasoning) == (calls, "r")
    assert json.loads(json.dumps(got["new"].tool_calls)) == calls
