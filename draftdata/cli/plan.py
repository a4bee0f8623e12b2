"""Command `plan`: what the configured budgets will cost, before any GPU time is spent.

`draftdata plan [dataset=<D>] [plan.tok_s=<N>] [plan.out=<path>] [hydra overrides]` prints, per dataset:
the prompts available, the budget, the tokens the response store already holds toward it (keys computed exactly
as generate computes them: tokenizer and model fingerprint, no weights), the tokens and requests still to
generate, the GPU time they take at a given or measured rate, and the disk the whole budget takes (responses,
samples, hidden states); it warns of a dataset whose longest sample (max_prompt_tokens + max_tokens) exceeds
`tokenize.max_seq_len` or the target's context, and, where the target's tokenizer is on this disk, refuses in one
line a chat template that ends the turn on a token the target does not stop on (as check_params and generate do).
With `datasets.<D>.turns: all` each assistant turn is a request: the store is walked conversation by
conversation as generate walks it (the turns it holds count, the first it lacks is next), the turns still to send
are those left of each conversation's source turns (its prompt record's `slots`), and a note gives the turns and
completion tokens a conversation holds on average (the disk counts every turn's prompt: where one sample holds a
conversation, an upper bound). Nothing is sent to any server and no backend is started; the only things it may
write are the model's file-hash cache beside the store (as every stage does) and, with `plan.out`, a JSON copy.

`plan.*` keys are this command's own (not in params.yaml): `plan.tok_s` is the generation rate to assume, in
tokens per second (default: the `new_tok_per_s` of the dataset's last `generate_metrics.json`); `plan.out` a file
to write the plan to as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from draftdata.config.load import cli
from draftdata.config.schema import (
    BudgetUnit,
    Config,
    DatasetConfig,
    Turns,
    check_all,
    length_warnings,
    template_kwargs_of,
)
from draftdata.errors import ConfigError
from draftdata.generate.accounting import needs_request, prompt_count, stored_total, unusable_reason
from draftdata.generate.budget.lengths import MIN_OBSERVED as MIN_LENGTHS
from draftdata.generate.budget.lengths import LengthModel
from draftdata.generate.request import Planned
from draftdata.generate.selection import plan_requests
from draftdata.generate.store import ResponseStore, StoredResponse
from draftdata.generate.work import conversation_plan, plan_conversations
from draftdata.hidden.shards import bytes_per_token, disk_per_token
from draftdata.model.load import ModelNotBuilt, model_dir, model_limits
from draftdata.model.tokenizer import end_of_turn_line, has_tokenizer_files, load_tokenizer
from draftdata.util.files import data_dir, read_jsonl, write_json
from draftdata.util.sqlite import resolve_store_path

# Disk estimates where no output exists yet to measure, in bytes per token of prompt + completion.
# responses.jsonl holds each token about twice: as a JSON id (5-7 bytes with its comma) and as text (the prompt in
# `messages`, the completion in `text`, about 4 bytes a token).
RESPONSES_BYTES_PER_TOKEN = 10.0
# samples.parquet: input_ids int32 + loss_mask int8 per token, before parquet's compression (an upper bound).
SAMPLES_BYTES_PER_TOKEN = 5.0
OPTIONS = ("plan.tok_s", "plan.out")


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
    mean_completion_from: str  # "<n> stored" | "max_tokens/2"
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


def split_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """This command's `plan.*` overrides, and the rest (for the config loader, whose schema has no `plan`)."""
    mine, rest = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.startswith("plan."):
            mine[key] = value
        else:
            rest.append(arg)
    return mine, rest


def parse_options(raw: dict[str, str]) -> Options:
    for key in raw:
        if key not in OPTIONS:
            raise ConfigError(key, f"unknown key; known: {', '.join(OPTIONS)} [from command line]")
    opts = Options(out=raw.get("plan.out") or None)
    if "plan.tok_s" in raw:
        try:
            opts.tok_s = float(raw["plan.tok_s"])
        except ValueError:
            opts.tok_s = -1.0
        if not (opts.tok_s > 0 and math.isfinite(opts.tok_s)):
            raise ConfigError(
                "plan.tok_s", f"must be a positive number of tokens per second, got {raw['plan.tok_s']!r}"
            )
    return opts


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
    return lm.mean(), f"{lm.n} stored" if lm.n >= MIN_LENGTHS else "max_tokens/2"


def generation_rate(given: float | None, metrics: dict) -> tuple[float | None, str]:
    """Tokens/s: given, else the last generate run's (0 there means it generated nothing: no measurement)."""
    if given is not None:
        return given, "given"
    measured = metrics.get("new_tok_per_s") or 0.0
    return (measured, "measured") if measured > 0 else (None, "none")


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

    from draftdata.hidden.layers import resolve_layers
    from draftdata.model.load import check_model_path, load_error

    check_model_path(cfg.model.path)
    try:
        conf = AutoConfig.from_pretrained(
            cfg.model.path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        ).get_text_config()
    except (OSError, ValueError) as e:
        raise load_error(e, "a model config", cfg.model.path) from None
    layers = resolve_layers(cfg, conf.num_hidden_layers)
    dtype = cfg.hidden_states.dtype
    return ModelShape(
        conf.num_hidden_layers,
        conf.hidden_size,
        layers,
        dtype,
        bytes_per_token(len(layers), conf.hidden_size, dtype),
        disk_per_token(len(layers), conf.hidden_size),
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
    if prompts_path.exists() and tokenizer is not None:
        records = list(read_jsonl(prompts_path))
        if ds.turns == Turns.all:
            planned, stored, turns, left_to_send = _conversation_turns(cfg, records, tokenizer(), store)
        else:  # the same keys generate computes (rendered prompt ids, model fingerprint, sampling, max_tokens)
            planned = plan_requests(cfg, records, tokenizer(), store)
            stored = store.get_many(p.key for p in planned) if store is not None else {}
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
    per_request = mean_c
    if ds.budget_unit == BudgetUnit.total:  # as generate: the prompts of the requests still to send
        per_request += _mean([prompt_count(p) for p in todo]) or mean_prompt or 0.0
    left = to_generate(ds.token_budget, reusable)

    gm = _read_json(out / "generate_metrics.json")
    tok_s, tok_s_from = generation_rate(opts.tok_s, gm)

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
        requests=expected_requests(left, per_request),
        prompts_left=left_to_send if planned else None,
        tok_s=tok_s,
        tok_s_from=tok_s_from,
        gpu_s=left / tok_s if tok_s else None,
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
    )


class _NoStore:
    """Nothing stored (no store yet): planning creates none."""

    def get_many(self, keys) -> dict:
        return {}

    def get_turn_renders(self, tokenizer, conversations, turns) -> dict:
        return {}

    def put_turn_renders(self, tokenizer, renders) -> None:
        pass


def _conversation_turns(
    cfg: Config, records: list[dict], tok, store: ResponseStore | None
) -> tuple[list[Planned], dict[str, StoredResponse], int, int]:
    """`turns: all`: each conversation walked over the turns the store holds, as generate walks it. The turns
    answered and each one's next, the store's rows for them, the source turns of all conversations (their
    `slots`), and the turns a run could still send (those left of the conversations that have not ended)."""
    convs, _ = plan_conversations(cfg, records, tok, store or _NoStore(), None)
    planned, stored = conversation_plan(convs, store or _NoStore())
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


# ---- output ------------------------------------------------------------------------------------------------------ #


def fmt_tokens(n: float | None) -> str:
    if n is None:
        return "-"
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{round(n):,}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = round(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def table(headers: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Fixed-width columns: those in `left` left-aligned (names, words), the rest right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for r in [headers, *rows]:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def render(
    plans: list[DatasetPlan],
    shape: ModelShape | None,
    cfg: Config,
    warnings: Sequence[str] = (),
    ends: Sequence[str] = (),
) -> str:
    all_gpu = all(p.gpu_s is not None for p in plans)
    prompts_known = all(p.prompts is not None for p in plans)
    tokens_rows = [
        [
            p.dataset,
            fmt_tokens(p.prompts) + ("" if p.prompts_from == "prompts.jsonl" else "*"),
            fmt_tokens(p.budget),
            p.unit,
            fmt_tokens(p.reusable),
            fmt_tokens(p.parked),
            fmt_tokens(p.to_generate),
            fmt_tokens(p.requests),
            f"{p.mean_completion:,.0f}",
            p.mean_completion_from,
        ]
        for p in plans
    ]
    tokens_rows.append(
        [
            "total",
            fmt_tokens(sum(p.prompts for p in plans)) if prompts_known else "-",
            fmt_tokens(sum(p.budget for p in plans)),
            "",
            fmt_tokens(sum(p.reusable for p in plans)),
            fmt_tokens(sum(p.parked for p in plans)),
            fmt_tokens(sum(p.to_generate for p in plans)),
            fmt_tokens(sum(p.requests for p in plans)),
            "",
            "",
        ]
    )
    cost_rows = [
        [
            p.dataset,
            fmt_tokens(p.tok_s),
            p.tok_s_from,
            fmt_duration(p.gpu_s),
            fmt_tokens(p.sequence_tokens),
            fmt_bytes(p.responses_bytes),
            fmt_bytes(p.samples_bytes),
            fmt_bytes(p.hidden_bytes),
            fmt_bytes(p.disk_bytes),
            _disk_basis(p),
        ]
        for p in plans
    ]
    gpu_total = sum(p.gpu_s or 0.0 for p in plans)
    if not all_gpu:  # a dataset without a rate: the sum of the others is a lower bound
        gpu_total_s = f">= {fmt_duration(gpu_total)}" if any(p.gpu_s for p in plans) else "-"
    else:
        gpu_total_s = fmt_duration(gpu_total)
    cost_rows.append(
        [
            "total",
            "",
            "",
            gpu_total_s,
            fmt_tokens(sum(p.sequence_tokens for p in plans)),
            *[
                fmt_bytes(sum(getattr(p, f) for p in plans))
                for f in ("responses_bytes", "samples_bytes", "hidden_bytes", "disk_bytes")
            ],
            "",
        ]
    )
    lines = [
        f"plan: {len(plans)} dataset(s); nothing is sent to any server",
        _target_line(cfg, shape),
        *ends,  # which token ends a turn, under each distinct template_kwargs
        "",
        *table(
            [
                "dataset",
                "prompts",
                "budget",
                "unit",
                "reusable",
                "parked",
                "to generate",
                "requests",
                "mean len",
                "mean len from",
            ],
            tokens_rows,
            left=(0, 3, 9),
        ),
        "",
        *table(
            [
                "dataset",
                "tok/s",
                "tok/s from",
                "GPU time",
                "seq tokens",
                "responses",
                "samples",
                "hidden states",
                "disk",
                "disk from",
            ],
            cost_rows,
            left=(0, 2, 9),
        ),
        *_disk_table(plans, shape),
    ]
    notes = [f"warning: {w}" for w in warnings] + [_conversations_note(p) for p in plans if p.turns is not None]
    notes += [
        f"{p.dataset}: about {p.requests:,} requests needed, {p.prompts_left:,} {_sent(p)} left to send: the "
        f"{_sent(p)} run out before the budget"
        for p in plans
        if p.prompts_left is not None and p.requests > p.prompts_left
    ]
    if not prompts_known or any(p.prompts_from != "prompts.jsonl" for p in plans):
        notes.append(
            "* prompts stage not run: source records counted, nothing reusable known yet, and the disk "
            "counts completion tokens only"
        )
    return "\n".join(lines + ([""] + notes if notes else []))


def _disk_table(plans: list[DatasetPlan], shape: ModelShape | None) -> list[str]:
    """The hidden states' bytes per token as stored and per trained token, in bf16 and fp8, beside online
    training's nothing."""
    if shape is None:
        return []
    rows = []
    for p in plans:
        per_trained = p.per_trained_token(shape) or {}
        rows.append(
            [
                p.dataset,
                "-" if p.trained_share is None else f"{p.trained_share:.3f}",
                p.trained_share_from,
                *(fmt_bytes(n) for d in ("bfloat16", "fp8") for n in (shape.disk_per_token[d], per_trained.get(d))),
                "0 B",
            ]
        )
    headers = ["dataset", "trained share", "share from"]
    headers += [h for d in ("bf16", "fp8") for h in (f"{d}/token", f"{d}/trained token")] + ["online"]
    caption = "hidden states on disk: per token as stored, per trained token (÷ trained share); online stores none"
    return ["", caption, *table(headers, rows, left=(0, 2))]


def _sent(p: DatasetPlan) -> str:
    return "prompts" if p.turns is None else "turns"


def _conversations_note(p: DatasetPlan) -> str:
    """turns: all: the requests are turns; what a conversation holds, and how many the budget still takes."""
    per = p.turns_per_conversation or 0.0
    return (
        f"{p.dataset}: turns: all: {p.prompts:,} conversations of {per:.2f} turns on average ({p.turns:,} turns), "
        f"about {round(per * p.mean_completion):,} completion tokens each: about {p.conversations_needed:,} "
        "conversations to go"
    )


def _target_line(cfg: Config, shape: ModelShape | None) -> str:
    if shape is None:
        return f"target: {cfg.model.path} (not built yet: hidden states not sized)"
    return (
        f"target: {cfg.model.path} ({shape.n_layers} layers, hidden {shape.hidden_size}); hidden states: "
        f"layers {shape.layers} + final, {shape.dtype}, {shape.bytes_per_token:,} bytes/token"
    )


def _disk_basis(p: DatasetPlan) -> str:
    if p.responses_from == p.samples_from:
        return p.responses_from
    return "responses measured" if p.responses_from == "measured" else "samples measured"


def to_json(plans: list[DatasetPlan], shape: ModelShape | None, warnings: Sequence[str] = ()) -> dict:
    return {
        "model": asdict(shape) if shape else None,  # None: the model is not built yet
        "warnings": list(warnings),
        "datasets": [
            dict(
                asdict(p),
                disk_bytes=p.disk_bytes,
                turns_per_conversation=p.turns_per_conversation,
                hidden_bytes_per_trained_token=p.per_trained_token(shape),
            )
            for p in plans
        ],
        "total": {
            k: sum(getattr(p, k) for p in plans)
            for k in (
                "budget",
                "reusable",
                "parked",
                "to_generate",
                "requests",
                "sequence_tokens",
                "responses_bytes",
                "samples_bytes",
                "hidden_bytes",
                "disk_bytes",
            )
        }
        | {"gpu_s": sum(p.gpu_s or 0.0 for p in plans), "gpu_s_complete": all(p.gpu_s is not None for p in plans)},
    }


# ---- entry point ------------------------------------------------------------------------------------------------- #


def main(cfg: Config, opts: Options | None = None) -> list[DatasetPlan]:
    opts = opts or Options()
    check_all(cfg)  # params.yaml whole, as the check_params stage does
    names = [cfg.dataset] if cfg.dataset is not None else list(cfg.datasets)
    try:
        shape = model_shape(cfg)
    except ModelNotBuilt as e:  # a fresh clone before the demo: say so, and plan from the sources alone
        shape, not_built = None, str(e)
    # samples tokenize would drop (or generate refuse) for their length: told here, not refused
    if shape is None:
        warnings = [f"{not_built}; until then prompts are counted from the sources and hidden states are not sized"]
        warnings += length_warnings(cfg, names, None)
    else:
        warnings = length_warnings(cfg, names, model_limits(cfg.model).context)
    tokenizer = _tokenizer_loader(cfg) if shape else None
    ends: list[str] = []
    if tokenizer is not None and has_tokenizer_files(model_dir(cfg.model)):
        # as check_params and generate: a template that ends the turn where the target does not stop, in one line;
        # else which token it is
        ends = sorted({end_of_turn_line(tokenizer(), cfg.model, template_kwargs_of(cfg, name)) for name in names})
    store_path = resolve_store_path(cfg.run.store_path)
    store = ResponseStore(store_path) if store_path.exists() else None  # no store yet: nothing stored, none made
    try:
        plans = [plan_dataset(cfg, name, tokenizer, store, shape, opts) for name in names]
    finally:
        if store is not None:
            store.close()
    print(render(plans, shape, cfg, warnings, ends))
    if opts.out:
        write_json(opts.out, to_json(plans, shape, warnings))
    return plans


def _tokenizer_loader(cfg: Config):
    """The tokenizer, loaded the first time something needs it (the end-of-turn check, a dataset with prompts)."""
    from functools import cache

    return cache(lambda: load_tokenizer(cfg.model))


def run(argv: list[str]) -> None:
    raw, rest = split_options(argv)
    # with dataset=<D> the loader checks that D exists, as for every stage; without it, all datasets are planned
    one = any(a.partition("=")[0].lstrip("+") == "dataset" for a in rest)
    cli(lambda cfg: main(cfg, parse_options(raw)), need_dataset=one, argv=rest, prog="draftdata plan")
