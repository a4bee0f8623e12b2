"""Adapters from source-dataset rows to OpenAI-style chat prompts.

Each shape turns one row of a real dataset (schemas and quirks: shared/SOURCES.md) into the request we send to
the target: `messages` ending at the last user/tool turn, the original final answer dropped, earlier assistant
turns kept as history, plus `tools` where the source has function definitions; and the whole adapted
`conversation`, the turns after that cut included, from which `turns: all` regenerates every assistant turn
(`turn_slots` says which). Pure functions, stdlib only:
reading files and counting skips is the caller's job; a row that cannot become a prompt raises `BadRecord`
with a short reason code so skips can be counted by reason.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from draftdata.config.schema import SHAPES as SHAPE_NAMES


class BadRecord(ValueError):
    """A row that cannot become a prompt.

    `.reason` is a short snake_case code for counting skips; str(exc) is a sentence naming the field.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Prompt:
    messages: list[dict]
    tools: list[dict] | None
    # The same conversation uncut: the source's answers after `messages` too (its final answer, swe-agent's last
    # action up to `submit`), under the same rules (empty turns dropped, keep_system, user_template).
    conversation: list[dict]


@dataclass(frozen=True)
class SourceOptions:
    # B5's system column forces the 114k tag format on the target; a user may want the target's own style.
    keep_system: bool = True
    # Applied to the first user turn, e.g. Magicoder's "Write a solution to the following coding problem:\n{content}".
    user_template: str | None = None

    def __post_init__(self) -> None:
        if self.user_template is not None and "{content}" not in self.user_template:
            raise ValueError(f"user_template must contain '{{content}}', got {self.user_template!r}")


Adapter = Callable[[Mapping, SourceOptions], Prompt]
SHAPES: dict[str, Adapter] = {}

_PROMPT_END_ROLES = ("user", "tool")


def to_prompt(shape: str, row: dict, options: SourceOptions = SourceOptions()) -> Prompt:
    """Adapt one row of a `shape`-shaped dataset. Raises BadRecord for a bad row, ValueError for an unknown shape."""
    try:
        adapt = SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown source shape {shape!r}; known: {', '.join(sorted(SHAPES))}") from None
    return adapt(row, options)


def turn_slots(conversation: list[dict]) -> list[int]:
    """Where the target answers, in order: the index of each assistant turn that follows a user or tool turn, and
    the conversation's length when it ends on a user or tool turn (an answer the source never had). Assistant turns
    right after another assistant turn (or a system turn) are not slots: one answer stands for the whole run."""
    slots = [
        i
        for i, m in enumerate(conversation)
        if m["role"] == "assistant" and i > 0 and conversation[i - 1]["role"] in _PROMPT_END_ROLES
    ]
    if conversation and conversation[-1]["role"] in _PROMPT_END_ROLES:
        slots.append(len(conversation))
    return slots


def _shape(name: str) -> Callable[[Adapter], Adapter]:
    """Register an adapter under `name`, guarding it against rows that are not mappings."""

    if name not in SHAPE_NAMES:  # config checks source.shape against its own list: keep the two one
        raise AssertionError(f"shape {name!r} is not in draftdata.config.schema.SHAPES")

    def register(adapt: Adapter) -> Adapter:
        @functools.wraps(adapt)
        def checked(row: Mapping, options: SourceOptions = SourceOptions()) -> Prompt:
            if not isinstance(row, Mapping):
                raise BadRecord("not_a_mapping", f"row is a {type(row).__name__}, not a mapping of column to value")
            return adapt(row, options)

        SHAPES[name] = checked
        return checked

    return register


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers


def _column(row: Mapping, name: str) -> Any:
    if name not in row:
        raise BadRecord("missing_field", f"required column {name!r} is missing (columns: {', '.join(map(str, row))})")
    return row[name]


def _key(turn: Mapping, key: str, where: str) -> Any:
    if key not in turn:
        raise BadRecord("missing_field", f"{where} has no {key!r} key")
    return turn[key]


def _list_column(row: Mapping, name: str) -> list:
    value = _column(row, name)
    # A parquet null is as good as an absent column for counting skips.
    if value is None:
        raise BadRecord("missing_field", f"required column {name!r} is null")
    # Tuples come from some loaders; a string here is a JSON-encoded list we do not guess at.
    if not isinstance(value, (list, tuple)):
        raise BadRecord("bad_field_type", f"column {name!r} is a {type(value).__name__}, expected a list of turns")
    return list(value)


def _turn(turn: Any, where: str) -> Mapping:
    if not isinstance(turn, Mapping):
        raise BadRecord("bad_turn", f"{where} is a {type(turn).__name__}, not a mapping")
    return turn


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRecord("bad_content", f"{where} is a {type(value).__name__}, expected a string")
    return value


def _role(value: Any, roles: Mapping[str, str], where: str) -> str:
    role = roles.get(value) if isinstance(value, str) else None
    if role is None:
        raise BadRecord("bad_turn_role", f"{where} is {value!r}; expected one of {', '.join(roles)}")
    return role


def _has_payload(message: dict) -> bool:
    # An empty tool result still answers a call: dropping it would leave an unanswered tool_call, which
    # OpenAI-compatible servers reject. Other empty turns carry nothing.
    return message["role"] == "tool" or bool(message["content"].strip()) or bool(message.get("tool_calls"))


def _finish(
    messages: list[dict],
    tools: list[dict] | None,
    options: SourceOptions,
    source: str,
    *,
    drop_leading_assistant: bool = False,
) -> Prompt:
    """Apply the prompt rule common to every shape to a whole conversation; `source` names it in errors. The
    prompt ends at the last user/tool turn; `conversation` keeps what follows it."""
    turns = [m for m in messages if _has_payload(m)]
    if not options.keep_system:
        turns = [m for m in turns if m["role"] != "system"]
    if not any(m["role"] == "user" for m in turns):
        if any(m["role"] == "user" for m in messages):
            raise BadRecord("empty_prompt", f"{source}: every user turn is empty or whitespace")
        raise BadRecord("no_user_turn", f"{source}: the conversation has no user turn")
    if drop_leading_assistant:
        first_user = next(i for i, m in enumerate(turns) if m["role"] == "user")
        turns = [m for i, m in enumerate(turns) if i > first_user or m["role"] != "assistant"]
    if options.user_template is not None:
        first_user = next(i for i, m in enumerate(turns) if m["role"] == "user")
        content = turns[first_user]["content"]
        # replace, not str.format: templates and prompts are full of literal braces (code, JSON).
        turns[first_user] = {**turns[first_user], "content": options.user_template.replace("{content}", content)}
    last = max(i for i, m in enumerate(turns) if m["role"] in _PROMPT_END_ROLES)
    return Prompt(messages=turns[: last + 1], tools=tools or None, conversation=turns)


def _single_turn(row: Mapping, column: str, options: SourceOptions) -> Prompt:
    content = _text(_column(row, column), f"column {column!r}")
    return _finish([{"role": "user", "content": content}], None, options, f"column {column!r}")


# ---------------------------------------------------------------------------------------------------------------
# Single-column instruction datasets: the answer column is simply not read.


@_shape("opencodeinstruct")
def _opencodeinstruct(row: Mapping, options: SourceOptions) -> Prompt:
    return _single_turn(row, "input", options)


@_shape("magicoder_oss")
def _magicoder_oss(row: Mapping, options: SourceOptions) -> Prompt:
    return _single_turn(row, "problem", options)


@_shape("magicoder_evol")
def _magicoder_evol(row: Mapping, options: SourceOptions) -> Prompt:
    return _single_turn(row, "instruction", options)


# ---------------------------------------------------------------------------------------------------------------
# OpenAI-style `messages` (Mixture-of-Thoughts, UltraChat, tool-calling sets)

_OPENAI_ROLES = {role: role for role in ("system", "user", "assistant", "tool")}


@_shape("messages")
def _messages(row: Mapping, options: SourceOptions) -> Prompt:
    turns = _list_column(row, "messages")
    messages = [_openai_message(turn, f"messages[{i}]") for i, turn in enumerate(turns)]
    return _finish(messages, _tools_column(row.get("tools")), options, "column 'messages'")


def _openai_message(turn: Any, where: str) -> dict:
    turn = _turn(turn, where)
    role = _role(turn.get("role"), _OPENAI_ROLES, f"{where}.role")
    # Content may be absent on an assistant turn that only calls tools.
    message: dict = {"role": role, "content": _text(turn.get("content"), f"{where}.content")}
    calls = turn.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, (list, tuple)):
            raise BadRecord("unparseable_tool_call", f"{where}.tool_calls is a {type(calls).__name__}, expected a list")
        message["tool_calls"] = [_openai_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    if role == "tool" and turn.get("tool_call_id") is not None:
        message["tool_call_id"] = _text(turn["tool_call_id"], f"{where}.tool_call_id")
    return message


def _openai_tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise BadRecord("unparseable_tool_call", f"{where} has no function.name")
    arguments = function.get("arguments")
    # OpenAI sends arguments as a JSON string; some datasets store the decoded object.
    if arguments is None or isinstance(arguments, Mapping):
        arguments = json.dumps(arguments or {}, ensure_ascii=False)
    elif not isinstance(arguments, str):
        raise BadRecord("unparseable_tool_call", f"{where}.function.arguments is a {type(arguments).__name__}")
    out: dict = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        out = {"id": _text(call["id"], f"{where}.id"), **out}
    return out


def _tools_column(value: Any) -> list[dict] | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise BadRecord("unparseable_tools", f"column 'tools' is a string that is not JSON: {exc}") from None
    if not isinstance(value, (list, tuple)):
        raise BadRecord("unparseable_tools", f"column 'tools' is a {type(value).__name__}, expected a list")
    return [_openai_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)]


def _openai_tool(tool: Any, where: str) -> dict:
    # Deep copies: a prompt must not share nested dicts with the caller's row.
    if isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping):
        return copy.deepcopy(dict(tool))
    # A bare function definition ({name, description, parameters}) is what OpenAI nests under "function".
    if isinstance(tool, Mapping) and isinstance(tool.get("name"), str):
        return {"type": "function", "function": copy.deepcopy(dict(tool))}
    raise BadRecord("unparseable_tools", f"{where} is neither an OpenAI tool nor a function definition")


# ---------------------------------------------------------------------------------------------------------------
# ShareGPT-style `conversations` (OpenThoughts-114k / OpenThoughts3, ShareGPT)

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@_shape("conversations")
def _conversations(row: Mapping, options: SourceOptions) -> Prompt:
    turns = _list_column(row, "conversations")
    # OpenThoughts-114k keeps its system prompt in a column, not in the turns.
    messages = (
        [{"role": "system", "content": _text(row["system"], "column 'system'")}]
        if row.get("system") is not None
        else []
    )
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        turn = _turn(turn, where)
        role = _role(_key(turn, "from", where), _SHAREGPT_ROLES, f"{where}.from")
        messages.append({"role": role, "content": _text(_key(turn, "value", where), f"{where}.value")})
    # Scraped ShareGPT rows may open with the bot's words (a split conversation); EAGLE-style loaders skip them.
    return _finish(messages, None, options, "column 'conversations'", drop_leading_assistant=True)


# ---------------------------------------------------------------------------------------------------------------
# nebius/SWE-agent-trajectories: observations are user turns, so the prompt is the original prefix up to the
# last observation, never a chain of regenerated actions.

_SWE_ROLES = {"system": "system", "user": "user", "ai": "assistant"}
# An action is a thought and one command, fenced (```\nsubmit\n```) or, in some agents' formats, on the last line.
_SWE_SUBMIT = re.compile(r"```[^\n]*\n\s*submit\s*\n\s*```|(?:^|\n)\s*submit\s*$")


@_shape("swe_agent")
def _swe_agent(row: Mapping, options: SourceOptions) -> Prompt:
    messages = []
    for i, turn in enumerate(_list_column(row, "trajectory")):
        where = f"trajectory[{i}]"
        turn = _turn(turn, where)
        role = _role(_key(turn, "role", where), _SWE_ROLES, f"{where}.role")
        messages.append({"role": role, "content": _text(_key(turn, "text", where), f"{where}.text")})
        if role == "assistant" and _SWE_SUBMIT.search(messages[-1]["content"]):
            break  # the episode ends at `submit`: what follows (the patch shown back) asks for no further turn
    return _finish(messages, None, options, "column 'trajectory'")


# ---------------------------------------------------------------------------------------------------------------
# glaiveai/glaive-function-calling-v2: two strings, `system` (sentence + JSON defs) and `chat` (tagged turns)

_GLAIVE_ROLES = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
# Turns are joined by "\n\n\n"; a tag at the start of a line is enough, so a row with a different separator
# still splits instead of becoming one giant user turn.
_GLAIVE_TAG = re.compile(r"^(USER|ASSISTANT|FUNCTION RESPONSE):", re.MULTILINE)
_GLAIVE_CALL = "<functioncall>"
_GLAIVE_EOS = "<|endoftext|>"
# {"name": "f", "arguments": '{...}'}: the single-quoted arguments are not JSON and may hold apostrophes,
# so the quoted part runs to the last quote before the closing brace.
_GLAIVE_QUOTED_CALL = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*\'(.*)\'\s*\}', re.DOTALL
)


@_shape("glaive")
def _glaive(row: Mapping, options: SourceOptions) -> Prompt:
    sentence, tools = _glaive_system(_text(_column(row, "system"), "column 'system'"))
    turns = _glaive_turns(_text(_column(row, "chat"), "column 'chat'"))
    kept = [i for i, (role, body) in enumerate(turns) if role == "tool" or (role == "user" and body.strip())]
    # With nothing to end on, only the (empty) user turns matter: they tell empty_prompt from no_user_turn.
    prompt = turns[: kept[-1] + 1] if kept else [turn for turn in turns if turn[0] == "user"]
    try:
        messages = _glaive_messages(turns)
    except BadRecord:  # a malformed call in the final answer must not reject the row: the prompt ends before it
        messages = _glaive_messages(prompt)
    return _finish([{"role": "system", "content": sentence}, *messages], tools, options, "column 'chat'")


def _glaive_system(text: str) -> tuple[str, list[dict] | None]:
    """Split `SYSTEM: <sentence> {def}{def}…` into the sentence and OpenAI tools (None when the defs don't parse)."""
    text = text.strip().removeprefix("SYSTEM:").strip()
    start = text.find("{")
    if start < 0:
        return text, None
    return text[:start].strip(), _glaive_defs(text[start:])


def _glaive_defs(text: str) -> list[dict] | None:
    # All or nothing: a partial tool list would show the target fewer functions than the chat uses.
    decoder = json.JSONDecoder()
    tools, pos = [], 0
    while True:
        # The separator between back-to-back defs is unverified: allow whitespace and a comma.
        while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
            pos += 1
        if pos == len(text):
            return tools
        try:
            definition, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if not isinstance(definition, dict) or not isinstance(definition.get("name"), str):
            return None
        tools.append({"type": "function", "function": definition})


def _glaive_turns(chat: str) -> list[tuple[str, str]]:
    """(role, raw body) per tagged turn."""
    chat = chat.strip()
    if not chat:
        return []
    tags = list(_GLAIVE_TAG.finditer(chat))
    if not tags or tags[0].start() != 0:
        raise BadRecord(
            "unparseable_chat", "column 'chat' does not start with a USER:/ASSISTANT:/FUNCTION RESPONSE: tag"
        )
    ends = [tag.start() for tag in tags[1:]] + [len(chat)]
    return [(_GLAIVE_ROLES[tag[1]], chat[tag.end() : end]) for tag, end in zip(tags, ends, strict=True)]


def _glaive_messages(turns: list[tuple[str, str]]) -> list[dict]:
    messages: list[dict] = []
    calls = 0
    for index, (role, body) in enumerate(turns):
        where = f"chat turn {index + 1} ({role})"
        if role == "assistant":
            message, tool_calls = _glaive_assistant(body, where, first_id=calls + 1)
            calls += len(tool_calls)
            messages.append(message)
        elif role == "tool":
            if not calls:
                raise BadRecord("orphan_tool_response", f"{where}: FUNCTION RESPONSE with no preceding <functioncall>")
            messages.append({"role": "tool", "content": body.strip(), "tool_call_id": f"call_{calls}"})
        else:
            messages.append({"role": "user", "content": body.strip()})
    return messages


def _glaive_assistant(body: str, where: str, first_id: int) -> tuple[dict, list[dict]]:
    """Prose plus zero or more `<functioncall> {...} <|endoftext|>` segments -> assistant message."""
    prose, *segments = body.split(_GLAIVE_CALL)
    # Anyscale's loader saw "prose ASSISTANT: <functioncall>…" inside one turn; the inner tag is not content.
    texts = [re.sub(r"\s*ASSISTANT:\s*$", "", prose)]
    tool_calls = []
    for offset, segment in enumerate(segments):
        # The call ends at the end-of-text marker; anything after it is more prose.
        call_text, _, tail = segment.partition(_GLAIVE_EOS)
        name, arguments = _glaive_call(call_text, where)
        tool_calls.append(
            {
                "id": f"call_{first_id + offset}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
        texts.append(tail)
    texts = [text.replace(_GLAIVE_EOS, "").strip() for text in texts]
    message: dict = {"role": "assistant", "content": " ".join(text for text in texts if text)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message, tool_calls


def _glaive_call(text: str, where: str) -> tuple[str, dict]:
    text = text.strip()
    match = _GLAIVE_QUOTED_CALL.fullmatch(text)
    if match:
        name, arguments = json.loads(match[1]), _glaive_arguments(match[2], where)
    else:
        # Some calls carry the arguments as a plain JSON object or JSON string instead of the quoted form.
        try:
            call = json.loads(text, strict=False)
        except ValueError:
            raise BadRecord("unparseable_tool_call", f"{where}: cannot parse the <functioncall> payload") from None
        if not isinstance(call, dict):
            raise BadRecord("unparseable_tool_call", f"{where}: the <functioncall> payload is not an object")
        name, arguments = call.get("name"), call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _glaive_arguments(arguments, where)
    if not isinstance(name, str) or not name:
        raise BadRecord("unparseable_tool_call", f"{where}: the <functioncall> has no function name")
    if not isinstance(arguments, dict):
        raise BadRecord("unparseable_tool_call", f"{where}: the <functioncall> arguments are not a JSON object")
    return name, arguments


def _glaive_arguments(text: str, where: str) -> Any:
    # strict=False accepts the raw newlines found inside argument strings; "\'" is a Python escape JSON lacks.
    for candidate in (text, text.replace("\\'", "'")):
        try:
            return json.loads(candidate, strict=False) if candidate.strip() else {}
        except ValueError:
            continue
    raise BadRecord("unparseable_tool_call", f"{where}: the <functioncall> arguments are not valid JSON")
