"""The tree is formatted and linted as pyproject.toml configures ruff (format and check)."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = ["paro_jax", "models", "tests", "experiments"]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff(command):
  # The ruff installed beside this interpreter (a venv not on PATH), else the one on PATH.
  beside = os.path.join(os.path.dirname(sys.executable), "ruff")
  ruff = beside if os.path.exists(beside) else shutil.which("ruff")
  assert ruff, "ruff is not installed: pip install -e '.[test]'"
  done = subprocess.run([ruff, *command, *TREE], cwd=REPO, capture_output=True, text=True)
  assert done.returncode == 0, (
    f"`ruff {' '.join(command)}` failed; run `ruff format {' '.join(TREE)}` and "
    f"`ruff check --fix {' '.join(TREE)}`, then fix what is left:\n{done.stdout}{done.stderr}"
  )
