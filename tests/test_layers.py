"""The package's layers import only downward (the contract the folder layout shows).

models/ knows nothing of paro_jax; core/ imports only core/ and models/; analysis/ never imports
cluster/ or run/; cluster/ imports only core/ (a run may use the cluster's heartbeats, the cluster
never the run); nothing in the library imports experiments/. paro_jax/report.py (the one voice of
warnings and errors) imports nothing of the project, and every layer may use it.
The modules the CLI imports before jax starts (CLI_START) are listed, and none imports jax, flax,
optax or numpy at its import (a function may, once the CLI has set the device flags); the
JAX_FREE ones (the step's config, names, units, the model shapes) import none at any depth. No two
modules import each other, at any depth. No module of paro_jax/core/, run/ or analysis/ is longer
than its MAX_LINES (one concern per file).
"""

import ast
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("core", "analysis", "run", "cluster")
# What each folder may import from this repository (besides itself).
ALLOWED = {
  "models": {"models"},
  "paro_jax.core": {"models", "paro_jax.core"},
  "paro_jax.analysis": {"models", "paro_jax.core", "paro_jax.analysis"},
  "paro_jax.run": {
    "models",
    "paro_jax.core",
    "paro_jax.analysis",
    "paro_jax.run",
    "paro_jax.cluster",
  },
  "paro_jax.cluster": {"paro_jax.core", "paro_jax.cluster"},
}
REPORT = "paro_jax.report"  # the reporter: below every layer
for _layer_name in ALLOWED:
  if _layer_name.startswith("paro_jax."):
    ALLOWED[_layer_name].add(REPORT)
JAX_FREE = (
  "paro_jax/core/config.py",
  "paro_jax/core/feedback_rules.py",
  "paro_jax/core/names.py",
  "paro_jax/core/strategy.py",
  "paro_jax/core/units.py",
  "paro_jax/core/xla_flags.py",
  "paro_jax/analysis/config.py",
  "paro_jax/analysis/memory.py",
  "models/config.py",
)
# Every module of the project that `import paro_jax.cli` and its parser import (the CLI sets the
# device flags after them, then imports the rest): test_the_cli_start_modules_are_listed.
CLI_START = (
  "models/__init__.py",
  "models/config.py",
  "paro_jax/__init__.py",
  "paro_jax/analysis/__init__.py",
  "paro_jax/analysis/config.py",
  "paro_jax/analysis/costs.py",
  "paro_jax/analysis/gpu.py",
  "paro_jax/analysis/hardware.py",
  "paro_jax/analysis/memory.py",
  "paro_jax/analysis/plan_compile.py",
  "paro_jax/analysis/plan_inputs.py",
  "paro_jax/analysis/plan_profile.py",
  "paro_jax/analysis/planner.py",
  "paro_jax/analysis/step_model.py",
  "paro_jax/cli.py",
  "paro_jax/cluster/__init__.py",
  "paro_jax/cluster/distributed.py",
  "paro_jax/cluster/gloo_rs.py",
  "paro_jax/cluster/launch.py",
  "paro_jax/cluster/native_stderr.py",
  "paro_jax/cluster/netns.py",
  "paro_jax/cluster/restart.py",
  "paro_jax/cluster/supervise.py",
  "paro_jax/cluster/watch.py",
  "paro_jax/core/__init__.py",
  "paro_jax/core/config.py",
  "paro_jax/core/feedback_rules.py",
  "paro_jax/core/names.py",
  "paro_jax/core/strategy.py",
  "paro_jax/core/units.py",
  "paro_jax/core/wire.py",
  "paro_jax/core/xla_flags.py",
  "paro_jax/report.py",
  "paro_jax/run/__init__.py",
  "paro_jax/run/config.py",
  "paro_jax/run/divergence.py",
  "paro_jax/run/metrics.py",
  "paro_jax/run/plot.py",
)
JAX = ("jax", "jaxlib", "flax", "optax")
PACKAGES = ("paro_jax", "models", "experiments")
MAX_CORE_LINES = 500


def _imports(path: pathlib.Path, at_import: bool = False) -> set[str]:
  """Every module name the file imports, at any depth (function-level imports included); with
  `at_import`, only those its import runs (none inside a function or class)."""
  names = set()
  tree = ast.parse(path.read_text())
  nodes = _module_level(tree) if at_import else ast.walk(tree)
  for node in nodes:
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


def _module_level(tree: ast.Module):
  """The statements a module's import runs: its body, into `if` and `try` blocks, not into
  functions or classes."""
  todo = list(tree.body)
  while todo:
    node = todo.pop()
    yield node
    if isinstance(node, (ast.If, ast.Try)):
      todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
      todo += [x for h in getattr(node, "handlers", []) for x in h.body]


def _layer(module: str) -> str | None:
  parts = module.split(".")
  if parts[0] == "models":
    return "models"
  if parts[0] == "paro_jax" and len(parts) > 1 and (parts[1] in LAYERS or module == REPORT):
    return f"paro_jax.{parts[1]}"
  if parts[0] in ("paro_jax", "experiments"):
    return ".".join(parts[:2]) if parts[0] == "experiments" else "paro_jax"
  return None


def _files(layer: str):
  return sorted((REPO / layer.replace(".", "/")).glob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_downward(layer):
  assert _files(layer), f"no modules found for {layer}"
  bad = []
  for path in _files(layer):
    for module in _imports(path):
      if module == "paro_jax":
        continue  # `from paro_jax import X`: X is judged (its own entry)
      target = _layer(module)
      # `from paro_jax import X` names the layer X: judge the layer, not the bare package.
      if target == "paro_jax" and module.count(".") == 1 and module.split(".")[1] in LAYERS:
        target = module

      if target is not None and target not in ALLOWED[layer]:
        bad.append(f"{path.relative_to(REPO)} imports {module}")
  assert not bad, "imports against the layer contract:\n" + "\n".join(bad)


def test_the_library_never_imports_experiments():
  for path in [*REPO.glob("paro_jax/**/*.py"), *REPO.glob("models/*.py")]:
    assert not any(m.split(".")[0] == "experiments" for m in _imports(path)), path


@pytest.mark.parametrize("name", JAX_FREE)
def test_jax_free_modules(name):
  assert not any(m.split(".")[0] in JAX for m in _imports(REPO / name))


@pytest.mark.parametrize("name", CLI_START)
def test_cli_start_modules_import_no_jax_at_import(name):
  found = [m for m in _imports(REPO / name, at_import=True) if m.split(".")[0] in (*JAX, "numpy")]
  assert not found, f"{name} imports {found} at its import: import it inside the function using it"


def test_the_cli_start_modules_are_listed():
  """CLI_START is the set of the project's modules the CLI imports before jax starts."""
  code = (
    "import sys; import paro_jax, paro_jax.cli, models.config; paro_jax.cli.build_parser(); "
    "print(' '.join(sorted(m.__file__ for n, m in sys.modules.items() "
    "if n.split('.')[0] in ('paro_jax', 'models'))))"
  )
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr
  started = {pathlib.Path(f).resolve().relative_to(REPO).as_posix() for f in done.stdout.split()}
  assert started == set(CLI_START), (
    f"add to CLI_START: {sorted(started - set(CLI_START))}; "
    f"remove: {sorted(set(CLI_START) - started)}"
  )


def test_the_import_time_check_reads_only_what_an_import_runs(tmp_path):
  (tmp_path / "m.py").write_text(
    "import os\ntry:\n  import numpy\nexcept ImportError:\n  pass\ndef f():\n  import jax\n"
  )
  assert _imports(tmp_path / "m.py", at_import=True) == {"os", "numpy"}
  assert "jax" in _imports(tmp_path / "m.py")


def test_contract_catches_a_violation(tmp_path, monkeypatch):
  """The checker itself: a core module importing the run layer is reported."""
  (tmp_path / "paro_jax" / "core").mkdir(parents=True)
  (tmp_path / "paro_jax" / "core" / "bad.py").write_text("from paro_jax.run import train\n")
  monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
  with pytest.raises(AssertionError, match="paro_jax/core/bad.py imports paro_jax.run"):
    test_layer_imports_only_downward("paro_jax.core")


def import_graph(repo: pathlib.Path) -> dict[str, set[str]]:
  """module -> the repository modules it imports (function-level imports included); a name
  imported from a package counts as its submodule when there is one."""
  paths = [p for pkg in PACKAGES for p in sorted((repo / pkg).glob("**/*.py"))]
  modules = {_module_of(p, repo): p for p in paths}
  graph = {}
  for name, path in modules.items():
    targets = set()
    for imported in _imports(path):
      while imported and imported not in modules:
        imported = imported.rpartition(".")[0]  # `from a.b import f`: the module a.b
      if imported and imported != name:
        targets.add(imported)
    graph[name] = targets
  return graph


def _module_of(path: pathlib.Path, repo: pathlib.Path) -> str:
  parts = path.relative_to(repo).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def mutual_imports(graph: dict[str, set[str]]) -> list[str]:
  return sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))


def test_no_two_modules_import_each_other():
  pairs = mutual_imports(import_graph(REPO))
  assert not pairs, (
    "modules that import each other (move what both need into a third module, as models/config.py "
    "is for models/llama.py and models/hf.py):\n" + "\n".join(pairs)
  )


def test_mutual_import_check_catches_a_circle(tmp_path):
  (tmp_path / "models").mkdir()
  (tmp_path / "models" / "a.py").write_text("from models.b import f\n")
  (tmp_path / "models" / "b.py").write_text("def g():\n  from models import a\n")
  assert mutual_imports(import_graph(tmp_path)) == ["models.a <-> models.b"]


def test_package_and_cli_start_without_jax():
  """`import paro_jax`, the CLI's parser and the model config import no jax (nor numpy): the CLI
  sets the device flags before jax starts, and `plan` needs no jax at all. This is why the jax
  imports of cli.py sit inside its command functions."""
  code = (
    "import sys; import paro_jax, paro_jax.cli, models.config; paro_jax.cli.build_parser(); "
    "print(sorted(m for m in ('jax', 'jaxlib', 'flax', 'optax', 'numpy') if m in sys.modules))"
  )
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == "[]", f"imported at start: {done.stdout.strip()}"


def long_modules(folder: pathlib.Path, limit: int) -> list[str]:
  """The modules of `folder` (its subfolders' included) longer than `limit` lines, with their
  lengths."""
  lengths = {
    p.relative_to(folder).as_posix(): len(p.read_text().splitlines())
    for p in sorted(folder.glob("**/*.py"))
  }
  return [f"{name}: {n} lines" for name, n in lengths.items() if n > limit]


# How long a module of each layer may be. run/ and analysis/ were split to this (run/train.py
# into setup, stopping, bookkeeping and reporting; run/checkpoint.py into its content and its
# errors; run/data.py into data, bins and tokenizers).
MAX_LINES = {"paro_jax.core": MAX_CORE_LINES, "paro_jax.run": 400, "paro_jax.analysis": 400}


@pytest.mark.parametrize("layer", sorted(MAX_LINES))
def test_modules_stay_small(layer):
  assert _files(layer), f"no modules found for {layer}"
  limit = MAX_LINES[layer]
  long = long_modules(REPO / layer.replace(".", "/"), limit)
  assert not long, (
    f"{layer.replace('.', '/')}/ modules over {limit} lines (split one along its seams, as "
    "core/collectives.py is split into rings.py, horing.py, stacked.py and "
    "compressed_collectives.py, or run/train.py into setup.py, stopping.py, bookkeeping.py and "
    "reporting.py):\n" + "\n".join(long)
  )


def test_module_length_check_catches_a_long_module(tmp_path):
  (tmp_path / "short.py").write_text("x = 1\n" * 3)
  (tmp_path / "long.py").write_text("x = 1\n" * 4)
  (tmp_path / "wing").mkdir()
  (tmp_path / "wing" / "deep.py").write_text("x = 1\n" * 5)
  assert long_modules(tmp_path, 3) == ["long.py: 4 lines", "wing/deep.py: 5 lines"]
