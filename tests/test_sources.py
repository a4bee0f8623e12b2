"""Source adapters: the demo files end to end, then hand-written rows for each real-data quirk."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import sys
from collections import Counter

import pytest
from conftest import DEMO, DEMO_SHAPES, ROOT

from draftdata.sources.shapes import SHAPES, BadRecord, Prompt, SourceOptions, to_prompt, turn_slots

REASONS = {
    "not_a_mapping",
    "missing_field",
    "bad_field_type",
    "bad_turn",
    "bad_turn_role",
    "bad_content",
    "empty_prompt",
    "no_user_turn",
    "unparseable_tools",
    "unparseable_tool_call",
    "unparseable_chat",
    "orphan_tool_response",
}
ROLES = {"system", "user", "assistant", "tool"}


def read_rows(name: str) -> list[dict]:
    with gzip.open(DEMO / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def adapt_all(name: str) -> tuple[list[tuple[dict, Prompt]], Counter]:
    adapted, skipped = [], Counter()
    for row in read_rows(name):
        try:
            adapted.append((row, to_prompt(DEMO_SHAPES[name], row)))
        except BadRecord as exc:
            assert exc.reason in REASONS
            skipped[exc.reason] += 1
    return adapted, skipped


def final_answer(name: str, row: dict) -> str | None:
    """The original answer the prompt must not contain (None when the row ends on the user)."""
    if name == "B1_glaive":
        return row["chat"].rsplit("ASSISTANT:", 1)[1].split("\n\n\nUSER:")[0].replace("<|endoftext|>", "").strip()
    if name == "B2_opencodeinstruct":
        return row["output"]
    if name == "B3_magicoder":
        return row["solution"]
    if name in ("B4_mixture_of_thoughts", "B6_ultrachat"):
        return row["messages"][-1]["content"]
    if name in ("B5_openthoughts", "B7_sharegpt"):
        last = row["conversations"][-1]
        return None if last["from"] in ("human", "user") else last["value"]
    return row["trajectory"][-1]["text"]


def texts(prompt: Prompt) -> list[str]:
    out = [m["content"] for m in prompt.messages]
    out += [c["function"]["arguments"] for m in prompt.messages for c in m.get("tool_calls", [])]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Demo files


@pytest.mark.parametrize("name", DEMO_SHAPES)
def test_demo_rows_all_adapt(name):
    rows = read_rows(name)
    adapted, skipped = adapt_all(name)
    assert len(rows) >= 220
    # The demo datasets run with on_bad_record: fail, so every quirky row must still adapt.
    assert not skipped, f"{name}: {dict(skipped)}"
    assert len(adapted) == len(rows)
    for _, prompt in adapted:
        assert prompt.messages[-1]["role"] in ("user", "tool")
        assert any(m["role"] == "user" for m in prompt.messages)
        for m in prompt.messages:
            assert m["role"] in ROLES
            assert isinstance(m["content"], str)
            assert m["content"].strip() or m.get("tool_calls") or m["role"] == "tool"
        assert prompt.tools is None or (prompt.tools and all(t["type"] == "function" for t in prompt.tools))


@pytest.mark.parametrize("name", DEMO_SHAPES)
def test_demo_prompts_drop_the_final_answer(name):
    adapted, _ = adapt_all(name)
    dropped = 0
    for row, prompt in adapted:
        answer = final_answer(name, row)
        if answer is not None:
            assert answer not in texts(prompt), f"{name}: final answer leaked into the prompt"
            dropped += 1
    assert dropped >= 0.8 * len(adapted)


@pytest.mark.parametrize("name", DEMO_SHAPES)
def test_demo_files_hold_a_few_exact_duplicates(name):
    counts = Counter(json.dumps(row, sort_keys=True) for row in read_rows(name))
    assert 2 <= sum(n - 1 for n in counts.values()) <= 3


def test_demo_files_match_the_generator():
    spec = importlib.util.spec_from_file_location("make_demo_data", ROOT / "scripts" / "make_demo_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is being executed
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    assert set(module.BUILDERS) == set(DEMO_SHAPES)
    for name in DEMO_SHAPES:
        assert module.rows_for(name) == read_rows(name), f"demo/{name}.jsonl.gz is stale: rerun the script"


def test_demo_glaive_tool_calls_are_paired_and_json():
    adapted, _ = adapt_all("B1_glaive")
    with_tools = [p for _, p in adapted if p.tools]
    assert len(with_tools) >= 100
    calls = 0
    for _, prompt in adapted:
        ids: list[str] = []
        for m in prompt.messages:
            for call in m.get("tool_calls", []):
                assert call["id"] == f"call_{len(ids) + 1}"
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
                if prompt.tools:
                    assert call["function"]["name"] in {t["function"]["name"] for t in prompt.tools}
                ids.append(call["id"])
            if m["role"] == "tool":
                assert m["tool_call_id"] == ids[-1]
        calls += len(ids)
    assert calls >= 100


def test_demo_glaive_keeps_rows_whose_defs_do_not_parse():
    adapted, _ = adapt_all("B1_glaive")
    sentence = "You are a helpful assistant with access to the following functions. Use them if required -"
    broken = [p for row, p in adapted if sentence in row["system"] and not row["system"].endswith("}")]
    assert broken, "the demo should hold a few rows with truncated function definitions"
    for prompt in broken:
        assert prompt.tools is None
        assert prompt.messages[0] == {"role": "system", "content": sentence}


def test_demo_openthoughts_system_column_and_keep_system():
    row = read_rows("B5_openthoughts")[0]
    kept = to_prompt("conversations", row)
    dropped = to_prompt("conversations", row, SourceOptions(keep_system=False))
    assert kept.messages[0] == {"role": "system", "content": row["system"]}
    assert [m["role"] for m in dropped.messages] == ["user"]
    assert "<|begin_of_thought|>" not in json.dumps(dropped.messages)


# ---------------------------------------------------------------------------------------------------------------
# Registry, options, errors


def test_registry_has_exactly_the_documented_shapes():
    assert set(SHAPES) == {
        "glaive",
        "opencodeinstruct",
        "magicoder_oss",
        "magicoder_evol",
        "messages",
        "conversations",
        "swe_agent",
    }


def test_unknown_shape_is_a_value_error_listing_known_shapes():
    with pytest.raises(ValueError, match=r"known: .*glaive.*messages.*swe_agent") as info:
        to_prompt("alpaca", {"instruction": "hi"})
    assert not isinstance(info.value, (KeyError, BadRecord))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("row", [["USER: hi"], "USER: hi", None, 3])
def test_rows_that_are_not_mappings(shape, row):
    with pytest.raises(BadRecord) as info:
        to_prompt(shape, row)
    assert info.value.reason == "not_a_mapping"


def test_bad_record_is_a_value_error_with_reason_and_sentence():
    with pytest.raises(ValueError) as info:
        to_prompt("messages", {"conversations": [{"from": "human", "value": "hi"}]})
    assert info.value.reason == "missing_field"
    assert "'messages'" in str(info.value)


def test_user_template_must_contain_content():
    with pytest.raises(ValueError, match="content"):
        SourceOptions(user_template="Solve this: {problem}")


def test_user_template_applies_to_the_first_user_turn_only_and_keeps_braces():
    row = {
        "messages": [
            {"role": "user", "content": "def f(): return {'a': 1}"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and {content}?"},
        ]
    }
    options = SourceOptions(user_template="Write a solution to the following coding problem:\n{content}")
    prompt = to_prompt("messages", row, options)
    assert (
        prompt.messages[0]["content"] == "Write a solution to the following coding problem:\ndef f(): return {'a': 1}"
    )
    assert prompt.messages[2]["content"] == "and {content}?"
    assert row["messages"][0]["content"] == "def f(): return {'a': 1}", "the row must not be mutated"


VALID = {
    "glaive": {"system": "SYSTEM: x", "chat": "USER: hi"},
    "opencodeinstruct": {"input": "hi"},
    "magicoder_oss": {"problem": "hi"},
    "magicoder_evol": {"instruction": "hi"},
    "messages": {"messages": [{"role": "user", "content": "hi"}], "tools": None},
    "conversations": {"conversations": [{"from": "human", "value": "hi"}], "system": None},
    "swe_agent": {"trajectory": [{"role": "user", "text": "hi"}]},
}
JUNK = [None, 0, 1.5, True, "", "x", "[", [], [None], ["hi"], [{}], {"a": 1}, [[{"role": "user"}]]]


def junk_variants(row: dict):
    """The valid row with one column, one turn or one turn field replaced by junk."""
    for column, value in row.items():
        for junk in JUNK:
            yield {**row, column: junk}
        if isinstance(value, list):
            for junk in JUNK:
                yield {**row, column: [junk]}
                for key in value[0]:
                    yield {**row, column: [{**value[0], key: junk}]}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_junk_raises_only_bad_record(shape):
    # The prompts stage counts BadRecord by reason; any other exception would crash the whole dataset.
    assert to_prompt(shape, VALID[shape]).messages[-1]["content"] == "hi"
    outcomes = Counter()
    for row in junk_variants(VALID[shape]):
        try:
            prompt = to_prompt(shape, row)
        except BadRecord as exc:
            assert exc.reason in REASONS
            outcomes[exc.reason] += 1
        else:
            assert prompt.messages[-1]["role"] in ("user", "tool")
            outcomes["ok"] += 1
    assert len(outcomes) >= 3


# ---------------------------------------------------------------------------------------------------------------
# Single-column instruction shapes


@pytest.mark.parametrize(
    ("shape", "column", "answer"),
    [
        ("opencodeinstruct", "input", "output"),
        ("magicoder_oss", "problem", "solution"),
        ("magicoder_evol", "instruction", "response"),
    ],
)
def test_single_column_shapes(shape, column, answer):
    row = {column: "Reverse a list in place.", answer: "```python\nxs.reverse()\n```", "id": "7"}
    user = [{"role": "user", "content": "Reverse a list in place."}]
    # the answer column is not read: the conversation is the prompt, and its one slot an answer after it
    assert to_prompt(shape, row) == Prompt(messages=user, tools=None, conversation=user)
    assert turn_slots(user) == [1]

    for value, reason in [
        ("", "empty_prompt"),
        ("  \n", "empty_prompt"),
        (None, "empty_prompt"),
        (["x"], "bad_content"),
    ]:
        with pytest.raises(BadRecord) as info:
            to_prompt(shape, {**row, column: value})
        assert info.value.reason == reason
        assert repr(column) in str(info.value)

    with pytest.raises(BadRecord) as info:
        to_prompt(shape, {answer: "x"})
    assert info.value.reason == "missing_field"
    assert repr(column) in str(info.value)


def test_magicoder_template():
    options = SourceOptions(user_template="Write a solution to the following coding problem:\n{content}")
    prompt = to_prompt("magicoder_oss", {"problem": "Sum two ints.", "solution": "a+b"}, options)
    assert prompt.messages == [
        {"role": "user", "content": "Write a solution to the following coding problem:\nSum two ints."}
    ]


# ---------------------------------------------------------------------------------------------------------------
# messages


def msg(role: str, content: str | None, **extra) -> dict:
    return {"role": role, "content": content, **extra}


def test_messages_drop_the_final_answer_keep_history():
    row = {"messages": [msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "d")]}
    assert to_prompt("messages", row).messages == [msg("user", "a"), msg("assistant", "b"), msg("user", "c")]


def test_messages_ending_on_user_are_kept_whole():
    row = {"messages": [msg("system", "s"), msg("user", "a"), msg("assistant", "b"), msg("user", "c")]}
    assert to_prompt("messages", row).messages == row["messages"]


def test_messages_empty_and_none_content_are_dropped():
    row = {"messages": [msg("user", "  "), msg("assistant", None), msg("user", "q"), msg("assistant", "")]}
    assert to_prompt("messages", row).messages == [msg("user", "q")]


def test_messages_system_only_and_assistant_only():
    for turns, reason in [
        ([msg("system", "s")], "no_user_turn"),
        ([msg("assistant", "hi")], "no_user_turn"),
        ([], "no_user_turn"),
        ([msg("user", ""), msg("assistant", "x")], "empty_prompt"),
    ]:
        with pytest.raises(BadRecord) as info:
            to_prompt("messages", {"messages": turns})
        assert info.value.reason == reason


def test_messages_keep_system_false_and_late_system_turn():
    row = {"messages": [msg("system", "s"), msg("user", "a"), msg("system", "late"), msg("user", "b")]}
    assert to_prompt("messages", row).messages == row["messages"]
    assert to_prompt("messages", row, SourceOptions(keep_system=False)).messages == [msg("user", "a"), msg("user", "b")]


def test_messages_tool_calls_tool_turns_and_tools_json_string():
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    row = {
        "messages": [
            msg("user", "time?"),
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}
                ],
            },
            msg("tool", "12:00", tool_call_id="c1"),
            msg("assistant", "It is noon."),
        ],
        "tools": json.dumps(tools),
    }
    prompt = to_prompt("messages", row)
    assert prompt.tools == tools
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "tool"]
    assert prompt.messages[1]["content"] == ""
    assert prompt.messages[1]["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
    }
    assert prompt.messages[2] == msg("tool", "12:00", tool_call_id="c1")


def test_messages_empty_tool_result_is_kept():
    row = {
        "messages": [
            msg("user", "run"),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "function": {"name": "run", "arguments": "{}"}}],
            },
            msg("tool", "", tool_call_id="c1"),
        ]
    }
    assert [m["role"] for m in to_prompt("messages", row).messages] == ["user", "assistant", "tool"]


def test_messages_tools_column_variants():
    bare = {"name": "f", "description": "d", "parameters": {}}
    base = {"messages": [msg("user", "x")]}
    assert to_prompt("messages", {**base, "tools": [bare]}).tools == [{"type": "function", "function": bare}]
    assert to_prompt("messages", {**base, "tools": []}).tools is None
    assert to_prompt("messages", {**base, "tools": ""}).tools is None
    assert to_prompt("messages", {**base, "tools": None}).tools is None
    for bad in ["[{not json", "{}", [3], [{"type": "function"}]]:
        with pytest.raises(BadRecord) as info:
            to_prompt("messages", {**base, "tools": bad})
        assert info.value.reason == "unparseable_tools"


@pytest.mark.parametrize(
    ("row", "reason", "named"),
    [
        ({"conversations": [{"from": "human", "value": "x"}]}, "missing_field", "messages"),
        ({"messages": None}, "missing_field", "messages"),
        ({"messages": "user: hi"}, "bad_field_type", "messages"),
        ({"messages": ["hi"]}, "bad_turn", "messages[0]"),
        ({"messages": [msg("user", "a"), msg("human", "b")]}, "bad_turn_role", "messages[1].role"),
        ({"messages": [{"content": "a"}]}, "bad_turn_role", "messages[0].role"),
        ({"messages": [msg("user", ["part"])]}, "bad_content", "messages[0].content"),
        (
            {"messages": [msg("user", "a"), msg("assistant", "", tool_calls=[{"function": {}}])]},
            "unparseable_tool_call",
            "messages[1].tool_calls[0]",
        ),
    ],
)
def test_messages_bad_rows(row, reason, named):
    with pytest.raises(BadRecord) as info:
        to_prompt("messages", row)
    assert info.value.reason == reason
    assert named in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# conversations (ShareGPT, OpenThoughts)


def conv(*turns: tuple[str, str], **columns) -> dict:
    return {"conversations": [{"from": f, "value": v} for f, v in turns], **columns}


def test_conversations_human_gpt_mapping_and_final_answer_dropped():
    row = conv(("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d"))
    assert to_prompt("conversations", row).messages == [msg("user", "a"), msg("assistant", "b"), msg("user", "c")]


def test_conversations_starting_with_gpt_drop_leading_bot_turns():
    row = conv(("gpt", "...continued"), ("bing", "more"), ("human", "q"), ("gpt", "a"), ("human", "q2"), ("gpt", "a2"))
    assert to_prompt("conversations", row).messages == [msg("user", "q"), msg("assistant", "a"), msg("user", "q2")]


def test_conversations_leading_system_survives_leading_bot_drop():
    row = conv(("system", "be brief"), ("gpt", "hello"), ("human", "q"), ("gpt", "a"))
    assert to_prompt("conversations", row).messages == [msg("system", "be brief"), msg("user", "q")]


def test_conversations_ending_on_human_are_kept_whole():
    row = conv(("human", "a"), ("chatgpt", "b"), ("user", "c"))
    assert to_prompt("conversations", row).messages == [msg("user", "a"), msg("assistant", "b"), msg("user", "c")]


def test_conversations_all_assistant_names():
    for name in ["gpt", "chatgpt", "bing", "bard", "assistant"]:
        row = conv(("human", "a"), (name, "b"), ("human", "c"))
        assert to_prompt("conversations", row).messages[1] == msg("assistant", "b")


def test_conversations_empty_and_consecutive_turns():
    row = conv(("human", "a"), ("human", "also b"), ("gpt", ""), ("human", " "), ("gpt", "x"))
    assert to_prompt("conversations", row).messages == [msg("user", "a"), msg("user", "also b")]


def test_conversations_system_column_and_keep_system():
    row = conv(("user", "q"), ("assistant", "<|begin_of_thought|>..."), system="Your role as an assistant ...")
    assert to_prompt("conversations", row).messages == [
        msg("system", "Your role as an assistant ..."),
        msg("user", "q"),
    ]
    assert to_prompt("conversations", row, SourceOptions(keep_system=False)).messages == [msg("user", "q")]
    assert to_prompt("conversations", {**row, "system": ""}).messages == [msg("user", "q")]


@pytest.mark.parametrize(
    ("row", "reason", "named"),
    [
        (conv(("human", "a"), ("narrator", "b")), "bad_turn_role", "conversations[1].from"),
        ({"conversations": [{"value": "a"}]}, "missing_field", "'from'"),
        ({"conversations": [{"from": "human"}]}, "missing_field", "'value'"),
        ({"messages": [msg("user", "a")]}, "missing_field", "'conversations'"),
        (conv(("gpt", "only the bot")), "no_user_turn", "'conversations'"),
        (conv(), "no_user_turn", "'conversations'"),
        (conv(("system", "s")), "no_user_turn", "'conversations'"),
        (conv(("human", "a"), system=7), "bad_content", "system"),
    ],
)
def test_conversations_bad_rows(row, reason, named):
    with pytest.raises(BadRecord) as info:
        to_prompt("conversations", row)
    assert info.value.reason == reason
    assert named in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# swe_agent


def swe(role: str, text: str | None) -> dict:
    return {"cutoff_date": "01.01.2023", "mask": role == "ai", "role": role, "system_prompt": None, "text": text}


def test_swe_agent_prefix_up_to_last_observation():
    trajectory = [
        swe("system", "SETTING"),
        swe("user", "ISSUE"),
        swe("ai", "DISCUSSION\n```\nls\n```"),
        swe("user", "a.py"),
        swe("ai", "DISCUSSION\n```\nsubmit\n```"),
    ]
    prompt = to_prompt("swe_agent", {"instance_id": "x__y-1", "trajectory": trajectory})
    assert prompt.messages == [
        msg("system", "SETTING"),
        msg("user", "ISSUE"),
        msg("assistant", "DISCUSSION\n```\nls\n```"),
        msg("user", "a.py"),
    ]
    assert prompt.tools is None
    assert [
        m["role"] for m in to_prompt("swe_agent", {"trajectory": trajectory}, SourceOptions(keep_system=False)).messages
    ] == ["user", "assistant", "user"]


@pytest.mark.parametrize(
    ("trajectory", "reason", "named"),
    [
        ([swe("system", "s"), swe("assistant", "x")], "bad_turn_role", "trajectory[1].role"),
        ([{"role": "user", "content": "issue"}], "missing_field", "'text'"),
        ([swe("system", "s"), swe("ai", "x")], "no_user_turn", "'trajectory'"),
        ([swe("user", None)], "empty_prompt", "'trajectory'"),
    ],
)
def test_swe_agent_bad_rows(trajectory, reason, named):
    with pytest.raises(BadRecord) as info:
        to_prompt("swe_agent", {"trajectory": trajectory})
    assert info.value.reason == reason
    assert named in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# glaive

SENTENCE = "You are a helpful assistant with access to the following functions. Use them if required -"
NOTE_DEF = {
    "name": "create_note",
    "description": "Create a note",
    "parameters": {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"]},
}
TIME_DEF = {"name": "get_time", "description": "Current time", "parameters": {}}


def glaive(*defs: dict, chat: str, sep: str = "\n\n") -> dict:
    body = sep.join(json.dumps(d, indent=4) for d in defs)
    return {
        "system": f"SYSTEM: {SENTENCE}\n{body}"
        if defs
        else "SYSTEM: You are a helpful assistant, with no access to external functions.",
        "chat": chat,
    }


def chat(*turns: str) -> str:
    return "\n\n\n".join(turns) + "\n\n\n"


@pytest.mark.parametrize("sep", ["\n\n", "\n", "", ",\n"])
def test_glaive_two_back_to_back_defs(sep):
    row = glaive(NOTE_DEF, TIME_DEF, sep=sep, chat=chat("USER: hi", "ASSISTANT: hello <|endoftext|>"))
    prompt = to_prompt("glaive", row)
    assert prompt.tools == [{"type": "function", "function": NOTE_DEF}, {"type": "function", "function": TIME_DEF}]
    assert prompt.messages == [msg("system", SENTENCE), msg("user", "hi")]


def test_glaive_call_with_apostrophes_and_raw_newlines_then_function_response():
    row = glaive(
        NOTE_DEF,
        chat=chat(
            "USER: Note that I'm out",
            'ASSISTANT: <functioncall> {"name": "create_note", '
            '"arguments": \'{"content": "Don\'t wait\nI\'m out"}\'} <|endoftext|>',
            'FUNCTION RESPONSE: {"status": "ok"}',
            "ASSISTANT: Your note is saved. <|endoftext|>",
        ),
    )
    prompt = to_prompt("glaive", row)
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "tool"]
    call = prompt.messages[2]["tool_calls"][0]
    assert call["id"] == "call_1" and call["type"] == "function" and call["function"]["name"] == "create_note"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"content": "Don't wait\nI'm out"}
    assert prompt.messages[2]["content"] == ""
    assert prompt.messages[3] == msg("tool", '{"status": "ok"}', tool_call_id="call_1")
    assert "Your note is saved." not in json.dumps(prompt.messages)


def test_glaive_prose_and_call_in_one_turn_and_second_call_id():
    row = glaive(
        TIME_DEF,
        chat=chat(
            "USER: time?",
            'ASSISTANT: Let me check. <functioncall> {"name": "get_time", "arguments": \'{}\'} <|endoftext|>',
            'FUNCTION RESPONSE: {"time": "12:00"}',
            "ASSISTANT: It's noon. <|endoftext|>",
            "USER: and now?",
            'ASSISTANT: <functioncall> {"name": "get_time", "arguments": \'{"tz": "it\\\'s UTC"}\'} <|endoftext|>',
            'FUNCTION RESPONSE: {"time": "12:01"}',
            "ASSISTANT: 12:01. <|endoftext|>",
        ),
    )
    messages = to_prompt("glaive", row).messages
    assert messages[2]["content"] == "Let me check."
    assert messages[4] == msg("assistant", "It's noon.")
    assert messages[6]["tool_calls"][0]["id"] == "call_2"
    assert json.loads(messages[6]["tool_calls"][0]["function"]["arguments"]) == {"tz": "it's UTC"}
    assert messages[7] == msg("tool", '{"time": "12:01"}', tool_call_id="call_2")
    assert len(messages) == 8


def test_glaive_arguments_as_json_object():
    row = glaive(
        TIME_DEF,
        chat=chat(
            "USER: time?",
            'ASSISTANT: <functioncall> {"name": "get_time", "arguments": {"tz": "UTC"}} <|endoftext|>',
            'FUNCTION RESPONSE: {"time": "12:00"}',
        ),
    )
    call = to_prompt("glaive", row).messages[2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"tz": "UTC"}


def test_glaive_no_functions_and_plain_chat():
    row = glaive(
        chat=chat("USER: hi", "ASSISTANT: hello <|endoftext|>", "USER: how are you?", "ASSISTANT: fine <|endoftext|>")
    )
    prompt = to_prompt("glaive", row)
    assert prompt.tools is None
    assert prompt.messages == [
        msg("system", "You are a helpful assistant, with no access to external functions."),
        msg("user", "hi"),
        msg("assistant", "hello"),
        msg("user", "how are you?"),
    ]


def test_glaive_unparseable_defs_keep_sentence_and_row():
    row = glaive(NOTE_DEF, chat=chat("USER: hi", "ASSISTANT: hello <|endoftext|>"))
    row["system"] = row["system"][:-3]  # truncated definition
    prompt = to_prompt("glaive", row)
    assert prompt.tools is None
    assert prompt.messages == [msg("system", SENTENCE), msg("user", "hi")]
    row["system"] += "}\nnot json"
    assert to_prompt("glaive", row).tools is None


def test_glaive_keep_system_false_keeps_tools():
    prompt = to_prompt("glaive", glaive(NOTE_DEF, chat=chat("USER: hi")), SourceOptions(keep_system=False))
    assert prompt.messages == [msg("user", "hi")]
    assert prompt.tools == [{"type": "function", "function": NOTE_DEF}]


def test_glaive_empty_user_turns():
    row = glaive(
        chat=chat(
            "USER: ",
            "ASSISTANT: Hello! <|endoftext|>",
            "USER: real question",
            "ASSISTANT: answer <|endoftext|>",
            "USER: ",
        )
    )
    assert to_prompt("glaive", row).messages[1:] == [msg("assistant", "Hello!"), msg("user", "real question")]
    with pytest.raises(BadRecord) as info:
        to_prompt("glaive", glaive(chat=chat("USER: ", "ASSISTANT: Hello! <|endoftext|>")))
    assert info.value.reason == "empty_prompt"


def test_glaive_two_consecutive_assistant_turns():
    row = glaive(
        chat=chat(
            "USER: q",
            "ASSISTANT: first <|endoftext|>",
            "ASSISTANT: second <|endoftext|>",
            "USER: r",
            "ASSISTANT: last <|endoftext|>",
        )
    )
    assert to_prompt("glaive", row).messages[1:] == [
        msg("user", "q"),
        msg("assistant", "first"),
        msg("assistant", "second"),
        msg("user", "r"),
    ]


def test_glaive_malformed_call_in_dropped_answer_is_harmless_but_in_history_is_not():
    bad_call = 'ASSISTANT: <functioncall> {"name": "get_time", "arguments": oops} <|endoftext|>'
    assert to_prompt("glaive", glaive(TIME_DEF, chat=chat("USER: time?", bad_call))).messages[-1] == msg(
        "user", "time?"
    )
    with pytest.raises(BadRecord) as info:
        to_prompt("glaive", glaive(TIME_DEF, chat=chat("USER: time?", bad_call, 'FUNCTION RESPONSE: {"t": 1}')))
    assert info.value.reason == "unparseable_tool_call"
    assert "chat turn 2" in str(info.value)


@pytest.mark.parametrize(
    ("row", "reason", "named"),
    [
        ({"chat": "USER: hi"}, "missing_field", "'system'"),
        ({"system": ""}, "missing_field", "'chat'"),
        ({"system": "", "chat": "hello there\n\n\nUSER: hi"}, "unparseable_chat", "chat"),
        (
            {"system": "", "chat": chat('FUNCTION RESPONSE: {"a": 1}', "USER: hi")},
            "orphan_tool_response",
            "FUNCTION RESPONSE",
        ),
        ({"system": "", "chat": chat("ASSISTANT: hi <|endoftext|>")}, "no_user_turn", "'chat'"),
        ({"system": "", "chat": ""}, "no_user_turn", "'chat'"),
        ({"system": None, "chat": 5}, "bad_content", "chat"),
    ],
)
def test_glaive_bad_rows(row, reason, named):
    with pytest.raises(BadRecord) as info:
        to_prompt("glaive", row)
    assert info.value.reason == reason
    assert named in str(info.value)


@pytest.mark.parametrize("submit", ["DISCUSSION\nDone.\n```\nsubmit\n```", "Done, submitting.\nsubmit"])
def test_swe_agent_prompts_end_before_the_submit_aftermath(submit):
    """Trajectories often go on after `submit` (the patch shown back to the agent): the prompt must not ask the
    target for a turn after the episode's end, so it ends at the observation that preceded the submit."""
    row = {
        "trajectory": [
            {"role": "system", "text": "You are an agent."},
            {"role": "user", "text": "Fix the bug."},
            {"role": "ai", "text": "DISCUSSION\nLook.\n```\nls\n```"},
            {"role": "user", "text": "a.py b.py\nbash-$"},
            {"role": "ai", "text": submit},
            {"role": "user", "text": "diff --git a/a.py b/a.py\n(Open file: n/a)\nbash-$"},
            {"role": "ai", "text": "DISCUSSION\nThe episode is over.\n```\nexit\n```"},
        ]
    }
    prompt = to_prompt("swe_agent", row)
    assert prompt.messages[-1] == {"role": "user", "content": "a.py b.py\nbash-$"}
    assert not any("diff --git" in m["content"] for m in prompt.messages)
    # a command that merely mentions submit is not a submit
    row["trajectory"][2]["text"] = "DISCUSSION\nBefore we submit, look.\n```\nls submit_dir\n```"
    assert to_prompt("swe_agent", row).messages[-1] == {"role": "user", "content": "a.py b.py\nbash-$"}


# ---------------------------------------------------------------------------------------------------------------
# The whole conversation and its turn slots (turns: all)

# sha256 of json.dumps([[messages, tools], ...]) over each demo file's rows, as prompts.jsonl writes them: taken
# before `conversation` was added, so the `turns: last` prompts stay byte for byte what they were
DEMO_MESSAGES_SHA256 = {
    "B1_glaive": "706d64330fb51d61",
    "B2_opencodeinstruct": "48a826e68daae3b3",
    "B3_magicoder": "505e9e8914233abd",
    "B4_mixture_of_thoughts": "d4459378cb277289",
    "B5_openthoughts": "477719a227e2c574",
    "B6_ultrachat": "b36a073823f73cc4",
    "B7_sharegpt": "1805b172484e3ca2",
    "B8_sweagent": "523bf285e946291f",
}


@pytest.mark.parametrize("name", DEMO_SHAPES)
def test_demo_prompt_messages_unchanged_by_the_whole_conversation(name):
    prompts = [p for _, p in adapt_all(name)[0]]
    blob = json.dumps([[p.messages, p.tools] for p in prompts], ensure_ascii=False).encode()
    assert hashlib.sha256(blob).hexdigest()[:16] == DEMO_MESSAGES_SHA256[name]
    for p in prompts:  # the prompt is the conversation cut after its last user/tool turn
        assert p.conversation[: len(p.messages)] == p.messages


def roles(conversation: list[dict]) -> str:
    return "".join(m["role"][0].upper() + ("c" if m.get("tool_calls") else "") for m in conversation)


@pytest.mark.parametrize(
    ("name", "row", "shape", "slots"),
    [
        # a call, its FUNCTION RESPONSE as a tool turn, then two assistant turns in a row: one answer for both
        ("B1_glaive", 10, "SUAcTAA", [2, 4]),
        ("B6_ultrachat", 0, "UAUA", [1, 3]),
        # ends on the user: one more answer than the source had
        ("B7_sharegpt", 26, "UAUAUAU", [1, 3, 5, 7]),
        # observations are user turns; the last action is the submit
        ("B8_sweagent", 0, "SUAUAUA", [2, 4, 6]),
    ],
)
def test_demo_turn_slots(name, row, shape, slots):
    prompt = to_prompt(DEMO_SHAPES[name], read_rows(name)[row])
    assert roles(prompt.conversation) == shape
    assert turn_slots(prompt.conversation) == slots
    if name == "B8_sweagent":
        assert prompt.conversation[-1]["content"].rstrip().endswith("```\nsubmit\n```")


def test_demo_turn_slot_counts():
    """Every multi-turn demo source gives each conversation at least one slot, and more than one on average."""
    for name in ("B1_glaive", "B6_ultrachat", "B7_sharegpt", "B8_sweagent"):
        counts = [len(turn_slots(p.conversation)) for _, p in adapt_all(name)[0]]
        assert min(counts) >= 1 and sum(counts) / len(counts) > 1.5, name


def test_turn_slots_rules():
    assert turn_slots([msg("system", "s"), msg("assistant", "hi"), msg("user", "q")]) == [3]
    assert turn_slots([msg("user", "q"), msg("assistant", "a"), msg("assistant", "b")]) == [1]
    assert turn_slots([msg("user", "q"), msg("assistant", "", tool_calls=[{}]), msg("tool", "r")]) == [1, 3]
    assert turn_slots([]) == []


def test_swe_agent_conversation_ends_at_submit():
    row = {
        "trajectory": [swe("user", "Fix."), swe("ai", "Done.\n```\nsubmit\n```"), swe("user", "diff"), swe("ai", "x")]
    }
    prompt = to_prompt("swe_agent", row)
    assert [m["content"] for m in prompt.conversation] == ["Fix.", "Done.\n```\nsubmit\n```"]
    assert turn_slots(prompt.conversation) == [1]


def test_glaive_conversation_keeps_the_final_answer_unless_its_call_is_malformed():
    good = 'ASSISTANT: <functioncall> {"name": "get_time", "arguments": "{}"} <|endoftext|>'
    prompt = to_prompt("glaive", glaive(TIME_DEF, chat=chat("USER: time?", good)))
    assert roles(prompt.conversation) == "SUAc" and turn_slots(prompt.conversation) == [2]
    bad = 'ASSISTANT: <functioncall> {"name": "get_time", "arguments": oops} <|endoftext|>'
    prompt = to_prompt("glaive", glaive(TIME_DEF, chat=chat("USER: time?", bad)))
    assert roles(prompt.conversation) == "SU" and turn_slots(prompt.conversation) == [2]
