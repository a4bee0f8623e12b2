"""Shipped chat templates (conf/templates/*.jinja) against golden files (tests/golden/, made by make_golden.py).

For every golden conversation: the tokenize stage's text path rebuilds the stored ids and mask token for token;
the trained span is exactly the completion plus one end-of-turn token; earlier assistant turns are never
trained; and the id path (prompt ids from the template + encoded completion + end of turn) gives the same sample
as the text path. Plus: a template whose generation prompt is not a prefix of the rendered reply is skipped, and
every template renders prompts adapted from each demo source.
"""

from __future__ import annotations

import copy
import gzip
import importlib.util
import json
from functools import cache
from pathlib import Path

import pytest
from conftest import DEMO_SHAPES

from draftdata.model.tokenizer import template_messages
from draftdata.sources.shapes import BadRecord, to_prompt
from draftdata.tokenize.samples import Skip, from_ids, from_text

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"
GOLDEN = sorted(GOLDEN_DIR.glob("*__*.json"))

_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN_DIR / "make_golden.py")
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)

TEMPLATE_KWARGS = {  # the kwargs each template is exercised with on the demo prompts
    "chatml": [{}],
    "llama3": [{}, {"tools_in_user_message": False}],
    "qwen3_thinking": [{}, {"enable_thinking": False}],
    "hermes_tools": [{}],
}


@cache
def tokenizer(template: str):
    return make_golden.load_tokenizer(template)


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def record(g: dict) -> dict:
    rec = {"messages": copy.deepcopy(g["messages"]), "text": g["completion"]}
    if g["tools"]:
        rec["tools"] = copy.deepcopy(g["tools"])
    return rec


def eot_id(tok, g: dict) -> int:
    return tok.convert_tokens_to_ids(g["eot_token"])


def assert_same_tokens(tok, expected: list[int], actual: list[int], what: str) -> None:
    if expected == actual:
        return
    n = min(len(expected), len(actual))
    pos = next((i for i in range(n) if expected[i] != actual[i]), n)
    lo, hi = max(0, pos - 6), pos + 6

    def around(ids):
        return " ".join(f"{i}:{tok.convert_ids_to_tokens(t)!r}" for i, t in zip(range(lo, hi), ids[lo:hi]))

    pytest.fail(
        f"{what}: first difference at position {pos} (lengths {len(expected)} expected, {len(actual)} actual)\n"
        f"  expected {around(expected)}\n  actual   {around(actual)}\n"
        f"  expected text around it: {tok.decode(expected[lo:hi])!r}\n"
        f"  actual text around it:   {tok.decode(actual[lo:hi])!r}"
    )


def split(mask: list[int]) -> int:
    """Where the trained span starts; fails unless the mask is 0…0 1…1 with at least one 1."""
    start = mask.index(1)
    assert mask == [0] * start + [1] * (len(mask) - start), "loss mask is not a single trained span at the end"
    return start


def visible_content(message: dict, template: str) -> str:
    """What an earlier assistant turn shows in the prompt (Qwen3 drops reasoning before the last query)."""
    content = message.get("content") or ""
    if template == "qwen3_thinking" and "</think>" in content:
        content = content.split("</think>")[-1].lstrip("\n")
    return content


def test_golden_files_cover_every_template():
    shipped = {p.stem for p in (ROOT / "conf" / "templates").glob("*.jinja")}
    assert shipped == set(make_golden.TEMPLATES)
    golden = {p.name.split("__")[0] for p in GOLDEN}
    assert golden == shipped
    for template, cases in make_golden.CASES.items():
        assert {f"{template}__{c}.json" for c in cases} <= {p.name for p in GOLDEN}


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_text_path_reproduces_golden(path):
    g = load(path)
    tok = tokenizer(g["template"])
    rec, kwargs = record(g), dict(g["template_kwargs"])
    convo = template_messages(rec["messages"]) + [{"role": "assistant", "content": g["completion"]}]
    assert tok.apply_chat_template(convo, tools=rec.get("tools"), tokenize=False, **kwargs) == g["rendered"]
    ids, mask = from_text(tok, rec, kwargs)
    assert_same_tokens(tok, g["input_ids"], ids, "input_ids")
    assert mask == g["loss_mask"], "loss_mask differs from the golden file"


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_trained_span_is_completion_and_one_end_of_turn(path):
    g = load(path)
    tok = tokenizer(g["template"])
    eot = eot_id(tok, g)
    ids, mask = g["input_ids"], g["loss_mask"]
    assert len(ids) == len(mask)
    start = split(mask)
    span = ids[start:]
    assert span[-1] == eot and span.count(eot) == 1, "the trained span must end at its only end-of-turn token"
    assert tok.decode(span) == g["completion"] + g["eot_token"] == g["trained_text"]
    assert g["rendered"].endswith(g["completion"] + g["eot_token"]), "the template adds text after end of turn"


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_earlier_assistant_turns_are_not_trained(path):
    g = load(path)
    tok = tokenizer(g["template"])
    start = split(g["loss_mask"])
    # The untrained part is exactly the prompt the target was sent, every earlier turn included.
    prompt = tok.apply_chat_template(
        template_messages(g["messages"]),
        tools=g["tools"],
        add_generation_prompt=True,
        tokenize=False,
        **g["template_kwargs"],
    )
    assert g["rendered"].startswith(prompt)
    assert tok.decode(g["input_ids"][:start]) == prompt
    earlier = [m for m in g["messages"] if m["role"] == "assistant"]
    untrained = tok.decode(g["input_ids"][:start])
    for m in earlier:
        assert visible_content(m, g["template"]) in untrained
        for call in m.get("tool_calls") or []:
            assert f'"name": "{call["function"]["name"]}"' in untrained
    # Every end-of-turn token before the trained span (one per earlier turn) is masked 0.
    eot = eot_id(tok, g)
    assert g["input_ids"][:start].count(eot) >= len(earlier)


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_id_path_agrees_with_text_path(path):
    g = load(path)
    tok = tokenizer(g["template"])
    kwargs = dict(g["template_kwargs"])
    prompt_ids = list(
        tok.apply_chat_template(
            g["messages"], tools=g["tools"], add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
    )
    output_ids = tok.encode(g["completion"], add_special_tokens=False) + [eot_id(tok, g)]
    ids, mask = from_ids(prompt_ids, output_ids)
    assert_same_tokens(tok, g["input_ids"], ids, "id path input_ids vs golden (text path)")
    assert mask == g["loss_mask"]
    text_ids, text_mask = from_text(tok, record(g), kwargs)
    assert (text_ids, text_mask) == (ids, mask)


# A DeepSeek-R1-like template: the generation prompt opens a <think> block that a rendered assistant turn lacks.
NOT_PREFIX_STABLE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)


def test_not_prefix_stable_template_is_skipped():
    tok = copy.deepcopy(tokenizer("chatml"))
    tok.chat_template = NOT_PREFIX_STABLE
    rec = {"messages": [{"role": "user", "content": "Hi there."}], "text": "Hello! How can I help?"}
    with pytest.raises(Skip) as e:
        from_text(tok, rec, {})
    assert e.value.reason == "template_not_prefix_stable"


def demo_prompts(name: str, n: int = 5) -> list:
    out = []
    with gzip.open(ROOT / "sources" / "demo" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            try:
                out.append(to_prompt(DEMO_SHAPES[name], json.loads(line)))
            except BadRecord:
                continue
            if len(out) == n:
                break
    assert len(out) == n, f"{name}: fewer than {n} usable rows"
    return out


@pytest.mark.parametrize("template", sorted(make_golden.TEMPLATES))
@pytest.mark.parametrize("demo", sorted(DEMO_SHAPES))
def test_template_renders_demo_prompts(template, demo):
    tok = tokenizer(template)
    eot = make_golden.TEMPLATES[template]
    completion = "Done: the answer is 42."
    for kwargs in TEMPLATE_KWARGS[template]:
        for p in demo_prompts(demo):
            text = tok.apply_chat_template(
                template_messages(p.messages), tools=p.tools, add_generation_prompt=True, tokenize=False, **kwargs
            )
            assert text and all(m["content"] in text for m in p.messages if m["role"] == "user")
            rec = {"messages": p.messages, "text": completion}
            if p.tools:
                rec["tools"] = p.tools
            ids, mask = from_text(tok, rec, kwargs)
            start = split(mask)
            assert tok.decode(ids[start:]) == completion + eot
            prompt_ids = list(
                tok.apply_chat_template(
                    p.messages, tools=p.tools, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
                )
            )
            assert_same_tokens(tok, prompt_ids, ids[:start], f"{demo} {kwargs}: prompt ids (id path) vs text path")


def test_the_empty_think_block_of_a_non_thinking_turn_is_context_or_trained_by_the_setting():
    """Qwen3's thinking template with thinking off writes `<think>\\n\\n</think>\\n\\n` into the generation prompt:
    the golden mask leaves it untrained (auto follows the template), `train` trains exactly it, and `context`
    keeps one the model wrote itself out of the loss; a template without the block refuses either setting."""
    from draftdata.config.schema import EmptyThink
    from draftdata.errors import ConfigError
    from draftdata.model.think import block_of, empty_think_ids
    from draftdata.tokenize.think import mark_empty_think

    g = load(GOLDEN_DIR / "qwen3_thinking__thinking_off.json")
    tok = tokenizer("qwen3_thinking")
    block = empty_think_ids(tok, {})
    assert tok.decode(block) == "<think>\n\n</think>\n\n"
    ids, mask = g["input_ids"], g["loss_mask"]
    start = split(mask)
    assert ids[start - len(block) : start] == block and not any(mask[:start])  # golden: the block is context
    trained = mark_empty_think(ids, mask, block, EmptyThink.train)
    assert split(trained) == start - len(block) and tok.decode([i for i, m in zip(ids, trained) if m]) == (
        "<think>\n\n</think>\n\n" + g["trained_text"]
    )
    assert mark_empty_think(ids, mask, block, EmptyThink.context) == mask  # the model did not write it: unchanged
    # the model wrote the empty block itself (a template that leaves it to the model): context keeps it out
    prompt_len = start - len(block)
    wrote = mark_empty_think(ids, [0] * prompt_len + [1] * (len(ids) - prompt_len), block, EmptyThink.context)
    assert wrote == mask
    on = load(GOLDEN_DIR / "qwen3_thinking__thinking_on.json")  # thinking on: no empty block, nothing moves
    assert mark_empty_think(on["input_ids"], on["loss_mask"], block, EmptyThink.train) == on["loss_mask"]
    assert block_of(tok, {}, EmptyThink.auto) is None
    with pytest.raises(ConfigError, match="tokenize.empty_think"):
        block_of(tokenizer("chatml"), {}, EmptyThink.train)
