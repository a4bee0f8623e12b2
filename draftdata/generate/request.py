"""A request a run plans: its prompt record, its store key, the prompt's ids, and (a conversation's later turn) how its
prompt holds the turns before it; and whether a run's requests fit the target's context. What a request counts toward
the budget is accounting.py's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from draftdata.config.schema import NEUTRAL_SAMPLING, Config, SamplingConfig
from draftdata.errors import UserError
from draftdata.util.hashing import canonical_json, content_hash


@dataclass(frozen=True)
class Link:
    """A conversation's later turn (`turns: all`) against the turns before it, for what its samples hold
    (accounting.py `link`): while the conversation is one sample (every turn's prompt ids start with the turn
    before's prompt and answer ids), or only its last turn is trained, a turn counts what its prompt adds to the turn
    before and its answer; where each turn is a sample of its own, its whole prompt."""

    before: int  # the turn before's prompt and answer, in tokens
    grows: bool  # it counts what its prompt adds to `before` (else its whole prompt)
    # The first turn that splits the conversation into a sample per turn: the prompt tokens the turns before it were
    # not counted for, which their own samples now hold (0 on every other turn).
    restated: int = 0


@dataclass
class Planned:
    prompt: dict
    key: str
    # the prompt's ids rendered with the chat template (exactly what the target is sent), or their JSON text as the
    # store's cache of renders holds it: decoded only for the prompts a run sends
    rendered: list[int] | str
    link: Link | None = None  # a conversation's later turn; None for a first turn or a single prompt

    @property
    def prompt_ids(self) -> list[int]:
        if isinstance(self.rendered, str):
            self.rendered = json.loads(self.rendered)
        return self.rendered

    @property
    def prompt_tokens(self) -> int:
        if isinstance(self.rendered, str):
            return self.rendered.count(",") + (self.rendered != "[]")
        return len(self.rendered)


def key_sampling(s: SamplingConfig) -> dict:
    """The sampling as the store key holds it. A field at its neutral value (and an empty `extra`) is left out, so
    the keys made before the field existed still match; config.schema's `sent` gives every field."""
    d = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
    for name, neutral in NEUTRAL_SAMPLING.items():
        if name != "top_k" and getattr(s, name) != neutral:
            d[name] = getattr(s, name)
    if s.extra:
        d["extra"] = dict(s.extra)
    return d


def request_key(model_fp: str, prompt_ids: list[int], sampling: dict, max_tokens: int) -> str:
    """Same model + same exact prompt tokens (template and its kwargs included) + same sampling = same key,
    whichever run or dataset asks."""
    return content_hash(
        {"model": model_fp, "prompt_ids": prompt_ids, "sampling": sampling, "max_tokens": max_tokens}, n=32
    )


def request_keys(model_fp: str, sampling: dict, max_tokens: int) -> Callable[[str], str]:
    """`request_key` of one run's prompts, from each prompt's ids as `ids_json` text: the canonical JSON of the rest
    is the same for every prompt, so only the ids' text is hashed anew (encoding 100k prompts' ids as JSON again
    would cost more than all the rest of a run whose budget is met)."""
    text = canonical_json({"model": model_fp, "prompt_ids": [], "sampling": sampling, "max_tokens": max_tokens})
    # The first match is the top-level field: keys are sorted ("max_tokens", "model" come before it) and inside a
    # JSON string a quote is always escaped, so no string value can hold it
    head, tail = text.split('"prompt_ids":[]', 1)
    start, end = (head + '"prompt_ids":').encode(), tail.encode()
    return lambda ids_text: hashlib.sha256(start + ids_text.encode() + end).hexdigest()[:32]


def check_context(plan: list[Planned], cfg: Config, context: int | None) -> None:
    """Before any request: a prompt and its max_tokens must fit the target's context, or every such request would
    come back an error (or be cut short) after costing a round trip (a max_tokens that leaves no room at all was
    refused with the target: load_target)."""
    if context is None:
        return
    room = context - cfg.ds.max_tokens
    over = [p for p in plan if p.prompt_tokens > room]
    if over:
        first = over[0]
        raise UserError(
            f"{first.prompt.get('where', first.prompt['id'])}: a prompt of {first.prompt_tokens:,} "
            f"tokens + max_tokens {cfg.ds.max_tokens:,} exceeds the target's context of {context:,} "
            f"({len(over)} prompts like it); set datasets.{cfg.dataset}.max_prompt_tokens to at most {room:,} (the "
            "prompts stage then drops them) or lower max_tokens"
        )
