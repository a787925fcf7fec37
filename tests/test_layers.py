"""The house's floors, held by import-linter (the contracts in pyproject.toml's [tool.importlinter]).

A contract checked by a kept tool rather than by hand: the package as it is keeps every
contract, and a copy of it with one upward import (``parallel`` importing ``training``) or one
cycle between siblings breaks it, so the check can fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import-linter's own command, run by this interpreter (its script may live outside the venv)
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as m; m()", "--no-cache"]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "repo"
    shutil.copytree(ROOT / "zerotron", dst / "zerotron", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_package_keeps_every_contract():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize("module,line,contract", [
    ("parallel/grid.py", "import zerotron.training.trainer", "layers"),
    ("data/indexed.py", "import zerotron.model.gpt", "data stands beside"),
    ("activation/config.py", "import zerotron.activation.checkpoint", "no import cycles"),
])
def test_an_import_against_the_floors_breaks_a_contract(tmp_path, module, line, contract):
    repo = _copy(tmp_path)
    path = repo / "zerotron" / module
    path.write_text(path.read_text() + f"\n{line}  # injected by the test\n")
    run = _lint(repo)
    assert run.returncode != 0, run.stdout
    assert contract in run.stdout.split("Broken contracts")[-1], run.stdout
