"""What an assistant turn does, to tell whether a regenerated turn did what the source's turn did (`turns: all`).

A turn either answers in text or calls tools. A source turn's calls are its OpenAI `tool_calls`; a stored answer's
are the chat parser's `tool_calls` where a server parsed them, else they are read from the text the target wrote,
in the formats of the templates draftdata ships: `<tool_call>{json}</tool_call>` (chatml, hermes_tools,
qwen3_thinking and the demo's tiny target) and Llama 3's one `{"name": ..., "parameters": ...}` per line. An agent
whose actions are shell commands in its text (SWE-agent) acts by its last fenced command. Two turns diverge when
their actions differ: kind, number of calls, names in order, and arguments compared as decoded JSON (key order and
spacing do not matter). Pure functions: the caller decodes ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

TEXT: Literal["text"] = "text"
CALLS: Literal["calls"] = "calls"
COMMAND: Literal["command"] = "command"

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```[^\n]*\n(.*?)\n\s*```", re.DOTALL)


@dataclass(frozen=True)
class Action:
    kind: Literal["text", "calls", "command"]
    # (function name, decoded arguments) per call, in order; for a command, one (normalised command, None)
    calls: tuple[tuple[str, Any], ...] = ()


def action(message: dict, commands: bool = False) -> Action:
    """The action of an assistant message ({"content", "tool_calls"?}): its calls if it has any, else those written
    in its content, else its text. `commands`: the source acts by fenced shell commands (swe_agent)."""
    if message.get("tool_calls"):
        return Action(
            CALLS, tuple(_call(c["function"]["name"], c["function"].get("arguments")) for c in message["tool_calls"])
        )
    content = message.get("content") or ""
    if commands:
        fenced = _FENCED.findall(content)
        return Action(COMMAND, ((" ".join(fenced[-1].split()), None),)) if fenced else Action(TEXT)
    calls = written_calls(content)
    return Action(CALLS, tuple(calls)) if calls else Action(TEXT)


def written_calls(text: str) -> list[tuple[str, Any]]:
    """Calls written in the text, after any reasoning: `<tool_call>` blocks, else Llama 3's JSON lines."""
    text = text.rsplit("</think>", 1)[-1]
    blocks = _TOOL_CALL.findall(text)
    if blocks:
        return [call for call in map(_json_call, blocks) if call is not None]
    return [call for call in map(_json_call, text.splitlines()) if call is not None]


def diverged(source_turn: dict, answer: dict, commands: bool = False) -> bool:
    """Whether the regenerated `answer` acts otherwise than the source's assistant turn (a text answer to a text
    turn is a match: only calls and commands change what the conversation sees next)."""
    return action(source_turn, commands) != action(answer, commands)


def _json_call(text: str) -> tuple[str, Any] | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    for key in ("arguments", "parameters"):  # Llama 3 writes "parameters"
        if key in call:
            return _call(call["name"], call[key])
    return None  # a JSON object with a name but no arguments is text (say, a record the answer shows)


def _call(name: str, arguments: Any) -> tuple[str, Any]:
    """OpenAI sends arguments as a JSON string, a template's call holds the object: both compare decoded."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: compared as the string it is
    return name, {} if arguments is None else arguments
