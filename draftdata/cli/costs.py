"""What each dataset's budget will cost, computed as generate computes it (the same request keys, the store's answers
counted by generate/accounting.py) but with nothing sent and no weights loaded: the arithmetic behind `draftdata
plan` (cli/plan.py), its tables in cli/plan_table.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from draftdata.config.modes import split_rows
from draftdata.config.schema import BudgetUnit, Config, DatasetConfig, Turns
from draftdata.generate.accounting import needs_request, prompt_count, stored_total, unusable_reason
from draftdata.generate.plan.planning import conversation_plan, plan_conversations, plan_requests
from draftdata.generate.request import Planned
from draftdata.generate.run.budget.lengths import MIN_OBSERVED as MIN_LENGTHS
from draftdata.generate.run.budget.lengths import LengthModel
from draftdata.generate.store import ResponseStore, StoredResponse
from draftdata.hidden.shards import bytes_per_token, disk_per_token
from draftdata.model.target import Target, load_target
from draftdata.util.files import data_dir, read_jsonl
from draftdata.util.sqlite import hash_cache_path, resolve_store_path

# Disk estimates where no output exists yet to measure, in bytes per token of prompt + completion.
# responses.jsonl holds each token about twice: as a JSON id (5-7 bytes with its comma) and as text (the prompt in
# `messages`, the completion in `text`, about 4 bytes a token).
RESPONSES_BYTES_PER_TOKEN = 10.0
# samples.parquet: input_ids int32 + loss_mask int8 per token, before parquet's compression (an upper bound).
SAMPLES_BYTES_PER_TOKEN = 5.0


@dataclass
class Options:
    tok_s: float | None = None  # generation tokens/s to assume; None: measured per dataset
    out: str | None = None  # also write the plan here as JSON


@dataclass
class ModelShape:
    n_layers: int
    hidden_size: int
    layers: list[int]  # physical ids of the kept layers (the final state is kept too)
    dtype: str
    bytes_per_token: int  # hidden states of one token
    # a token's states in bf16 and fp8, and online training's (the trainer computes them, nothing is stored): 0
    disk_per_token: dict[str, int]
    # per drafter family in hidden_states.drafters: its layers, and a token's bytes were it captured alone
    families: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    policy_top_k: int = 0  # hidden_states.policy_top_k: the policy kept beside the states (0: none)
    states: bool = True  # False: the policy alone (hidden_states.drafters: [])


@dataclass
class ModePlan:
    """One mode's row (`datasets.<D>.modes`): its prompts, its share of the budget and what is left of it."""

    mode: str
    prompts: int  # its rows: prompts, or conversations under `turns: all`
    budget: int  # its share
    reusable: int
    parked: int
    to_generate: int
    requests: int
    mean_completion: float
    mean_completion_from: str


@dataclass
class DatasetPlan:
    dataset: str
    prompts: int | None  # in prompts.jsonl, else the source's records (None: not counted)
    prompts_from: str  # prompts.jsonl | source (prompts stage not run) | not counted (hub source)
    budget: int
    unit: str
    reusable: int  # stored tokens that count toward the budget
    reusable_responses: int
    parked: int  # completion tokens of parked partials (continued, not regenerated, when needed)
    to_generate: int
    mean_completion: float
    mean_completion_from: str  # "<n> stored" | "max_tokens/2" (with how many are stored, if any)
    mean_prompt: float | None  # rendered prompt tokens (None: prompts stage not run)
    requests: int
    prompts_left: int | None  # requests a run could still send (missing or parked): prompts, or turns (turns: all)
    tok_s: float | None
    tok_s_from: str  # given | measured | none
    gpu_s: float | None
    sequence_tokens: int  # prompt + completion tokens of the whole budget
    responses_bytes: int
    samples_bytes: int
    hidden_bytes: int
    responses_from: str  # measured | estimate
    samples_from: str
    turns: int | None = None  # turns: all: the source turns of every conversation (None: turns: last)
    trained_share: float | None = None  # of the samples' tokens, those the loss mask trains (None: not known)
    trained_share_from: str = "-"  # measured (tokenize_metrics.json) | estimate (mean lengths) | -
    conversations_needed: int | None = None  # turns: all: conversations of the mean length the budget still takes
    modes: list[ModePlan] = field(default_factory=list)  # a row per mode (datasets.<D>.modes), none without

    @property
    def turns_per_conversation(self) -> float | None:
        return round(self.turns / self.prompts, 2) if self.turns is not None and self.prompts else None

    @property
    def disk_bytes(self) -> int:
        return self.responses_bytes + self.samples_bytes + self.hidden_bytes

    def per_trained_token(self, shape: ModelShape | None) -> dict[str, int] | None:
        """The hidden states' bytes per token the loss mask trains: what a token of training signal costs on disk
        (the prompts' and earlier turns' states are stored too, and train nothing)."""
        if shape is None or not self.trained_share:
            return None
        return {d: round(n / self.trained_share) for d, n in shape.disk_per_token.items()}


# ---- pure helpers ---------------------------------------------------------------------------------------------- #


def trained_share(tokenize: dict, mean_prompt: float | None, mean_c: float) -> tuple[float | None, str]:
    """The share of the samples' tokens the loss mask trains: counted by tokenize where it ran; before, a
    response's completion over its prompt + completion (an estimate: with `turns: all` a sample holds every turn)."""
    if tokenize.get("tokens"):
        return round(tokenize["trained_tokens"] / tokenize["tokens"], 4), "measured"
    if mean_prompt:
        return round(mean_c / (mean_prompt + mean_c), 4), "estimate"
    return None, "-"


def to_generate(budget: int, reusable: int) -> int:
    return max(0, budget - reusable)


def expected_requests(tokens: int, per_request: float) -> int:
    return math.ceil(tokens / per_request) if tokens > 0 else 0


def sequence_tokens(budget: int, unit: str, mean_prompt: float | None, mean_completion: float) -> int:
    """Prompt + completion tokens of the samples a budget yields: a completion budget brings its prompts along
    (unknown prompts count as none, so the disk is then a lower bound)."""
    if unit == BudgetUnit.total.value or not mean_prompt:
        return budget
    return round(budget * (mean_prompt + mean_completion) / mean_completion)


def mean_completion(lengths: list[int], max_tokens: int) -> tuple[float, str]:
    """The budget controller's own expectation: the mean of the known lengths once there are enough of them,
    max_tokens/2 before."""
    lm = LengthModel(max_tokens)
    for n in lengths:
        lm.add(n)
    if lm.n >= MIN_LENGTHS:
        return lm.mean(), f"{lm.n} stored"
    # a few stored lengths are not yet read (the controller waits for MIN_LENGTHS too): said, not left to guess
    return lm.mean(), f"max_tokens/2 ({lm.n} stored, {MIN_LENGTHS} read)" if lm.n else "max_tokens/2"


def generation_rate(given: float | None, metrics: dict, concurrency: int | None = None) -> tuple[float | None, str]:
    """Tokens/s: given, else the last generate run's (0 there means it generated nothing: no measurement), with the
    requests in flight it ran at, and the concurrency set now where it differs (a rate read at 1 in flight says
    little of 64)."""
    if given is not None:
        return given, "given"
    measured = metrics.get("new_tok_per_s") or 0.0
    if measured <= 0:
        return None, "none"
    ran = metrics.get("concurrency")
    if ran is None:  # a run from before the metrics held it
        return measured, "measured"
    now = f", now {concurrency}" if concurrency is not None and concurrency != ran else ""
    return measured, f"measured @{ran}{now}"


def measured_rate(path: Path, amount: float | None) -> float | None:
    """Bytes of `path` per unit of `amount` (tokens it holds), where both exist."""
    if not amount or amount <= 0 or not path.exists():
        return None
    return path.stat().st_size / amount


def count_records(path: Path) -> int:
    """Rows of a local prompt source without adapting them: lines of a .jsonl, parquet's row count."""
    import gzip

    from draftdata.config.schema import file_kind
    from draftdata.sources.files import iter_local

    kind = file_kind(path)
    if kind == ".jsonl":
        with (gzip.open if path.name.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    if kind == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(1 for _ in iter_local(path))  # one JSON document: it has to be parsed whole anyway


# ---- reading what exists ----------------------------------------------------------------------------------------- #


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def model_shape(cfg: Config) -> ModelShape:
    """From the model's config.json alone: no weights are loaded."""
    from transformers import AutoConfig

    from draftdata.drafters.layers import captured, family_layers
    from draftdata.model.load import check_model_path, load_error

    check_model_path(cfg.model.path)
    try:
        conf = AutoConfig.from_pretrained(
            cfg.model.path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        ).get_text_config()
    except (OSError, ValueError) as e:
        raise load_error(e, "a model config", cfg.model.path) from None
    families = family_layers(cfg, conf.num_hidden_layers)
    layers = captured(families)
    hs = cfg.hidden_states
    return ModelShape(
        conf.num_hidden_layers,
        conf.hidden_size,
        layers,
        hs.dtype,
        bytes_per_token(len(layers), conf.hidden_size, hs.dtype, hs.policy_top_k, states=bool(hs.drafters)),
        disk_per_token(len(layers), conf.hidden_size, hs.policy_top_k),
        {name: (ids, bytes_per_token(len(ids), conf.hidden_size, hs.dtype)) for name, ids in families.items()},
        hs.policy_top_k,
        bool(hs.drafters),
    )


def plan_dataset(
    cfg: Config, name: str, tokenizer, store: ResponseStore | None, shape: ModelShape | None, opts: Options
) -> DatasetPlan:
    cfg = replace(cfg, dataset=name)
    ds, out = cfg.ds, data_dir(name)
    stored: dict[str, StoredResponse] = {}
    planned = []
    prompts_path = out / "prompts.jsonl"
    turns = left_to_send = None
    modes: list[ModePlan] = []
    if prompts_path.exists() and tokenizer is not None:
        records = list(read_jsonl(prompts_path))
        # each mode's rows under its own settings, as generate plans them (one part where there are no modes)
        for mode, sub, rows in split_rows(cfg, records):
            # its keys as generate computes them (rendered prompt ids, model fingerprint, sampling, max_tokens)
            target = load_target(sub, hash_cache_path(resolve_store_path(cfg.run.store_path)), tokenizer())
            if ds.turns == Turns.all:
                more, found, slots, left = _conversation_turns(sub, rows, target, store)
                turns, left_to_send = (turns or 0) + slots, (left_to_send or 0) + left
            else:
                more = plan_requests(sub, rows, target, store)
                found = store.get_many(p.key for p in more) if store is not None else {}
            if mode is not None:  # its share lands on its own (a mode past its share takes nothing off another's)
                modes.append(_mode_plan(mode, sub.ds, len(rows), more, found))
            planned += more
            stored |= found
        prompts, prompts_from = len(records) if turns is not None else len(planned), "prompts.jsonl"
    elif ds.source.path is not None:
        prompts, prompts_from = count_records(Path(ds.source.path)), "source (prompts stage not run)"
    else:
        prompts, prompts_from = None, "not counted (hub source; prompts stage not run)"

    reusable, reusable_n, parked, lengths = _stored_tokens(planned, stored, ds)
    todo = [p for p in planned if needs_request(stored.get(p.key))]
    if left_to_send is None:
        left_to_send = len(todo)
    mean_prompt = _mean([p.prompt_tokens for p in planned])
    mean_c, mean_c_from = mean_completion(lengths, ds.max_tokens)
    left = to_generate(ds.token_budget, reusable)
    per_request = _per_request(ds, planned, todo, mean_c)
    requests = expected_requests(left, per_request)
    if modes:  # the modes' shares, each landed on its own
        reusable, parked = sum(m.reusable for m in modes), sum(m.parked for m in modes)
        left, requests = sum(m.to_generate for m in modes), sum(m.requests for m in modes)

    gm = _read_json(out / "generate_metrics.json")
    tok_s, tok_s_from = generation_rate(opts.tok_s, gm, ds.concurrency)

    seq = sequence_tokens(ds.token_budget, ds.budget_unit.value, mean_prompt, mean_c)
    resp_rate = measured_rate(out / "responses.jsonl", gm.get("prompt_tokens", 0) + gm.get("completion_tokens", 0))
    tm = _read_json(out / "tokenize_metrics.json")
    samp_rate = measured_rate(out / "samples.parquet", tm.get("tokens"))
    share, share_from = trained_share(tm, mean_prompt, mean_c)
    return DatasetPlan(
        dataset=name,
        prompts=prompts,
        prompts_from=prompts_from,
        budget=ds.token_budget,
        unit=ds.budget_unit.value,
        reusable=reusable,
        reusable_responses=reusable_n,
        parked=parked,
        to_generate=left,
        mean_completion=round(mean_c, 1),
        mean_completion_from=mean_c_from,
        mean_prompt=None if mean_prompt is None else round(mean_prompt, 1),
        requests=requests,
        prompts_left=left_to_send if planned else None,
        tok_s=tok_s,
        tok_s_from=tok_s_from,
        # the rate counts generated tokens: under budget_unit total, the completions' part of what is left (the
        # prompts are prefilled, far faster than decoded)
        gpu_s=left * (mean_c / per_request if per_request else 1.0) / tok_s if tok_s else None,
        sequence_tokens=seq,
        responses_bytes=round(seq * (resp_rate or RESPONSES_BYTES_PER_TOKEN)),
        samples_bytes=round(seq * (samp_rate or SAMPLES_BYTES_PER_TOKEN)),
        hidden_bytes=seq * shape.bytes_per_token if shape else 0,
        responses_from="measured" if resp_rate else "estimate",
        samples_from="measured" if samp_rate else "estimate",
        turns=turns,
        conversations_needed=None if turns is None else expected_requests(left, mean_c * turns / max(prompts, 1)),
        trained_share=share,
        trained_share_from=share_from,
        modes=modes,
    )


def _per_request(ds: DatasetConfig, planned: list[Planned], todo: list[Planned], mean_c: float) -> float:
    """What a request is expected to count toward the budget: its completion, and under `budget_unit: total` (as
    generate counts) the prompt of a request still to send."""
    if ds.budget_unit != BudgetUnit.total:
        return mean_c
    return mean_c + (_mean([prompt_count(p) for p in todo]) or _mean([p.prompt_tokens for p in planned]) or 0.0)


def _mode_plan(
    mode: str, ds: DatasetConfig, prompts: int, planned: list[Planned], stored: dict[str, StoredResponse]
) -> ModePlan:
    """A mode's row, `ds` its settings and share of the budget, as the dataset's own figures are computed."""
    reusable, _, parked, lengths = _stored_tokens(planned, stored, ds)
    mean_c, mean_c_from = mean_completion(lengths, ds.max_tokens)
    todo = [p for p in planned if needs_request(stored.get(p.key))]
    left = to_generate(ds.token_budget, reusable)
    requests = expected_requests(left, _per_request(ds, planned, todo, mean_c))
    return ModePlan(mode, prompts, ds.token_budget, reusable, parked, left, requests, round(mean_c, 1), mean_c_from)


class _NoStore:
    """Nothing stored (no store yet): planning creates none."""

    def get_many(self, keys) -> dict:
        return {}

    def get_turn_renders(self, tokenizer, conversations, turns) -> dict:
        return {}

    def put_turn_renders(self, tokenizer, renders) -> None:
        pass


def _conversation_turns(
    cfg: Config, records: list[dict], target: Target, store: ResponseStore | None
) -> tuple[list[Planned], dict[str, StoredResponse], int, int]:
    """`turns: all`: each conversation walked over the turns the store holds, as generate walks it. The turns
    answered and each one's next, the store's rows for them, the source turns of all conversations (their
    `slots`), and the turns a run could still send (those left of the conversations that have not ended)."""
    convs, _, met = plan_conversations(cfg, records, target, store or _NoStore(), None)
    planned, answered = conversation_plan(convs)
    stored = answered | met
    left = sum(len(c.rec["slots"]) - len(c.done) for c in convs if c.next is not None)
    return planned, stored, sum(len(r["slots"]) for r in records), left


def _stored_tokens(
    planned: list[Planned], stored: dict[str, StoredResponse], ds: DatasetConfig
) -> tuple[int, int, int, list[int]]:
    """Tokens counting toward the budget (what generate counts before it decides to send anything: each planned
    request's stored answer, as the output counts it), how many responses hold them, parked partial tokens, and the
    completion lengths of the complete ones."""
    reusable, n = stored_total(planned, stored, ds)
    lengths = [r.completion_tokens for r in stored.values() if not r.partial and unusable_reason(r, ds) is None]
    parked = sum(r.completion_tokens for r in stored.values() if r.partial and unusable_reason(r, ds) is not None)
    return reusable, n, parked, lengths


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None
