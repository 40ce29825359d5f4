"""The tree is formatted and linted as pyproject.toml configures ruff (format and check)."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = ["paro_jax", "models", "tests", "experiments"]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff(command):
  ruff = shutil.which("ruff")
  assert ruff, "ruff is not installed: pip install -e '.[test]'"
  done = subprocess.run([ruff, *command, *TREE], cwd=REPO, capture_output=True, text=True)
  assert done.returncode == 0, (
    f"`ruff {' '.join(command)}` failed; run `ruff format {' '.join(TREE)}` and "
    f"`ruff check --fix {' '.join(TREE)}`, then fix what is left:\n{done.stdout}{done.stderr}"
  )
