"""A thinking template's empty think block (`tokenize.empty_think`): what its generation prompt gains with thinking
off (Qwen3's `<think>\n\n</think>\n\n`), as ids of the target's tokenizer."""

from __future__ import annotations

from draftdata.config.schema import EmptyThink
from draftdata.errors import ConfigError

_PROBE = [{"role": "user", "content": "."}]


def empty_think_ids(tok, template_kwargs: dict) -> list[int] | None:
    """The ids the template's generation prompt gains with enable_thinking false over true, where they continue the
    same ids (None: a template that writes no such block)."""

    def prompt(thinking: bool) -> str:
        kwargs = {**template_kwargs, "enable_thinking": thinking}
        return tok.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False, **kwargs)

    on, off = prompt(True), prompt(False)
    if off == on or not off.startswith(on):
        return None
    head, whole = tok.encode(on, add_special_tokens=False), tok.encode(off, add_special_tokens=False)
    return whole[len(head) :] if whole[: len(head)] == head and len(whole) > len(head) else None


def block_of(tok, template_kwargs: dict, how: EmptyThink) -> list[int] | None:
    """The block's ids where `how` acts on them (None under auto); a setting the template cannot meet is refused."""
    if how == EmptyThink.auto:
        return None
    block = empty_think_ids(tok, template_kwargs)
    if block is None:
        raise ConfigError(
            "tokenize.empty_think",
            f"is {how.value}, but the chat template writes no empty think block with enable_thinking false; "
            "leave it auto",
        )
    return block
