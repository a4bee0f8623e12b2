"""What a run's requests can show wrong or costly, checked and said before any part of the stage sends one: a chat
template that cannot render what a chat-format server's parsers return (`check_chat_rendering`), and the stored
answers that a config change left behind (`check_stale`).

A chat-format server's tool-call parser moves a call out of the answer's text; a template that drops tool calls from
the assistant turn would then store answers that tokenize cannot render as the model wrote them.

A stored answer is found again by its request key: the model's fingerprint, the prompt's ids under the chat template
(and its kwargs), sampling and max_tokens (request.py). Change any of them and every answer stored for a prompt
stops matching: the run regenerates them all. That is what the change asks for, and nothing is lost (the old answers
stay in the store: undoing the change finds them again; Ctrl-C keeps what was generated), but it may cost hours. So
the first stage that meets it says, before any request, how many stored answers no longer match and what
regenerating costs, as `draftdata plan` computes it: the tokens the budget still needs, and the time at the last
run's rate (an expectation: under landing exact, the output's prompt-order run may need more of them). With
`run.confirm_regenerate: true`, the run stops there instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftdata.config.schema import BackendKind, Config
from draftdata.errors import UserError
from draftdata.generate.plan.planning import Plan, left_behind
from draftdata.generate.run.settled import output_tokens
from draftdata.generate.store import ResponseStore
from draftdata.model.target import Target
from draftdata.util.log import log


def preflight(
    cfg: Config, target: Target, plan: Plan, store: ResponseStore, metrics: Path, mode: str | None = None
) -> None:
    """Every check a part's requests need before the first part sends one. `cfg`: the part's (its budget share, where
    `mode` is one); `metrics`: the dataset's last generate_metrics.json (the last run's rate)."""
    if cfg.backend.kind == BackendKind.openai and plan.standing.todo:
        check_chat_rendering(cfg, target, [p.prompt for p in plan.standing.todo])
    check_stale(cfg, plan, store, metrics, mode)


def named(mode: str | None) -> dict[str, str]:
    """A line's `mode=` field, where the run generates a mode's share (datasets.<D>.modes)."""
    return {} if mode is None else {"mode": mode}


def check_chat_rendering(cfg: Config, target: Target, prompts: list[dict]) -> None:
    """A chat-format run over prompts with tools, whose template drops tool calls from the assistant turn, is refused:
    its answers could not be rendered as the model wrote them."""
    if cfg.backend.prompt_format != "chat" or cfg.backend.return_token_ids:
        return
    if any(p.get("tools") for p in prompts) and "tool_calls" in target.unrendered:
        raise UserError(
            f"backend.prompt_format chat: dataset {cfg.dataset} has tools, and a server's tool-call parser moves a "
            "call out of the answer's text, but the chat template drops tool_calls from the assistant turn; set "
            "model.chat_template to one that renders them, or backend.return_token_ids: true"
        )


@dataclass
class Stale:
    answers: int  # prompts of the plan that the store answered under another key, and not under this run's
    tokens: int  # what the budget still needs beyond the answers that match (draftdata plan's "to generate")
    tok_s: float | None  # the last run's generation rate (None: none measured)


def check_stale(cfg: Config, plan: Plan, store: ResponseStore, metrics: Path, mode: str | None = None) -> None:
    """Before any request of a run that will generate: say what the store's answers left behind by a change cost to
    regenerate (the prompts to send that the store answered under another key), or stop (run.confirm_regenerate).
    `cfg`: the part's (its budget share, where `mode` is one)."""
    if output_tokens(plan) >= cfg.ds.token_budget:
        return
    if stale := left_behind(store, cfg.dataset, plan.standing.todo):
        tokens = max(0, cfg.ds.token_budget - plan.standing.counted)  # draftdata plan's figure
        line = announce(cfg, Stale(stale, tokens, last_rate(metrics)))
        log("generate", dataset=cfg.dataset, **named(mode), warning=line)


def last_rate(metrics: Path) -> float | None:
    """Tokens/s of the dataset's last generate run that generated (its generate_metrics.json)."""
    try:
        rate = json.loads(metrics.read_text()).get("new_tok_per_s") or 0.0
    except (OSError, ValueError):
        return None
    return rate if rate > 0 else None


def announce(cfg: Config, stale: Stale) -> str:
    """The line that says what the change costs, or (run.confirm_regenerate) the refusal that stops the run."""
    cost = f"regenerating costs {stale.tokens:,} tokens"
    if not stale.tokens:
        cost = "the answers that still match meet the budget, and the output regenerates those of the others it needs"
    elif stale.tok_s:
        cost += f", about {stale.tokens / stale.tok_s:,.0f} s at the last run's {stale.tok_s:,.1f} tok/s"
    one = stale.answers == 1
    line = (
        f"{stale.answers:,} stored answer{'' if one else 's'} for these prompts no longer match{'es' if one else ''} "
        f"(the model, chat template or its kwargs, sampling or max_tokens changed): {cost}"
    )
    if cfg.run.confirm_regenerate:
        raise UserError(
            f"generate {cfg.dataset}: {line}; nothing was sent. Undo the change to reuse them (they are still in "
            "the store), or set run.confirm_regenerate: false to regenerate"
        )
    return line + "; undo the change to reuse them (they stay in the store)"
