"""The tree is formatted and linted as pyproject.toml configures ruff (format and check)."""

import ast
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = ["paro_jax", "models", "tests", "experiments"]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff(command):
  ruff = _beside_python("ruff")
  assert ruff, "ruff is not installed: pip install -e '.[test]'"
  done = subprocess.run([ruff, *command, *TREE], cwd=REPO, capture_output=True, text=True)
  assert done.returncode == 0, (
    f"`ruff {' '.join(command)}` failed; run `ruff format {' '.join(TREE)}` and "
    f"`ruff check --fix {' '.join(TREE)}`, then fix what is left:\n{done.stdout}{done.stderr}"
  )


def _beside_python(tool: str) -> str | None:
  """The `tool` installed beside this interpreter (a venv not on PATH), else the one on PATH."""
  beside = os.path.join(os.path.dirname(sys.executable), tool)
  return beside if os.path.exists(beside) else shutil.which(tool)


def test_no_dead_code():
  """vulture finds nothing it is sure of (80% and up: unused imports, variables and arguments,
  unreachable code) in the library. At its default 60% it lists what only tests use too: read
  that list when a name may have lost its last user (names frameworks call, such as jinja's
  `parse` or importlib's `exec_module`, are on it as well)."""
  vulture = _beside_python("vulture")
  if vulture is None:
    pytest.skip("vulture is not installed: pip install -e '.[test]'")
  done = subprocess.run(
    [vulture, "paro_jax", "models", "--min-confidence", "80"],
    cwd=REPO,
    capture_output=True,
    text=True,
  )
  assert done.returncode == 0, (
    "dead code (remove it; an argument a caller's signature needs is named _like_this):\n"
    + done.stdout
    + done.stderr
  )


def test_the_dead_code_check_can_fail(tmp_path):
  vulture = _beside_python("vulture")
  if vulture is None:
    pytest.skip("vulture is not installed: pip install -e '.[test]'")
  (tmp_path / "m.py").write_text("import os\n\n\ndef f():\n  return 1\n  print(os.sep)\n")
  done = subprocess.run(
    [vulture, str(tmp_path), "--min-confidence", "80"], capture_output=True, text=True
  )
  assert done.returncode != 0 and "unreachable code" in done.stdout, done.stdout


def _unexplained_local_imports(source: str) -> list[int]:
  """Lines of imports inside functions with no comment saying why: on the import, on the
  line before it, or on any line of the run of imports it belongs to."""
  lines = source.splitlines()
  local = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for inner in ast.walk(node):
        if isinstance(inner, (ast.Import, ast.ImportFrom)):
          local.add(inner.lineno)
  bad = []
  for n in sorted(local):
    run = [n]  # the run of consecutive local imports this one belongs to
    while run[0] - 1 in local:
      run.insert(0, run[0] - 1)
    while run[-1] + 1 in local:
      run.append(run[-1] + 1)
    said = [lines[i - 1] for i in run] + [lines[run[0] - 2] if run[0] > 1 else ""]
    if not any("#" in line for line in said):
      bad.append(n)
  return bad


def test_imports_inside_functions_say_why():
  # Imports go at the top of a module; one inside a function (keeping `import paro_jax`, `plan`
  # and the CLI's start free of jax, an optional dependency, a cycle) carries a comment saying so.
  found = []
  for top in ("paro_jax", "models"):
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for name in sorted(files):
        if name.endswith(".py"):
          path = os.path.join(root, name)
          with open(path) as f:
            found += [
              f"{os.path.relpath(path, REPO)}:{n}" for n in _unexplained_local_imports(f.read())
            ]
  assert not found, (
    "imports inside functions without a comment saying why (move them to the top of the module, "
    f"or say why not on the line): {found}"
  )


def test_the_local_import_check_can_fail():
  source = (
    "import os\n\n\ndef f():\n  import json\n\n  return json\n\n\ndef g():\n  import re  # why\n"
  )
  assert _unexplained_local_imports(source) == [5]


def test_test_files_have_distinct_names():
  # The test folders are not packages: pytest imports each test file by its base name, and two
  # files of one name in different folders stop the whole run with "import file mismatch".
  seen = {}
  for root, _, files in os.walk(os.path.join(REPO, "tests")):
    for name in files:
      if name.startswith("test_") and name.endswith(".py"):
        seen.setdefault(name, []).append(os.path.relpath(os.path.join(root, name), REPO))
  assert not {n: p for n, p in seen.items() if len(p) > 1}, "rename one of each pair"
