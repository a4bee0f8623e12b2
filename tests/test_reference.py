"""The configuration reference in docs/configuration.md is the generator's output, and covers every key of the
schema; a stage's `--help` shows the composed config without running the stage."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing

import pytest
from conftest import ROOT

from draftdata.cli import reference
from draftdata.config import schema as config


def schema_paths(cls: type = config.Config, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, walked here independently of the generator."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out += schema_paths(tp, f"{prefix}{f.name}.")
        elif len(args) == 2 and dataclasses.is_dataclass(args[1]):  # Dict[str, DatasetConfig]
            out += schema_paths(args[1], f"{prefix}{f.name}.<name>.")
        else:
            out.append(prefix + f.name)
    return out


DOC = ROOT / "docs" / "configuration.md"


def test_docs_block_is_the_generators_output():
    assert reference.DOC == DOC  # where `draftdata reference --write` writes
    text = DOC.read_text()
    assert text.count(reference.START) == 1 and text.count(reference.END) == 1
    assert reference.block(text) == reference.render(), (
        "docs/configuration.md's configuration reference is stale: run `draftdata reference --write`"
    )
    assert reference.START not in (ROOT / "README.md").read_text()  # one copy of the table, in the docs


def test_every_schema_key_has_a_documented_row():
    table = reference.block(DOC.read_text())
    rows = {line.split(" | ")[0].removeprefix("| ").strip("`"): line for line in table.splitlines()[2:]}
    assert list(rows) == schema_paths()
    for path, row in rows.items():
        meaning = row.rstrip(" |").rsplit(" | ", 1)[1]
        assert len(meaning.split()) >= 2, f"{path}: {meaning!r}"


def test_dvc_column_follows_dvc_yaml():
    by_path = {k.path: k for k in reference.keys()}
    assert by_path["datasets.<name>.token_budget"].dvc == "DVC param (generate)"
    assert by_path["datasets.<name>.source.hf_name"].dvc == "DVC param (prompts)"  # declared as the whole `source`
    assert by_path["tokenize.max_skip_pct"].dvc == "DVC param (tokenize)"  # declared as the whole `tokenize`
    assert by_path["model.path"].dvc == "DVC param (prompts, generate, tokenize, hidden_states)"
    assert by_path["model.chat_template"].dvc == "DVC param (prompts, generate, tokenize)"
    for run_time in ("datasets.<name>.concurrency", "hidden_states.backend", "backend.urls", "run.store_path"):
        assert by_path[run_time].dvc == "run-time"


def test_comments_are_read_from_the_source():
    source = """
class A:
    # prompts
    first: int = 1
    # Explains the second key,
    # over two lines.
    second: int = 2  # and beside it
    third: int = 3  # type: ignore[assignment]  # required
    fourth: int = 4
"""
    comments = reference.field_comments(source)
    assert ("A", "first") not in comments  # a section header explains nothing
    assert comments[("A", "second")] == "Explains the second key, over two lines. and beside it."
    assert comments[("A", "third")] == "required."
    assert ("A", "fourth") not in comments


@dataclasses.dataclass
class Small:
    explained: int = 1
    added: int = 2


SMALL_SOURCE = "class Small:\n    explained: int = 1  # what it does\n    added: int = 2\n"


def test_a_key_without_a_meaning_stops_the_generator():
    with pytest.raises(SystemExit, match="added has no meaning"):
        reference.keys(Small, SMALL_SOURCE, meanings={})
    rows = reference.keys(Small, SMALL_SOURCE, meanings={"added": "Explained elsewhere."})
    assert [(k.path, k.default, k.dvc, k.meaning) for k in rows] == [
        ("explained", "`1`", "run-time", "what it does."),
        ("added", "`2`", "run-time", "Explained elsewhere."),
    ]


def test_a_meaning_for_a_key_the_schema_lacks_stops_the_generator():
    with pytest.raises(SystemExit, match="names keys the schema lacks: removed"):
        reference.keys(Small, SMALL_SOURCE, meanings={"added": "Explained elsewhere.", "removed": "Gone."})


def test_help_says_what_the_stage_does_and_show_config_the_config_and_neither_runs_anything(tmp_path):
    (tmp_path / "params.yaml").write_text("tokenize:\n  max_seq_len: 1234\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def stage(*args):
        return subprocess.run(
            [sys.executable, "-m", "stages.tokenize", "dataset=B3_magicoder", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    proc = stage("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Stage `tokenize@D`")  # its description first
    assert "usage: python -m stages.tokenize dataset=<D> [key=value ...] [--show-config]\n" in proc.stdout
    assert len(proc.stdout.splitlines()) < 40
    proc = stage("--show-config")
    assert proc.returncode == 0, proc.stderr
    assert "\ntokenize:\n" in proc.stdout
    assert "  max_seq_len: 1234\n" in proc.stdout  # params.yaml composed over the defaults
    assert "  on_too_long: drop\n" in proc.stdout  # a default params.yaml does not set
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # no data/, nothing else written


def test_help_in_the_project_writes_nothing_under_data():
    def snapshot() -> dict[str, float]:
        data = ROOT / "data"
        return {str(p): p.stat().st_mtime for p in data.rglob("*")} if data.exists() else {}

    before = snapshot()
    proc = subprocess.run(
        [sys.executable, "-m", "stages.tokenize", "--show-config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tokenize:" in proc.stdout and "max_seq_len" in proc.stdout
    assert snapshot() == before
