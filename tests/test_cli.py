"""`draftdata <command>`: one console script for what a user runs beside `dvc repro`, and the reader API a trainer
imports without the pipeline's machinery."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from draftdata.cli import COMMANDS


def draftdata(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    # `python -m draftdata` is the console script's module: the same main()
    return subprocess.run(
        [sys.executable, "-m", "draftdata", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_help_lists_every_command():
    proc = draftdata("--help")
    assert proc.returncode == 0
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["plan", "export", "verify", "compare", "reference"] == list(COMMANDS)


def test_an_unknown_command_is_one_error_line_and_status_2(tmp_path):
    proc = draftdata("exprot", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == "error: unknown command 'exprot'"
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "command, first",
    [
        ("plan", "Command `plan`: what the configured budgets will cost"),
        ("export", "`draftdata export dataset=<D> export.format=specforge|speculators|modelopt|modelopt_policy|"),
        ("verify", "`draftdata verify dataset=<D> [verify.samples=3]"),
        ("compare", "Compare experiments at a glance: `draftdata compare"),
        ("reference", "usage: draftdata reference"),
    ],
)
def test_each_command_has_its_help(command, first):
    """Its description first, in a screen: the config is behind --show-config."""
    proc = draftdata(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(first), proc.stdout[:300]
    assert len(proc.stdout.splitlines()) < 60
    assert proc.stdout.count(first) == 1  # said once


def test_plan_and_export_take_hydra_overrides_as_the_stages_do():
    """--show-config shows the value an override sets: the same grammar and composition as a stage."""
    for command in ("plan", "export"):
        proc = draftdata(command, "--show-config", "datasets.B3_magicoder.token_budget=12345")
        assert proc.returncode == 0, proc.stderr
        assert "token_budget: 12345" in proc.stdout


def test_help_cut_short_by_a_pipe_ends_quietly():
    proc = subprocess.run(
        f"{sys.executable} -m draftdata plan --show-config | head -3",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(proc.stdout.splitlines()) == 3 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_a_dashed_option_is_one_line_naming_the_key_value_form():
    proc = draftdata("plan", "--dataset", "B3_magicoder")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "Lexer" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: command line: --dataset: draftdata plan takes key=value (e.g. dataset=...)")


def test_compare_refuses_a_dataset_no_experiment_has(tmp_path):
    """An empty table and status 0 read as "nothing differs"; a dataset no summary names is one error line."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    proc = draftdata("compare", "dataset=B9", cwd=tmp_path)
    assert proc.returncode != 0 and proc.stderr.strip().startswith("error: dataset: no summary.json of B9"), proc


def test_the_reader_imports_no_pipeline_machinery():
    """`from draftdata.hidden import HiddenStates` in a trainer's process loads the reader and the shard format only:
    no DVC, Hydra, OmegaConf, transformers, engine or step of the pipeline."""
    code = (
        "import sys; from draftdata.hidden import HiddenStates; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('dvc', 'hydra', 'omegaconf', 'transformers', 'draftdata'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    assert "draftdata.hidden.reader" in loaded
    assert not {m for m in loaded if not m.startswith("draftdata")}, loaded
    assert not {
        m for m in loaded if m.startswith(("draftdata.hidden.engines", "draftdata.config", "draftdata.generate"))
    }


def test_compare_shows_every_summary_figure_in_120_columns():
    """`draftdata compare` rows carry each key stages/summary.py writes (the trained share of the budget and of the
    samples' tokens too), and the overshoot, read from tokens and budget as older summaries held it."""
    from draftdata.cli.compare import COLUMNS, table
    from stages.summary import summarise

    generate = {"budget": 1000, "budget_tokens": 1025, "overshoot_pct": 2.5, "completion_tokens": 1025}
    tokenize = {"samples": 9, "skipped": {"too_long": 1}, "tokens": 3800, "trained_tokens": 950}
    figures = summarise(generate, tokenize)
    assert set(COLUMNS) == set(figures) | {"over_pct"}
    older = dict(figures, over_pct=2.5)  # a summary.json from before over_pct left it
    lines = table([("workspace", {"D": figures}), ("  exp-budget-2k", {"D": older})], "D")
    header, row, old = lines[1].split(), lines[2].split(), lines[3].split()
    assert row[header.index("trained")] == "95" and row[header.index("trained_share")] == "0.25"
    assert row[header.index("over_pct")] == old[header.index("over_pct")] == "2.5"
    assert max(map(len, lines)) <= 120


def test_log_lines_of_processes_sharing_a_pipe_stay_whole():
    """torchrun's ranks write to one pipe, unbuffered where PYTHONUNBUFFERED is set (as CI runners often do): a
    line written as text then newline can take the other process's line between the two."""
    writer = (
        "import sys; from draftdata.util.log import log\n"
        "for i in range(3000): log('hidden_states', rank=sys.argv[1], i=i, writing='data/B3/hidden_states')\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", writer, r], stdout=write, env=env) for r in "01"]
    os.close(write)
    with open(read) as out:
        lines = out.read().splitlines()
    assert [p.wait() for p in procs] == [0, 0]
    pattern = re.compile(r"hidden_states rank=[01] i=[\d,]+ writing=data/B3/hidden_states")
    torn = [line for line in lines if not pattern.fullmatch(line)]
    assert len(lines) == 6000 and not torn, torn[:3]
