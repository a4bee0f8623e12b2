"""What to send and what to keep: the store key of a prompt, which stored responses are usable, and the output
selected in prompt order up to the budget.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from draftdata.config.schema import BackendKind, BudgetUnit, Config, DatasetConfig, OnBudget, OnTruncation
from draftdata.errors import ConfigError, UserError
from draftdata.generate.budget import landing
from draftdata.generate.store import CUT, ResponseStore, StoredResponse, ids_json
from draftdata.model.fingerprint import run_model_fingerprint
from draftdata.model.tokenizer import render_prompt_ids, tokenizer_fingerprint
from draftdata.util.hashing import canonical_json, content_hash


@dataclass
class Planned:
    prompt: dict
    key: str
    # the prompt's ids rendered with the chat template (exactly what the target is sent), or their JSON text as the
    # store's cache of renders holds it: decoded only for the prompts a run sends
    rendered: list[int] | str
    # a conversation's later turn (`turns: all`): the tokens of its sample before this turn (the turn before's prompt
    # and answer), which this turn's prompt holds; 0 for a first turn or a single prompt
    before: int = 0

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

    def added_prompt(self, prompt_tokens: int | None = None) -> int:
        """The prompt tokens this request adds to its sample (of `prompt_tokens`, a stored answer's count; default
        the plan's): all of a first turn's or a single prompt's; of a conversation's later turn, what its prompt
        adds to the turn before and its answer (the source's next user or tool turns, the template's markers), as
        tokenize makes one sample of the whole conversation. A template that rewrites earlier turns (drops their
        reasoning) renders a prompt shorter than that; tokenize then gives each turn a sample of its own, so all of
        it counts."""
        n = self.prompt_tokens if prompt_tokens is None else prompt_tokens
        return n - self.before if n >= self.before else n


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


def tokens_of(p: Planned, r: StoredResponse, unit: BudgetUnit) -> int:
    """What a response counts toward its dataset's budget: its completion tokens; under budget_unit total also the
    prompt tokens it adds to its sample, so that a conversation counts each token its sample holds once (the
    states' size), not each turn's whole history again."""
    return r.completion_tokens + (p.added_prompt(r.prompt_tokens) if unit == BudgetUnit.total else 0)


def stored_tokens(
    plan: list[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig, partial: bool = True
) -> tuple[int, int]:
    """What the plan's usable stored answers count toward the budget, each as the output counts it (two
    conversations that share a turn each hold it), and how many answers hold them; `partial=False`: complete ones
    only (keep_partial's cut ones count once no more generation is wanted)."""
    pairs = [
        (p, r)
        for p in plan
        if (r := stored.get(p.key)) is not None and (partial or not r.partial) and unusable_reason(r, ds) is None
    ]
    return sum(tokens_of(p, r, ds.budget_unit) for p, r in pairs), len(pairs)


def unusable_reason(r: StoredResponse, ds: DatasetConfig) -> str | None:
    """Why a stored response does not enter the output (None: it does)."""
    if r.partial and not (r.finish_reason == CUT and ds.on_budget == OnBudget.keep_partial):
        return "cut_by_budget" if r.finish_reason == CUT else "interrupted"  # parked: continued when needed
    if is_empty(r):
        return "empty"
    if r.finish_reason == "length" and ds.on_truncation == OnTruncation.drop:
        return "truncated_dropped"
    return None


def is_empty(r: StoredResponse) -> bool:
    # text is decoded without special tokens; a chat answer may be all thinking or tool calls, which are not in it
    return r.completion_tokens == 0 or not (r.text.strip() or r.reasoning or r.tool_calls)


def needs_request(r: StoredResponse | None) -> bool:
    """Whether a run that generates sends this prompt: missing, parked (to continue), or an empty answer stored by an
    earlier version."""
    return r is None or r.partial or r.completion_tokens == 0


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
    sizes = [tokens_of(p, r, ds.budget_unit) for p, r in usable]
    heads = [p.prompt.get("turn", 0) == 0 for p, _ in usable]  # a turn of a conversation (`turns: all`) names it
    chosen = landing(sizes, ds.token_budget, heads)
    return [usable[i] for i in chosen], sum(sizes[i] for i in chosen), skipped


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
