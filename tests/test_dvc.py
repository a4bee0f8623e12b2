"""Real DVC in a temp git repo: the shipped dvc.yaml runs end to end, a second repro is a no-op, and editing one
dataset's budget reruns only that dataset's chain."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

KEEP = ("B1_glaive", "B3_magicoder", "B6_ultrachat")
COPY = ["conf", "stages", "sources", "dvc.yaml", "params.yaml", "pyproject.toml", ".dvc/config", ".dvc/.gitignore",
        ".dvcignore", ".gitignore"]


def sh(args: list[str], cwd: Path) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t",
               DVC_NO_ANALYTICS="1")
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def dvc(*args: str, cwd: Path) -> str:
    return sh([sys.executable, "-m", "dvc", *args], cwd)


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("dvc") / "repo"
    for rel in COPY:
        src, dst = ROOT / rel, repo / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["datasets"] = {k: v for k, v in params["datasets"].items() if k in KEEP}
    for ds in params["datasets"].values():  # small, so the test stays quick on 2 cores
        ds.update(token_budget=300, max_tokens=48, max_prompts=60)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh(["git", "init", "-q"], repo)
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "init"], repo)
    return repo


@pytest.mark.slow
def test_repro_noop_and_budget_edit_reruns_one_chain(repo):
    first = dvc("repro", cwd=repo)
    expected = {"tiny_model"} | {f"{s}@{d}" for s in ("prompts", "generate", "tokenize", "hidden_states") for d in KEEP}
    assert ran(first) == expected
    for d in KEEP:
        assert (repo / "data" / d / "samples.parquet").exists()
        assert (repo / "data" / d / "hidden_states" / "index.json").exists()
    assert not (repo / "outputs").exists() and not (repo / ".hydra").exists()

    second = dvc("repro", cwd=repo)
    assert ran(second) == set()

    # the hidden states are on disk once: the output's shards, the state store's and DVC's cache share an inode
    for shard in (repo / "data" / "B1_glaive" / "hidden_states" / "shards").iterdir():
        in_store = list((repo / ".draftdata" / "states").rglob(shard.name))
        assert len(in_store) == 1 and in_store[0].stat().st_ino == shard.stat().st_ino
        assert shard.stat().st_nlink == 3

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["datasets"]["B3_magicoder"]["token_budget"] = 500
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = dvc("status", cwd=repo)
    changed = set(re.findall(r"^(\S+):\s*$", status, flags=re.M))
    assert changed == {"generate@B3_magicoder"}, status

    third = dvc("repro", cwd=repo)
    assert ran(third) == {"generate@B3_magicoder", "tokenize@B3_magicoder", "hidden_states@B3_magicoder"}

    shown = dvc("metrics", "show", cwd=repo)
    for d in KEEP:
        assert f"data/{d}/generate_metrics.json" in shown


@pytest.mark.slow
def test_run_time_knob_reruns_nothing(repo):
    dvc("repro", cwd=repo)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["datasets"]["B1_glaive"]["concurrency"] = 3
    params["backend"] = {"kind": "embedded", "request_timeout_s": 5.0}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert ran(dvc("repro", cwd=repo)) == set()


@pytest.mark.slow
def test_temp_experiment_shares_the_workspace_store(repo):
    """`dvc exp run --temp` runs in a copy under .dvc/tmp/exps; its responses must land in the workspace's store."""
    import sqlite3

    dvc("repro", cwd=repo)
    store = repo / ".draftdata" / "store.sqlite"

    def count() -> int:
        with sqlite3.connect(store) as db:
            return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    before = count()
    out = dvc("exp", "run", "--temp", "-S", "datasets.B3_magicoder.token_budget=900", cwd=repo)
    assert "generate@B3_magicoder" in out
    assert count() > before
    assert not list((repo / ".dvc" / "tmp").rglob("store.sqlite"))
    # the experiment's states went to the workspace's state store too: here, the same budget computes nothing
    # (DVC restores the stages from its run cache; forced, the stage finds every state in the store)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["datasets"]["B3_magicoder"]["token_budget"] = 900
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc("repro", cwd=repo)
    assert "hidden_states@B3_magicoder" in ran(dvc("repro", "-s", "-f", "hidden_states@B3_magicoder", cwd=repo))
    metrics = yaml.safe_load((repo / "data" / "B3_magicoder" / "hidden_states_metrics.json").read_text())
    assert metrics["computed_samples"] == 0 and metrics["samples"] > 0
