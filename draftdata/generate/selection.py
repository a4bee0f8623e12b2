"""What to send and what to keep: a run's requests (each prompt rendered once and keyed), and the output selected in
prompt order up to the budget, by what each response counts (accounting.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from draftdata.config.schema import BackendKind, Config, DatasetConfig
from draftdata.errors import ConfigError, UserError
from draftdata.generate.accounting import counted, unusable_reason
from draftdata.generate.request import Planned, request_keys
from draftdata.generate.store import ResponseStore, StoredResponse, ids_json
from draftdata.model.fingerprint import run_model_fingerprint
from draftdata.model.tokenizer import render_prompt_ids, tokenizer_fingerprint
from draftdata.util.hashing import content_hash


def select_responses(plan: list[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig):
    """Usable responses in prompt order, landed on the budget (`landing`: those that fit, then the shortest that
    reaches it, a conversation's later turn only after the turns before it); every unusable one is counted by
    reason."""
    usable: list[tuple[Planned, StoredResponse]] = []
    skipped: Counter = Counter()
    for p in plan:
        r = stored.get(p.key)
        if r is None:
            continue
        reason = unusable_reason(r, ds)
        if reason:
            skipped[reason] += 1
        else:
            usable.append((p, r))
    sizes = [counted(p, r, ds.budget_unit) for p, r in usable]
    heads = [p.prompt.get("turn", 0) == 0 for p, _ in usable]  # a turn of a conversation (`turns: all`) names it
    chosen = landing(sizes, ds.token_budget, heads)
    return [usable[i] for i in chosen], sum(sizes[i] for i in chosen), skipped


def landing(tokens: Sequence[int], budget: int, heads: Sequence[bool] | None = None) -> list[int]:
    """Which responses make the output, as indices into `tokens` (each one's count toward the budget, in prompt
    order): in prompt order while they fit within the budget; then, in place of the next one, which would pass it,
    the shortest of the rest that reaches it. So the output passes the budget by as little as one response can,
    not by whichever comes next (up to max_tokens: a long reasoning answer among short ones), and a lower budget's
    output is still the start of a higher one's, all but its last response. The responses left out stay in the
    store for a larger budget.

    `heads` (`turns: all`, where `tokens` lists each conversation's turns in order): which responses may stand in
    the output without the turns before them, a conversation's first turns. The one that reaches the budget is the
    next in line or a head, never a later turn alone: its prompt holds the turns before it, answers included, as
    context the drafter would pay for and train nothing on, and a conversation's output stays its turns from the
    first."""
    total, end = 0, 0
    while end < len(tokens) and total + tokens[end] <= budget:
        total += tokens[end]
        end += 1
    if total == budget or end == len(tokens):
        return list(range(end))  # exactly on the budget, or short of it with everything there is
    gap = budget - total  # tokens[end] passes it: some response reaches it
    rest = range(end, len(tokens)) if heads is None else [end, *(j for j in range(end + 1, len(tokens)) if heads[j])]
    crossing = min((j for j in rest if tokens[j] >= gap), key=tokens.__getitem__)
    return [*range(end), crossing]


def check_context(plan: list[Planned], cfg: Config, context: int | None) -> None:
    """Before any request: a prompt and its max_tokens must fit the target's context, or every such request would
    come back an error (or be cut short) after costing a round trip."""
    if context is None:
        return
    key = f"datasets.{cfg.dataset}"
    if cfg.ds.max_tokens >= context:
        raise ConfigError(
            f"{key}.max_tokens",
            f"{cfg.ds.max_tokens:,} leaves no room for a prompt in the target's context of {context:,} tokens",
        )
    room = context - cfg.ds.max_tokens
    over = [p for p in plan if p.prompt_tokens > room]
    if over:
        first = over[0]
        raise UserError(
            f"{first.prompt.get('where', first.prompt['id'])}: a prompt of {first.prompt_tokens:,} "
            f"tokens + max_tokens {cfg.ds.max_tokens:,} exceeds the target's context of {context:,} "
            f"({len(over)} prompts like it); set {key}.max_prompt_tokens to at most {room:,} (the "
            "prompts stage then drops them) or lower max_tokens"
        )


def plan_requests(cfg: Config, prompts: Iterable[dict], tok, store: ResponseStore | None = None) -> list[Planned]:
    """One request per store key, in prompt order. The prompts stage dedups by message JSON, but prompts that differ
    only in what the chat template drops (a template that trims whitespace renders "Hello" and "Hello\\n" alike)
    get one key. The first is kept and the others dropped: else one response would be sent, output and counted
    toward the budget once per prompt. The number dropped is the number of prompts less the plan's length
    (generate_metrics' duplicate_after_template). With a store, rendered prompts are cached there."""
    ds, prompts = cfg.ds, list(prompts)
    model_fp, render_fp = fingerprints(cfg, tok)
    key_of = request_keys(model_fp, ds.sampling.as_dict(), ds.max_tokens)
    plan: dict[str, Planned] = {}
    for rec, ids in zip(prompts, rendered_prompts(cfg, render_fp, prompts, tok, store)):
        key = key_of(ids)
        if key not in plan:
            plan[key] = Planned(rec, key, ids)
    return list(plan.values())


def rendered_prompts(cfg: Config, fp: str, prompts: list[dict], tok, store: ResponseStore | None) -> list[str]:
    """Each prompt's ids under the chat template, as `ids_json` text; those rendered by an earlier run under the same
    model, tokenizer files, template, template kwargs and tokenizer libraries (`fp`, the render fingerprint) come
    from the store (a 100k-prompt rerun would otherwise render them all again, also when the budget is already
    met)."""
    kwargs = cfg.template_kwargs
    cached = store.get_rendered(fp, (rec["id"] for rec in prompts)) if store is not None else {}
    new: dict[str, str] = {}
    out = []
    for rec in prompts:
        ids = cached.get(rec["id"])
        if ids is None:  # the id is a hash of the messages and tools: all the template reads of a prompt
            ids = new[rec["id"]] = ids_json(render_prompt_ids(tok, rec["messages"], rec.get("tools"), kwargs))
        out.append(ids)
    if store is not None and new:
        store.put_rendered(fp, new)
    return out


def fingerprints(cfg: Config, tok) -> tuple[str, str]:
    """A run's two fingerprints, derived once where it is planned: the model's (its files: part of every request
    key) and the render cache's (the model's, the tokenizer's files, template and the dataset's template kwargs, and
    the tokenizer libraries' versions)."""
    import tokenizers
    import transformers

    model_fp = run_model_fingerprint(cfg, in_process=cfg.backend.kind == BackendKind.embedded)
    libraries = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    tokenizer = tokenizer_fingerprint(tok, cfg.model, cfg.template_kwargs)
    return model_fp, content_hash({"model": model_fp, "tokenizer": tokenizer, **libraries}, n=32)
