"""tokenize@D over conversations regenerated turn by turn (`turns: all`): the responses of each test are built by
replaying a conversation over a store of the target's answers (each turn's prompt ids really are the earlier
prompt, the answer and what the template adds), with the demo's tiny tokenizer and the shipped templates on the
golden tokenizer. Golden masks: a prefix-stable conversation is one sample with every answer trained; a template
that drops earlier reasoning gives one sample per turn, the ids that turn was sent."""

from __future__ import annotations

import itertools

import pytest
from test_conversation import chat_conv, drive, golden, make_golden, target, tool_conv

from draftdata.config.schema import Config, ModelConfig, OnTooLong, TokenizeConfig, TrainOn
from draftdata.generate.land.output import output_record
from draftdata.hidden.reader import HiddenStates
from draftdata.tokenize.samples import build_samples, from_ids
from draftdata.util.files import write_jsonl

CHAT = ("What is the capital of France?", "Paris.", "And Spain?", "Madrid.", "Italy?", "Rome.")
ANSWERS = ["It is Paris, of course.", "Madrid is.", "Rome, the eternal city."]


def responses(r, ids: bool = True) -> list[dict]:
    """responses.jsonl lines of a replayed conversation, as generate writes them (without ids: a text-only server)."""
    lines = []
    for p, s in r.done:
        line = {**output_record(p, s), "conversation": p.prompt["conversation"], "turn": p.prompt["turn"]}
        if not ids:
            line.update(prompt_ids=None, output_ids=None)
        lines.append(line)
    lines[-1]["end_reason"] = r.ended
    return lines


def config(tmp_path, **tokenize) -> Config:
    """A target without generation config: its tokenizer's eos ends the turn (the golden tokenizers')."""
    return Config(model=ModelConfig(path=str(tmp_path)), tokenize=TokenizeConfig(**{"max_seq_len": 4096, **tokenize}))


def runs(tok, ids: list[int], mask: list[int]) -> list[tuple[int, str]]:
    """The sample as (mask value, decoded text) runs: where each trained span starts and ends, exactly."""
    out, at = [], 0
    for value, group in itertools.groupby(mask):
        n = len(list(group))
        out.append((value, tok.decode(ids[at : at + n], skip_special_tokens=False)))
        at += n
    return out


def trained(tok, sample) -> list[str]:
    return [text for value, text in runs(tok, sample.input_ids, sample.loss_mask) if value]


def tiny_target(path):
    from transformers import AutoTokenizer

    return target(AutoTokenizer.from_pretrained(path))


def eot(t) -> str:
    return t.tok.eos_token


@pytest.mark.parametrize("template", ["tiny", "chatml", "hermes_tools", "llama3"])
def test_a_prefix_stable_conversation_is_one_sample_with_every_answer_trained(template, request, tmp_path):
    t = tiny_target(request.getfixturevalue("tiny_model")) if template == "tiny" else golden(template)
    r, _ = drive(chat_conv(*CHAT), t, ANSWERS)
    lines = responses(r)
    samples, tally = build_samples(lines, t.tok, config(tmp_path))
    assert len(samples) == 1 and tally.conversations == 1 and tally.per_turn == 0 and not tally.skipped
    (s,) = samples
    last = lines[-1]
    # the whole conversation as the server saw its last turn, every answer trained where it stands
    assert s.input_ids == last["prompt_ids"] + last["output_ids"]
    assert trained(t.tok, s) == [a + eot(t) for a in ANSWERS]
    assert sum(s.loss_mask) == sum(line["completion_tokens"] for line in lines)
    assert (s.id, s.conversation, s.turn, s.responses) == (last["id"], "conv-1", 2, 3)
    # untrained: the template's text around the answers, the source's user turns in it
    context = [text for value, text in runs(t.tok, s.input_ids, s.loss_mask) if not value]
    assert len(context) == 3 and all(q in c for q, c in zip(CHAT[::2], context))


def test_golden_mask_chatml(tmp_path):
    t = golden("chatml")
    r, _ = drive(chat_conv(*CHAT), t, ANSWERS)
    (s,), _ = build_samples(responses(r), t.tok, config(tmp_path))
    start, end = "<|im_start|>", "<|im_end|>"
    assert runs(t.tok, s.input_ids, s.loss_mask) == [
        (0, f"{start}system\nYou are a concise assistant.{end}\n{start}user\n{CHAT[0]}{end}\n{start}assistant\n"),
        (1, f"{ANSWERS[0]}{end}"),
        (0, f"\n{start}user\n{CHAT[2]}{end}\n{start}assistant\n"),
        (1, f"{ANSWERS[1]}{end}"),
        (0, f"\n{start}user\n{CHAT[4]}{end}\n{start}assistant\n"),
        (1, f"{ANSWERS[2]}{end}"),
    ]


def test_golden_mask_llama3(tmp_path):
    t = golden("llama3")
    r, _ = drive(chat_conv(*CHAT), t, ANSWERS)
    (s,), _ = build_samples(responses(r), t.tok, config(tmp_path))
    got = runs(t.tok, s.input_ids, s.loss_mask)
    assert [v for v, _ in got] == [0, 1, 0, 1, 0, 1]
    assert [text for v, text in got if v] == [a + "<|eot_id|>" for a in ANSWERS]
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert got[2][1] == header.format("user") + CHAT[2] + "<|eot_id|>" + header.format("assistant")
    assert got[0][1].endswith(CHAT[0] + "<|eot_id|>" + header.format("assistant"))


def test_golden_mask_hermes_tools_with_a_matching_call(tmp_path):
    """The call's answer, the answer after its result and the last one: all trained; the result is context."""
    t = golden("hermes_tools")
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    r, _ = drive(tool_conv(), t, [written, "18 degrees.", "Any time."])
    lines = responses(r)
    assert [line["turn"] for line in lines] == [0, 1, 2] and lines[-1]["end_reason"] == "source_exhausted"
    (s,), _ = build_samples(lines, t.tok, config(tmp_path))
    got = runs(t.tok, s.input_ids, s.loss_mask)
    assert [text for v, text in got if v] == [written + "<|im_end|>", "18 degrees.<|im_end|>", "Any time.<|im_end|>"]
    result = '<|im_start|>tool\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>'
    assert got[2] == (0, f"\n{result}\n<|im_start|>assistant\n")


def test_the_text_path_follows_the_same_rule(tmp_path):
    """A text-only server: each turn rendered back through the template. Answers the tokenizer encodes as the
    target wrote them (no spaces) make it the id path's sample exactly."""
    t = golden("chatml")
    r, _ = drive(chat_conv(*CHAT), t, ["Paris.", "Madrid!", "Rome."])
    (by_text,), tally = build_samples(responses(r, ids=False), t.tok, config(tmp_path))
    (by_ids,), _ = build_samples(responses(r), t.tok, config(tmp_path))
    assert tally.text_path == 3 and tally.per_turn == 0
    assert (by_text.input_ids, by_text.loss_mask) == (by_ids.input_ids, by_ids.loss_mask)
    assert trained(t.tok, by_text) == ["Paris.<|im_end|>", "Madrid!<|im_end|>", "Rome.<|im_end|>"]


@pytest.fixture(params=["conf/templates/qwen3_thinking.jinja", "bench/templates/qwen3.jinja"])
def thinking(request):
    from conftest import ROOT

    tok = make_golden.load_tokenizer("qwen3_thinking")
    tok.chat_template = (ROOT / request.param).read_text()
    return target(tok)


THOUGHTS = ["<think>\nAdd them.\n</think>\n\nIt is 4.", "<think>\nAgain.\n</think>\n\nIt is 6."]


def test_a_template_that_drops_earlier_reasoning_gives_one_sample_per_turn(thinking, tmp_path):
    t = thinking
    r, _ = drive(chat_conv("What is 2+2?", "4.", "And 3+3?", "6."), t, THOUGHTS)
    lines = responses(r)
    samples, tally = build_samples(lines, t.tok, config(tmp_path))
    assert tally.conversations == 1 and tally.per_turn == 1
    # each sample is exactly what its turn was sent and what the target wrote
    assert [(s.input_ids, s.loss_mask) for s in samples] == [from_ids(x["prompt_ids"], x["output_ids"]) for x in lines]
    assert [(s.id, s.conversation, s.turn) for s in samples] == [(x["id"], "conv-1", x["turn"]) for x in lines]
    assert [trained(t.tok, s) for s in samples] == [[a + "<|im_end|>"] for a in THOUGHTS]
    assert "Add them." not in t.tok.decode(samples[1].input_ids)  # turn 1 was sent without turn 0's reasoning
    from stages.tokenize import samples_per_conversation

    assert samples_per_conversation(samples, tally.conversations) == 2.0  # tokenize_metrics.json's figure


def test_a_thinking_template_on_the_text_path(thinking, tmp_path):
    """A chat server's parsers moved the thinking out of the text: each turn rendered back, one sample each."""
    t = thinking
    answers = [{"text": "It is 4.", "reasoning": "Add them."}, {"text": "It is 6.", "reasoning": "Again."}]
    r, _ = drive(chat_conv("What is 2+2?", "4.", "And 3+3?", "6."), t, answers)
    samples, tally = build_samples(responses(r, ids=False), t.tok, config(tmp_path))
    assert tally.text_path == 2 and tally.per_turn == 1 and len(samples) == 2
    assert [trained(t.tok, s) for s in samples] == [[a + "<|im_end|>"] for a in THOUGHTS]
    assert "Add them." not in t.tok.decode(samples[1].input_ids)


def test_last_turn_trains_the_final_answer_only(thinking, tmp_path):
    t = golden("chatml")
    r, _ = drive(chat_conv(*CHAT), t, ANSWERS)
    lines = responses(r)
    (s,), _ = build_samples(lines, t.tok, config(tmp_path, train_on=TrainOn.last_turn))
    assert (s.input_ids, s.loss_mask) == from_ids(lines[-1]["prompt_ids"], lines[-1]["output_ids"])
    # not prefix-stable: the last turn's sample alone
    r, _ = drive(chat_conv("What is 2+2?", "4.", "And 3+3?", "6."), thinking, THOUGHTS)
    lines = responses(r)
    (s,), tally = build_samples(lines, thinking.tok, config(tmp_path, train_on=TrainOn.last_turn))
    assert (s.input_ids, s.loss_mask) == from_ids(lines[-1]["prompt_ids"], lines[-1]["output_ids"])
    assert s.turn == 1 and tally.per_turn == 1


def test_too_long_conversations(tmp_path):
    """truncate keeps a conversation's first tokens (and the answers in them trained); drop keeps the turns that
    fit."""
    t = golden("chatml")
    r, _ = drive(chat_conv(*CHAT), t, ANSWERS)
    lines = responses(r)
    (whole,), _ = build_samples(lines, t.tok, config(tmp_path))
    cut = len(lines[1]["prompt_ids"]) + 2  # into the second answer
    (s,), tally = build_samples(lines, t.tok, config(tmp_path, max_seq_len=cut, on_too_long=OnTooLong.truncate))
    assert (s.input_ids, s.loss_mask) == (whole.input_ids[:cut], whole.loss_mask[:cut]) and tally.truncated == 1
    assert trained(t.tok, s)[0] == ANSWERS[0] + "<|im_end|>"
    # drop: the turns that do not fit go, the conversation keeps the first (the whole of it as its sample)
    (s,), tally = build_samples(lines, t.tok, config(tmp_path, max_seq_len=cut))
    assert (s.input_ids, s.loss_mask) == from_ids(lines[0]["prompt_ids"], lines[0]["output_ids"])
    assert (s.turn, s.responses, tally.skipped) == (0, 1, {"over_max_seq_len": 2})
    samples, tally = build_samples(lines, t.tok, config(tmp_path, max_seq_len=len(lines[0]["prompt_ids"])))
    assert samples == [] and tally.skipped == {"over_max_seq_len": 3} and tally.conversations == 0


def test_an_empty_turn_stays_context(tmp_path):
    """A turn with nothing to train is skipped as empty_output; its turn stays in the later turns' prompts."""
    t = golden("chatml")
    r, _ = drive(chat_conv(*CHAT), t, [ANSWERS[0], "", ANSWERS[2]])
    (s,), tally = build_samples(responses(r), t.tok, config(tmp_path))
    assert tally.skipped == {"empty_output": 1} and s.responses == 2
    assert trained(t.tok, s) == [ANSWERS[0] + "<|im_end|>", ANSWERS[2] + "<|im_end|>"]


def test_the_stage_writes_conversation_columns_beside_single_responses(project, tiny_model):
    """samples.parquet names each sample's conversation and last trained turn; a response regenerated alone has
    none; the hidden-states stage reads the file as before."""
    import json

    import pyarrow.parquet as pq

    t = tiny_target(tiny_model)
    r, _ = drive(chat_conv(*CHAT), t, ANSWERS)
    single = {k: v for k, v in responses(r)[0].items() if k not in ("conversation", "turn", "end_reason")}
    single["id"] = "alone"
    project.set("tokenize.train_on", "all_turns")  # the fixture keeps last_turn
    write_jsonl(project.data("B3") / "responses.jsonl", [single, *responses(r)])
    project.run("tokenize", "B3")
    rows = pq.read_table(project.data("B3") / "samples.parquet").to_pylist()
    assert [(x["id"], x["conversation"], x["turn"]) for x in rows] == [
        ("alone", None, None),
        (responses(r)[-1]["id"], "conv-1", 2),
    ]
    m = json.loads((project.data("B3") / "tokenize_metrics.json").read_text())
    assert (m["responses"], m["samples"], m["conversations"], m["conversations_per_turn_samples"]) == (4, 2, 1, 0)
    assert m["samples_per_conversation"] == 1.0  # the response regenerated alone is no conversation's
    assert (
        m["trained_tokens"]
        == sum(x["n_trained"] for x in rows)
        == single["completion_tokens"] + sum(x["completion_tokens"] for x in responses(r))
    )
    project.run("hidden_states", "B3")
    states = list(HiddenStates(project.data("B3") / "hidden_states"))
    assert [(s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in states] == [
        (x["id"], x["input_ids"], x["loss_mask"]) for x in rows
    ]
