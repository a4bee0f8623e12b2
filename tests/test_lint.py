"""The code as CI wants it: ruff's lint rules and its formatter (settings in pyproject.toml)."""

from __future__ import annotations

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
