"""tokenize@D: the id path and the text path agree, drift is measured, every skip has a reason, metadata
round-trips and HF datasets reads the output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import HARMONY_TEMPLATE

from draftdata.config.schema import ModelConfig
from draftdata.errors import ConfigError, UserError
from draftdata.model.tokenizer import load_tokenizer, render_prompt_ids, tokenizer_fingerprint
from draftdata.tokenize.parquet import read_metadata
from draftdata.tokenize.samples import from_ids, from_text
from draftdata.util.files import write_jsonl

HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another one, please."},
]


@pytest.fixture
def tok(tiny_model):
    return load_tokenizer(ModelConfig(path=str(tiny_model)))


def response(
    tok, rid: str, messages: list[dict], text: str, *, ids: bool, finish: str = "stop", tools=None, output_ids=None
) -> dict:
    prompt_ids = render_prompt_ids(tok, messages, tools, {})
    if output_ids is None:
        output_ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if finish == "stop" else [])
    rec = {
        "id": rid,
        "key": rid,
        "messages": messages,
        "text": text,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(output_ids),
        "finish_reason": finish,
        "prompt_ids": prompt_ids if ids else None,
        "output_ids": output_ids if ids else None,
    }
    if tools:
        rec["tools"] = tools
    return rec


def run_tokenize(project, records: list[dict]) -> tuple[list[dict], dict]:
    write_jsonl(project.data("B3") / "responses.jsonl", records)
    project.run("tokenize", "B3")
    import pyarrow.parquet as pq

    rows = pq.read_table(project.data("B3") / "samples.parquet").to_pylist()
    return rows, json.loads((project.data("B3") / "tokenize_metrics.json").read_text())


def test_text_path_equals_id_path_with_history_and_tools(tok):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look up a number",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    messages = HISTORY[:3] + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"n": 11}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"prime": true}'},
    ]
    for msgs, t in ((HISTORY, None), (messages, tools)):
        rec = response(tok, "a", msgs, "Eleven is prime.", ids=True, tools=t)
        by_ids = from_ids(rec["prompt_ids"], rec["output_ids"])
        by_text = from_text(tok, {"messages": msgs, "tools": t, "text": rec["text"]}, {})
        assert by_text == by_ids
        ids, mask = by_ids
        assert sum(mask) == rec["completion_tokens"] and ids[-1] == tok.eos_token_id and mask[-1] == 1
        # history (system, user, the earlier assistant turn, the tool call and result) is never trained
        first = mask.index(1)
        assert "Seven." in tok.decode(ids[:first]) and all(m == 1 for m in mask[first:])


def test_truncated_text_path_leaves_out_the_unproduced_end_of_turn(tok):
    rec = response(tok, "a", HISTORY, "Thirteen is", ids=False, finish="length")
    ids, mask = from_text(tok, rec, {})
    assert tok.eos_token_id not in ids[mask.index(1) :]
    assert sum(mask) == rec["completion_tokens"]


def test_drift_is_measured_on_a_completion_split_mid_word(project, tok):
    word = max((t for t in tok.get_vocab() if t.isascii() and t.isalpha() and t.islower()), key=len)  # one token
    pieces = [tok.convert_tokens_to_ids(c) for c in word]  # the generator emitted it letter by letter
    assert len(tok.encode(word, add_special_tokens=False)) == 1 and None not in pieces
    split = response(tok, "split", HISTORY, word, ids=False, output_ids=pieces + [tok.eos_token_id])
    plain = response(tok, "plain", HISTORY, word, ids=False)
    rows, m = run_tokenize(project, [split, plain])
    assert m["text_path_samples"] == 2 and m["drift_pct"] == 50.0
    assert [r["n_trained"] for r in rows] == [2, 2]  # re-encoded: the word and the end of turn


def test_every_skip_reason_is_counted(project, tok, tiny_model):
    ok = response(tok, "ok", HISTORY, "Five.", ids=True)
    empty = dict(response(tok, "empty", HISTORY, "", ids=True), completion_tokens=0, output_ids=[])
    long = response(tok, "long", HISTORY, "word " * 1200, ids=True)
    long_prompt = response(tok, "long_prompt", [{"role": "user", "content": "number " * 1500}], "Two.", ids=True)
    text_only = response(tok, "text_only", HISTORY, "Three.", ids=False)
    project.set("tokenize.max_skip_pct", 100)  # every reason counted, whatever the share
    rows, m = run_tokenize(project, [ok, empty, long, text_only])
    assert [r["id"] for r in rows] == ["ok", "text_only"]
    assert m["skipped"] == {"empty_output": 1, "over_max_seq_len": 1} and m["responses"] == 4

    project.set("tokenize.on_too_long", "truncate")
    rows, m = run_tokenize(project, [ok, long, long_prompt])
    assert m["truncated_to_max_seq_len"] == 1 and [len(r["input_ids"]) for r in rows][1] == 1024
    assert m["skipped"] == {"no_trained_tokens_after_truncation": 1}

    # A template whose rendered assistant turn differs from its generation prompt is not prefix-stable; one that
    # rewrites the response would train tokens the target never produced; one that writes no end-of-turn token
    # has nothing to end the trained span.
    unstable = tiny_model.parent / "unstable.jinja"
    unstable.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.role == 'assistant' %}:{% endif %}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    no_end = tiny_model.parent / "no_end.jinja"
    no_end.write_text(
        "{% for m in messages %}{{ m.role }}:\n{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:\n{% endif %}"
    )
    altering = tiny_model.parent / "altering.jinja"
    altering.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    before_end = tiny_model.parent / "before_end.jinja"  # writes text between the response and its end of turn
    before_end.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.role == 'assistant' %} [done]{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    raising = tiny_model.parent / "raising.jinja"
    raising.write_text(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    for template, reason in (
        (unstable, "template_not_prefix_stable"),
        (altering, "template_alters_response"),
        (no_end, "no_end_of_turn"),
        (before_end, "text_before_end_of_turn"),
        (raising, "template_error:TemplateError"),
    ):
        project.set("model.chat_template", str(template))
        _, m = run_tokenize(project, [text_only])
        assert m["skipped"] == {reason: 1}, (template.name, m)


def test_metadata_round_trip_and_hf_datasets_reads_it(project, tok, tiny_model):
    rows, _ = run_tokenize(project, [response(tok, "a", HISTORY, "Five.", ids=True)])
    meta = read_metadata(project.data("B3") / "samples.parquet")
    assert meta["tokenizer"] == json.loads(
        json.dumps(tokenizer_fingerprint(tok, ModelConfig(path=str(tiny_model)), {}))
    )
    assert meta["tokenizer"]["files_sha256"]["tokenizer.json"] and meta["schema_version"] == 1

    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(project.data("B3") / "samples.parquet"), split="train")
    assert ds[0]["input_ids"] == rows[0]["input_ids"] and ds[0]["loss_mask"] == rows[0]["loss_mask"]


def test_process_pool_gives_the_same_samples(project, tok, monkeypatch):
    """Large text-path inputs are rendered in worker processes; the result must not depend on it."""
    import draftdata.tokenize.samples as tz
    from draftdata.config.load import load_config

    recs = [
        response(
            tok,
            f"r{i}",
            HISTORY[:1] + [{"role": "user", "content": f"Count to {i}."}],
            f"{i} apples " * (i % 7 + 1),
            ids=False,
        )
        for i in range(40)
    ]
    cfg = load_config("B3", params_path=project.path / "params.yaml")
    serial, _ = tz.build_samples(recs, tok, cfg)
    monkeypatch.setattr(tz, "PARALLEL_MIN_RECORDS", 10)
    monkeypatch.setattr(tz.os, "cpu_count", lambda: 4)
    parallel, tally = tz.build_samples(recs, tok, cfg)
    assert [(s.id, s.input_ids, s.loss_mask) for s in parallel] == [(s.id, s.input_ids, s.loss_mask) for s in serial]
    assert tally.text_path == 40


def test_too_many_skips_stop_the_stage_naming_the_top_reason(project, tok):
    ok = [response(tok, f"ok{i}", HISTORY, "Five.", ids=True) for i in range(18)]
    empty = [dict(response(tok, f"e{i}", HISTORY, "", ids=True), completion_tokens=0, output_ids=[]) for i in range(2)]
    with pytest.raises(UserError) as err:
        run_tokenize(project, ok + empty)  # 2 of 20: 10 % > the default 5 %
    message = str(err.value)
    assert "2 of 20" in message and "empty_output (2)" in message and "tokenize.max_skip_pct" in message
    assert "\n" not in message
    assert not (project.data("B3") / "samples.parquet").exists()  # nothing written from a run that failed
    project.set("tokenize.max_skip_pct", 10)
    rows, m = run_tokenize(project, ok + empty)
    assert len(rows) == 18 and m["skipped"] == {"empty_output": 2}


def test_only_template_errors_become_skips(project, tok, monkeypatch):
    """A template that refuses a conversation is a skip; an error anywhere else is a bug and stops the stage."""
    import draftdata.tokenize.samples

    def broken(messages):
        raise KeyError("content")

    monkeypatch.setattr(draftdata.tokenize.samples, "template_messages", broken)
    with pytest.raises(KeyError):
        run_tokenize(project, [response(tok, "a", HISTORY, "Three.", ids=False)])


def test_end_of_turn_ids_are_the_eos_and_the_generation_config_only(tiny_model, harmony_model, tmp_path):
    """What servers stop on, no names: Qwen's generation config lists <|im_end|> and <|endoftext|>; gpt-oss's
    <|return|> and <|call|>, and its <|end|> (which closes the reasoning channel) is not an end of turn."""
    import shutil

    from draftdata.model.tokenizer import end_of_turn_ids

    tok = load_tokenizer(ModelConfig(path=str(tiny_model)))
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model = tmp_path / "qwen"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, endoftext]}))
    assert end_of_turn_ids(tok, ModelConfig(path=str(model))) == {im_end, endoftext}
    assert end_of_turn_ids(tok, None) == {im_end}  # a tokenizer on its own: its eos

    harmony = load_tokenizer(ModelConfig(path=str(harmony_model)))
    ret, call, end = harmony.convert_tokens_to_ids(["<|return|>", "<|call|>", "<|end|>"])
    assert end_of_turn_ids(harmony, ModelConfig(path=str(harmony_model))) == {ret, call}


def test_llama_3_ends_its_turn_by_the_generation_config(tmp_path):
    """Llama 3 (8B-Instruct's first release): the tokenizer's eos is <|end_of_text|>, the template ends a turn with
    <|eot_id|>, and only the generation config's [128001, 128009] makes that a stop. Without it no server would stop
    there: refused in one line. The golden tokenizer's <|endoftext|> stands for <|end_of_text|>."""
    import importlib.util

    from draftdata.model.tokenizer import end_of_turn_ids

    golden = importlib.util.spec_from_file_location("make_golden", Path(__file__).parent / "golden" / "make_golden.py")
    make_golden = importlib.util.module_from_spec(golden)
    golden.loader.exec_module(make_golden)
    tok = make_golden.load_tokenizer("llama3")
    tok.eos_token = "<|endoftext|>"
    eos, eot = tok.convert_tokens_to_ids(["<|endoftext|>", "<|eot_id|>"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, eot]}))
    assert end_of_turn_ids(tok, ModelConfig(path=str(tmp_path))) == {eos, eot}
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(ConfigError) as err:
        end_of_turn_ids(tok, ModelConfig(path=str(tmp_path)))
    assert err.value.key == "model.path" and f"'<|eot_id|>' (id {eot})" in str(err.value)


HARMONY_TEXT = (
    "<|channel|>analysis<|message|>Two and two make four.<|end|><|start|>assistant<|channel|>final<|message|>Four."
)


def test_text_path_ends_a_harmony_turn_at_return_not_at_end(project, harmony_model):
    """gpt-oss's reasoning ends with <|end|> and its answer with <|return|>: a response holding both is one sample
    trained through <|return|>. A template that closes the final message with <|end|> (as some fine-tuning copies of
    gpt-oss's do) would train an end the target never makes: refused in one line, nothing written."""

    project.set("model.path", str(harmony_model))
    tok = load_tokenizer(ModelConfig(path=str(harmony_model)))
    end, ret = tok.convert_tokens_to_ids(["<|end|>", "<|return|>"])
    rows, m = run_tokenize(project, [response(tok, "a", HISTORY[1:2], HARMONY_TEXT, ids=False)])
    assert m["samples"] == 1 and m["text_path_samples"] == 1
    (row,) = rows
    trained = [t for t, keep in zip(row["input_ids"], row["loss_mask"]) if keep]
    assert trained[-1] == ret and trained.count(end) == 1 and trained.count(ret) == 1
    assert tok.decode(trained) == HARMONY_TEXT + "<|return|>"

    closes_with_end = project.path / "closes_with_end.jinja"
    closes_with_end.write_text(HARMONY_TEMPLATE.replace("'<|return|>'", "'<|end|>'"))
    project.set("model.chat_template", str(closes_with_end))
    (project.data("B3") / "samples.parquet").unlink()
    with pytest.raises(ConfigError) as err:
        run_tokenize(project, [response(tok, "a", HISTORY[1:2], HARMONY_TEXT, ids=False)])
    message = str(err.value)
    assert err.value.key == "model.chat_template" and "\n" not in message
    assert f"'<|end|>' (id {end})" in message and "eos_token_id in generation_config.json" in message
    assert not (project.data("B3") / "samples.parquet").exists()


def _same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab() and a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert {i: str(t) for i, t in a.added_tokens_decoder.items()} == {
        i: str(t) for i, t in b.added_tokens_decoder.items()
    }
    assert a.all_special_tokens == b.all_special_tokens and a.chat_template == b.chat_template
    assert (a.eos_token_id, a.pad_token_id, a.bos_token_id) == (b.eos_token_id, b.pad_token_id, b.bos_token_id)
    text = "def f(x):\n    return x ** 2  # <think>é</think> <|im_end|>"
    assert a(text).input_ids == b(text).input_ids and a(text, add_special_tokens=False) == b(
        text, add_special_tokens=False
    )
    assert render_prompt_ids(a, HISTORY, None, {}) == render_prompt_ids(b, HISTORY, None, {})
    assert a.apply_chat_template(HISTORY, tokenize=False) == b.apply_chat_template(HISTORY, tokenize=False)


def test_a_plain_fast_tokenizer_loads_as_autotokenizer_loads_it_without_torch(tiny_model, tmp_path):
    """The CPU-only stages load a plain Rust-backed tokenizer as its class, skipping AutoTokenizer's model config
    (whose classes import torch): the same tokenizer, and no torch imported."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from draftdata.model.tokenizer import plain_fast_tokenizer

    assert plain_fast_tokenizer(str(tiny_model))
    _same_tokenizer(load_tokenizer(ModelConfig(path=str(tiny_model))), AutoTokenizer.from_pretrained(tiny_model))
    code = (
        "import sys; from draftdata.config.schema import ModelConfig; "
        "from draftdata.model.tokenizer import load_tokenizer, end_of_turn_ids;"
        f"t = load_tokenizer(ModelConfig(path={str(tiny_model)!r})); end_of_turn_ids(t, ModelConfig(path="
        f"{str(tiny_model)!r})); print('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"

    # where AutoTokenizer decides otherwise, it decides: a model type that overrides the named class (Qwen2's), code
    # of the tokenizer's own, or no generic class named
    import shutil

    for name, edit in [
        ("qwen2", lambda d: _edit_json(d / "config.json", model_type="qwen2")),
        ("auto_map", lambda d: _edit_json(d / "tokenizer_config.json", auto_map={"AutoTokenizer": ["x.T", None]})),
        ("named", lambda d: _edit_json(d / "tokenizer_config.json", tokenizer_class="Qwen2Tokenizer")),
        ("tekken", lambda d: (d / "tekken.json").write_text("{}")),
    ]:
        d = tmp_path / name
        shutil.copytree(tiny_model, d)
        edit(d)
        assert not plain_fast_tokenizer(str(d)), name
    # without config.json (a tokenizer for a model that lives on a server) the named class is taken as it stands
    d = tmp_path / "no_config"
    shutil.copytree(tiny_model, d)
    (d / "config.json").unlink()
    assert plain_fast_tokenizer(str(d))
    _same_tokenizer(load_tokenizer(ModelConfig(path=str(d))), AutoTokenizer.from_pretrained(d))


def _edit_json(path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_stop_answer_whose_ids_do_not_end_its_turn_is_skipped_on_the_id_path_too(project, tok):
    """A server that stopped on a stop string says `stop` with ids that end on an ordinary token: that sample would
    never train the end of the turn. The id path refuses it as the text path does: `no_end_of_turn`, counted."""
    good = response(tok, "a", HISTORY, "Three.", ids=True)
    cut = response(tok, "b", HISTORY[:2], "Two.", ids=True, output_ids=tok.encode("Two.", add_special_tokens=False))
    assert cut["finish_reason"] == "stop" and cut["output_ids"][-1] != tok.eos_token_id
    project.params["tokenize"]["max_skip_pct"] = 100.0
    project.save()
    rows, metrics = run_tokenize(project, [good, cut])
    assert [r["id"] for r in rows] == ["a"] and metrics["skipped"]["no_end_of_turn"] == 1


def test_a_template_that_fails_on_a_plain_turn_is_refused_not_skipped_over(tiny_model, tmp_path):
    """The end-of-turn check renders a plain user and assistant turn: a template that raises there is refused in
    one line naming the key (the check used to pass it silently)."""
    from draftdata.model.tokenizer import end_of_turn_ids

    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ raise_exception('this template takes tool turns only') }}")
    tok = load_tokenizer(ModelConfig(path=str(tiny_model), chat_template=str(broken)))
    with pytest.raises(ConfigError, match=r"^model.chat_template: the chat template fails on a plain .* tool turns"):
        end_of_turn_ids(tok, ModelConfig(path=str(tiny_model), chat_template=str(broken)))


def test_library_code_never_exits_the_process():
    """Only the entry points end the process (draftdata.config.load.cli, the commands' and the vLLM worker's
    mains); a library function raises, and its caller decides."""
    import re

    root = Path(__file__).resolve().parents[1] / "draftdata"
    allowed = {"config/load.py", "cli/__init__.py", "cli/verify.py", "cli/compare.py", "hidden/engines/vllm_worker.py"}
    calls = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"\bsys\.exit\(", p.read_text()) and str(p.relative_to(root)) not in allowed
    ]
    assert not calls
