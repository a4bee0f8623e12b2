"""The cache of a run's turn renders (`turns: all`): the ids of turns rendered through the chat template by earlier
runs under the same render fingerprint (model, tokenizer files, template and kwargs, tokenizer libraries), loaded from
the response store when a run is planned, and the turns it renders kept there for the next run (conversation.py says
what a turn's render is).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftdata.generate.plan.conversation import TurnRenders
from draftdata.generate.store import ResponseStore


@dataclass
class Renders:
    """The turns' renders of a run under its render fingerprint, and where they are kept."""

    fingerprint: str
    turns: TurnRenders

    @classmethod
    def load(cls, fingerprint: str, store: ResponseStore, prompts: list[dict]) -> Renders:
        cached = store.get_turn_renders(
            fingerprint, (rec["id"] for rec in prompts), sum(len(r["slots"]) for r in prompts)
        )
        return cls(fingerprint, TurnRenders(cached))

    def keep(self, store: ResponseStore, at_least: int = 1) -> None:
        """Write the turns rendered since the last call, once there are `at_least`."""
        if len(self.turns.new) >= at_least:
            store.put_turn_renders(self.fingerprint, self.turns.take_new())
