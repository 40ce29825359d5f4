"""The package's layers import only downward (the contract the folder layout shows).

models/ knows nothing of paro_jax; core/ imports only core/ and models/; analysis/ never imports
cluster/ or run/, and its wings (hlo/, gpu/, planner/, inspect/) import only those before them;
data/ (the data pipeline) and hf/ (HF weights and adapters in and out) import only core/ and
models/, below run/, which may import them all; cluster/ imports only core/ (a run may use the
cluster's heartbeats, the cluster never the run); nothing in the library imports experiments/.
paro_jax/report.py (the one voice of warnings and errors) imports nothing of the project, and
every layer may use it.
The modules the CLI imports before jax starts (CLI_START) are listed, and none imports jax, flax,
optax or numpy at its import (a function may, once the CLI has set the device flags); the
JAX_FREE ones (the step's config, names, units, the model shapes) import none at any depth. No two
modules import each other, at any depth. Every name is imported from the module that defines it
(no module hands on another's names; `paro_jax`'s public API names each one's module). No module
of paro_jax/ is longer than MAX_LINES (one concern per file).
"""

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("core", "analysis", "data", "hf", "run", "cluster")
# What each folder may import from this repository (besides itself).
ALLOWED = {
  "models": {"models"},
  "paro_jax.core": {"models", "paro_jax.core"},
  # analysis/ in wings, each importing only those listed before it: hlo/ (reading compiled HLO),
  # gpu/ (GPU targets, their peaks, XLA's estimate), planner/ (the analytic planner, checked by
  # XLA's estimate for `plan --target`), inspect/ (`paro-jax inspect`: compiles and reports).
  "paro_jax.analysis": set(),
  "paro_jax.analysis.hlo": {"paro_jax.core", "paro_jax.analysis.hlo"},
  "paro_jax.analysis.gpu": {"paro_jax.core", "paro_jax.analysis.hlo", "paro_jax.analysis.gpu"},
  "paro_jax.analysis.planner": {
    "models",
    "paro_jax.core",
    "paro_jax.analysis.gpu",
    "paro_jax.analysis.planner",
  },
  "paro_jax.analysis.inspect": {"models", "paro_jax.core", "paro_jax.analysis"},
  # data/: the data pipeline, below run/ (a run asks it for batches, their fingerprint, the meta)
  "paro_jax.data": {"models", "paro_jax.core", "paro_jax.data"},
  # hf/: the model's way in and out (HF weights, PEFT adapters), placed on the mesh core/ builds
  "paro_jax.hf": {"models", "paro_jax.core", "paro_jax.hf"},
  "paro_jax.run": {
    "models",
    "paro_jax.core",
    "paro_jax.analysis",
    "paro_jax.data",
    "paro_jax.hf",
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
  "paro_jax/analysis/gpu/hardware.py",
  "paro_jax/analysis/inspect/config.py",
  "paro_jax/analysis/planner/config.py",
  "paro_jax/analysis/planner/costs.py",
  "paro_jax/analysis/planner/inputs.py",
  "paro_jax/analysis/planner/memory.py",
  "paro_jax/analysis/planner/profile.py",
  "paro_jax/analysis/planner/step_model.py",
  "paro_jax/analysis/planner/wording.py",
  "paro_jax/data/config.py",
  "models/config.py",
  "models/hf_config.py",
  "models/presets.py",
)
# Every module of the project that `import paro_jax.cli` and its parser import (the CLI sets the
# device flags after them, then imports the rest): test_the_cli_start_modules_are_listed.
CLI_START = (
  "models/__init__.py",
  "models/config.py",
  "models/hf_config.py",
  "models/presets.py",
  "paro_jax/__init__.py",
  "paro_jax/analysis/__init__.py",
  "paro_jax/analysis/gpu/__init__.py",
  "paro_jax/analysis/gpu/hardware.py",
  "paro_jax/analysis/gpu/targets.py",
  "paro_jax/analysis/inspect/__init__.py",
  "paro_jax/analysis/inspect/command.py",
  "paro_jax/analysis/inspect/config.py",
  "paro_jax/analysis/planner/__init__.py",
  "paro_jax/analysis/planner/command.py",
  "paro_jax/analysis/planner/config.py",
  "paro_jax/analysis/planner/costs.py",
  "paro_jax/analysis/planner/inputs.py",
  "paro_jax/analysis/planner/memory.py",
  "paro_jax/analysis/planner/planner.py",
  "paro_jax/analysis/planner/profile.py",
  "paro_jax/analysis/planner/rerank.py",
  "paro_jax/analysis/planner/step_model.py",
  "paro_jax/analysis/planner/wording.py",
  "paro_jax/cli.py",
  "paro_jax/cluster/__init__.py",
  "paro_jax/cluster/distributed.py",
  "paro_jax/cluster/gloo_rs.py",
  "paro_jax/cluster/launch.py",
  "paro_jax/cluster/launch_command.py",
  "paro_jax/cluster/native_stderr.py",
  "paro_jax/cluster/netns.py",
  "paro_jax/cluster/restart.py",
  "paro_jax/cluster/supervise.py",
  "paro_jax/cluster/watch.py",
  "paro_jax/core/__init__.py",
  "paro_jax/core/config.py",
  "paro_jax/core/feedback_rules.py",
  "paro_jax/core/flags.py",
  "paro_jax/core/names.py",
  "paro_jax/core/strategy.py",
  "paro_jax/core/units.py",
  "paro_jax/core/wire.py",
  "paro_jax/core/xla_flags.py",
  "paro_jax/data/__init__.py",
  "paro_jax/data/config.py",
  "paro_jax/data/prepare_command.py",
  "paro_jax/report.py",
  "paro_jax/run/__init__.py",
  "paro_jax/run/config.py",
  "paro_jax/run/divergence.py",
  "paro_jax/run/eval_command.py",
  "paro_jax/run/export_command.py",
  "paro_jax/run/generate_command.py",
  "paro_jax/run/generate_config.py",
  "paro_jax/run/metrics.py",
  "paro_jax/run/plot.py",
  "paro_jax/run/train_command.py",
)
JAX = ("jax", "jaxlib", "flax", "optax")
PACKAGES = ("paro_jax", "models", "experiments")


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
  if parts[:2] == ["paro_jax", "analysis"] and len(parts) > 2 and ".".join(parts[:3]) in ALLOWED:
    return ".".join(parts[:3])  # a wing of analysis/
  if parts[0] == "paro_jax" and len(parts) > 1 and (parts[1] in LAYERS or module == REPORT):
    return f"paro_jax.{parts[1]}"
  if parts[0] in ("paro_jax", "experiments"):
    return ".".join(parts[:2]) if parts[0] == "experiments" else "paro_jax"
  return None


def _files(layer: str):
  return sorted((REPO / layer.replace(".", "/")).glob("*.py"))


def _allowed(layer: str, target: str) -> bool:
  """Whether `layer` may import `target`: a layer listed, or a wing of one (analysis's)."""
  return any(target == a or target.startswith(a + ".") for a in ALLOWED[layer])


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

      if target is not None and not _allowed(layer, target):
        bad.append(f"{path.relative_to(REPO)} imports {module}")
  assert not bad, "imports against the layer contract:\n" + "\n".join(bad)


# What the rest of the library asks of the data pipeline (paro_jax/data/), by module: the
# config, the batches and their fingerprint, the shards' meta and the tokenizer a run writes
# beside its checkpoints, the chat template it records, and each command's entry. Anything else
# stays inside data/; a new name here is a decision, not a side effect.
DATA_SURFACE = {
  "paro_jax.data.config": {"DataConfig"},
  "paro_jax.data.streams": {"Batches", "expand_paths", "load_tokens", "split_eval"},
  "paro_jax.data.sources": {"data_format", "hf_directory", "instruction_batches"}
  | {"instruction_examples"},
  "paro_jax.data.examples": {"ExampleBatches", "select", "dropped_line"},
  "paro_jax.data.fingerprint": {"data_change", "data_fingerprint"},
  "paro_jax.data.bins": {"DataChanged"},
  "paro_jax.data.instruct": {"CHAT", "TEXT", "end_of_turn", "tokenizer_directory"},
  "paro_jax.data.chat": {"ChatTemplate", "special_tokens", "find_template"}
  | {"CHAT_TEMPLATE_FILE", "TOKENIZER_CONFIG"},
  "paro_jax.data.tokenizers": {"BYTES", "TOKENIZER_FILE", "HFTokenizer", "resolve_tokenizer"}
  | {"check_resumed_tokenizer", "tokenizer_identity"},
  "paro_jax.data.prepare": {"pid_alive"},
  "paro_jax.data.prompts": {"read_prompts", "prompt_tokenizer", "chat_template", "prompt_ids"},
  "paro_jax.data": {"prepare_command"},
}


def data_imports_from_outside(repo: pathlib.Path) -> list[str]:
  """Every `from paro_jax.data... import name` outside paro_jax/data/ not in DATA_SURFACE."""
  bad = []
  for path in sorted((repo / "paro_jax").glob("**/*.py")):
    if path.relative_to(repo).parts[:2] == ("paro_jax", "data"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paro_jax.data"):
        for a in node.names:
          if a.name not in DATA_SURFACE.get(node.module, ()):
            bad.append(f"{path.relative_to(repo)}: {node.module}.{a.name}")
  return bad


def test_the_rest_of_the_library_uses_only_the_data_surface():
  bad = data_imports_from_outside(REPO)
  assert not bad, (
    "names of paro_jax/data/ used outside it but not in DATA_SURFACE (keep them inside data/, "
    "or add them to its surface on purpose):\n" + "\n".join(bad)
  )


def test_the_data_surface_check_catches_an_inner_name(tmp_path):
  (tmp_path / "paro_jax" / "run").mkdir(parents=True)
  (tmp_path / "paro_jax" / "run" / "x.py").write_text(
    "from paro_jax.data.streams import Batches, _not_utf\n"
  )
  assert data_imports_from_outside(tmp_path) == [
    "paro_jax/run/x.py: paro_jax.data.streams._not_utf"
  ]


def test_every_folder_of_the_library_is_a_layer():
  """A new folder (a wing) gets its own line in ALLOWED: its modules are judged, not skipped."""
  folders = {
    _module_of(p.parent / "__init__.py", REPO)
    for top in ("paro_jax", "models")
    for p in (REPO / top).glob("**/*.py")
  } - {"paro_jax"}
  assert folders == set(ALLOWED), (
    f"add to ALLOWED: {sorted(folders - set(ALLOWED))}; remove: {sorted(set(ALLOWED) - folders)}"
  )


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
    "is for models/llama.py and paro_jax/hf/weights.py):\n" + "\n".join(pairs)
  )


def test_mutual_import_check_catches_a_circle(tmp_path):
  (tmp_path / "models").mkdir()
  (tmp_path / "models" / "a.py").write_text("from models.b import f\n")
  (tmp_path / "models" / "b.py").write_text("def g():\n  from models import a\n")
  assert mutual_imports(import_graph(tmp_path)) == ["models.a <-> models.b"]


SOURCE_DIRS = ("paro_jax", "models", "tests", "experiments", "examples")


def _module_file(repo: pathlib.Path, module: str) -> pathlib.Path | None:
  path = repo / module.replace(".", "/")
  for candidate in (path / "__init__.py", path.with_suffix(".py")):
    if candidate.exists():
      return candidate
  return None


@functools.cache
def _defined(path: pathlib.Path) -> frozenset:
  """The names a module defines at its top level (into `if`, `try` and `with` blocks): functions,
  classes and assigned names; not the names it imports."""
  names = set()
  for node in _module_level(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    elif isinstance(node, ast.With):
      names.update(d.name for d in node.body if isinstance(d, (ast.FunctionDef, ast.ClassDef)))
  return frozenset(names)


def imported_elsewhere(repo: pathlib.Path, dirs=SOURCE_DIRS) -> list[str]:
  """Every `from M import name` of a project module M that does not define `name` (nor has a
  submodule of that name), and every `alias.name` read through a module imported as `alias`
  that does not define it: a name reached through a module that only passes it on."""
  bad = []
  for path in (p for d in dirs for p in sorted((repo / d).glob("**/*.py"))):
    tree, where = ast.parse(path.read_text()), path.relative_to(repo)
    aliases = {}  # local name -> the project module it is
    for node in ast.walk(tree):
      if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
        continue
      if node.module.split(".")[0] not in ("paro_jax", "models"):
        continue
      module = _module_file(repo, node.module)
      if module is None:
        bad.append(f"{where}:{node.lineno}: no module {node.module}")
        continue
      for a in node.names:
        sub = _module_file(repo, f"{node.module}.{a.name}")
        if sub is not None:
          aliases[a.asname or a.name] = sub
        elif a.name not in _defined(module):
          bad.append(f"{where}:{node.lineno}: {node.module} does not define {a.name}")
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for a in node.names:
          module = _module_file(repo, a.name)
          if a.asname and a.name.split(".")[0] in ("paro_jax", "models") and module:
            aliases[a.asname] = module
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
      ):
        module = aliases[node.value.id]
        package = module.parent if module.name == "__init__.py" else None
        if node.attr in _defined(module) or (package and _module_file(package, node.attr)):
          continue
        bad.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr} is not defined there")
  return bad


def test_names_are_imported_from_where_they_are_defined():
  """No re-export shims: a name has one import path, its module's. (`paro_jax`'s lazy public API
  is the exception the package means: each name beside the module that defines it.)"""
  bad = imported_elsewhere(REPO)
  assert not bad, "import these from the module that defines them:\n" + "\n".join(bad)


def test_the_public_api_names_the_defining_modules():
  import paro_jax  # no jax at import: names resolve on first use

  bad = [
    f"{name}: {module}"
    for name, module in paro_jax._EXPORTS.items()
    if name not in _defined(_module_file(REPO, module))
  ]
  assert not bad, f"paro_jax/__init__.py's _EXPORTS: not defined in the module named: {bad}"


def test_the_import_path_check_catches_a_re_export(tmp_path):
  (tmp_path / "models").mkdir()
  (tmp_path / "models" / "__init__.py").write_text("")
  (tmp_path / "models" / "a.py").write_text("X = 1\n")
  (tmp_path / "models" / "b.py").write_text("from models.a import X\n\nY = X\n")
  (tmp_path / "models" / "c.py").write_text(
    "from models import b\nfrom models.a import X\nfrom models.b import Y, X\n\nZ = b.X + b.Y\n"
  )
  assert imported_elsewhere(tmp_path, ("models",)) == [
    "models/c.py:3: models.b does not define X",
    "models/c.py:5: b.X is not defined there",
  ]


# Public names defined in more than one module, each meaning the same thing in all of them.
SAME_MEANING = {
  "main": "a program's entry point (cli.py; cluster/reaper.py, run as a process of its own), or "
  "a command's, called by cli.py once it has parsed the flags (run/train_command.py, ...)",
  "add_parser": "a command's parser, added to the `paro-jax` subcommands by cli.py",
  "check_args": "a command's checks of its parsed flags that argparse cannot make",
  "boundary_sync": "the boundary's gradient sync: core/step.py's, core/feedback.py's with error "
  "feedback",
}


def public_definitions(repo: pathlib.Path) -> dict[str, list[str]]:
  """Top-level public name -> the library modules that define it."""
  found = {}
  for path in (p for top in ("paro_jax", "models") for p in sorted((repo / top).glob("**/*.py"))):
    for name in _defined(path):
      if not name.startswith("_"):
        found.setdefault(name, []).append(path.relative_to(repo).as_posix())
  return found


def test_no_two_modules_define_one_public_name():
  """One name, one meaning: a public name defined in two modules (two `estimate`s, two
  `Interrupted`s) reads the same and means two things; one fact written twice drifts."""
  twice = {
    name: paths
    for name, paths in public_definitions(REPO).items()
    if len(paths) > 1 and name not in SAME_MEANING
  }
  assert not twice, (
    "rename one of each (or import the one fact from where it is written):\n"
    + "\n".join(f"{name}: {', '.join(paths)}" for name, paths in sorted(twice.items()))
  )


def test_the_one_name_check_catches_a_second_meaning(tmp_path):
  (tmp_path / "models").mkdir()
  (tmp_path / "models" / "a.py").write_text("def estimate():\n  pass\n")
  (tmp_path / "models" / "b.py").write_text("class Estimate:\n  pass\n\n\nestimate = 1\n")
  found = public_definitions(tmp_path)
  assert found["estimate"] == ["models/a.py", "models/b.py"] and found["Estimate"] == [
    "models/b.py"
  ]


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


# How long any module of paro_jax/ or models/ may be (one concern per file). Modules were split
# to this along their seams: run/train.py into setup, stopping, bookkeeping and reporting; the
# command line into one module per command beside the code it runs, cli.py only dispatching; the
# model into attention, layers, rope, lora and the model that stacks them, its configuration into
# config, presets and hf_config.
MAX_LINES = 400


@pytest.mark.parametrize("package", ["paro_jax", "models"])
def test_modules_stay_small(package):
  long = long_modules(REPO / package, MAX_LINES)
  assert not long, (
    f"{package}/ modules over {MAX_LINES} lines (split one along its seams, as "
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
