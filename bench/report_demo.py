"""The demo's figures in README and the docs, rendered from bench/results/demo.json (`python -m bench.demo`).

Each block sits between `<!-- demo-<name>:start -->` and `<!-- demo-<name>:end -->` markers in its page;
`python -m bench.report --write` rewrites them and tests/test_bench_demo.py keeps them equal to this output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_FILE = ROOT / "bench" / "results" / "demo.json"
DEMO_COMMAND = "python -m bench.demo --install --fresh-kernel"


def load(path: Path = DEMO_FILE) -> dict:
    return json.loads(path.read_text())


def duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s} s"


def run_block(d: dict) -> str:
    """README's paragraph on the demo run: its time, its generate stages, what generation kept, its progress lines."""
    sets = d["datasets"].values()
    budgets = [x["budget"] for x in sets]
    generate_s = sum(x["generate_wall_s"] for x in sets)
    new, kept = sum(x["new_tokens"] for x in sets), sum(x["new_in_output_tokens"] for x in sets)
    met = "every budget met" if all(x["budget_met"] for x in sets) else "**a budget not met**"
    p = d["progress"]
    install = f"; the install line before it took {duration(d['install_s'])}" if d.get("install_s") else ""
    kernel = (
        "its first build of the decode-attention kernel included"
        if d["kernel_built"]
        else "the decode-attention kernel already built"
    )
    zero = p["eta_0s_with_work_left"]
    return (
        f"On a {d['machine']['cpus']}-core {d['machine']['processor']}, the demo's `dvc repro` "
        f"({d['stages_run']} stages) took {duration(d['repro_s'])} in a fresh clone (`{DEMO_COMMAND}`, "
        f"{kernel}{install}), of which the {len(budgets)} generate stages {generate_s:,.0f} s (`wall_s` in their "
        f"`generate_metrics.json`; budgets of {min(budgets):,} to {max(budgets):,} completion tokens, {met}). "
        f"Generation keeps what it makes: {new:,} tokens generated for outputs of {kept:,} (`new_tokens` against "
        f"`new_in_output_tokens`: {new / kept:.2f} to 1), the rest complete answers past the output's end, kept in "
        f"the store for a larger budget. Its {p['progress_lines']:,} progress lines (a line every "
        f"{p.get('log_every_s', 10):g} s, `run.log_every_s` in the clone) gave {p['eta_lines']:,} ETAs, "
        f"{p['eta_outside_factor']} of them off by more than {p['factor']:g}× (or {p['slack_s']:g} s) from the time "
        f"that remained, {'none' if zero == 0 else zero} `ETA 0s` with work left. A second `dvc repro` ran "
        f"{'nothing' if d['second_repro_stages_run'] == 0 else str(d['second_repro_stages_run']) + ' stages'}; "
        f"two exports of {d['verify_dataset']} stand side by side ({', '.join(f'`{e}/`' for e in d['exports'])})."
    )


def summary(d: dict) -> list[str]:
    """docs/benchmarks.md's section: README's paragraph, and the stages' times per dataset."""
    rows = [
        f"| {name} | {x['budget']:,} | {x['budget_tokens']:,} | {x['generate_wall_s']:.1f} | {x['new_tokens']:,} | "
        f"{x['new_in_output_tokens']:,} |"
        for name, x in d["datasets"].items()
    ]
    head = [
        "| dataset | budget | tokens | generate s | generated | in the output |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    return [run_block(d), "", *head, *rows]


def plan_block(d: dict) -> str:
    """docs/generation.md's plan example: the command and what it printed after the demo's run."""
    return f"After the demo's `dvc repro`, `{d['plan_command']}` prints:\n\n```\n{d['plan']}\n```"


def disk_plan_block(d: dict) -> str:
    """docs/generation.md's per-trained-token table: the end of `draftdata plan dataset=<D>`."""
    lines = d["plan_one"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("hidden states on disk"))
    table = "\n".join("  " + line for line in lines[start:] if line.strip())
    name = d["verify_dataset"]  # in a list item: indented as its text
    head = f"  After `dvc repro hidden_states@{name}`, `draftdata plan dataset={name}` ends with:"
    return f"{head}\n\n  ```\n{table}\n  ```"


def raised_block(d: dict) -> str:
    """docs/generation.md: the raised budget generated, against what the plan said of it."""
    r, p, name = d["raised"], d["planned"], d["verify_dataset"]
    per = [x["bytes_per_token"] for x in d["datasets"].values() if x.get("bytes_per_token")]
    return (
        f"On the demo, `python -m stages.generate dataset={name} datasets.{name}.token_budget={r['budget']}` then "
        f"stored {r['newly_generated']:,} responses ({r['continued']:,} of them continuing parked partials), "
        f"generating {r['new_tokens']:,} new tokens and continuing {r['continued_tokens']:,} parked ones in "
        f"{r['stage_s']:,.0f} s of stage time (model loading included; {r['wall_s']:,.0f} s in `wall_s`); its "
        f"{r['responses']:,} responses hold {r['prompt_tokens'] + r['completion_tokens']:,} prompt + completion "
        f"tokens (planned: {p['requests']:,} requests, {p['to_generate']:,} tokens, "
        f"{p['sequence_tokens']:,} prompt + completion tokens). The demo's shards hold {min(per):,.2f} to "
        f"{max(per):,.2f} bytes per token against the plan's {d['plan_bytes_per_token']:,}."
    )


def disk_block(d: dict) -> str:
    """docs/hidden-states.md: one dataset's bytes per token and per trained token, bf16 and fp8."""
    x, name = d["datasets"][d["verify_dataset"]], d["verify_dataset"]
    fp8, share = x["per_trained_token"]["fp8"], x["trained_tokens"] / x["tokens"]
    large = 2 * (3 + 1) * 7168 + 4  # bf16 states of 3 layers and the final one at H = 7168, and the token's id
    return (
        f"On the demo's {name} (`dvc repro hidden_states@{name}`), {x['trained_tokens']:,} of {x['tokens']:,} tokens "
        f"are trained ({share:.3f}): {x['bytes_per_token']:,.2f} bytes a token as stored in bf16 make "
        f"{x['bytes_per_trained_token']:,.1f} bytes a trained token; in fp8, by the formula, {fp8:,.1f} a trained "
        f"token; online 0. At H = 7168 and k = 3 ([production.md](production.md)) the same share makes {large:,} "
        f"bytes a token in bf16, {large / share / 1e3:,.0f} kB a trained token."
    )


def verify_block(d: dict) -> str:
    """docs/hidden-states.md: what `draftdata verify` printed after the demo's run."""
    name = d["verify_dataset"]
    return (
        f"After the demo's `dvc repro hidden_states@{name}`, `draftdata verify dataset={name}` prints:\n\n"
        f"```\n{d['verify']}\n```"
    )


def met_block(d: dict) -> str:
    """docs/generation.md: the line of a generate run whose budget the store meets."""
    return f"`{d['budget_met_line']}`"


def turns_block(d: dict) -> str:
    """docs/generation.md: the demo's `turns: all` datasets, and each on `turns: last` (bench/demo.py)."""
    rows = [
        "On the demo (`dvc repro`, then `generate_metrics.json` and `tokenize_metrics.json`; before: the same dataset "
        "on `turns: last`, prompts, generate and tokenize run again with `datasets.<D>.turns=last`):",
        "",
        "| dataset | `on_tool_divergence` | trained share before → after | turns / conversations | conversations ended "
        "| tokens / budget |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, x in d["turns_all"].items():
        ended = ", ".join(f"{n} {why}" for why, n in sorted(x["ended"].items(), key=lambda kv: (-kv[1], kv[0])))
        tool = f"`{x['on_tool_divergence']}`" if x["on_tool_divergence"] else "-"
        rows.append(
            f"| {name} | {tool} | {x['trained_share_last']:.3f} → {x['trained_share']:.3f} | "
            f"{x['turns']:,} / {x['conversations']:,} | {ended} | {x['budget_tokens']:,} / {x['budget']:,} |"
        )
    return "\n".join(rows)


# page -> block name -> renderer
BLOCKS: dict[str, dict[str, Callable[[dict], str]]] = {
    "README.md": {"demo-run": run_block},
    "docs/generation.md": {
        "demo-plan": plan_block,
        "demo-plan-disk": disk_plan_block,
        "demo-raised": raised_block,
        "demo-met": met_block,
        "demo-turns": turns_block,
    },
    "docs/hidden-states.md": {"demo-disk": disk_block, "demo-verify": verify_block},
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def rendered(page: str, name: str, d: dict) -> str:
    """What stands between a block's markers: its text, and the end marker's indentation (a block in a list item)."""
    text = (ROOT / page).read_text()
    end = markers(name)[1]
    line_start = text.rfind("\n", 0, text.find(end)) + 1
    return BLOCKS[page][name](d) + "\n" + text[line_start : text.find(end)]


def write(d: dict | None = None) -> None:
    """Rewrite every demo block from the results file."""
    from draftdata.util.blocks import replace_between

    d = d if d is not None else load()
    for page, blocks in BLOCKS.items():
        path = ROOT / page
        text = path.read_text()
        new = text
        for name in blocks:
            new = replace_between(new, *markers(name), rendered(page, name, d), page)
        if new != text:
            path.write_text(new)
        print(f"{page}: demo figures {'updated' if new != text else 'already up to date'}")
