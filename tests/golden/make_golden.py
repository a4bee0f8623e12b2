"""Build the golden files for the shipped chat templates (conf/templates/*.jinja).

    python tests/golden/make_golden.py              # rewrite every tests/golden/<template>__<case>.json
    python tests/golden/make_golden.py --tokenizer  # first retrain tests/golden/tokenizer.json, then the same

The tokenizer is a small byte-level BPE trained on the demo sources with a special token for every template's
markers. It is checked in, so golden ids never depend on BPE training being reproducible across `tokenizers`
versions; retrain it only on purpose (every golden file changes with it).

Each golden file holds one conversation rendered with one template: the request (messages, tools,
template_kwargs), the completion text, the rendered full conversation, and `input_ids` / `loss_mask` exactly as
the tokenize stage's text path (`draftdata.tokenize.samples.from_text`) produced them, plus the decoded trained span.
tests/test_templates.py rebuilds each one and compares token by token.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TEMPLATES_DIR = ROOT / "conf" / "templates"
TOKENIZER = HERE / "tokenizer.json"
VOCAB_SIZE = 1024

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# template name -> the single token that ends an assistant turn
TEMPLATES = {
    "chatml": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "qwen3_thinking": "<|im_end|>",
    "hermes_tools": "<|im_end|>",
}

# ---------------------------------------------------------------------------------------------------------------
# The conversations

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the documentation.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "default": 3}},
                "required": ["query"],
            },
        },
    },
]

SINGLE = {
    "messages": [{"role": "user", "content": "Write a haiku about tokenizers."}],
    "tools": None,
    "completion": "Bytes merge into words,\nids march in a single line —\nthe mask marks our own.",
}

MULTI = {
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And its population?"},
        {"role": "assistant", "content": "About 2.1 million people live in the city proper."},
        {"role": "user", "content": "Write a one-line Python expression that sums the squares of 1 to 10."},
    ],
    "tools": None,
    "completion": "sum(i * i for i in range(1, 11))  # 385",
}


def tool_messages(call_content: str = "") -> list[dict]:
    """Two parallel calls: one with OpenAI's JSON-string arguments, one with a mapping; then both results."""
    return [
        {"role": "system", "content": "You are a helpful assistant with access to tools."},
        {"role": "user", "content": "What's the weather in Paris and in Tokyo right now? Answer in Celsius."},
        {
            "role": "assistant",
            "content": call_content,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "condition": "cloudy"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": 24, "condition": "sunny"}'},
    ]


TOOL = {
    "messages": tool_messages(),
    "tools": TOOLS,
    "completion": "It is 18 °C and cloudy in Paris, and 24 °C and sunny in Tokyo.",
}

THINK = "<think>\n{}\n</think>\n\n{}"

Q3_SINGLE = dict(
    SINGLE, completion=THINK.format("Five, seven, five syllables; the subject is BPE.", SINGLE["completion"])
)

Q3_MULTI = {
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": THINK.format("Easy geography question.", "The capital of France is Paris.")},
        {"role": "user", "content": "And its population?"},
        {
            "role": "assistant",
            "content": "About 2.1 million people live in the city proper.",
            "reasoning_content": "City proper, not the metro area.",
        },
        {"role": "user", "content": "Write a one-line Python expression that sums the squares of 1 to 10."},
    ],
    "tools": None,
    "completion": THINK.format("A generator inside sum; 1+4+...+100 = 385.", MULTI["completion"]),
}

Q3_TOOL = {
    "messages": tool_messages(THINK.format("Two cities, so two get_weather calls in parallel.", "")),
    "tools": TOOLS,
    "completion": THINK.format("Both results are in; report them in Celsius.", TOOL["completion"]),
}

CASES: dict[str, dict[str, dict]] = {
    name: {
        "single_turn": dict(SINGLE, template_kwargs={}),
        "multi_turn": dict(MULTI, template_kwargs={}),
        "tool_call": dict(TOOL, template_kwargs={}),
    }
    for name in ("chatml", "llama3", "hermes_tools")
}
CASES["llama3"]["tool_call_in_system"] = dict(TOOL, template_kwargs={"tools_in_user_message": False})
CASES["qwen3_thinking"] = {
    "single_turn": dict(Q3_SINGLE, template_kwargs={}),
    "multi_turn": dict(Q3_MULTI, template_kwargs={}),
    "tool_call": dict(Q3_TOOL, template_kwargs={}),
    "thinking_on": dict(Q3_MULTI, template_kwargs={"enable_thinking": True}),
    "thinking_off": dict(Q3_MULTI, template_kwargs={"enable_thinking": False}),
    "thinking_off_plain": dict(MULTI, messages=Q3_MULTI["messages"], template_kwargs={"enable_thinking": False}),
}

# ---------------------------------------------------------------------------------------------------------------


def train_tokenizer(path: Path = TOKENIZER) -> None:
    from draftdata.model.tiny import iter_demo_texts, train_bpe

    tok = train_bpe(iter_demo_texts(ROOT / "sources" / "demo"), VOCAB_SIZE, SPECIAL_TOKENS)
    tok.save(str(path), pretty=True)


def load_tokenizer(template: str, tokenizer_file: Path = TOKENIZER):
    """The golden tokenizer with `template`'s chat template and end-of-turn token, as the tests load it."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file), eos_token=TEMPLATES[template], pad_token="<|endoftext|>"
    )
    tok.chat_template = (TEMPLATES_DIR / f"{template}.jinja").read_text()
    return tok


def golden_path(template: str, case: str) -> Path:
    return HERE / f"{template}__{case}.json"


def build(template: str, case: str, spec: dict, tok) -> dict:
    from draftdata.model.tokenizer import template_messages
    from draftdata.tokenize.samples import from_text

    messages, tools, kwargs = copy.deepcopy(spec["messages"]), copy.deepcopy(spec["tools"]), spec["template_kwargs"]
    rec = {"messages": messages, "text": spec["completion"]}
    if tools:
        rec["tools"] = tools
    ids, mask = from_text(tok, copy.deepcopy(rec), dict(kwargs))
    convo = template_messages(messages) + [{"role": "assistant", "content": spec["completion"]}]
    return {
        "template": template,
        "case": case,
        "eot_token": TEMPLATES[template],
        "template_kwargs": kwargs,
        "messages": messages,
        "tools": tools,
        "completion": spec["completion"],
        "rendered_prompt": tok.apply_chat_template(
            template_messages(messages), tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        ),
        "rendered": tok.apply_chat_template(convo, tools=tools, tokenize=False, **kwargs),
        "input_ids": ids,
        "loss_mask": mask,
        "trained_text": tok.decode([i for i, m in zip(ids, mask) if m]),
    }


def dumps(golden: dict) -> str:
    """Indented JSON with `input_ids` and `loss_mask` on one line each, so a diff shows which fields changed."""
    flat = {k: (f"@@{k}@@" if k in ("input_ids", "loss_mask") else v) for k, v in golden.items()}
    text = json.dumps(flat, indent=1, ensure_ascii=False)
    for k in ("input_ids", "loss_mask"):
        text = text.replace(f'"@@{k}@@"', json.dumps(golden[k]))
    return text + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", action="store_true", help="retrain tests/golden/tokenizer.json first")
    args = ap.parse_args()
    if args.tokenizer or not TOKENIZER.exists():
        train_tokenizer()
        print(f"wrote {TOKENIZER.relative_to(ROOT)}")
    for template, cases in CASES.items():
        tok = load_tokenizer(template)
        for case, spec in cases.items():
            out = golden_path(template, case)
            out.write_text(dumps(build(template, case, spec, tok)))
            print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
