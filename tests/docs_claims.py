"""Checks of what README.md and docs/ say about the code, used by tests/test_docs.py.

Each `check_*` function takes a markdown text (and what it is checked against) and returns a list
of problems, one line each; empty when the text agrees with the code. They take their inputs as
arguments so that a test can feed them a synthetic page and see them fail.
"""

from __future__ import annotations

import ast
import glob
import importlib
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC_FILES = [
  "README.md",
  *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md")),
  "experiments/results/README.md",
]
# Files whose comments and docstrings name paths of the repository.
SOURCE_DIRS = ["paro_jax", "models", "tests", "experiments", "examples"]
UNKNOWN = object()  # a default argparse computes (not a literal in the source)
REQUIRED = object()  # a flag without a default

# Flags of other programs that the docs show beside ours (pip, pytest, SLURM, torchrun, ...).
FOREIGN_FLAGS = {
  "durations",  # pytest
  "dist",  # pytest-xdist
  "maxprocesses",  # pytest-xdist
  "nodes",  # sbatch / srun
  "ntasks-per-node",  # sbatch
  "gpus-per-node",  # sbatch
  "cpus-per-task",  # sbatch
  "job-name",  # sbatch
  "time",  # sbatch
  "nproc-per-node",  # torchrun
  "kill-on-bad-exit",  # srun
  "output",  # sbatch
  "open-mode",  # sbatch
  "requeue",  # sbatch
  "signal",  # sbatch / scancel
  "batch",  # scancel
  "map-by",  # mpirun
  "allow-run-as-root",  # mpirun
  "logdir",  # tensorboard
  "backend-store-uri",  # mlflow ui
}

FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w-])")
# A default quoted beside a flag in backticks: "`--keep K` (default 3)", "`--lr`, default 3e-3".
QUOTED_DEFAULT = re.compile(
  r"`--([a-z][a-z0-9-]*)[^`]*`[^`.;\n]{0,40}?(?:\(|, )default:?\s+`?([^\s`,;)]+)"
)
XLA_FLAG = re.compile(r"--(xla_[a-z0-9_]+)=([^\s`]+)")
REPO_PATH = re.compile(
  r"(?<![\w/.-])((?:paro_jax|models|tests|experiments|examples|docs)/[\w./{},*-]*[\w*}/])"
)
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def parser_flags() -> dict[str, list]:
  """Every long flag the project's programs define, with the defaults argparse gives it.

  The `paro-jax` subcommands are read from `cli.build_parser()` (defaults as argparse holds them);
  the scripts under experiments/, examples/ and tests/ (those the tests run, e.g.
  tests/docs_samples.py) from their source (a default that is not a literal is UNKNOWN)."""
  from paro_jax import cli  # imports no jax

  flags: dict[str, list] = {}
  parser = cli.build_parser()
  subparsers = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
  for sub in subparsers[0].choices.values():
    for action in sub._actions:
      for option in action.option_strings:
        if option.startswith("--"):
          defaults = flags.setdefault(option[2:], [])
          if not action.required:  # a required flag has no default to quote
            defaults.append(action.default)
  scripts = [p for p in sorted(ROOT.glob("tests/**/*.py")) if not p.name.startswith("test_")]
  scripts += sorted(ROOT.glob("experiments/**/*.py")) + sorted(ROOT.glob("examples/*.py"))
  for path in scripts:
    for flag, default in _source_flags(path.read_text()):
      defaults = flags.setdefault(flag, [])
      if default is not REQUIRED:
        defaults.append(default)
  return flags


# Modules of constants a script's default may name (they import no jax: reading them is cheap).
CONSTANT_MODULES = ("paro_jax.core.names", "paro_jax.core.units")


def _imported_constants(tree: ast.AST) -> dict:
  """The names a script imports from CONSTANT_MODULES, with their values."""
  constants = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module in CONSTANT_MODULES:
      module = importlib.import_module(node.module)
      for alias in node.names:
        constants[alias.asname or alias.name] = getattr(module, alias.name, UNKNOWN)
  return constants


def _source_flags(source: str):
  tree = ast.parse(source)
  constants = _imported_constants(tree)
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
      continue
    default = None
    for kw in node.keywords:
      if kw.arg == "default":
        try:
          default = ast.literal_eval(kw.value)
        except ValueError:  # a constant the script imports, else decided at run time
          name = kw.value.id if isinstance(kw.value, ast.Name) else None
          default = constants.get(name, UNKNOWN)
      if kw.arg == "action" and isinstance(kw.value, ast.Constant):
        if kw.value.value == "store_true" and default is None:
          default = False
    if any(
      kw.arg == "required" and getattr(kw.value, "value", None) is True for kw in node.keywords
    ):
      default = REQUIRED
    for arg in node.args:
      if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
        yield arg.value[2:], default


def _same_default(quoted: str, default) -> bool:
  if default is UNKNOWN or (default is None and quoted.lower() != "none"):
    return True  # decided at run time (None: "the default is computed", as the help says)
  if isinstance(default, (tuple, list)):
    return quoted in [str(d) for d in default]
  if isinstance(default, bool) or default is None:
    return quoted.lower() == str(default).lower()
  try:
    return float(quoted) == float(default)
  except (TypeError, ValueError):
    return quoted.strip("'\"") == str(default)


# The results index's section of retired studies: their commands are of the commit each names.
RETIRED_SECTION = "## Studies whose scripts are retired"


def _without_retired(text: str) -> str:
  """The text with the section of retired studies blanked (its lines kept, so line numbers hold)."""
  start = text.find(RETIRED_SECTION)
  if start < 0:
    return text
  end = text.find("\n## ", start + len(RETIRED_SECTION))
  end = len(text) if end < 0 else end
  return text[:start] + re.sub(r"[^\n]", "", text[start:end]) + text[end:]


def check_flags(text: str, flags: dict[str, list], where: str = "") -> list[str]:
  """Every `--flag` named exists in some program of the project (or is another program's), and
  a default quoted beside it equals one that argparse gives it. The commands of retired studies
  (RETIRED_SECTION) are not checked: their scripts are in the commit each names, not here."""
  problems = []
  text = _without_retired(text)
  for m in FLAG.finditer(text):
    name = m.group(1)
    if name not in flags and name not in FOREIGN_FLAGS:
      problems.append(
        f"{where}:{_line(text, m.start())}: --{name} is no flag of paro-jax or of a script"
      )
  for m in QUOTED_DEFAULT.finditer(text):
    name, quoted = m.group(1), m.group(2).rstrip(".")
    defaults = flags.get(name, [])
    if defaults and not any(_same_default(quoted, d) for d in defaults):
      problems.append(
        f"{where}:{_line(text, m.start())}: --{name} quoted with default {quoted!r}, "
        f"argparse has {', '.join(repr(d) for d in defaults)}"
      )
  return problems


def check_xla_flags(text: str, gpu_flags: dict, where: str = "") -> list[str]:
  """An XLA flag of `core/xla_flags.py` quoted with a value has the value that file sets."""
  problems = []
  for m in XLA_FLAG.finditer(text):
    name, value = m.group(1), m.group(2)
    if name in gpu_flags and value != str(gpu_flags[name]).lower():
      problems.append(
        f"{where}:{_line(text, m.start())}: --{name}={value}, but paro_jax/core/xla_flags.py "
        f"sets {gpu_flags[name]}"
      )
  return problems


def check_paths(text: str, base: pathlib.Path, where: str = "", root: pathlib.Path = ROOT):
  """Every repository path named (paro_jax/..., tests/..., experiments/..., ...) and every
  relative markdown link exists. `a{,_2}` is read as two paths; `*` as a glob."""
  problems = []
  for m in REPO_PATH.finditer(text):
    for path in _expand(m.group(1).rstrip(".,")):
      if not _exists(root / path):
        problems.append(f"{where}:{_line(text, m.start())}: {path} does not exist")
  for m in MD_LINK.finditer(text):
    target = m.group(1)
    if "://" in target or target.startswith("mailto:"):
      continue
    if not _exists(base / target):
      problems.append(f"{where}:{_line(text, m.start())}: link {target} does not exist")
  return problems


def comments_and_docstrings(source: str) -> str:
  """The comments and docstrings of a Python source, one per line (what its prose names)."""
  parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)]
  parts = [p for p in parts if p.startswith("#")]
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      parts.append(ast.get_docstring(node) or "")
  return "\n".join(parts)


def _expand(path: str) -> list[str]:
  m = re.search(r"\{([^{}]*)\}", path)
  if not m:
    return [path]
  return [
    p for alt in m.group(1).split(",") for p in _expand(path[: m.start()] + alt + path[m.end() :])
  ]


def _exists(path: pathlib.Path) -> bool:
  return bool(glob.glob(str(path))) if "*" in str(path) else path.exists()


def _line(text: str, offset: int) -> int:
  return text.count("\n", 0, offset) + 1


def markdown_table(text: str, header_starts: str) -> list[dict[str, str]]:
  """The rows of the first markdown table whose header line starts with `header_starts`."""
  lines = text.splitlines()
  for i, line in enumerate(lines):
    if line.startswith(header_starts):
      head = [c.strip() for c in line.strip("|").split("|")]
      rows = []
      for row in lines[i + 2 :]:
        if not row.startswith("|"):
          break
        rows.append(dict(zip(head, (c.strip() for c in row.strip("|").split("|")))))
      return rows
  raise ValueError(f"no table starting {header_starts!r}")
