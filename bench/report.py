"""The benchmark figures of docs/benchmarks.md, rendered from bench/results/*.json.

    python -m bench.report            # print the figures (markdown)
    python -m bench.report --write    # rewrite docs/benchmarks.md's block between the bench-report markers

Every figure in the block comes from the files each benchmark writes (budget.json, budget_live.json, client.json,
tokenize.json, hidden_states.json, hidden_states_llama8b.json, hidden_states_vllm.json, reliability.json, modes.json,
noop.json, noop_turns.json, drafter.json), so rerunning a benchmark and then `python -m bench.report --write` is all
it takes to bring the page up to date; a test keeps the page's block equal to this output. `--write` also rewrites
README.md's quality block (the drafter's figures, from drafter.json). Nothing here measures anything, and it imports
nothing of the project.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from bench import report_demo
from bench.drafter import ERRORS as DRAFTER_ERRORS  # the convention errors the bench trains, named once
from bench.drafter import UNTRAINED as DRAFTER_UNTRAINED
from bench.report_proof import PROOF_COMMAND, PROOF_FILE, PROOF_PLOT, plot, proof_section, quality
from draftdata.util.blocks import between, replace_between

RESULTS = Path(__file__).resolve().parent / "results"
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
START = "<!-- bench-report:start -->"
END = "<!-- bench-report:end -->"

BUDGET_STRATEGIES = (
    ("check_cancel", "check_cancel"),
    ("ours", "ours (`landing: finished`)"),
    ("ours_exact", "ours (`landing: exact`)"),
    ("exact_limit", "exact_limit"),
    ("ours_keep_partial", "ours_keep_partial"),
)


# ---- formatting ------------------------------------------------------------------------------------------------ #


def num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def budget_name(budget: int) -> str:
    return f"{budget / 1e6:g}M" if budget >= 1_000_000 else f"{budget / 1e3:g}k"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def goals_line(goals: dict[str, bool]) -> str:
    return "Goals: " + ", ".join(f"`{name}` {'met' if ok else '**missed**'}" for name, ok in goals.items()) + "."


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} to {fmt(hi)}"


# ---- one section per benchmark --------------------------------------------------------------------------------- #


def budget(r: dict) -> list[str]:
    s, rows = r["settings"], r["scenarios"]
    seeds = {row["budget"]: row["seeds"] for row in rows}
    out = [
        "### Budget strategies: `python -m bench.budget`",
        "",
        f"A server with {s['concurrency']} slots; completion lengths of the families "
        f"{', '.join(s.get('families', ['lognormal']))} (lognormal: mean {num(s['mean_len'])}, sigma "
        f"{s['sigma']:g}), capped at {num(s['max_tokens'])}; a throughput reading every {s['reading_s']:g} s with "
        f"{' or '.join(f'{n:g} %' for n in s['noise_pct'])} noise; the cancel reaches the server "
        f"{s['abort_latency_s'] * 1000:g} ms after the decision; compute_bound flat above {s['knee']} running "
        f"requests (compute_bound_kN at N), saturating with h = {s['saturation_h']:g} (saturating_hN: h = N); a "
        f"parked request's re-prefill ({num(s.get('prompt_tokens', 0))} prompt tokens + its partial) charged at "
        f"1/{s.get('prefill_speedup', 0):g} of a decode token, in lost. Averaged over "
        + ", ".join(f"{n} draws at {budget_name(b)}" for b, n in sorted(seeds.items()))
        + ". Cells: overshoot % / waste % / lost % / time ÷ ideal.",
        "",
    ]
    labels = [label for _, label in BUDGET_STRATEGIES]
    out += table(["server", "lengths", "budget", "noise", *labels, "missed goals"], [budget_row(row) for row in rows])
    out += [
        "",
        "Ours against check_cancel, per server over its rows above (ranges over lengths, budgets and noises):",
        "",
    ]
    derived = []
    for model in dict.fromkeys(row["model"] for row in rows):
        mine = [row for row in rows if row["model"] == model]
        cc = [row["strategies"]["check_cancel"] for row in mine]
        ours = [row["strategies"]["ours"] for row in mine]
        gap = [o["time_vs_ideal"] - c["time_vs_ideal"] for o, c in zip(ours, cc)]
        extra = [
            (o["time_vs_ideal"] - 1) / (c["time_vs_ideal"] - 1) for o, c in zip(ours, cc) if c["time_vs_ideal"] > 1
        ]
        waste = [c["waste_pct"] / o["waste_pct"] for o, c in zip(ours, cc) if o["waste_pct"] > 0]
        parked = {}
        for row, o in zip(mine, ours):
            parked.setdefault(budget_name(row["budget"]), []).append(100 * o["parked_tokens"] / o["generated_tokens"])
        derived.append(
            [
                model,
                span(gap, lambda x: f"{x:+.4f}"),
                span(extra, lambda x: f"{x:.2f}"),
                span(waste, lambda x: f"{x:.1f}×"),
                f"{max(o['lost_pct'] for o in ours):.2f} / {max(c['lost_pct'] for c in cc):.2f}",
                ", ".join(f"{b}: {span(v, lambda x: f'{x:.1f}')}" for b, v in parked.items()),
            ]
        )
    out += table(
        [
            "server",
            "time ÷ ideal, minus check_cancel's",
            "extra time (time ÷ ideal − 1) ÷ check_cancel's",
            "check_cancel's waste ÷ ours",
            "most lost %, ours / check_cancel",
            "ours parked % of what it generated",
        ],
        derived,
    )
    out += budget_exact(rows)
    kp = [row["strategies"]["ours_keep_partial"] for row in rows]
    full = s["concurrency"] * s["mean_len"]
    out += [
        "",
        f"ours_keep_partial in every row: waste at most {max(m['waste_pct'] for m in kp):.2f} %, time ÷ ideal at most "
        f"{max(m['time_vs_ideal'] for m in kp):.4f}. A full batch holds about {s['concurrency']} × "
        f"{num(s['mean_len'])} = {num(full)} tokens in flight.",
    ]
    order = [m for m in s.get("scenario_models", []) if m in r["models"]]
    models = {m: r["models"][m] for m in [*order, *sorted(set(r["models"]) - set(order))]}
    names = list(dict.fromkeys(name for m in models.values() for name in m))
    out += [
        "",
        f"Without noise at {budget_name(s['budget'])}, every strategy (`cap` stops at {num(s['cap_samples'])} "
        "samples; `ours_slack_N` is ours blind to the server's rate, with admit slack N). Cells: overshoot % / "
        "waste % / time ÷ ideal.",
        "",
    ]
    out += table(
        ["strategy", *models],
        [
            [
                name,
                *(
                    f"{m[name]['overshoot_pct']:.2f} / {m[name]['waste_pct']:.2f} / {m[name]['time_vs_ideal']:.4f}"
                    for m in models.values()
                ),
            ]
            for name in names
        ],
    )
    out += budget_turns(r)
    if rows := r.get("neighbour_scenarios"):
        out += [
            "",
            "A noisy neighbour (`python -m bench.budget --only neighbour_scenarios`): another job on the server's "
            "machine halves its rate for 10 to 60 s at a time (uniform), a minute apart on average (exponential "
            "gaps), at random; the readings' noise as above. Time ÷ ideal is over the same server's ideal, its slow "
            "episodes included. Cells as above.",
            "",
            *table(
                ["server", "lengths", "budget", "noise", *labels, "missed goals"], [budget_row(row) for row in rows]
            ),
        ]
    missed = [f"`{model}.{k}`" for model, goals in r["goals"].items() for k, ok in goals.items() if not ok]
    out += ["", f"Every goal in the file met: {'yes' if r['all_goals_met'] else 'no'}"]
    out[-1] += f" (missed: {', '.join(missed)})." if missed else "."
    return out


def budget_exact(rows: list[dict]) -> list[str]:
    """landing exact against today's rule (finished) and against exact_limit, per server and budget, where the rows
    ran it."""
    rows = [row for row in rows if "ours_exact" in row["strategies"] and "exact_limit" in row["strategies"]]
    if not rows:
        return []
    derived = []
    for model in dict.fromkeys(row["model"] for row in rows):
        for budget in sorted({row["budget"] for row in rows if row["model"] == model}):
            mine = [row["strategies"] for row in rows if (row["model"], row["budget"]) == (model, budget)]
            cost = [m["ours_exact"]["time_vs_ideal"] - m["ours"]["time_vs_ideal"] for m in mine]
            over = [m["ours_exact"]["time_vs_ideal"] - m["exact_limit"]["time_vs_ideal"] for m in mine]
            waste = [m["ours_exact"]["waste_pct"] for m in mine]
            derived.append(
                [
                    model,
                    budget_name(budget),
                    span(cost, lambda x: f"{x:+.4f}"),
                    span(over, lambda x: f"{x:+.4f}"),
                    span(waste, lambda x: f"{x:.1f}"),
                ]
            )
    return [
        "",
        "`landing: exact` (the default) against `landing: finished` (the rule before it) and against exact_limit, "
        "which sends exactly the requests the exact output holds, as soon as a slot is free (it knows the lengths "
        "to come; no controller does; for conversations it starts those the output holds, each turn sent as the one "
        "before it completes), per server over its rows above:",
        "",
        *table(
            [
                "server",
                "budget",
                "time ÷ ideal, exact minus finished",
                "time ÷ ideal, exact minus exact_limit",
                "exact's waste %",
            ],
            derived,
        ),
    ]


def budget_row(row: dict) -> list[str]:
    """A scenario row's case, its strategies' cells (overshoot / waste / lost / time) and the goals it missed."""
    cells = []
    for name, _ in BUDGET_STRATEGIES:
        if (m := row["strategies"].get(name)) is None:  # a strategy the row did not run
            cells.append("–")
            continue
        cells.append(
            f"{m['overshoot_pct']:.2f} / {m['waste_pct']:.2f} / {m['lost_pct']:.2f} / {m['time_vs_ideal']:.4f}"
        )
    missed = ", ".join(f"`{k}`" for k, ok in row["goals"].items() if not ok) or "none"
    case = [row["model"], row.get("family", "lognormal"), budget_name(row["budget"]), f"{row['noise_pct']:g} %"]
    if "turns" in row:
        case.insert(2, f"{row['end_early_pct']:g} %")
    return [*case, *cells, missed]


def budget_turns(r: dict) -> list[str]:
    """The multi-turn rows (`turns: all`), where the file has them: budget_unit completion, then total."""
    s = r["settings"]
    labels = [label for _, label in BUDGET_STRATEGIES]
    out = []
    for key, intro in (
        (
            "turn_scenarios",
            f"Conversations (`turns: all`): 1 to {s['max_turns']} turns each (uniform), each turn's length from the "
            "family, a conversation's turns one after another, a share of the turns that have a source turn after "
            "them ending their conversation early (the controller expects every source turn); budget_unit "
            "completion. A parked turn's re-prefill counts its whole history (500 tokens of source turns per turn "
            "and the answers before it). Cells as above.",
        ),
        (
            "turn_total_scenarios",
            "The same conversations under budget_unit total (`python -m bench.budget --only turn_total_scenarios`): "
            "every turn's prompt, its history included, counts toward the budget, and the controller is told each "
            "started conversation's next prompt and what a turn adds to it, as the generate stage tells it. Waste "
            "and time count decoded tokens (the tokens past the budget taken off the answers); overshoot counts "
            "prompts and answers. Cells as above.",
        ),
    ):
        if rows := r.get(key):
            out += [
                "",
                intro,
                "",
                *table(
                    ["server", "lengths", "end early", "budget", "noise", *labels, "missed goals"],
                    [budget_row(row) for row in rows],
                ),
                *budget_exact(rows),
            ]
    return out


def shared_machine(s: dict) -> tuple[str, str]:
    """A live run's shared-machine options (`--neighbour`, `--hog N`): the command's flags and the sentence that says
    what they did; empty for a run on a quiet machine."""
    neighbour, hog = s.get("neighbour"), s.get("hog")
    if not (neighbour or hog):
        return "", ""
    flags, parts = [f"--family {s['family']}"], []
    if neighbour:
        flags.append("--neighbour")
        parts.append(
            f"a noisy neighbour slows the server to {s['neighbour_factor']:g} of its rate for 10 to 60 s at a time, a "
            "minute apart on average, at random (the same episodes for both strategies of a prompt set; the ideal "
            "time goes through them too)"
        )
    if hog:
        flags.append(f"--hog {hog}")
        parts.append(f"{hog} processes keep a core busy each all through, slowing the server and the client alike")
    return " " + " ".join(flags), " On a shared machine: " + " and ".join(parts) + "."


def budget_live(r: dict) -> list[str]:
    s, runs, summary = r["settings"], r["runs"], r["summary"]
    flags, shared = shared_machine(s)
    out = [
        f"### Budget controller live{' on a shared machine' if flags else ''}: `python -m bench.budget_live{flags}`",
        "",
        f"The generate path against a streaming SGLang-protocol server in its own process: {s['concurrency']} "
        f"requests in flight, aggregate throughput flat above {s['knee']} running requests "
        f"({num(s['full_rate_tok_s'])} tokens/s from there to the full batch), a chunk every {s['stream_interval']} "
        f"tokens, {s['family']} lengths scaled to max_tokens {num(s['max_tokens'])}, a budget of "
        f"{num(s['budget'])} completion tokens, {s['repeats']} prompt sets each run by both. Generated tokens are "
        f"counted by the server, kept ones by the client; time is the server's busy span.{shared}",
        "",
    ]
    body = []
    for name, rs in runs.items():
        for i, m in enumerate(rs):
            body.append(
                [
                    name,
                    str(i),
                    f"{m['overshoot_pct']:.2f}",
                    f"{m['waste_pct']:.2f}",
                    f"{m['lost_pct']:.2f}",
                    f"{m['time_s']:.1f}",
                    f"{m['time_vs_ideal']:.3f}",
                    num(m["server_tok_s"]),
                    str(m["stopped_in_flight"]),
                    f"{m['floor']:g}" if "floor" in m else "",
                ]
            )
    out += table(
        [
            "strategy",
            "prompt set",
            "overshoot %",
            "waste %",
            "lost %",
            "time s",
            "time ÷ ideal",
            "server tokens/s",
            "stopped in flight",
            "ours' knee estimate",
        ],
        body,
    )
    ours, cc = summary["ours"], summary["check_cancel"]
    out += [
        "",
        f"Mean: ours wastes {ours['waste_pct']:.2f} % against check_cancel's {cc['waste_pct']:.2f} %, in "
        f"{ours['time_s']:.1f} s against {cc['time_s']:.1f} s. {goals_line(r['goals'])}",
    ]
    return out


CLIENT_LABELS = {
    "ours": "ours (streamed, the default)",
    "ours_unstreamed": "ours, not streamed",
    "openai": "one shared `AsyncOpenAI` client, a semaphore",
    "raw": "raw: a bare aiohttp loop (the floor)",
}


def client(r: dict) -> list[str]:
    s, med, per_token, ratios = r["settings"], r["medians"], r["per_token"], r["ratios"]
    short, long = (str(t) for t in s["output_tokens"])
    body = []
    for name, label in CLIENT_LABELS.items():
        m, rounds = med[name], r["rounds"][name]
        cells = [label, num(m[short]["rps"], 1), num(m[short]["cpu_us_per_request"], 1)]
        cells += [num(m[short]["wall_us_per_request"], 1)]
        if long in m:
            split = per_token[name]
            cells += [num(m[long]["rps"], 1), num(m[long]["cpu_us_per_request"], 1)]
            cells += [f"{num(split['cpu_us_fixed'], 1)} + {split['cpu_us_per_token']:.2f}"]
        else:
            cells += ["", "", ""]
        cells += [", ".join(num(x["rps"], 1) for x in rounds[short])]
        body.append(cells)
    pairs = zip(r["rounds"]["ours"][short], r["rounds"]["raw"][short])
    per_round = ", ".join(f"{o['rps'] / w['rps']:.2f}" for o, w in pairs)
    header = [
        "client",
        f"req/s ({short} tokens)",
        "CPU µs per request",
        "wall µs per request",
        f"req/s ({long} tokens)",
        "CPU µs per request",
        "CPU µs: fixed + per token",
        f"req/s per round ({short} tokens)",
    ]
    return [
        "### Client overhead: `python -m bench.client`",
        "",
        f"{s['concurrency']} requests in flight, prompts of {s['prompt_tokens']} tokens, answers of {short} and "
        f"{long} tokens, one SSE event per token from a zero-latency server; medians of {s['rounds']} interleaved "
        "rounds. Wall µs per request is the wall time of a run over its requests (the inverse of req/s).",
        "",
        *table(header, body),
        "",
        f"ours ÷ the shared AsyncOpenAI client: {ratios['cpu_per_request_vs_openai']:.3f} of its CPU per request "
        f"({short} tokens), {ratios['cpu_per_token_vs_openai']:.3f} of its CPU per streamed token, "
        f"{ratios['rps_vs_openai']:.2f}× its requests per second; ours ÷ raw: {ratios['rps_vs_raw']:.3f} in requests "
        f"per second (per round: {per_round}). {goals_line(r['goals'])}",
    ]


EMBEDDED_LABELS = {
    "ours": "ours (slot batching)",
    "vllm": "vLLM's CPU build (tuned)",
    "transformers_cb": "transformers' continuous batching",
    "static": "transformers `generate`, static batches",
}


def embedded_cpu(machine: dict) -> str:
    """The CPU the figures belong to and the machine's load while they were taken (results that name them)."""
    cpu = machine.get("cpu")
    if not cpu:
        return ""
    flags = ", ".join(cpu["flags"]) or "none of AVX2, AVX-512, AMX"
    load = machine.get("load_average_1_5_15", {})
    during = (
        f"; load average (1, 5, 15 min) {', '.join(f'{x:g}' for x in load['start'])} at the start, "
        f"{', '.join(f'{x:.2f}' for x in load['end'])} at the end"
        if load
        else ""
    )
    return f" ({cpu['model_name']}: {flags}; ours computes in {cpu['compute_dtype']}{during})"


def embedded(r: dict) -> list[str]:
    """The embedded engine against the alternatives and this CPU's limit."""
    cs = list(r["limit"]["by_concurrency"])
    engines = [e for e in EMBEDDED_LABELS if e in r["engines"]]

    def cell(e: str, c: str, fmt) -> str:  # an engine measured at fewer concurrencies leaves the others blank
        row = r["engines"][e].get(c)
        return fmt(row) if row else "-"

    body = [[EMBEDDED_LABELS[e], *(cell(e, c, lambda x: num(x["tok_s"], 1)) for c in cs)] for e in engines]
    lim = r["limit"]["by_concurrency"]
    body.append(["limit, this workload (prefill counted)", *(num(lim[c]["workload_tok_s"], 1) for c in cs)])
    body.append(["limit, decode only", *(num(lim[c]["decode_only_tok_s"], 1) for c in cs)])
    if all("workload_torch_attention_tok_s" in lim[c] for c in cs):
        body.append(
            [
                "limit, this workload, attention at torch's kernel's speed",
                *(num(lim[c]["workload_torch_attention_tok_s"], 1) for c in cs),
            ]
        )
    detail = []
    for e in engines:
        row = r["engines"][e]
        detail.append(
            [
                EMBEDDED_LABELS[e],
                *(
                    cell(e, c, lambda x: f"{x['ttft_median_s']} / {x['ttft_p90_s']}" if x["ttft_median_s"] else "-")
                    for c in cs
                ),
                f"{max(row[c]['peak_rss_mb'] for c in cs if c in row):,}",
            ]
        )
    w = r["workload"]
    ours = r["engines"].get("ours", {})
    split = (
        [
            "prefill, decode, sampling s: "
            + ", ".join(
                f"{c}: {t['prefill_s']:g} / {t['decode_s']:g} / {t['sample_s']:g} "
                f"(mean batch {ours[c]['mean_decode_batch']})"
                for c in cs
                if (t := ours.get(c, {}).get("time_split_s"))
            )
        ]
        if ours
        else []
    )
    prof = r.get("ours_profile")
    step = (
        [
            f"A decode step of ours at {prof['requests_in_flight']} in flight ({prof['compute_dtype']} arithmetic, "
            f"16-bit keys and values, {prof.get('attention_kernel', 'SDPA')} decode attention): {prof['step_ms']} ms "
            "under torch's profiler; "
            + ", ".join(f"{k.replace('_', ' ')} {100 * v:.0f} %" for k, v in prof["share"].items())
            + "."
        ]
        if prof
        else []
    )
    rates = ", ".join(
        f"{c}: bf16 {lim[c]['matmul_gflop_s']['bfloat16']:g}, float32 {lim[c]['matmul_gflop_s']['float32']:g}"
        for c in cs
    )
    goals = r["goals"]
    amx = "amx_bf16" in r["machine"].get("cpu", {}).get("flags", [])
    return [
        "### The embedded engine: `python -m bench.embedded`" + (", on a CPU with AMX" if amx else ""),
        "",
        f"{r['model']}, the demo's prompts (mean {w['prompt_tokens_mean']:g} tokens, up to {w['prompt_tokens_max']}), "
        f"{w['new_tokens'][0]} to {w['new_tokens'][1]} new tokens, temperature {w['sampling']['temperature']}, top_p "
        f"{w['sampling']['top_p']}; {r['machine']['cpus']} cores{embedded_cpu(r['machine'])}. Output tokens per second "
        "at c in flight:",
        "",
        *table(["engine", *(f"c = {c}" for c in cs)], body),
        "",
        "Time to first token, median / 90th percentile (s), and peak memory (MB):",
        "",
        *table(["engine", *(f"c = {c}" for c in cs), "peak MB"], detail),
        "",
        f"Matmul rates measured at the model's shapes (GFLOP/s, by rows): {rates}; memory "
        f"{r['limit']['memory_bandwidth_gb_s']} GB/s. Ours: {'; '.join(split)}."
        + (f" vLLM's flags: `{r['vllm_setup']['flags']}`." if "vllm" in r["engines"] else ""),
        *([""] + step if step else []),
        "",
        "ours ÷ the others: "
        + "; ".join(
            f"{k.removeprefix('ours_vs_')} {', '.join(f'{c}: {v}' for c, v in d.items())}"
            for k, d in r["ratios"].items()
        )
        + f". Ours ÷ the limit at 32: {goals['ours_of_limit_at_32']['workload']} of this workload's, "
        f"{goals['ours_of_limit_at_32']['decode_only']} of decode alone"
        + (
            f", {goals['ours_of_limit_at_32']['workload_torch_attention']} of this workload's with attention at "
            f"torch's kernel's speed (attention {100 * lim['32']['attention_share_torch']:.0f} % of that limit's "
            "time). "
            if "workload_torch_attention" in goals["ours_of_limit_at_32"]
            else ". "
        )
        + goals_line(
            {
                "ours >= vLLM at 8, 32, 64": goals.get("ours_vs_vllm_met", False),
                "ours >= 0.5 of the limit at 32": goals.get("ours_of_limit_met", False),
            }
        ),
        *(["", f"Measured by: {r['command']}."] if "--engines" in r.get("command", "") else []),
    ]


TOKENIZE_TEMPLATES = {
    "chatml": "ChatML (the demo's 20-line template)",
    "qwen3_tools": "Qwen3's template, thinking and tools",
}
TOKENIZE_SAMPLERS = {
    "tiny_model": "the demo target (random weights)",
    "bigram": "bigram model of the demo texts' tokens",
}


def tokenize(r: dict) -> list[str]:
    s = r["settings"]
    body = []
    for name, label in TOKENIZE_TEMPLATES.items():
        t = r["templates"][name]
        body.append(
            [
                label,
                num(t["mean_tokens_per_sample"]),
                f"{num(t['stage_tok_s'])} ({t['wall_s']['stage']:.2f} s)",
                f"{num(t['raw_tok_s'])} ({t['wall_s']['raw']:.2f} s)",
                f"{t['ratio']:.3f} ({', '.join(f'{x:.2f}' for x in t['ratio_per_round'])})",
                num(t["stage_samples_s"], 1),
                f"{num(t['id_path_tok_s'])} ({t['wall_s']['id_path']:.2f} s)",
            ]
        )
    drift = []
    for name, label in TOKENIZE_SAMPLERS.items():
        d = r["drift"][name]
        drift.append(
            [
                label,
                f"{num(d['responses'])} ({d['mean_generated_tokens']:g} tokens, {d['ended_pct']:g} % ended)",
                f"{d['samples_differ_pct']:.2f} %",
                f"{d['tokens_differ_pct']:.2f} %",
                f"{d['stage_drift_pct']:.2f} %",
                f"{'exact' if d['id_path_exact'] else 'differs'} on {num(d['id_path_samples'])}",
            ]
        )
    return [
        "### Tokenize: `python -m bench.tokenize`",
        "",
        f"{num(s['samples'])} synthetic multi-turn samples under each template ({s['wall_s']:g} s in all).",
        "",
        *table(
            [
                "template",
                "tokens a sample",
                "stage, text path: tokens/s (s)",
                "raw encode: tokens/s (s)",
                "text path ÷ raw (per round)",
                "samples/s, text path",
                "stage, id path: tokens/s (s)",
            ],
            body,
        ),
        "",
        f"Drift: generated ids stored as text and re-encoded (up to {num(s['max_new_tokens'])} new tokens).",
        "",
        *table(
            [
                "sampler",
                "responses",
                "samples whose ids differ",
                "generated tokens not reproduced",
                "the stage's drift_pct",
                "id path",
            ],
            drift,
        ),
        "",
        goals_line(r["goals"]),
    ]


def hidden_states(r: dict) -> list[str]:
    s, m, paths = r["settings"], r["settings"]["model"], r["paths"]
    labels = {
        "ours": f"ours ({s['store_dtype']})",
        "forward": "plain forward (ours' engine and batches, nothing captured)",
        "naive": f"naive (batches of {r['naive_batch']}, {s['naive_batch_rule']})",
        "fp8": "ours, fp8",
    }
    body = [
        [
            label,
            num(p["tok_s"]),
            num(p["cpu_tok_s"]),
            f"{100 * p['pad_share']:.1f} %",
            num(p["bytes_per_token"], 2) if p["files"] else "–",  # the plain forward stores nothing
            num(p["files"]),
            num(p["peak_rss_mb"]),
        ]
        for name, label in labels.items()
        for p in [paths[name]]
    ]
    avg = r["avg_padded_batch_tokens"]
    return [
        "### Hidden states: `python -m bench.hidden_states`",
        "",
        f"A random-weight Llama (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads, MLP {m['intermediate_size']}, vocab {num(m['vocab_size'])}, "
        f"{s['model_dtype']} weights), layers {s['layers']} plus the final state kept; {s['samples']} samples of "
        f"lognormal length (mean {num(s['mean_len'])}, sigma {s['sigma']:g}, at most {num(s['max_len'])}; "
        f"{s['mean_tokens_per_sample']:g} tokens on average), {s['rounds']} paired rounds of {s['window_samples']} "
        f"samples; {s['device']}, {s['threads']} threads; torch {s['torch']}, transformers {s['transformers']}; "
        f"{r['wall_s']:g} s in all.",
        "",
        *table(["path", "tokens/s", "tokens/s of CPU time", "padding", "bytes a token", "files", "peak RSS MB"], body),
        "",
        f"ours ÷ naive: {r['ratio']:.3f} in tokens/s (per round: {', '.join(f'{x:.3f}' for x in r['ratio_per_round'])}"
        f"; median {r['ratio_median_of_rounds']:.3f}), {r['ratio_cpu']:.3f} by CPU time. Average padded batch: "
        f"{num(avg['ours'])} tokens (ours) against {num(avg['naive'])} (naive). Bytes a token against the "
        f"{s['store_dtype']} limit 2·(k+1)·H = {num(r['limit_bytes_per_token'])}: "
        f"{r['bytes_per_token'] / r['limit_bytes_per_token']:.4f}; fp8 ÷ bf16: "
        f"{r['fp8_bytes_per_token'] / r['bytes_per_token']:.2f}, relative error {r['fp8_rel_err']:.4f}. Peak RSS: "
        f"{r['peak_rss_how']}.",
        "",
        *capture_lines(r),
        "",
        goals_line(r["goals"]),
    ]


def pairing(r: dict) -> str:
    """How the plain forward was timed beside ours (a result from before the pairing says neither)."""
    if r.get("forward_paired_by_batch"):
        return ", the plain forward paired with ours batch by batch"
    return "" if "forward_paired_by_batch" not in r else ", the plain forward a turn of its own next to ours"


def capture_lines(r: dict) -> list[str]:
    """capture_vs_forward and where ours' time goes, as bench.hidden_states.capture_figures gives them."""
    split = r["time_split"]
    steps = sorted(((k, v) for k, v in split["seconds"].items() if v >= 0.0005 or k == "other"), key=lambda kv: -kv[1])
    rows = [[k, f"{v:.3f}", f"{100 * split['share_of_ours'][k]:.2f} %"] for k, v in steps]
    overlapped = f" ({', '.join(split['overlapped'])} ran on the writer thread)" if split["overlapped"] else ""
    return [
        f"ours ÷ plain forward (`capture_vs_forward`): {r['capture_vs_forward']:.3f}, the median of the rounds "
        f"({', '.join(f'{x:.3f}' for x in r['capture_vs_forward_per_round'])}){pairing(r)}; "
        f"{r['capture_vs_forward_all_rounds']:.3f} over all rounds, {r['capture_vs_forward_cpu']:.3f} by CPU time "
        "(rounds "
        f"{', '.join(f'{x:.3f}' for x in r['capture_vs_forward_cpu_per_round'])}); the same padded batches in both: "
        f"{'yes' if r['same_batches'] else 'no'}. Where ours' {split['ours_seconds']:.1f} s went against the plain "
        f"forward's {split['plain_forward_seconds']:.1f} s (the decoder inside ours ÷ the plain forward: "
        f"{split['decoder_vs_plain_forward']:.3f}){overlapped}:",
        "",
        *table(["step", "seconds", "share of ours"], rows),
    ]


def hidden_states_llama8b(r: dict) -> list[str]:
    m, s, fl, small = r["model"], r["settings"], r["flops"], r["small_shape_flops"]
    capture = "capture_vs_forward" in r  # a run before the plain forward was measured has no such column

    def share(f: dict) -> str:
        return f"{100 * f['lm_head_share_of_naive']:.1f} %"

    body = [
        [
            str(depth),
            num(d["ours_tok_s"], 1),
            num(d["naive_tok_s"], 1),
            f"{d['ratio']:.3f}",
            f"{d['ratio_cpu']:.3f}",
            f"{d['flops']['ratio']:.3f}",
            share(d["flops"]),
            *([f"{d['capture_vs_forward']:.3f} ({d['capture_vs_forward_cpu']:.3f})"] if capture else []),
        ]
        for depth, d in r["depths"].items()
    ]
    fitted = [num(r["tok_s"]["ours"], 1), num(r["tok_s"]["naive"], 1), f"{r['ratio']:.3f}", f"{r['ratio_cpu']:.3f}"]
    body.append(
        [
            f"**{m['num_hidden_layers']}, fitted**",
            *fitted,
            f"{fl['ratio']:.3f}",
            share(fl),
            *([f"{r['capture_vs_forward']:.3f} ({r['capture_vs_forward_cpu']:.3f})"] if capture else []),
        ]
    )
    rates = r["implied_gflop_per_cpu_s"]
    out = [
        "### Hidden states at an 8B target's shape: `python -m bench.hidden_states --llama8b`",
        "",
        f"Llama-3.1-8B's shape (hidden {num(m['hidden_size'])}, {m['num_attention_heads']} heads of "
        f"{m['head_dim']}, {m['num_key_value_heads']} KV heads, MLP {num(m['intermediate_size'])}, vocab "
        f"{num(m['vocab_size'])}, random bfloat16 weights) at {' and '.join(r['depths'])} layers, keeping "
        f"{len(m['layers_kept'])} layers plus the final state as the 32-layer target would; {s['samples']} samples "
        f"({s['mean_tokens_per_sample']:g} tokens on average), {s['rounds']} paired rounds, naive in batches of "
        f"{s['naive_batch']}; {s['device']}, {s['threads']} threads; {r['wall_s']:g} s in all. The last row: "
        f"{r['method']}.",
        "",
        *table(
            [
                "layers",
                "ours tokens/s",
                "naive tokens/s",
                "ours ÷ naive",
                "by CPU time",
                "by FLOP count",
                "LM head, share of naive's FLOPs",
                *(["ours ÷ plain forward (by CPU time)"] if capture else []),
            ],
            body,
        ),
        "",
        f"For comparison, the default run's shape (above): FLOP ratio {small['ratio']:.3f}, LM head {share(small)} "
        f"of naive's FLOPs. GFLOP per CPU second implied by the terms fitted on CPU time (close values: the fit agrees "
        "with the FLOP count): "
        f"a layer of ours {rates['ours_layer']:g}, a layer of naive {rates['naive_layer']:g}, the LM head "
        f"{rates['lm_head']:g}.",
    ]
    if abs(r["ratio"] / r["ratio_cpu"] - 1) > 0.1:  # a fit through two points carries any burst of another job
        out[-1] += (
            f" The wall-clock fit ({r['ratio']:.3f}) departs from the CPU-time fit ({r['ratio_cpu']:.3f}) and the "
            "FLOP count: other jobs' bursts on the shared machine stretched some rounds; read the real depth from "
            "the CPU-time fit."
        )
    return out


UNITS = {"wall": "wall", "cpu": "CPU"}  # bench.noop's two clocks: key in the JSON, name in the table


def hidden_states_vllm(r: dict) -> list[str]:
    s = r["settings"]
    body = [
        [path, num(r["tok_s"][path]), ", ".join(f"{x:g}" for x in r["seconds_per_round"][path])]
        for path in ("extract", "hook", "plain")
    ]

    def ratio(path: str) -> str:
        c = r[f"capture_vs_forward_{path}"]
        per_round = ", ".join(f"{x:.3f}" for x in c["per_round"])
        return f"{path} {c['median_of_rounds']:.3f} (per round: {per_round}; all rounds {c['all_rounds']:.3f})"

    return [
        "### Hidden states through vLLM: `python -m bench.hidden_states_vllm`",
        "",
        f"A {s['model']}, {s['dtype']}, layers {s['layers']} plus the final state; {s['samples']} samples, "
        f"{num(s['tokens_per_round'])} tokens in {s['batches_per_round']} batches of at most "
        f"{num(s['batch_tokens'])} tokens, {s['rounds']} rounds; {s['threads']} thread(s) a vLLM process; "
        f"{r['wall_s']:g} s in all.",
        "",
        *table(["path", "tokens/s", "seconds per round"], body),
        "",
        f"capture_vs_forward, median of rounds: {ratio('extract')}; {ratio('hook')}.",
    ]


def row_invariance(r: dict) -> list[str]:
    """Whether each matmul gives a row the same values whatever the rows beside it (bench/row_invariance.py)."""
    cols = [k for k in next(iter(r["shapes"].values())) if k != "shape"]
    rows = [
        [name, "×".join(map(str, v["shape"])), *("yes" if v[c] else "**no**" for c in cols)]
        for name, v in r["shapes"].items()
    ]
    return [
        "### The embedded engine's matmuls, row by row: `python -m bench.row_invariance`",
        "",
        "Why `concurrency` changes a fresh store's answers: a kernel that gives a row other values beside other rows "
        "makes the tokens depend on the batch. The demo target's weights; "
        f"torch {r['torch']}, {r['dtype']}, {r['threads']} threads; a batch of 64 random rows against sub-batches "
        f"{', '.join(f'{a}..{b}' for a, b in r['slices'])}: each row bit-identical to the same row of the whole "
        "batch? `plain`: as called; `tileN`: in fixed tiles of N rows, the last padded; `kernels_agree`: F.linear "
        "and packed give the same values.",
        "",
        *table(["weight", "shape", *cols], rows),
    ]


def noop(r: dict) -> list[str]:
    s = r["settings"]
    turns = s.get("turns")  # `--turns N`: conversations, every turn regenerated
    labels = {
        "cached": "rerun, rendered ids from the store",
        "uncached": f"rerun, every {'turn' if turns else 'prompt'} rendered again (no cache)",
        "floor": "floor: Python, imports, config, tokenizer",
    }
    rows = [
        [label, *(f"{r[f'median_{u}_s'][k]:.2f} ({', '.join(f'{x:.2f}' for x in r[f'{u}_s'][k])})" for u in UNITS)]
        for k, label in labels.items()
    ]
    ratios = ", ".join(f"{r[f'uncached_over_cached_{u}']:g} by {name} time" for u, name in UNITS.items())
    if turns:
        title = f"### No-op rerun of conversations: `python -m bench.noop --turns {turns} --prompts {s['prompts']}`"
        over = f"{num(s['prompts'])} conversations of {turns} user turns (`turns: all`)"
    else:
        title, over = "### No-op rerun: `python -m bench.noop`", f"{num(s['prompts'])} prompts"
    return [
        title,
        "",
        f"`python -m stages.generate dataset=S` over {over} whose budget is met (nothing sent,"
        f" {num(s['reused'])} stored responses reused), seconds of the whole process, median of {s['runs']}.",
        "",
        *table(["run", "wall s (each run)", "CPU s (each run)"], rows),
        "",
        f"Uncached ÷ cached: {ratios}.",
    ]


def resumed_conversations(summary: list[dict]) -> list[str]:
    """The kills of the conversations of `turns: all`, and how many conversations they cut between turns."""
    turns = [x for x in summary if "turns: all" in x["label"]]
    if not turns:
        return []
    kills, cut = sum(x["trials"] for x in turns), sum(x.get("conversations_resumed", 0) for x in turns)
    return [
        f"`turns: all`: {num(kills)} kills cut {num(cut)} conversations between turns (their first turns stored, the "
        "rest asked by the restart); the fake server counts every request by its store key, so a stored turn asked "
        "again would be counted duplicated above.",
        "",
    ]


def reliability(r: dict) -> list[str]:
    kill, faults, inputs = r["kill"], r["faults"], r["inputs"]
    phases = ("before", "working", "writing", "written")
    keys = ("lost", "duplicated", "stale", "tmp_left", "missed", "failures")
    body, totals = [], dict.fromkeys(("trials", *phases, "effective", *keys), 0)
    for row in kill["summary"]:
        values = {"trials": row["trials"], **row["phases"], "effective": row["effective"]}
        values |= {k: row.get(k, 0) for k in keys}  # runs before `missed` was told apart count misses as failures
        for k, v in values.items():
            totals[k] += v
        body.append([row["label"], *(num(values[k]) for k in totals)])
    body.append(["**all**", *(f"**{num(v)}**" for v in totals.values())])
    out = [
        "### Reliability: `python -m bench.reliability kill|faults|inputs`",
        "",
        f"**kill**: {num(kill['figures']['kill_trials'])} kills over {len(kill['summary'])} scenarios "
        f"(seed {kill['seed']}, {kill['wall_s']:g} s), {num(kill['figures']['kill_effective'])} of them effective "
        "(they landed while the stage worked or wrote its outputs); where each landed (before any work showed, "
        "working, writing outputs, outputs written), then the problems the checks found after the restart; a missed "
        "trial had no kill (the run ended before each of 5 kill moments drawn for it), a failed one a restart or a "
        "check that failed. Goal: at least 50 effective kills, 4 of them in every stage's writing, with nothing lost, "
        "duplicated or stale and no failed trial; "
        f"met: {'yes' if kill['goal_met'] else '**no**'}.",
        "",
        *table(
            [
                "scenario",
                "kills",
                *phases,
                "effective",
                "lost",
                "duplicated",
                "stale",
                "temp files left",
                "missed trials",
                "failed trials",
            ],
            body,
        ),
        "",
        "Per stage, every scenario of it together:",
        "",
        *table(
            ["stage", "kills", *phases, "effective"],
            [
                [x["stage"], num(x["trials"]), *(num(x["phases"][p]) for p in phases), num(x["effective"])]
                for x in kill["by_stage"]
            ],
        ),
        "",
        *resumed_conversations(kill["summary"]),
        f"**faults**: {faults['figures']['fault_scenarios']} scenarios, {faults['figures']['fault_failed']} failed "
        f"({faults['wall_s']:g} s).",
        "",
        *table(
            ["scenario", "backend", "expected", "outcome", "what the run did", "ok"],
            [
                [
                    f"`{x['name']}`",
                    x["backend"],
                    x["expected"],
                    x["outcome"],
                    x["detail"].split("; error:")[0],  # the error line names the run's loopback ports
                    "yes" if x["ok"] else "**no**",
                ]
                for x in faults["rows"]
            ],
        ),
    ]
    stages = list(dict.fromkeys(x["stage"] for x in inputs["rows"]))
    rows = []
    for stage in stages:
        mine = [x for x in inputs["rows"] if x["stage"] == stage]
        refused = sum(x["expected"].startswith("refused") for x in mine)
        rows.append(
            [stage, num(len(mine)), num(refused), num(len(mine) - refused), num(sum(not x["ok"] for x in mine))]
        )
    out += [
        "",
        f"**inputs**: {inputs['figures']['bad_inputs']} bad inputs and params, "
        f"{inputs['figures']['bad_inputs_unclear']} unclear ({inputs['wall_s']:g} s).",
        "",
        *table(["stage", "cases", "to be refused in one line", "to be counted as a skip", "unclear"], rows),
        "",
        "Every suite's goal met: " + ("yes." if r["all_goals_met"] else "**no**."),
    ]
    return out


DRAFTER_LABELS = {
    "correct": "our export as it is",
    "aux_off_by_one": "aux layers off by one",
    "aux_reversed": "aux layers in reverse order",
    "post_norm_as_pre": "post-norm final state where pre-norm is expected",
    "pre_norm_as_post": "pre-norm final state where post-norm is expected",
    "fp8": "fp8 states",
    "mid_budget": "`all` at the middle budget",
    "small_budget": "`all` at the smallest budget",
    "matched_budget": "`all` cut to the source's trained tokens",
    "last_turn": "last turn only (`turns: last`), at the smallest budget",
    "source_answers": "the source's own answers (no regeneration), at `all`'s budget",
    "no_states": "no states (zeros, in training and when judged)",
    "dflash": "DFlash on our export for dflash",
    "dflash_layers_off_by_one": "DFlash given the layers one above its own (speculators' ids taken for physical ones)",
    "dflash2": "DFlash2 on our export for dflash2",
    "dflash2_layers_off_by_one": (
        "DFlash2 given the layers one above its own (speculators' ids taken for physical ones)"
    ),
    "dspark": "DSpark on our export for dspark",
    "dspark_post_norm_as_pre": "DSpark given the post-norm last state where pre-norm is expected",
    "peagle": "P-EAGLE on our export for peagle",
    "peagle_post_norm_as_pre": "P-EAGLE given the post-norm last state where pre-norm is expected",
    "domino": "Domino (SpecForge's) on our export for dflash",
    "domino_layers_off_by_one": "Domino given the layers one above its own (speculators' ids taken for physical ones)",
}
# The data's choices side by side: (what is compared, the variant, the one it is compared with); the difference is
# the first's accepted length less the second's, seed by seed (the same initial weights and order of packs).
DRAFTER_CHOICES = (
    ("regenerated answers − the source's own, at one budget", "correct", "source_answers"),
    ("bf16 − fp8 states", "correct", "fp8"),
    ("every turn − the last turn only, at one budget", "small_budget", "last_turn"),
    ("budget: largest − middle", "correct", "mid_budget"),
    ("budget: middle − smallest", "mid_budget", "small_budget"),
)
# The field's anchors beside our figures, as their owners published them (what differs in the setups is said with
# them in docs/benchmarks.md).
CI_FLOOR = (0.4, 0.2, 0.04)  # speculators' nightly EAGLE-3 regression: Qwen3-VL-2B after 5k samples, per position
ANGELSLIM_ACCEPTED = 2.17  # AngelSlim's published EAGLE-3 drafter for Qwen3-1.7B, served: mean accepted length


def pm(m: dict, digits: int = 3, spread_digits: int = 3) -> str:
    """mean (spread over the seeds)"""
    return f"{m['mean']:.{digits}f} ({m['spread']:.{spread_digits}f})"


def pm_short(m: dict) -> str:
    """The README's: the spread to 2 decimals (3 would restate other benchmarks' figures by coincidence)."""
    return pm(m, spread_digits=2)


def family(x: dict) -> str:
    """A variant's drafter family (results from before the block drafters hold EAGLE-3's alone)."""
    return x["variant"].get("family", "eagle3")


def eagle3_variants(v: dict) -> dict:
    return {k: x for k, x in v.items() if family(x) == "eagle3"}


def goal_parts(goal: str) -> tuple[str, str]:
    """`<correct>_beats_<error>` -> (the family's correct variant, the error)."""
    correct, error = goal.split("_beats_", 1)
    return correct, error


def eagle3_goals(goals: dict) -> dict:
    return {k: ok for k, ok in goals.items() if goal_parts(k)[0] == "correct"}


def drafter(r: dict) -> list[str]:
    s, t, ds = r["settings"], r["target"], r["datasets"]
    v = eagle3_variants(r["variants"])
    correct = v["correct"]["accepted_length"]["mean"]
    body = []
    for name, x in v.items():
        runs = ", ".join(f"{run['accepted_length']:.3f}" for run in x["runs"])
        body.append(
            [
                DRAFTER_LABELS.get(name, name),
                f"`{x['variant']['export']}`",
                f"{pm(x['accepted_length'])}",
                runs,
                f"{x['accepted_length']['mean'] - correct:+.3f}",
                *(pm(x[f"full_acc_{k}"]) for k in range(3)),
            ]
        )
    sets = [[f"`{n}`", num(d["samples"]), num(d["tokens"]), num(d["trained_tokens"])] for n, d in ds.items()]
    goals = eagle3_goals(r["goals"])
    return [
        f"### Drafter trained on our data: `{DRAFTER_COMMAND}`",
        "",
        f"{target_line(t)}{alike(t)} Data by the stages from the demo's conversations (all eight sources in one "
        f"`messages` file) at temperature {s['dataset_params']['all']['sampling']['temperature']:g}, budgets "
        f"{', '.join(num(b) for b in s['budgets'].values())} completion tokens (`all`, `mid`, `small`), "
        f"{captured(s, t)}, exported for speculators (training sets, and the held-out samples of `all`):",
        "",
        *table(["set", "samples", "tokens", "trained tokens"], sets),
        "",
        f"Drafter: speculators' `Eagle3DraftModel` (1 layer), its KL loss over {3} training-time-test steps, "
        f"{num(s['steps'])} steps of packs of {num(s['max_len'])} tokens per run at learning rate {s['lr']:g} "
        f"({schedule(s)}), seeds "
        f"{', '.join(str(run['seed']) for run in v['correct']['runs'])}; judged on the held-out samples of `all` "
        "served the right way. Accepted length in vLLM's convention (the bonus token included, 3 draft tokens: "
        "at most 4); per-step accuracy is speculators' `full_acc_k`. Cells: mean (spread, max − min over the "
        "seeds; each run generates its data afresh, and a fresh generation is not bit-reproducible (docs/"
        "generation.md: a logit's last bits follow the batch it was computed in), so another run of this command "
        "trains on slightly other answers, a drift the seeds' spread leaves out; the variants of one run share "
        f"theirs). {wall(r['wall_s'])}{jobs(s)}{step_time(r)}",
        "",
        *table(
            [
                "trained on",
                "export",
                "accepted length",
                "per seed",
                "vs ours",
                "acc step 1",
                "acc step 2",
                "acc step 3",
            ],
            body,
        ),
        "",
        beats_line("Ours beats each convention error", v, goals) + paired_line(r) + shift_line(v),
        *vocab_lines(r),
        *choice_lines(v),
        *field_lines(r),
        *block_lines(r),
        *unbeaten_blocks(r),
        *untrained_lines(r["variants"]),
    ]


def untrained_lines(v: dict) -> list[str]:
    """The families the stage serves that this bench does not train, each with why (none where every one is)."""
    trained = {family(x) for x in v.values()}
    missing = [f"{BLOCK_NAMES.get(f, f.upper())}: {why}" for f, why in DRAFTER_UNTRAINED.items() if f not in trained]
    return ["", "Not trained by this bench: " + "; ".join(missing) + "."] if missing else []


# drafter.json's run: every variant (each family the bench trains beside its convention errors) on one capture of
# the same data; the block drafters' longer run after it in the same workdir, on that target and data
DRAFTER_COMMAND = "python -m bench.drafter --jobs 2 --max-anchors 128 --workdir W"
BLOCKS_COMMAND = (
    "python -m bench.drafter --steps 2000 --max-anchors 128 --variants correct,dflash,dflash_layers_off_by_one,"
    "dspark,dspark_post_norm_as_pre --jobs 2 --workdir W --out bench/results/drafter_blocks.json"
)


def drafter_blocks(r: dict) -> list[str]:
    """The block drafters' own run: trained longer than drafter.json's EAGLE-3 variants (DFlash predicts the corpus's
    commonest token for its first few hundred steps), with fewer blocks a pack so that the CPU can afford the steps."""
    s, t = r["settings"], r["target"]
    return [
        f"### Block drafters trained on our data: `{BLOCKS_COMMAND}`",
        "",
        f"{target_line(t)}{alike(t)} The section above's target and data (the same `--workdir W`; `all`: "
        f"{num(r['datasets']['all']['samples'])} samples, {num(r['datasets']['all']['tokens'])} tokens; "
        f"{captured(s, t)}); {num(s['steps'])} steps a run; {eagle3_beside(r['variants']['correct'])} "
        f"{wall(r['wall_s'])}{jobs(s)}",
        *block_lines(r),
        *unbeaten_blocks(r),
    ]


def eagle3_beside(correct: dict) -> str:
    """EAGLE-3's figure beside the block drafters, where it was trained on samples shifted as speculators' CLI
    shifts them (results from before the bench shifted them say so instead: their first step predicted the token
    its own states encode, an easier task than serving's)."""
    if correct.get("samples") == "shifted":
        return f"EAGLE-3's drafter trained beside them reaches {pm(correct['accepted_length'])} at these steps."
    return (
        "EAGLE-3's drafter trained beside them is not quoted: this run trained and judged it on unshifted samples "
        "(speculators' CLI shifts them; the section above does)."
    )


def unbeaten_blocks(r: dict) -> list[str]:
    """Why an error is not separated, from the run's own figures: the seeds' spread beside the paired difference."""
    v, paired = r["variants"], r.get("paired", {})
    missed = [
        (correct, error)
        for correct, error in (goal_parts(k) for k, ok in r["goals"].items() if not ok)
        if error in paired and family(v[error]) != "eagle3"
    ]
    if not missed:
        return []
    parts = [
        f"`{error}`: the family's own drafter spreads by {v[correct]['accepted_length']['spread']:.3f} over the "
        f"seeds, the error's by {v[error]['accepted_length']['spread']:.3f}, and the paired difference runs from "
        f"{min(paired[error]['per_seed']):+.3f} to {max(paired[error]['per_seed']):+.3f} (mean "
        f"{paired[error]['mean']:+.3f})"
        for correct, error in missed
    ]
    why = unbeaten_why({v[error]["variant"]["final"] for _, error in missed})
    return ["", "Not separated at these steps (" + "; ".join(parts) + "): " + why + "."]


def unbeaten_why(finals: set[str]) -> str:
    """What the unseparated errors change too little: a layer error, neighbouring layers' states; a final-state
    error, the targets the drafter is fitted to (its KL, said with the table)."""
    why = []
    if "pre" in finals:
        why.append(
            "on this 8-layer target a layer's output and the next one's are nearly the same states (the cosine above)"
        )
    if "post" in finals:
        why.append("the post-norm last state moves the targets the drafter is fitted to by the KL said above")
    return " and ".join(why) + ", and the error's cost is not told apart from the seeds' drift"


def block_lines(r: dict) -> list[str]:
    """The block drafters (DFlash, DFlash2, DSpark) and P-EAGLE, each beside its own convention errors (a result
    without them, none)."""
    v = r["variants"]
    blocks = {k: x for k, x in v.items() if family(x) != "eagle3"}
    if not blocks:
        return []
    goals = {k: ok for k, ok in r["goals"].items() if k not in eagle3_goals(r["goals"])}
    rows = [block_row(k, x, r.get("paired", {})) for k, x in blocks.items()]
    header = ["drafter", "export", "accepted length", "per seed", "its family's own − it, per seed"]
    return [
        "",
        block_intro(r, blocks),
        "",
        *table([*header, "accuracy, every position", "accuracy, first position"], rows),
        "",
        beats_line("Each family's own export beats its convention error", v, goals) + shift_line(blocks),
    ]


def beats_line(lead: str, v: dict, goals: dict) -> str:
    """Whether each error is beaten by more than 3x the larger spread of the two, and by how many (none measured:
    nothing to say)."""
    if not goals:
        return ""
    return (
        f"{lead} by more than 3× the larger spread (its margin ÷ that spread): "
        + ", ".join(f"`{goal_parts(k)[1]}` {'yes' if ok else '**no**'} ({margin(v, k):.1f})" for k, ok in goals.items())
        + "."
    )


def block_intro(r: dict, blocks: dict) -> str:
    """What the block drafters (and P-EAGLE, where trained) are, how they were trained and judged, and a training
    step's time."""
    s = r["settings"]
    recipes = {x["drafter"]["model"]: (x["drafter"], x["runs"]) for x in blocks.values() if "drafter" in x}
    parts = [
        recipe(model, d, statistics.fmean(run["train_s"] for run in runs) / s["steps"])
        for model, (d, runs) in recipes.items()
    ]
    layers = s.get("block_layers")
    served = f"their layers {', '.join(map(str, layers))}" if layers else "their layers"
    peagle = any(family(x) == "peagle" for x in blocks.values())
    domino = any(family(x) == "domino" for x in blocks.values())
    return (
        f"{'Block and parallel' if peagle else 'Block'} drafters, "
        f"{'the trainers' if domino else 'speculators'}' own models: "
        + "; ".join(parts)
        + ". Each trains on its family's export of "
        "`all` with the EAGLE-3 drafters' steps, packs, seeds and schedule, and is judged on the same held-out "
        f"samples of `all` served right ({served}, the pre-norm last state) by its own forward, a block anchored at "
        "every trained position outside a sample's last block. Accepted length: speculators' own (`eal`: a block's "
        "leading run of tokens equal to the target's argmax, plus the verifier's bonus token: at most the block "
        f"size for {anchored(blocks)}, whose first slot is the anchor, one more for DSpark); accuracy: `full_acc` over "
        "every drafted position, and the first drafted position's."
        + (peagle_judged(s) if peagle else "")
        + (DOMINO_JUDGED if domino else "")
        + " Cells: mean (spread, max − min over the seeds)."
    )


def anchored(blocks: dict) -> str:
    """The trained families whose block's first slot is the anchor (DFlash's, DFlash2's: speculators'
    `sample_from_anchor` off), DFlash's name where none is."""
    names = [BLOCK_NAMES[f] for f in ("dflash", "dflash2") if any(family(x) == f for x in blocks.values())]
    return and_list(names or ["DFlash"])


# how Domino is judged, unlike speculators' block drafters (bench/drafter_train.py `evaluate_domino`)
DOMINO_JUDGED = (
    " Domino trains on DFlash's export (the same layers and rows as SpecForge's own Domino export) through SpecForge's "
    "`OnlineDominoModel` and its train strategy's loss, a pack's samples padded into rows by SpecForge's collator, and "
    "is judged by that forward with a block anchored at every position whose token and the next are trained: each "
    "block drafts what SpecForge's decoding loop drafts (its block size less one tokens, its GRU reading the anchor "
    "and then the drafts before), counted as the others (the leading run equal to the target's argmax, plus the "
    "bonus token: at most its block size)."
)


def recipe(model: str, d: dict, step_s: float) -> str:
    """A drafter's recipe in a few words: a block drafter's block and loss, P-EAGLE's depths and COD sampling,
    Domino's GRU head."""
    if "gru_width" in d:
        return (
            f"SpecForge's `DominoDraftModel` ({d['draft_layers']} draft layer, where its Qwen3-8B recipe has 5; "
            f"block {d['block_size']}, labels shifted one on, its GRU {d['gru_width']:g} and its embedding "
            f"{d['emb_width']:g} of the target's width as that recipe has them, the base-loss weight decaying to 0 "
            f"over the first half of the steps as its strategy does, {num(d['max_anchors'])} blocks a pack; a training "
            f"step {step_s:.2f} s)"
        )
    if "num_depths" in d:
        return (
            f"`{model}` ({d['draft_layers']} draft layer, speculators' default; {d['num_depths']} parallel depths, "
            f"COD sampling keeping {d['down_sample_ratio']:g}^d of a depth's rollouts, at least "
            f"{d['down_sample_ratio_min']:g}, loss {d['loss_fn']}, {num(d['max_anchors'])} rollouts a pack; a training "
            f"step {step_s:.2f} s)"
        )
    return (
        f"`{model}` ({d['draft_layers']} draft layer, where speculators' default is 5; block {d['block_size']}, "
        f"loss {d['loss_fn']}, per-position weight {d['per_position_loss_weight']}, {num(d['max_anchors'])} blocks a "
        f"pack; a training step {step_s:.2f} s)"
    )


def peagle_judged(s: dict) -> str:
    """How P-EAGLE is judged, unlike the blocks: every depth of a rollout from every trained position."""
    layers = s.get("eagle3_layers")
    served = f"EAGLE-3's layers {', '.join(map(str, layers))}" if layers else "EAGLE-3's layers"
    return (
        f" P-EAGLE reads {served} and is judged by its own forward over every depth of a rollout anchored at each "
        "trained position (depth d drafts the token d after the first, all in one pass, as served); its accepted "
        "length is counted as EAGLE-3's (speculators' `compute_accepted_length_counts`: the leading run of drafts "
        "equal to the target's argmax, plus the bonus token: at most one more than its depths), its accuracy is its "
        "own metrics' (`full_acc` over every depth, and the first depth's)."
    )


def block_row(name: str, x: dict, paired: dict) -> list[str]:
    lead = paired.get(name)
    first = min((k for k in x if k.startswith("position_")), key=lambda k: int(k.split("_")[1]))
    return [
        DRAFTER_LABELS.get(name, name),
        f"`{x['variant']['export']}`",
        pm(x["accepted_length"]),
        ", ".join(f"{run['accepted_length']:.3f}" for run in x["runs"]),
        ", ".join(f"{d:+.3f}" for d in lead["per_seed"]) if lead else "",
        pm(x["full_acc"]),
        pm(x[first]),
    ]


def vocab_lines(r: dict) -> list[str]:
    """The draft vocabulary and how much of the trained tokens it covers (a result from before it was kept, or a
    target drafted over its whole vocabulary, says nothing)."""
    dv = r.get("draft_vocab")
    if not dv or not isinstance(dv.get("coverage"), dict):
        return []
    cov = dv["coverage"]
    parts = [
        f"`{n}` {100 * c['train']:.2f} % of its training rows' trained tokens ({num(c['distinct_trained_tokens'])} "
        f"distinct), {100 * c['held_out']:.2f} % of the held-out ones"
        for n, c in cov.items()
    ]
    return [
        "",
        f"Draft vocabulary (EAGLE-3's for a large vocabulary, handed to speculators as `t2d`/`d2t`): the "
        f"{num(dv['size'])} most frequent trained tokens of each training set's own training rows, of the target's "
        f"{num(dv['target_vocab'])}; a draft is judged as the target's id against the target's argmax over its whole "
        "vocabulary. It covers: " + "; ".join(parts) + ".",
    ]


def choice_lines(v: dict) -> list[str]:
    """The data's choices (DRAFTER_CHOICES): the difference of accepted lengths, the larger spread of the two, and
    the difference seed by seed."""
    rows = []
    for label, a, b in DRAFTER_CHOICES:
        if a not in v or b not in v:
            continue
        x, y = v[a]["accepted_length"], v[b]["accepted_length"]
        by_seed = {run["seed"]: run["accepted_length"] for run in v[b]["runs"]}
        diffs = [run["accepted_length"] - by_seed[run["seed"]] for run in v[a]["runs"] if run["seed"] in by_seed]
        spread = max(x["spread"], y["spread"])
        rows.append(
            [
                label,
                f"{x['mean']:.3f} − {y['mean']:.3f}",
                f"{x['mean'] - y['mean']:+.3f}",
                f"{spread:.3f}",
                f"{(x['mean'] - y['mean']) / max(spread, 1e-9):+.1f}",
                ", ".join(f"{d:+.3f}" for d in diffs),
            ]
        )
    if not rows:
        return []
    return [
        "",
        "The data's choices, accepted length (the first less the second; × spread: the difference over the larger "
        "spread of the two, as the goals read the errors):",
        "",
        *table(["choice", "accepted length", "difference", "larger spread", "× spread", "per seed"], rows),
    ]


def field_lines(r: dict) -> list[str]:
    """Ours in the field's units (speculators' per-position accuracies, vLLM's accepted length) beside the field's
    published figures."""
    v = r["variants"]["correct"]
    if "cond_acc_0" not in v:
        return []
    full = " / ".join(f"{v[f'full_acc_{k}']['mean']:.3f}" for k in range(3))
    cond = " / ".join(f"{v[f'cond_acc_{k}']['mean']:.3f}" for k in range(3))
    floor = " / ".join(f"{x:g}" for x in CI_FLOOR)
    return [
        "",
        *table(
            ["", "per-position accuracy (`full_acc_k`, k = 0, 1, 2)", "`cond_acc_k`", "accepted length"],
            [
                [
                    "ours (SmolLM2's held-out samples)" if "given" in r["target"] else "ours",
                    full,
                    cond,
                    f"{v['accepted_length']['mean']:.3f}",
                ],
                ["speculators' CI floor (Qwen3-VL-2B, 5k samples)", f"≥ {floor}", "", ""],
                ["AngelSlim's EAGLE-3 for Qwen3-1.7B (served)", "", "", f"{ANGELSLIM_ACCEPTED:g}"],
            ],
        ),
        "",
        f"What differs in the setups: ours is a drafter for a target of {target_size(r['target'])}, trained "
        f"{num(r['settings']['steps'])} steps of {num(r['settings']['max_len'])} tokens (at most "
        f"{num(r['settings']['steps'] * r['settings']['max_len'])} tokens seen, samples and their prompts) on a CPU, "
        "measured offline: on held-out conversations of the corpus it was trained on, each draft of 3 tokens "
        "against the target's own greedy token (accepted length at most 4). speculators' floor is its nightly "
        "regression's threshold for a 2B vision-language target after 5k training samples, on its own "
        "validation data; AngelSlim's is a drafter trained by its authors on their data for a 1.7B target, its "
        "acceptance measured while served. Read ours against them as an order of magnitude, not a ranking.",
    ]


def target_size(t: dict) -> str:
    """The target's shape in a few words."""
    shape = t["shape"]
    return f"{shape['num_layers']} layers, hidden {shape['hidden_size']}"


def captured(s: dict, t: dict) -> str:
    """Which of the target's layers the hidden_states stage kept."""
    if "captured_layers" in s:
        return (
            f"layers {', '.join(map(str, s['captured_layers']))} of {t['shape']['num_layers']} captured (every one a "
            "variant reads: EAGLE-3's, the block drafters' and each one above)"
        )
    if t["shape"]["num_layers"] <= 8:
        return f"all {t['shape']['num_layers']} layers captured"
    eagle3 = s["eagle3_layers"]
    return (
        f"the layers the variants read captured (EAGLE-3's {', '.join(map(str, eagle3))} and the off-by-one's "
        f"{', '.join(str(i + 1) for i in eagle3)}, of {t['shape']['num_layers']})"
    )


def shift_line(v: dict) -> str:
    """What each final-state error does to the drafter's training targets, where measured."""
    parts = [
        f"`{k}` KL {x['target_shift']['kl_nats']:.2g} nats, argmax changed at "
        f"{100 * x['target_shift']['argmax_changed']:.1f} % of the positions"
        for k, x in v.items()
        if "target_shift" in x
    ]
    if not parts:
        return ""
    return (
        " What the final-state errors do to the targets the drafter is fitted to, on the held-out samples' trained "
        "positions (near-zero KL: the same targets, nothing measurable to lose): " + "; ".join(parts) + "."
    )


def wall(w: dict) -> str:
    """The run's wall time. A target kept in --workdir from an earlier run is not in this run's total (which is then
    below the sum of its parts): said so, not added."""
    if w["all"] + 1 < w["target"] + w["data"] + w["drafters"]:
        return (
            f"Wall time: {w['all']:g} s ({w['data']:g} s data, {w['drafters']:g} s drafters); the target "
            f"({w['target']:g} s) was trained by an earlier run in the same --workdir."
        )
    return f"Wall time: {w['all']:g} s ({w['target']:g} s target, {w['data']:g} s data, {w['drafters']:g} s drafters)."


def jobs(s: dict) -> str:
    """How many processes trained drafters at once (one in results from before `--jobs`)."""
    n = s.get("jobs", 1)
    return f" {n} processes trained drafters at once (`--jobs {n}`), {s['threads']} torch thread each." if n > 1 else ""


def step_time(r: dict) -> str:
    """Where the drafters' time went: a run's training seconds and a step's, over every run."""
    runs = [run for v in eagle3_variants(r["variants"]).values() for run in v["runs"] if "train_s" in run]
    if not runs:
        return ""
    train = sum(run["train_s"] for run in runs) / len(runs)
    if len(runs) < sum(len(v["runs"]) for v in r["variants"].values()):  # the block drafters' runs share the wall
        return f" An EAGLE-3 run trained {train:.0f} s ({train / r['settings']['steps']:.2f} s a step)."
    per_run = r["wall_s"]["drafters"] * r["settings"].get("jobs", 1) / len(runs)  # a process's share of the wall
    return (
        f" A run took about {per_run:.0f} s of its process's time (the drafters' wall time × processes ÷ runs, so a "
        f"process that finished first adds its idle end): {train:.0f} s training "
        f"({train / r['settings']['steps']:.2f} s a step), the rest building the drafter and judging the held-out "
        "samples."
    )


def paired_line(r: dict) -> str:
    """The errors' per-seed differences (a result from before they were kept has none)."""
    if "paired" not in r:
        return ""
    parts = [
        f"`{k}` {', '.join(f'{d:+.3f}' for d in x['per_seed'])} (every seed: {'yes' if x['every_seed'] else 'no'})"
        for k, x in r["paired"].items()
        if family(r["variants"][k]) == "eagle3"
    ]
    if not parts:
        return ""
    return " Ours minus the error, seed by seed (the same initial weights and packs): " + "; ".join(parts) + "."


def target_line(t: dict) -> str:
    """What the target is and how well it models the demo corpus (before and after training, where it was trained
    here)."""
    shape = (
        f"{t['shape']['num_layers']} layers, hidden {t['shape']['hidden_size']}, vocab {num(t['shape']['vocab_size'])}"
    )
    a = t["after"]
    if "given" in t:
        return (
            f"The target: `{t['given']}` ({shape}), given by `--target`. On {num(a['tokens'])} held-out tokens of the "
            f"demo corpus: loss {a['loss']:.2f} nats, next-token entropy {a['entropy_nats']:.2f} nats, mean top-1 "
            f"probability {a['top1_prob']:.3f}."
        )
    b = t["before"]
    return (
        f"The target: the demo target ({shape}) trained {num(t['steps'])} steps of {num(t['tokens_per_step'])} tokens "
        f"on the demo corpus ({t['train_s']:g} s). On {num(b['tokens'])} held-out tokens: loss {b['loss']:.2f} → "
        f"{a['loss']:.2f} nats, next-token entropy {b['entropy_nats']:.2f} → {a['entropy_nats']:.2f} nats (uniform: "
        f"{b['uniform_entropy_nats']:.2f}), mean top-1 probability {b['top1_prob']:.3f} → {a['top1_prob']:.3f}."
    )


def alike(t: dict) -> str:
    """How alike the trained target's neighbouring layers are, and how far its final norm's weights spread (a result
    from before they were measured says nothing)."""
    cos, norm = t["after"].get("adjacent_layer_cosine"), t.get("final_norm_weight")
    out = ""
    if cos:
        out += (
            f" Neighbouring layers' outputs{'' if 'given' in t else ' after training'}: cosine {min(cos):.3f} to "
            f"{max(cos):.3f} (mean over "
            "tokens, layer l against l + 1)."
        )
    if norm:
        out += f" Its final norm's weights: mean {norm['mean']:.2f}, standard deviation {norm['std']:.2f}."
    return out


def schedule(s: dict) -> str:
    """The drafter's learning-rate schedule (constant in results from before speculators' own was used)."""
    return s.get("schedule", "constant")


def margin(v: dict, goal: str) -> float:
    """How many times the larger spread of the two the correct export's lead over an error is."""
    correct, error = goal_parts(goal)
    c, e = v[correct]["accepted_length"], v[error]["accepted_length"]
    return (c["mean"] - e["mean"]) / max(c["spread"], e["spread"], 1e-9)


def unseparated(r: dict) -> str:
    """The errors the goal misses: by how much ours leads seed by seed, and (final-state errors) how little they
    move the targets the drafter is fitted to."""
    parts = []
    for goal, ok in r["goals"].items():
        name = goal_parts(goal)[1]
        d = r.get("paired", {}).get(name)
        if ok or d is None:
            continue
        lead = f"ours minus it, seed by seed, {min(d['per_seed']):+.3f} to {max(d['per_seed']):+.3f}"
        shift = r["variants"][name].get("target_shift")
        if shift:
            lead += f"; the error moves the targets by a KL of {shift['kl_nats']:.2g} nats"
        parts.append(f"{DRAFTER_LABELS[name]} ({lead})")
    return " Not separated: " + "; ".join(parts) + "." if parts else ""


def which_target(t: dict) -> str:
    return f"the target `{t['given']}`" if "given" in t else "a small target trained on the demo corpus"


def readme_quality(r: dict) -> str:
    """README.md's quality block: the drafter's headline figures, from drafter.json (the block drafters', where
    measured, after EAGLE-3's)."""
    text = eagle3_quality(dict(r, variants=eagle3_variants(r["variants"]), goals=eagle3_goals(r["goals"])))
    return text + block_quality(r)


BLOCK_NAMES = {"dflash": "DFlash", "dflash2": "DFlash2", "dspark": "DSpark", "domino": "Domino", "peagle": "P-EAGLE"}


def block_quality(r: dict) -> str:
    """The block drafters beside their convention errors, in one paragraph (none without them)."""
    v = r["variants"]
    errors = [k for k in DRAFTER_ERRORS if k in v and family(v[k]) != "eagle3"]
    if not errors:
        return ""
    pairs = "; ".join(
        f"`{correct}` {pm_short(v[correct]['accepted_length'])}, {DRAFTER_LABELS[error]} "
        f"{pm_short(v[error]['accepted_length'])}"
        for correct, error in (goal_parts(k) for k in r["goals"] if goal_parts(k)[1] in errors)
    )
    beaten = [DRAFTER_LABELS[goal_parts(k)[1]] for k, ok in r["goals"].items() if ok and goal_parts(k)[1] in errors]
    kinds = "Block and parallel" if any(family(v[e]) == "peagle" for e in errors) else "Block"
    return (
        f"\n{kinds} drafters ({owners({family(v[e]) for e in errors})}, "
        f"one draft layer, {num(r['settings']['steps'])} steps), each with its own convention error: {pairs}. "
        f"Beaten by more than 3× the larger spread of the two: {', '.join(beaten) or 'none'}.\n"
    )


def owners(families: set[str]) -> str:
    """Whose models the trained block families are: speculators' and, for Domino, SpecForge's."""
    theirs = and_list(sorted(BLOCK_NAMES[f] for f in families if f != "domino"))
    own = [f"speculators' own {theirs}"] if theirs else []
    return ", ".join(own + (["SpecForge's own Domino"] if "domino" in families else []))


def and_list(names: list[str]) -> str:
    """ "A", "A and B", "A, B and C"."""
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


def eagle3_quality(r: dict) -> str:
    v = r["variants"]
    c = v["correct"]["accepted_length"]
    worst = {k: v[k]["accepted_length"] for k in v if k in DRAFTER_ERRORS}
    lines = [
        f"A drafter trained on our export (speculators' own EAGLE-3 model and loss, {len(v['correct']['runs'])} "
        f"seeds, {which_target(r['target'])}) reaches an accepted length of {pm_short(c)} on held-out "
        "conversations (mean, spread over the seeds). The same states with a convention error:",
        "",
        *(f"- {DRAFTER_LABELS[k]}: {pm_short(m)}" for k, m in worst.items()),
        "",
        "Of these, beaten by more than 3× the larger spread of the two: "
        + (", ".join(DRAFTER_LABELS[k.removeprefix("correct_beats_")] for k, ok in r["goals"].items() if ok) or "none")
        + " (docs/benchmarks.md has the per-step accuracies and the margins)."
        + unseparated(r),
    ]
    if "no_states" in v:
        lines += [
            "",
            f"The same drafter given no states (zeros) reaches {pm_short(v['no_states']['accepted_length'])}: what the "
            "states are worth to it, the scale the errors' costs read against.",
        ]
    others = [k for k in v if k not in DRAFTER_ERRORS and k not in ("correct", "no_states")]
    if others:
        lines += [
            "",
            "Other choices of the data: "
            + "; ".join(f"{DRAFTER_LABELS[k]} {pm_short(v[k]['accepted_length'])}" for k in others)
            + ".",
        ]
    compared = [(label, a, b) for label, a, b in DRAFTER_CHOICES if a in v and b in v]
    if compared:
        lines += [
            "",
            "Side by side (difference of accepted lengths; the larger spread of the two): "
            + "; ".join(
                f"{label} {v[a]['accepted_length']['mean'] - v[b]['accepted_length']['mean']:+.3f} "
                f"({max(v[a]['accepted_length']['spread'], v[b]['accepted_length']['spread']):.3f})"
                for label, a, b in compared
            )
            + ".",
        ]
    return "\n".join(lines) + "\n"


def export_scaling(r: dict) -> list[str]:
    s = r["settings"]
    sizes = [str(n) for n in s["sizes"]]
    rows = [
        [fmt, *(f"{v['ms_per_sample'][n]:.3f}" for n in sizes), f"{v['ratio']:.3f}"]
        for fmt, v in sorted(r["per_format"].items())
    ]
    return [
        "### The offline export's time per sample: `python -m bench.export_scaling`",
        "",
        f"Synthetic hidden-states outputs of {' and '.join(f'{int(n):,}' for n in sizes)} samples "
        f"({s['tokens_per_sample']} tokens each, hidden size {s['hidden']}, {s['aux_layers']} aux layers), each "
        "exported whole (staging directory, every sample's file, the rename into place). Milliseconds a sample, "
        "and the largest size's ÷ the smallest's (1: linear; below 1, the fixed costs spread over more samples):",
        "",
        *table(["format", *(f"{int(n):,} samples, ms" for n in sizes), "ratio"], rows),
        "",
        goals_line(r["goals"]),
    ]


def gather(r: dict) -> list[str]:
    g, c, m = r["gather"], r["copy"], r["machine"]
    rows = [("gather", g), ("copy", c)]
    return [
        "### Gathering shards to rank 0 across nodes: `python -m bench.gather`",
        "",
        f"Two gloo processes over loopback on this {m['cores']}-core machine, as two nodes' ranks with "
        f"`run.states_layout: local`: rank 1 sends {g['shards']} shards ({g['bytes'] / 1e9:.2f} GB) and rank 0 writes "
        "each into its store and indexes it, against copying the same files on this disk (`shutil.copyfile`). "
        "Loopback has no network's limit: on a cluster the gather goes at the smaller of its own rate and the link's.",
        "",
        *table(["path", "GB/s", "seconds"], [[k, f"{v['gb_s']:.3f}", f"{v['seconds']:.2f}"] for k, v in rows]),
        "",
        f"gather ÷ copy: {r['gather_over_copy']:.2f}. " + goals_line(r["goals"]),
    ]


def gpu_tok_s(row: dict) -> float:
    """A throughput point's ours, as either version of the part wrote it."""
    return row["ours"]["tok_s"] if "ours" in row else row["tok_s"]


def gpu(r: dict) -> list[str]:
    m = r["machine"]
    runs = r["runs"]
    first = runs["first"]["parts"]
    g, s = first["greedy"], first["states"]
    points = sorted({int(c) for x in runs.values() for c in x["parts"].get("throughput", {}).get("by_concurrency", {})})
    rows = [
        [
            str(c),
            *(
                num(gpu_tok_s(x["parts"]["throughput"]["by_concurrency"][str(c)]), 1)
                if str(c) in x["parts"].get("throughput", {}).get("by_concurrency", {})
                else "–"
                for x in runs.values()
            ),
        ]
        for c in points
    ]
    proof = first["proof"].get("error") or f"goals {first['proof'].get('goals')}"
    made = [x for x in first["proof"].get("log", []) if " tok (" in x]
    if made:  # the data's last progress line before the cut
        done, budget = made[-1].split(": ", 1)[1].split(" tok")[0].split("/")
        proof += (
            f"; the data's generation (`all`, 128 in flight) had made {done} of its {budget} tokens in the part's "
            f"{num(first['proof']['seconds'])} s"
        )
    return [
        "### On a GPU: `python -m bench.gpu.bundle`, then `bench/gpu/device.sh` there",
        "",
        f"One {m['gpu']} ({m['gpu_memory_gib']} GiB, CUDA {m['cuda']}, {m['cpus']} CPUs), torch {m['torch']}, "
        f"transformers {m['transformers']}; {r['date']}; {r['note']}.",
        "",
        f"- the embedded engine at temperature 0 in float32: {g['identical']} of {g['answers']} answers "
        f"({g['reference_tokens']:,} tokens) identical to transformers' `generate` from the same prompt ids;",
        f"- the hf hidden-states engine, {s['samples']} samples ({s['tokens']} tokens) in one padded batch: "
        f"relative L2 {s['rel_l2_float32']:.1e} from the CPU's states in float32; {s['rel_l2_bfloat16']:.4f} in bf16, "
        f"where bf16 on the CPU is {s['cpu_rel_l2_bfloat16']:.4f} away;",
        "- the embedded engine's output tokens per second (transformers' continuous batching), in each run call:",
        "",
        *table(["in flight", *(f"{k} run" for k in runs)], rows),
        "",
        f"- the proof: {proof}.",
        "",
        goals_line(r["goals"]),
    ]


def modes(r: dict) -> list[str]:
    s = r["setup"]
    weights = " / ".join(f"{name} {m['weight']:g}" for name, m in s["modes"].items())
    rows = [
        [
            num(b["budget"]),
            name,
            num(x["share"]),
            num(x["tokens"]),
            f"+{x['overshoot_pct']:.3f} %",
            num(x["last_answer_tokens"]),
            str(x["responses"]),
            f"{b['generated_per_kept']:g}",
        ]
        for b in r["budgets"]
        for name, x in b["shares"].items()
    ]
    return [
        "### Modes by weight: `python -m bench.modes`",
        "",
        f"Modes {weights} on the tiny target with the qwen3_thinking template, in process, max_tokens "
        f"{s['max_tokens']}; a source of {num(s['source_prompts'])} real prompts (the demo datasets' first user "
        "turns); "
        "the budgets one after another on one store. Each share is passed by less than its last answer (the one that "
        "crosses it):",
        "",
        *table(["budget", "mode", "share", "tokens", "over", "last answer", "responses", "generated ÷ kept"], rows),
        "",
        goals_line(r["goals"]),
    ]


def fleet(r: dict) -> list[str]:
    s, fit = r["settings"], r["client_cost_fit"]
    rows = [
        [
            x["family"],
            num(x.get("max_tokens", s["max_tokens"])),
            str(x["stream_interval"]),
            str(x["servers"]),
            f"{x['time_scale']:g}",
            f"+{x['overshoot_pct']:.3f} %",
            f"{x['waste_pct']:.1f} %",
            f"{x['time_vs_ideal']:.2f}",
            f"{x['client_us_per_token']:.1f}",
            num(x["client_us_per_request"]),
            f"{x['client_cores_at_nominal']:.2f}",
            f"{x['servers_over_client_cpu']:.2f}",
            f"{x['share_over_speed'][0]:.2f} to {x['share_over_speed'][1]:.2f}",
        ]
        for x in r["runs"]
    ]
    return [
        "### A fleet of servers: `python -m bench.fleet`",
        "",
        f"The generate stage's client (the sglang backend, streamed, landing exact) against N simulated SGLang servers "
        f"in one other process: {s['per_server_in_flight']} in flight per server, a budget of "
        f"{s['answers_per_server']} answers per server, full-batch rates of 0.5 to 1 × {num(s['full_rate_tok_s'])} "
        "tok/s, knees of 16 to 64, noise up to 10 %, server 0 dead from 30 % to 60 % of the ideal time; time scaled "
        f"where the fleet would send more than {num(s['max_events_per_s'])} chunks a second ({s['cpus']} cores). "
        "Cores at nominal: the client's CPU per token × the fleet's unscaled rate (100 servers: 375k tok/s); "
        "share: each server's share of the tokens over its share of the speed (servers 1 to N-1).",
        "",
        *table(
            [
                "lengths",
                "max_tokens",
                "interval",
                "servers",
                "scale",
                "over",
                "waste",
                "time ÷ ideal",
                "µs/token",
                "µs/request",
                "cores at nominal",
                "servers ÷ client CPU",
                "share ÷ speed",
            ],
            rows,
        ),
        "",
        f"The client's CPU fitted over the runs at max_tokens {num(s['max_tokens'])}: {fit['us_per_event']:g} µs "
        "per stream chunk and "
        f"{num(fit['us_per_request'])} µs per request (r² {fit['r2']}).",
        "",
        goals_line(r["goals"]),
    ]


SECTIONS = (
    ("budget.json", "python -m bench.budget", budget),
    ("budget_live.json", "python -m bench.budget_live", budget_live),
    ("budget_live_neighbour.json", "python -m bench.budget_live --family bimodal --neighbour --hog 2", budget_live),
    ("client.json", "python -m bench.client", client),
    ("embedded.json", "python -m bench.embedded --vllm-python <venv>/bin/python", embedded),
    (
        "embedded_amx.json",
        "python -m bench.embedded --engines ours,vllm --vllm-python <venv>/bin/python --out "
        "bench/results/embedded_amx.json (on a CPU with AMX)",
        embedded,
    ),
    ("tokenize.json", "python -m bench.tokenize", tokenize),
    ("hidden_states.json", "python -m bench.hidden_states", hidden_states),
    ("hidden_states_llama8b.json", "python -m bench.hidden_states --llama8b", hidden_states_llama8b),
    ("hidden_states_vllm.json", "python -m bench.hidden_states_vllm", hidden_states_vllm),
    ("export_scaling.json", "python -m bench.export_scaling", export_scaling),
    ("reliability.json", "python -m bench.reliability kill|faults|inputs", reliability),
    ("modes.json", "python -m bench.modes", modes),
    ("fleet.json", "python -m bench.fleet", fleet),
    ("gather.json", "python -m bench.gather", gather),
    ("noop.json", "python -m bench.noop", noop),
    (
        "demo.json",
        report_demo.DEMO_COMMAND,
        lambda r: ["### The demo on a fresh clone: `python -m bench.demo`", "", *report_demo.summary(r)],
    ),
    ("noop_turns.json", "python -m bench.noop --turns 3 --prompts 20000", noop),
    ("row_invariance.json", "python -m bench.row_invariance --out bench/results/row_invariance.json", row_invariance),
    (PROOF_FILE, PROOF_COMMAND, proof_section),
    ("drafter.json", DRAFTER_COMMAND, drafter),
    ("drafter_blocks.json", BLOCKS_COMMAND, drafter_blocks),
    ("gpu_h200.json", "python -m bench.gpu.bundle (then bench/gpu/device.sh on the GPU machine)", gpu),
)
README = DOC.parents[1] / "README.md"
QUALITY_START = "<!-- quality-report:start -->"
QUALITY_END = "<!-- quality-report:end -->"


def render(results: Path = RESULTS) -> str:
    """The block: one section per benchmark, from its JSON file (a missing file says which command writes it)."""
    parts = []
    for name, command, section in SECTIONS:
        path = results / name
        if path.exists():
            parts.append("\n".join(section(json.loads(path.read_text()))))
        else:
            parts.append(f"`bench/results/{name}` is missing: `{command}` writes it.")
    return "\n\n".join(parts) + "\n"


def replace_block(text: str, block_text: str) -> str:
    return replace_between(text, START, END, block_text, DOC.name)


def block(text: str) -> str:
    """What stands between the markers (as `replace_block` writes it)."""
    return between(text, START, END)


# what the toy bench can and cannot show, said before its figures where the real target's lead the block
TOY_INTRO = (
    "The toy bench (`python -m bench.drafter`: a small target trained on the demo corpus, hidden 64, 8 layers) is the "
    "CI-sized check. It shows that the data trains drafters through the trainers' own code and that regeneration "
    "pays; it cannot rank most convention errors, as its neighbouring layers are nearly alike, and a drafter given "
    "no states comes close to ours on it.\n\n"
)


def render_quality(results: Path = RESULTS) -> str:
    """README.md's quality block: the real target's proof (drafter_smollm2.json) where measured, then the toy's, from
    drafter.json and, where measured, drafter_blocks.json (a missing drafter.json says which command writes it)."""
    real = results / PROOF_FILE
    lead = quality(json.loads(real.read_text())) + "\n" + TOY_INTRO if real.exists() else ""
    path, blocks = results / "drafter.json", results / "drafter_blocks.json"
    if not path.exists():
        return lead + "`bench/results/drafter.json` is missing: `python -m bench.drafter` writes it.\n"
    text = readme_quality(json.loads(path.read_text()))
    return lead + text + (block_quality(json.loads(blocks.read_text())) if blocks.exists() else "")


def write_block(path: Path, label: str, start: str, end: str, figures: str) -> None:
    text = path.read_text()
    new = replace_between(text, start, end, figures, label)
    if new != text:
        path.write_text(new)
    print(f"{label}: benchmark figures {'updated' if new != text else 'already up to date'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="rewrite the blocks in docs/benchmarks.md and README.md's quality section"
    )
    args = parser.parse_args(argv)
    figures = render()
    if not args.write:
        sys.stdout.write(figures)
        return
    write_block(DOC, "docs/benchmarks.md", START, END, figures)
    write_block(README, "README.md", QUALITY_START, QUALITY_END, render_quality())
    if report_demo.DEMO_FILE.exists():  # the demo's figures in README and the docs (python -m bench.demo)
        report_demo.write()
    real = RESULTS / PROOF_FILE
    if real.exists():
        drawn = plot(json.loads(real.read_text()), RESULTS / PROOF_PLOT)
        print(f"bench/results/{PROOF_PLOT}: {'drawn' if drawn else 'not drawn (pip install matplotlib)'}")


if __name__ == "__main__":
    main()
