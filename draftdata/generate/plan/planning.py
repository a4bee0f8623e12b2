"""What a run asks, planned from the store before anything is sent: one request per prompt (`turns: last`), or each
conversation walked over the turns the store holds (`turns: all`: `plan_conversations`, one store query per turn
depth for all of them, to the first turn not stored, a parked partial there continued, or to its end; the turns'
ids rendered on the way kept in the store's `turn_rendered`, so the next run steps over stored turns without the
chat template); and, once generation is done, why each conversation in the output ends there and the figures of
`turns: all` for the metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from draftdata.config.schema import Config, DatasetConfig, TrainOn, Turns
from draftdata.errors import UserError
from draftdata.generate.accounting import Standing, standing, unusable_reason
from draftdata.generate.plan.conversation import TurnRendering, turns
from draftdata.generate.plan.conversations import BUDGET, FAILED, Conversation, step_over_stored
from draftdata.generate.plan.renders import Renders
from draftdata.generate.request import Planned, check_context, key_sampling, request_keys
from draftdata.generate.store import ResponseStore, StoredResponse
from draftdata.model.target import Target
from draftdata.model.tokenizer import render_prompt_ids
from draftdata.util.hashing import ids_json


def plan_requests(
    cfg: Config, prompts: Iterable[dict], target: Target, store: ResponseStore | None = None
) -> list[Planned]:
    """One request per store key, in prompt order. The prompts stage dedups by message JSON, but prompts that differ
    only in what the chat template drops (a template that trims whitespace renders "Hello" and "Hello\\n" alike)
    get one key. The first is kept and the others dropped: else one response would be sent, output and counted
    toward the budget once per prompt. The number dropped is the number of prompts less the plan's length
    (generate_metrics' duplicate_after_template). With a store, rendered prompts are cached there."""
    ds, prompts = cfg.ds, list(prompts)
    rendered = rendered_prompts(cfg, target, prompts, store)
    key_of = request_keys(target.model_fp, key_sampling(ds.sampling), ds.max_tokens)
    plan: dict[str, Planned] = {}
    for rec, ids in zip(prompts, rendered):
        key = key_of(ids)
        if key not in plan:
            plan[key] = Planned(rec, key, ids)
    return list(plan.values())


def rendered_prompts(cfg: Config, target: Target, prompts: list[dict], store: ResponseStore | None) -> list[str]:
    """Each prompt's ids under the chat template, as `ids_json` text; those rendered by an earlier run under the same
    model, tokenizer files, template, template kwargs and tokenizer libraries (the target's render fingerprint) come
    from the store (a 100k-prompt rerun would otherwise render them all again, also when the budget is already
    met)."""
    kwargs, fp = cfg.template_kwargs, target.render_fp
    cached = store.get_rendered(fp, (rec["id"] for rec in prompts)) if store is not None else {}
    new: dict[str, str] = {}
    out = []
    for rec in prompts:
        ids = cached.get(rec["id"])
        if ids is None:  # the id is a hash of the messages and tools: all the template reads of a prompt
            ids = new[rec["id"]] = ids_json(render_prompt_ids(target.tok, rec["messages"], rec.get("tools"), kwargs))
        out.append(ids)
    if store is not None and new:
        store.put_rendered(fp, new)
    return out


def plan_conversations(
    cfg: Config, prompts: list[dict], target: Target, store: ResponseStore, context: int | None
) -> tuple[list[Conversation], Renders, dict[str, StoredResponse]]:
    """Every conversation walked over the turns the store holds, in prompt order; the turns' renders (those made on
    the way are kept); and the store's rows for the turns they stopped at (parked partials, empty answers).
    `context`: the target's (None: unknown): a first turn that does not fit it with max_tokens is refused before the
    store is read for the turns after it, and a later turn that does not fit ends its conversation."""
    ds = cfg.ds
    renders = Renders.load(target.render_fp, store, prompts)
    sampling = key_sampling(ds.sampling)
    rendering = TurnRendering(target.tok, cfg.template_kwargs, target.model_fp, sampling, ds.max_tokens, renders.turns)
    commands = ds.source.shape == "swe_agent"  # its actions are fenced shell commands in the text
    every_turn = cfg.tokenize.train_on == TrainOn.all_turns
    walks = [(rec, turns(rec, rendering, ds.on_tool_divergence.value, commands)) for rec in prompts]
    convs = [Conversation(rec, walk, every_turn=every_turn) for rec, walk in walks]
    for c in convs:
        c.start(None)
    check_context([c.first for c in convs if c.first is not None], cfg, context)
    room = None if context is None else context - ds.max_tokens
    met: dict[str, StoredResponse] = {}
    step_over_stored(convs, store, {}, room, met)
    renders.keep(store)
    return convs, renders, met


def conversation_plan(convs: list[Conversation]) -> tuple[list[Planned], dict[str, StoredResponse]]:
    """Every conversation's turns in order (answered ones, then the next), and the answers of the answered ones (the
    store's rows for the next turns, parked partials and empty answers, are the caller's to add)."""
    return [p for c in convs for p in c.turns()], {p.key: r for c in convs for p, r in c.done}


def end_reasons(
    convs: list[Conversation], selected: list[tuple[Planned, StoredResponse]], ds: DatasetConfig
) -> dict[str, str]:
    """The turn id of each conversation's last line in the output -> why the conversation ends there: its own
    reason when every usable answered turn is in the output, else the budget (the output's, or the run's)."""
    last = {p.prompt["conversation"]: p for p, _ in selected}
    out = {}
    for c in convs:
        if (p := last.get(c.rec["id"])) is None:
            continue
        out[p.prompt["id"]] = c.unanswered  # its next turn is to come (or, under keep_partial, this is its cut one)
        if c.next is None:
            at = next(i for i, (q, _) in enumerate(c.done) if q is p)
            if all(unusable_reason(r, ds) for _, r in c.done[at + 1 :]):
                out[p.prompt["id"]] = c.ended
    return out


def ended_unsampled(
    convs: list[Conversation], selected: list[tuple[Planned, StoredResponse]], ds: DatasetConfig
) -> list[Conversation]:
    """Conversations that ended before any usable turn (turn 0's answer empty, or cut and dropped): no line of the
    output names them, yet the run took them and they ended. Only those the output reaches: every usable turn of the
    conversations before them is in it (a lower budget's output stops short of the later ones, as it does of the
    other conversations there)."""
    chosen = {p.prompt["id"] for p, _ in selected}
    out = []
    for c in convs:
        usable = [p for p, r in c.done if unusable_reason(r, ds) is None]
        if c.next is None and not usable:
            out.append(c)
        elif any(p.prompt["id"] not in chosen for p in usable):
            break  # the output stops in this conversation
    return out


def conversation_metrics(
    reasons: dict[str, str], turns_out: int, same_server_share: float | None, unsampled: list[Conversation]
) -> dict:
    """generate_metrics' figures of `turns: all`: the output's turns (each one the target's answer) and
    conversations by end reason (those that ended before a usable turn included), and the share of next turns this
    run sent to the server that answered the previous one (null: none sent)."""
    ended = Counter(reasons.values()) + Counter(c.ended for c in unsampled)
    return {
        "turns_regenerated": turns_out,
        "conversations": len(reasons) + len(unsampled),
        "conversations_ended": dict(sorted(ended.items())),
        "same_server_share": same_server_share,
    }


def turns_kept(
    convs: list[Conversation], reasons: dict[str, str], selected: list, unsampled: list[Conversation]
) -> dict:
    """Of the output's conversations that ended on their own (not at the budget, nor at a failed request), and
    those that ended before a usable turn (`ended_unsampled`: none of their turns kept), the share of their
    source's assistant turns the output holds: what a diverging call (`on_tool_divergence`), a cut or empty answer
    or the context took from them."""
    turns_out = Counter(p.prompt["conversation"] for p, _ in selected)
    ended = {p.prompt["conversation"]: reasons[p.prompt["id"]] for p, _ in selected if p.prompt["id"] in reasons}
    own = [c.rec for c in convs if c.rec["id"] in turns_out and ended.get(c.rec["id"]) not in (BUDGET, FAILED)]
    own += [c.rec for c in unsampled]
    source = sum(len(rec["slots"]) for rec in own)
    return {"turns_kept_share": round(sum(turns_out[rec["id"]] for rec in own) / source, 3) if source else None}


def left_behind(store: ResponseStore, dataset: str, todo: list[Planned]) -> int:
    """The prompts of `todo` for which the store holds a complete answer of `dataset` under another key."""
    missing = {p.prompt["id"]: p.key for p in todo}
    if not missing:
        return 0
    return len({pid for pid, key in store.answered_prompts(dataset) if pid in missing and key != missing[pid]})


@dataclass(frozen=True)
class Plan:
    """What a run asks, made before any request: one request per prompt in prompt order (`turns: last`), or each
    conversation walked over the turns the store holds (`turns: all`), with the store's rows for them and what those
    count (`standing`, accounting.py). The conversations are the one part a run moves: it steps each on from where
    the store leaves it (work.py), so a plan serves one run, and the output reads them as the run left them."""

    ds: DatasetConfig
    requests: list[Planned]
    stored: dict[str, StoredResponse]
    standing: Standing
    duplicates: int = 0  # prompts whose rendered ids an earlier prompt had (`turns: last`)
    convs: list[Conversation] | None = None
    renders: Renders | None = None  # `turns: all`: the turns' renders, those made on the way kept in the store
    room: int | None = None  # `turns: all`: the target's context less max_tokens, a later turn's limit (None: unknown)

    @classmethod
    def make(cls, cfg: Config, prompts: list[dict], target: Target, store: ResponseStore) -> Plan:
        context = target.context
        if cfg.ds.turns != Turns.all:
            plan = plan_requests(cfg, prompts, target, store)  # one per key: prompts rendered alike are asked once
            check_context(plan, cfg, context)
            stored = store.get_many(p.key for p in plan)
            return cls(cfg.ds, plan, stored, standing(plan, stored, cfg.ds), len(prompts) - len(plan))
        convs, renders, met = plan_conversations(cfg, prompts, target, store, context)  # over their stored turns
        plan, answered = conversation_plan(convs)
        stored = answered | met
        room = None if context is None else context - cfg.ds.max_tokens
        return cls(cfg.ds, plan, stored, standing(plan, stored, cfg.ds), convs=convs, renders=renders, room=room)


def conversation_figures(plan: Plan, reasons: dict[str, str], selected: list, same_server_share: float | None) -> dict:
    """generate_metrics' figures of `turns: all` ({} under `turns: last`)."""
    if plan.convs is None:
        return {}
    unsampled = ended_unsampled(plan.convs, selected, plan.ds)
    return conversation_metrics(reasons, len(selected), same_server_share, unsampled) | turns_kept(
        plan.convs, reasons, selected, unsampled
    )


def check_turns(prompts: list[dict], cfg: Config, path) -> None:
    """Prompts written for the other `turns` (a hand run with `datasets.D.turns=...` the prompts stage did not get):
    refused before any request. A conversation's record holds its turns (`slots`); a last turn's does not."""
    if not prompts:
        return
    written = Turns.all if "slots" in prompts[0] else Turns.last
    if written != cfg.ds.turns:
        raise UserError(
            f"{path}: written for turns: {written.value}, but datasets.{cfg.dataset}.turns is {cfg.ds.turns.value}; "
            f"run the prompts stage with it first (python -m stages.prompts dataset={cfg.dataset} "
            f"datasets.{cfg.dataset}.turns={cfg.ds.turns.value}, or dvc repro prompts@{cfg.dataset})"
        )
