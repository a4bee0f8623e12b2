"""A non-thinking turn's empty think block in a sample's loss mask (`tokenize.empty_think`): trained or left as
context (the block's ids: draftdata/model/think.py)."""

from __future__ import annotations

from draftdata.config.schema import EmptyThink


def mark_empty_think(ids: list[int], mask: list[int], block: list[int] | None, how: EmptyThink) -> list[int]:
    """The loss mask of one answer's sample (its prompt, then its answer) with its empty think block trained
    (`train`: where the prompt ends with it) or left as context (`context`: where the answer starts with it)."""
    if not block:
        return mask
    start, n = len(ids) - sum(mask), len(block)  # where the answer starts
    if how == EmptyThink.train and start >= n and ids[start - n : start] == block:
        return mask[: start - n] + [1] * n + mask[start:]
    if how == EmptyThink.context and ids[start : start + n] == block:
        return mask[:start] + [0] * n + mask[start + n :]
    return mask
