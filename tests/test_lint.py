"""The code as CI wants it: ruff's lint rules and its formatter (settings in pyproject.toml)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess

import pytest
from conftest import ROOT


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or str(ROOT / ".venv" / "bin" / "ruff")  # installed by `pip install -e '.[test]'`
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff(args):
    proc = ruff(*args)
    assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def lint_imports(root) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(ROOT / ".venv" / "bin" / "lint-imports")
    env = dict(os.environ, PYTHONPATH=str(root))  # the packages under `root` come before the installed ones
    return subprocess.run([exe, "--no-cache"], cwd=root, capture_output=True, text=True, env=env)


def test_the_import_contracts_hold():
    """The layering in pyproject.toml ([tool.importlinter]): errors < util < config < target < the four steps < cli,
    no stage script importing another, and the reader free of engines, DVC and Hydra."""
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize(
    "module, upward",
    [
        ("draftdata/errors.py", "import draftdata.config.schema"),  # the bottom layer reaching up
        ("draftdata/config/schema.py", "from draftdata.sources import shapes"),  # config above what it validates
        ("draftdata/hidden/reader.py", "import draftdata.hidden.engines.hf"),  # the read side importing an engine
        ("draftdata/tokenize/samples.py", "import draftdata.generate.store"),  # one step reaching into another
        ("stages/tokenize.py", "import stages.generate"),  # a stage script importing another
    ],
)
def test_an_upward_import_breaks_a_contract(tmp_path, module, upward):
    """The contracts are not vacuous: each kind of violation, planted in a copy of the code, fails the check."""
    for name in ("draftdata", "stages"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    planted = tmp_path / module
    planted.write_text(planted.read_text() + f"\n{upward}  # noqa\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0 and "BROKEN" in proc.stdout, proc.stdout[-3000:]


def test_stage_mains_are_short():
    """A stage reads its config, calls the library and writes its outputs: its main() fits on a screen."""
    for script in sorted((ROOT / "stages").glob("*.py")):
        tree = ast.parse(script.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        if script.name == "__init__.py":
            continue
        assert len(mains) == 1, f"{script.name}: one main()"
        statements = sum(isinstance(n, ast.stmt) for n in ast.walk(mains[0])) - 1
        assert statements <= 30, f"{script.name}: main() has {statements} statements"
