"""A source conversation regenerated turn by turn, on-policy (`turns: all`), derived from the response store.

Turn t's request holds the source's system, user and tool turns before its slot (where the target answers: the
prompt record's `slots`, from sources.shapes.turn_slots) and, in place of each earlier source assistant turn, the
target's own stored answer. Where that answer made the same calls as the source, the source's tool results
follow it (their `tool_call_id`s rewritten to the answer's calls); where it acted otherwise, the conversation ends
there (`on_tool_divergence: stop`) or goes on with the source's results anyway (`keep_source`, when there is one
result per call). Each turn is keyed by `request_key` over its
exact prompt ids, like any request: `replay` walks a conversation through the answers stored under those keys and
says which turns are done, which one to request next, or why the conversation ended. Nothing but the store holds a
conversation's state: the same answers and template give the same keys in any process, so a rerun resumes at the
first turn not stored. Pure: the caller brings the lookup, the tokenizer and the cache of renders.

Prompt ids. Where the template writes the history as it was (turn t's rendered prompt starts with turn t-1's
prompt followed by the answer's own tokens), turn t's ids are turn t-1's ids + the answer's ids + the rest
encoded: the target's own tokens, exactly, never re-tokenised. Where it rewrites the history (Qwen3-style templates
drop earlier reasoning), they are the rendered prompt's ids, as a chat server renders it; `prefix_stable` then says
so from the ids.

Renders. A rerun walks every conversation over its stored turns, and rendering each turn through the chat template
costs milliseconds. `TurnRenders` holds the ids of turns rendered before, by turn key: a hash of the conversation's
id (a hash of its whole source and tools: all the template reads of it but the answers) and of every answer before
the turn (text, reasoning, tool calls, ids). The template, tokenizer and kwargs are the caller's fingerprint (one
`TurnRenders` per fingerprint). A changed source, answer, template or kwargs is a new key; a turn not cached, or cached
in a form that cannot be read, is rendered.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from draftdata.generate.accounting import needs_request
from draftdata.generate.plan.actions import diverged, written_calls
from draftdata.generate.request import Planned, request_keys
from draftdata.generate.store import StoredResponse
from draftdata.model.tokenizer import assistant_message, render_prompt_ids, template_messages
from draftdata.model.tokenizer import prefix_stable as prefix_stable  # tokenize decides with it too
from draftdata.util.hashing import canonical_json, content_hash, ids_json

# Why a conversation ended: its source has no turn left, a turn acted otherwise than the source's (or its calls
# cannot be paired with the source's results), or an answer was cut by max_tokens (a cut answer cannot be history).
SOURCE_EXHAUSTED = "source_exhausted"
TOOL_CALL_DIVERGED = "tool_call_diverged"
TRUNCATED = "truncated"
STOP, KEEP_SOURCE = "stop", "keep_source"  # on_tool_divergence
# A cached render: a turn's ids as `ids_json` text, or "+" and the ids that follow the previous turn's ids and its
# answer's (the template wrote the history as it was): each row holds what its turn adds, not the whole history.


@dataclass
class TurnRenders:
    """The turns' ids rendered under one template, tokenizer and kwargs: (conversation id, turn key) -> a cached
    render. `new`: those rendered since the caller last took them (to keep them for the next run)."""

    cached: dict[tuple[str, str], str] = field(default_factory=dict)
    new: dict[tuple[str, str], str] = field(default_factory=dict)

    def get(self, conv: str, turn: str) -> str | None:
        ids = self.cached.get((conv, turn))
        return ids if ids is not None and _readable(ids) else None  # unreadable: rendered again

    def put(self, conv: str, turn: str, ids: str) -> None:
        self.cached[conv, turn] = self.new[conv, turn] = ids

    def take_new(self) -> dict[tuple[str, str], str]:
        new, self.new = self.new, {}
        return new


def _readable(cached: str) -> bool:
    """Whether a cached render reads as `ids_json` text (a cut or mangled row is rendered again). Checked byte-wise:
    a regular expression or JSON over a long conversation's ids would cost as much as rendering it."""
    body = cached[2:-1] if cached.startswith("+[") else cached[1:-1] if cached.startswith("[") else None
    if body is None or not cached.endswith("]") or body.startswith(",") or body.endswith(","):
        return False
    return not body.encode().translate(None, b"0123456789,")


@dataclass(frozen=True)
class TurnRendering:
    """What a turn's prompt ids and store key are made with: the target's tokenizer and template kwargs, what a
    request key holds besides the ids, and the turns rendered before (None: every turn is rendered)."""

    tok: Any
    template_kwargs: dict
    model_fp: str
    sampling: dict
    max_tokens: int
    renders: TurnRenders | None = None

    @cached_property
    def key_of(self) -> Callable[[str], str]:
        """The request key of a turn's ids as `ids_json` text."""
        return request_keys(self.model_fp, self.sampling, self.max_tokens)


@dataclass
class Replay:
    done: list[tuple[Planned, StoredResponse]]  # the turns stored with an answer, in order
    next: Planned | None  # the first turn without a usable answer (missing or parked): what to request
    ended: str | None  # why there is no next turn


@dataclass
class _Sent:
    """A turn as sent and the ids of its answer: what the next turn's ids grow from. Its rendered text is wanted
    only when the next turn is rendered: a turn whose ids were cached renders it then."""

    messages: list[dict]
    planned: Planned
    output_ids: list[int] | None
    text: str | None = None

    def rendered(self, rendering: TurnRendering, tools: list[dict] | None) -> str:
        if self.text is None:
            self.text = _render(rendering, self.messages, tools)
        return self.text


def replay(
    conv: dict,
    lookup: Callable[[str], StoredResponse | None],
    rendering: TurnRendering,
    on_tool_divergence: str = STOP,
    commands: bool = False,
) -> Replay:
    """Walk the prompt record `conv` ({"id", "conversation", "slots", "tools"?, "where"?}) through the stored answers.
    `commands`: the source acts by shell commands in its text (swe_agent), compared as actions."""
    walk = turns(conv, rendering, on_tool_divergence, commands)
    try:
        planned = next(walk)
        while True:
            planned = walk.send(lookup(planned.key))
    except StopIteration as end:
        return end.value


def turns(
    conv: dict, rendering: TurnRendering, on_tool_divergence: str = STOP, commands: bool = False
) -> Generator[Planned, StoredResponse | None, Replay]:
    """`replay` one turn at a time: yields each turn's request and is sent its stored answer (None: not stored),
    so a caller can look up many conversations' turns in one query, or send a turn and step on once it is
    answered. Returns the replay at the first turn without a usable answer, or where the conversation ends."""
    if on_tool_divergence not in (STOP, KEEP_SOURCE):
        raise ValueError(f"on_tool_divergence is {on_tool_divergence!r}, expected {STOP!r} or {KEEP_SOURCE!r}")
    source, slots = conv["conversation"], conv["slots"]
    history: list[dict] = []
    consumed = 0  # source messages before this index are in `history`
    sent: _Sent | None = None
    done: list[tuple[Planned, StoredResponse]] = []
    turn_key = ""  # no answer before turn 0
    for t, slot in enumerate(slots):
        messages = history + source[consumed:slot]
        planned, text = _plan_turn(conv, t, messages, [p.key for p, _ in done], rendering, sent, turn_key)
        stored = yield planned
        if needs_request(stored):
            return Replay(done, planned, None)
        done.append((planned, stored))
        if stored.finish_reason == "length":
            return Replay(done, None, TRUNCATED)
        answer = answer_message(stored, rendering.tok)
        follow = _follow(source, slot, answer, t + 1 == len(slots), on_tool_divergence == STOP, commands)
        if isinstance(follow, str):
            return Replay(done, None, follow)
        results, consumed = follow
        history = messages + [answer] + results
        sent = _Sent(messages, planned, stored.output_ids, text)
        turn_key = _next_turn_key(turn_key, stored)
    return Replay(done, None, SOURCE_EXHAUSTED)


def _follow(
    source: list[dict], slot: int, answer: dict, last: bool, stop: bool, commands: bool
) -> tuple[list[dict], int] | str:
    """After the answer at `slot`: the source's tool results that follow it (paired with its calls) and the index
    of the source message after them, or why the conversation ends there."""
    turn_end = _after(source, slot, ("assistant",))
    if turn_end > slot and stop and diverged(_merged(source[slot:turn_end]), answer, commands):
        return TOOL_CALL_DIVERGED
    if last:
        return SOURCE_EXHAUSTED
    consumed = _after(source, turn_end, ("tool",))
    results = paired_results(source[turn_end:consumed], source[slot:turn_end], answer)
    return TOOL_CALL_DIVERGED if results is None else (results, consumed)


def answer_message(r: StoredResponse, tok) -> dict:
    """A stored answer as an assistant turn of the history: as a chat server's parsers split it (text, reasoning,
    tool calls) where they ran, else every token the target wrote less its end-of-turn token (the stored text is
    decoded without special tokens, so it lacks markers such as <tool_call> and <think>)."""
    if r.reasoning or r.tool_calls or not r.output_ids:
        return assistant_message({"text": r.text, "reasoning_content": r.reasoning, "tool_calls": r.tool_calls})
    ids = r.output_ids[:-1] if r.output_ids[-1] in tok.all_special_ids else r.output_ids
    return {"role": "assistant", "content": _decode(tok, ids)}


def paired_results(results: list[dict], source_turn: list[dict], answer: dict) -> list[dict] | None:
    """The source's tool results, each pointed at the answer's call it answers: the call its `tool_call_id` names
    in the source turn, else the call at its position. None when they cannot be paired one to one (a call left
    unanswered, or a result with no call), which a server refuses and a template cannot render."""
    call_ids = _call_ids(answer)
    if len(results) != len(call_ids):
        return None
    source_ids = [c.get("id") for m in source_turn for c in m.get("tool_calls") or []]
    order = [source_ids.index(r.get("tool_call_id")) if r.get("tool_call_id") in source_ids else -1 for r in results]
    if sorted(order) != list(range(len(call_ids))):  # no ids to go by (or not one per call): by position
        order = list(range(len(call_ids)))
    return [_answering(result, call_ids[j]) for result, j in zip(results, order)]


def _plan_turn(
    conv: dict,
    t: int,
    messages: list[dict],
    keys: list[str],
    rendering: TurnRendering,
    sent: _Sent | None,
    turn_key: str,
) -> tuple[Planned, str | None]:
    """Turn t's request, and its rendered text where it was rendered (None: its ids were cached)."""
    tools = conv.get("tools")
    cached = rendering.renders.get(conv["id"], turn_key) if rendering.renders is not None else None
    ids: list[int] | str | None = _cached_ids(cached, sent) if cached is not None else None
    text = None
    if ids is None:
        text, ids, row = _prompt_ids(rendering, messages, tools, sent)
        if rendering.renders is not None:
            rendering.renders.put(conv["id"], turn_key, row)
    # the turn's id names its place: the conversation, the turn, and the answers (by key) it was built on
    record = {"id": content_hash({"prompt": conv["id"], "turn": t, "keys": keys}), "conversation": conv["id"]}
    record.update(turn=t, messages=messages, **({"tools": tools} if tools else {}))
    if "where" in conv:
        record["where"] = conv["where"]
    return Planned(record, rendering.key_of(ids if isinstance(ids, str) else ids_json(ids)), ids), text


def _next_turn_key(turn_key: str, r: StoredResponse) -> str:
    """The turn key after answer `r`: everything of the answer that the history or the next ids are made of."""
    answer = canonical_json([r.text, r.reasoning, r.tool_calls]) + (ids_json(r.output_ids) if r.output_ids else "")
    return hashlib.sha256(f"{turn_key}\n{answer}".encode()).hexdigest()[:32]


def _cached_ids(cached: str, sent: _Sent | None) -> str | None:
    """A cached render as the turn's ids (`ids_json` text); None where it goes on from an answer with no ids."""
    if not cached.startswith("+"):
        return cached
    if sent is None or not sent.output_ids:
        return None
    parts = (_ids_text(sent.planned), ids_json(sent.output_ids), cached[1:])
    return "[" + ",".join(p[1:-1] for p in parts if p != "[]") + "]"


def _ids_text(p: Planned) -> str:
    return p.rendered if isinstance(p.rendered, str) else ids_json(p.rendered)


def _prompt_ids(rendering: TurnRendering, messages: list[dict], tools: list[dict] | None, sent: _Sent | None):
    """(rendered prompt, its ids, the render to hold): the previous turn's ids and answer ids + the rest encoded
    where the rendered prompt continues them verbatim, else the prompt rendered whole."""
    tok = rendering.tok
    text = _render(rendering, messages, tools)
    if sent is not None and sent.output_ids:
        head = sent.rendered(rendering, tools) + _decode(tok, sent.output_ids)
        if text.startswith(head):
            rest = tok.backend_tokenizer.encode(text[len(head) :], add_special_tokens=False).ids
            return text, sent.planned.prompt_ids + sent.output_ids + rest, "+" + ids_json(rest)
    ids = render_prompt_ids(tok, messages, tools, rendering.template_kwargs)
    return text, ids, ids_json(ids)


def _render(rendering: TurnRendering, messages: list[dict], tools: list[dict] | None) -> str:
    return rendering.tok.apply_chat_template(
        template_messages(messages),
        tools=tools,
        add_generation_prompt=True,
        tokenize=False,
        **rendering.template_kwargs,
    )


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _after(source: list[dict], start: int, roles: tuple[str, ...]) -> int:
    """The index of the first message at or after `start` whose role is not one of `roles`."""
    end = start
    while end < len(source) and source[end]["role"] in roles:
        end += 1
    return end


def _merged(turn: list[dict]) -> dict:
    """A run of source assistant messages as the one turn the target answers in their place."""
    calls = [c for m in turn for c in m.get("tool_calls") or []]
    content = "\n".join(m["content"] for m in turn if m["content"])
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def _call_ids(answer: dict) -> list[str | None]:
    """One entry per call the answer makes: its id, or None for a call written in the text (no parser ran)."""
    if answer.get("tool_calls"):
        return [c.get("id") for c in answer["tool_calls"]]
    return [None] * len(written_calls(answer.get("content") or ""))


def _answering(result: dict, call_id: str | None) -> dict:
    """A tool result pointed at `call_id` (a call read from the target's text has no id: the result names none)."""
    out = {k: v for k, v in result.items() if k != "tool_call_id"}
    return out if call_id is None else {**out, "tool_call_id": call_id}
