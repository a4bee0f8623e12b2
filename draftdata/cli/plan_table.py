"""`draftdata plan`'s tables (cli/plan.py): the tokens each dataset's budget takes, its generation time and disk, the
hidden states' bytes per trained token, and the notes; and the same as JSON (`plan.out`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from draftdata.cli.costs import DatasetPlan, ModelShape, ModePlan
from draftdata.config.schema import Config


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
    lines = [
        f"plan: {len(plans)} dataset(s); nothing is sent to any server",
        _target_line(cfg, shape),
        *ends,  # which token ends a turn, under each distinct template_kwargs
        "",
        *_tokens_table(plans),
        "",
        *_cost_table(plans),
        *_disk_table(plans, shape),
    ]
    notes = _notes(plans, warnings)
    return "\n".join(lines + ([""] + notes if notes else []))


TOKENS_HEADERS = ["dataset", "prompts", "budget", "unit", "reusable", "parked", "to generate", "requests"]
TOKENS_HEADERS += ["mean len", "mean len from"]
COST_HEADERS = ["dataset", "tok/s", "tok/s from", "gen time", "seq tokens", "responses", "samples"]
COST_HEADERS += ["hidden states", "disk", "disk from"]


def _tokens_table(plans: list[DatasetPlan]) -> list[str]:
    """Per dataset: its prompts, budget, what the store holds toward it, what is left to generate and in how many
    requests, at which mean completion length."""
    prompts_known = all(p.prompts is not None for p in plans)
    rows = []
    for p in plans:
        rows.append(
            [
                p.dataset,
                fmt_tokens(p.prompts) + ("" if p.prompts_from == "prompts.jsonl" else "*"),
                fmt_tokens(p.budget),
                p.unit,
                *(fmt_tokens(n) for n in (p.reusable, p.parked, p.to_generate, p.requests)),
                f"{p.mean_completion:,.0f}",
                p.mean_completion_from,
            ]
        )
        rows += [_mode_row(m) for m in p.modes]  # beneath it, each mode's share (not in the total: the row holds it)
    total = [fmt_tokens(sum(getattr(p, f) for p in plans)) for f in ("reusable", "parked", "to_generate", "requests")]
    prompts = fmt_tokens(sum(p.prompts for p in plans)) if prompts_known else "-"
    rows.append(["total", prompts, fmt_tokens(sum(p.budget for p in plans)), "", *total, "", ""])
    return table(TOKENS_HEADERS, rows, left=(0, 3, 9))


def _mode_row(m: ModePlan) -> list[str]:
    figures = (m.reusable, m.parked, m.to_generate, m.requests)
    return [f"  mode {m.mode}", fmt_tokens(m.prompts), fmt_tokens(m.budget), "", *(fmt_tokens(n) for n in figures)] + [
        f"{m.mean_completion:,.0f}",
        m.mean_completion_from,
    ]


def _cost_table(plans: list[DatasetPlan]) -> list[str]:
    """Per dataset: the generation time at its rate (the generation server's time, or this machine's with the
    embedded backend) and the disk its whole budget takes."""
    sizes = ("responses_bytes", "samples_bytes", "hidden_bytes", "disk_bytes")
    rows = [
        [
            p.dataset,
            fmt_tokens(p.tok_s),
            p.tok_s_from,
            fmt_duration(p.gpu_s),
            fmt_tokens(p.sequence_tokens),
            *(fmt_bytes(getattr(p, f)) for f in sizes),
            _disk_basis(p),
        ]
        for p in plans
    ]
    time_total = sum(p.gpu_s or 0.0 for p in plans)
    if all(p.gpu_s is not None for p in plans):
        time_total_s = fmt_duration(time_total)
    else:  # a dataset without a rate: the sum of the others is a lower bound
        time_total_s = f">= {fmt_duration(time_total)}" if any(p.gpu_s for p in plans) else "-"
    seq = fmt_tokens(sum(p.sequence_tokens for p in plans))
    rows.append(
        ["total", "", "", time_total_s, seq, *(fmt_bytes(sum(getattr(p, f) for p in plans)) for f in sizes), ""]
    )
    return table(COST_HEADERS, rows, left=(0, 2, 9))


def _notes(plans: list[DatasetPlan], warnings: Sequence[str]) -> list[str]:
    notes = [f"warning: {w}" for w in warnings] + [_conversations_note(p) for p in plans if p.turns is not None]
    notes += [
        f"{p.dataset}: about {p.requests:,} requests needed, {p.prompts_left:,} {_sent(p)} left to send: the "
        f"{_sent(p)} run out before the budget"
        for p in plans
        if p.prompts_left is not None and p.requests > p.prompts_left
    ]
    if any(p.prompts is None or p.prompts_from != "prompts.jsonl" for p in plans):
        notes.append(
            "* prompts stage not run: source records counted, nothing reusable known yet, and the disk "
            "counts completion tokens only"
        )
    return notes


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
                *(
                    fmt_bytes(n)
                    for d in ("bfloat16", "fp8", "policy")
                    for n in (shape.disk_per_token[d], per_trained.get(d))
                ),
                "0 B",
            ]
        )
    k = f"top-{shape.policy_top_k} (policy_top_k)" if shape.policy_top_k else "top-20 (ModelOpt's k)"
    headers = ["dataset", "trained share", "share from"]
    headers += [h for d in ("bf16", "fp8", "policy") for h in (d, f"{d}/trained")] + ["online"]
    caption = [
        "hidden states on disk: per token as stored, per trained token (÷ trained share), bytes; online stores none",
        f"policy: the target's {k} next-token policy alone (an external draft's data: no states)",
    ]
    return ["", *caption, *table(headers, rows, left=(0, 2))]


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
    hs = cfg.hidden_states
    policy = f"top-{hs.policy_top_k} policy (top-p {hs.policy_top_p})"
    kept = f"layers {shape.layers} + final, {shape.dtype}" if shape.states else "no states"
    kept += f" + {policy}" if shape.policy_top_k else ""
    line = (
        f"target: {cfg.model.path} ({shape.n_layers} layers, hidden {shape.hidden_size}); hidden states: "
        f"{kept}, {shape.bytes_per_token:,} bytes/token"
    )
    if len(shape.families) > 1:  # what the union costs against each family captured alone
        alone = "; ".join(f"{name} {ids} {n:,}" for name, (ids, n) in shape.families.items())
        line += f" for {', '.join(shape.families)} (alone, bytes/token: {alone})"
    return line


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
