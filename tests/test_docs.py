"""What README.md and docs/ claim about the code and the results is true of them.

Flags named exist and quoted defaults are argparse's; repository paths named in the docs and in
comments exist; XLA flag values quoted are those of core/xla_flags.py; the headline figures are
derived again from the results pages they cite; the sample outputs are what the current code
prints (tests/docs_samples.py). The checkers are shown to fail on synthetic pages.
"""

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from paro_jax.analysis.inspect.config import InspectConfig
from paro_jax.analysis.planner.config import PlanConfig
from paro_jax.core.config import flag_of, options
from paro_jax.core.names import DEFAULT_INT8_BLOCK
from paro_jax.run.config import RunConfig
from paro_jax.core.xla_flags import GPU_FLAGS
from tests import docs_claims
from tests.docs_claims import ROOT, markdown_table

HEADLINE = ROOT / "experiments/results/strategies_headline/README.md"
PLANNER_HEADLINE = ROOT / "experiments/results/planner_headline/validate.md"
GPU_ESTIMATES = ROOT / "experiments/results/gpu_estimates/README.md"
INT8_ERROR = ROOT / "experiments/results/int8_error/error.json"
LINK_BOUND = ("infiniband", "paper_cloud", "commodity")


@pytest.fixture(scope="module")
def flags():
  return docs_claims.parser_flags()


def _read(path) -> str:
  return (ROOT / path).read_text()


def _flat(text: str) -> str:
  """Whitespace collapsed: a figure may be quoted across a line break."""
  return " ".join(text.split())


@pytest.mark.parametrize("doc", docs_claims.DOC_FILES)
def test_flags_exist_and_quoted_defaults_are_argparses(doc, flags):
  problems = docs_claims.check_flags(_read(doc), flags, doc)
  assert not problems, "fix the page or the flag:\n" + "\n".join(problems)


# The docs that quote flags of core/xla_flags.py with their values.
XLA_FLAG_DOCS = ["docs/collectives.md", "docs/gpu.md"]


def _quoted_xla_flags(doc: str) -> list[str]:
  return [m.group(1) for m in docs_claims.XLA_FLAG.finditer(_read(doc)) if m.group(1) in GPU_FLAGS]


@pytest.mark.parametrize("doc", XLA_FLAG_DOCS)
def test_xla_flag_values_are_the_ones_set(doc):
  assert _quoted_xla_flags(doc), f"{doc} quotes no flag of core/xla_flags.py: off XLA_FLAG_DOCS"
  problems = docs_claims.check_xla_flags(_read(doc), GPU_FLAGS, doc)
  assert not problems, "\n".join(problems)


def test_every_doc_quoting_xla_flags_is_checked():
  quoting = [doc for doc in docs_claims.DOC_FILES if _quoted_xla_flags(doc)]
  assert quoting == XLA_FLAG_DOCS, f"XLA_FLAG_DOCS should be {quoting}"


@pytest.mark.parametrize("doc", docs_claims.DOC_FILES)
def test_paths_and_links_in_docs_exist(doc):
  problems = docs_claims.check_paths(_read(doc), (ROOT / doc).parent, doc)
  assert not problems, "\n".join(problems)


def test_paths_in_comments_exist():
  sources = [p for d in docs_claims.SOURCE_DIRS for p in sorted((ROOT / d).glob("**/*.py"))]
  problems = []
  for path in sources:
    prose = docs_claims.comments_and_docstrings(path.read_text())
    problems += docs_claims.check_paths(prose, path.parent, str(path.relative_to(ROOT)))
  # pyproject.toml's comments (the whole file: its strings name no repository paths).
  problems += docs_claims.check_paths(_read("pyproject.toml"), ROOT, "pyproject.toml")
  # Line numbers in comments count comment blocks, not lines: the file and the path say where.
  assert not problems, "\n".join(problems)


def test_every_results_folder_is_in_the_index():
  index = _read("experiments/results/README.md")
  entries = sorted(
    p.name for p in (ROOT / "experiments/results").iterdir() if p.name != "README.md"
  )
  missing = [e for e in entries if f"[`{e}" not in index and f"`{e}/`" not in index]
  assert not missing, (
    "add these to experiments/results/README.md (what, command, date, current or superseded): "
    + ", ".join(missing)
  )


CODE_MAP = "docs/code_map.md"
LIBRARY = ("paro_jax", "models")


def code_map(text: str) -> dict[str, list[str]]:
  """module path -> the test paths of its line, for each table line of the code map."""
  rows = {}
  for line in text.splitlines():
    m = re.match(r"\| `([\w/]+\.py)` \|.*\| (`.*`) \|$", line)
    if m:
      assert m.group(1) not in rows, f"{CODE_MAP} names {m.group(1)} twice"
      rows[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
  return rows


def library_modules(root) -> set[str]:
  """Every module of paro_jax/ and models/ but a package's `__init__.py` that is its docstring
  alone."""
  found = set()
  for path in (p for top in LIBRARY for p in (root / top).glob("**/*.py")):
    body = ast.parse(path.read_text()).body
    if path.name == "__init__.py" and len(body) == 1 and isinstance(body[0], ast.Expr):
      continue
    found.add(path.relative_to(root).as_posix())
  return found


def _dotted(path: str) -> str:
  parts = path.removesuffix(".py").split("/")
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path) -> set[str]:
  """The project modules a file imports (at any depth; `from pkg import mod` names mod)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return {n for n in names if n.split(".")[0] in LIBRARY}


def reaches(root, test: str, module: str) -> bool:
  """Whether the test file imports the module, imports a module that imports it, or names its
  path (from the repository or from paro_jax/)."""
  text, dotted = (root / test).read_text(), _dotted(module)
  if module in text or module.removeprefix("paro_jax/") in text.replace("paro_jax/", ""):
    return True
  direct = _imported(root / test)
  if dotted in direct:
    return True
  for name in direct:
    file = root / (name.replace(".", "/") + ".py")
    if file.exists() and dotted in _imported(file):
      return True
  return False


def test_the_code_map_names_every_module():
  rows, modules = code_map(_read(CODE_MAP)), library_modules(ROOT)
  assert set(rows) == modules, (
    f"{CODE_MAP}: add a line for {sorted(modules - set(rows))}; "
    f"remove the line of {sorted(set(rows) - modules)}"
  )


def test_the_code_map_names_tests_that_reach_their_module():
  problems = []
  for module, tests in code_map(_read(CODE_MAP)).items():
    if not tests:
      problems.append(f"{module}: no test named")
    for test in tests:
      if not (ROOT / test).is_file():
        problems.append(f"{module}: {test} does not exist")
      elif not reaches(ROOT, test, module):
        problems.append(f"{module}: {test} neither imports it nor names it")
  assert not problems, f"{CODE_MAP}:\n" + "\n".join(problems)


def test_the_code_map_check_catches_a_missing_module_and_a_stray_test(tmp_path):
  (tmp_path / "models").mkdir()
  (tmp_path / "models" / "__init__.py").write_text('"""Models."""\n')
  (tmp_path / "models" / "a.py").write_text("X = 1\n")
  (tmp_path / "models" / "b.py").write_text("from models.a import X\n")
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_b.py").write_text("from models import b\n")
  (tmp_path / "tests" / "test_c.py").write_text("import os\n")
  rows = code_map("| `models/a.py` | X | `tests/test_b.py`, `tests/test_c.py` |\n")
  assert set(rows) != library_modules(tmp_path) == {"models/a.py", "models/b.py"}
  assert reaches(tmp_path, "tests/test_b.py", "models/a.py")  # through the module b
  assert not reaches(tmp_path, "tests/test_c.py", "models/a.py")


# The checkers fail where they should: synthetic pages, each with one wrong claim.


def test_checker_reports_a_wrong_quoted_default(flags):
  page = "Keep the newest checkpoints (`--keep K` (default 4)); the `--lr`, default 3e-3."
  problems = docs_claims.check_flags(page, flags, "page.md")
  assert len(problems) == 1 and "--keep quoted with default '4', argparse has 3" in problems[0]
  right = "Keep the newest checkpoints (`--keep K` (default 3)); the `--lr`, default 3e-3."
  assert docs_claims.check_flags(right, flags, "page.md") == []


def test_checker_skips_only_the_retired_studies_commands(flags):
  """A retired study's command runs its script at another commit: its flags are not this tree's.
  The same flag outside that section, before or after it, is still reported, on its own line."""
  page = (
    "intro `--no-such-flag`\n"
    f"{docs_claims.RETIRED_SECTION}\n| x | `python experiments/old.py --no-such-flag` |\n"
    "## Superseded\nlater `--no-such-flag`\n"
  )
  problems = docs_claims.check_flags(page, flags, "page.md")
  assert [p.split(":")[1] for p in problems] == ["1", "5"], problems


@pytest.mark.parametrize("cls", [RunConfig, InspectConfig, PlanConfig])
def test_quoted_defaults_are_checked_against_the_config_fields(cls, flags):
  """The defaults argparse has are the config dataclasses' (paro_jax/cli.py builds the flags from
  their fields): for each field's flag, its default quoted passes, any other value fails."""
  checked = 0
  for _, field in options(cls):
    default = field.default
    if default in (dataclasses.MISSING, None) or isinstance(default, (bool, tuple)):
      continue  # required, computed at run time, or a flag without a value
    if "," in str(default):
      continue  # the checker reads a quoted default up to a comma
    flag = flag_of(field)
    right = f"Set `{flag}` (default {default})."
    assert docs_claims.check_flags(right, flags, "page.md") == [], right
    if any(d is None or d is docs_claims.UNKNOWN for d in flags[flag[2:]]):
      continue  # a program decides this flag's default at run time: any quote may be right
    wrong = f"Set `{flag}` (default {987654.5 if _is_number(default) else 'no-such-value'})."
    problems = docs_claims.check_flags(wrong, flags, "page.md")
    assert len(problems) == 1 and repr(default) in problems[0], (wrong, problems)
    checked += 1
  assert checked >= 10, checked


def test_script_defaults_named_by_constant_or_required_are_read():
  source = (
    "from paro_jax.core.names import DEFAULT_INT8_BLOCK as B\n"
    "ap.add_argument('--int8-block', type=int, default=B)\n"
    "ap.add_argument('--nodes', type=int, required=True)\n"
    "ap.add_argument('--sizes', default=SIZES)\n"
  )
  found = dict(docs_claims._source_flags(source))
  assert found["int8-block"] == DEFAULT_INT8_BLOCK and found["nodes"] is docs_claims.REQUIRED
  assert found["sizes"] is docs_claims.UNKNOWN  # not a constant of paro_jax/core/names.py


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_checker_reports_an_unknown_flag(flags):
  problems = docs_claims.check_flags("run `paro-jax train --no-such-flag`", flags, "page.md")
  assert problems == ["page.md:1: --no-such-flag is no flag of paro-jax or of a script"]


def test_checker_reports_a_wrong_xla_value():
  page = "```\n--xla_gpu_experimental_parallel_collective_overlap_limit=2\n```"
  problems = docs_claims.check_xla_flags(page, GPU_FLAGS, "page.md")
  assert problems and "overlap_limit=2, but paro_jax/core/xla_flags.py sets 4" in problems[0]


def test_checker_reports_a_missing_path_and_link(tmp_path):
  page = "See `paro_jax/core/nothing_here.py`, [a page](missing.md) and [one](../README.md)."
  problems = docs_claims.check_paths(page, ROOT / "docs", "page.md")
  assert problems == [
    "page.md:1: paro_jax/core/nothing_here.py does not exist",
    "page.md:1: link missing.md does not exist",
  ]
  both = "`experiments/results/strategies_1gbit{,_9}/`"
  assert docs_claims.check_paths(both, ROOT, "p") == [
    "p:1: experiments/results/strategies_1gbit_9/ does not exist"
  ]


# Headline figures, derived again from the results pages they cite.


@pytest.fixture(scope="module")
def headline():
  text = HEADLINE.read_text()
  rows = [
    r
    for r in markdown_table(text, "| regime (link per node) | A |")
    if r["regime (link per node)"].split()[0] in LINK_BOUND
  ]
  return text, rows


def _x(cell: str) -> float:
  return float(cell.split("x")[0])


def _span(values, digits, suffix=""):
  return f"{min(values):.{digits}f}-{max(values):.{digits}f}{suffix}"


def test_readme_headline_figures_are_the_results_pages(headline):
  text, rows = headline
  readme = _flat(_read("README.md"))
  by_regime = lambda name: [
    _x(r["vs GGG (fair)"]) for r in rows if name in r["regime (link per node)"]
  ]
  ours = [float(r["overhead: ours / torch"].split("/")[0]) for r in rows]
  torch = [float(r["overhead: ours / torch"].split("/")[1]) for r in rows]
  expected = [
    f"the best strategy runs {_span(by_regime('infiniband'), 1, 'x')} (InfiniBand-class links) "
    f"to {_span(by_regime('commodity'), 1, 'x')}",
    f"communication overhead {_span(ours, 2)} against {_span(torch, 2)}",
    f"reaches {_span([_x(r['ours / torch']) for r in rows], 2, 'x')} its tokens/s",
    f"(ours {_span([_x(r['ours / torch']) for r in rows], 2, 'x')})",
  ]
  # ZeRO-3's bytes against FSDP2 full shard, A = 1 and 4 (the bytes table).
  zero3 = markdown_table(text, "| | ours | torch |")[0]
  ours_mib = [float(v) for v in re.findall(r"[\d.]+", zero3["ours"].split(":")[1])]
  torch_mib = [float(v) for v in re.findall(r"[\d.]+", zero3["torch"].split(":")[1])]
  ratios = {f"{o / t:.2f}" for o, t in zip(ours_mib, torch_mib)}
  assert len(ratios) == 1, f"ZeRO-3's byte ratio differs between A=1 and A=4: {ratios}"
  expected.append(f"ZeRO-3 (GGG) sends {ratios.pop()}x the bytes of FSDP2's full shard")
  int8 = markdown_table(text, "| A | fastest, int8 |")
  a1, a4 = (next(r["ours / torch"] for r in int8 if r["A"] == a) for a in ("1", "4"))
  expected.append(f"reaches {a1} torch's best tokens/s at A=1 and {a4} at A=4")
  expected.append(f"met at A=1 ({a1}) but not at A=4 ({a4})")
  missing = [e for e in expected if e not in readme]
  assert not missing, (
    f"README.md no longer quotes {HEADLINE.relative_to(ROOT)}; expected:\n" + "\n".join(missing)
  )


def test_benchmarks_headline_table_is_the_results_pages(headline):
  _, rows = headline
  results = {(r["regime (link per node)"].split()[0], r["A"]): r for r in rows}
  quoted = markdown_table(_read("docs/benchmarks.md"), "| regime | A | fastest of ours |")
  assert len(quoted) == len(results)
  for q in quoted:
    r = results[(q["regime"], q["A"])]
    assert q["fastest of ours"] == r["fastest of ours"].split(" (")[0], q
    assert q["vs GGG (fair)"] == r["vs GGG (fair)"], q
    assert q["ours / torch's best, tokens/s"].startswith(r["ours / torch"] + " "), q
    assert q["overhead: ours / torch"] == r["overhead: ours / torch"], q
    assert q["exposed s: ours / torch"] == r["exposed communication (s): ours / torch"], q


def test_planner_figures_are_the_validation_pages():
  rows = markdown_table(PLANNER_HEADLINE.read_text(), "| regime | link | A |")
  rho = {(r["regime"], r["A"]): float(r["Spearman"]) for r in rows}
  speed = [float(r["pick speed / best"]) for r in rows]
  spearman = f"{min(rho.values()):.2f} to {max(rho.values()):.2f}"
  assert f"Spearman correlation is {spearman}" in _flat(_read("README.md"))
  assert f"runs at {_span(speed, 2)} of the measured best" in _flat(_read("README.md"))
  per_cell = ", ".join(
    f"{rho[(g, '1')]:.2f} / {rho[(g, '4')]:.2f} ({name})"
    for g, name in [("infiniband", "infiniband A=1 / 4"), ("paper_cloud", "paper_cloud")]
  )
  planner = _flat(_read("docs/planner.md"))
  assert f"Spearman is {per_cell}, " in planner
  assert f"runs at {_span(speed, 2)} of the measured best" in planner


def test_planner_grid_is_the_gpu_estimates_page():
  """docs/planner.md's table of XLA's estimate against the planner and `--compile-top` is the
  results page's, cell by cell; so are the counts of cells README.md quotes."""
  page = GPU_ESTIMATES.read_text()
  main = {r["cell"]: r for r in markdown_table(page, "| cell | strategies | Spearman |")}
  top = {r["cell"]: r for r in markdown_table(page, "| cell | candidates | pick |")}
  docs = markdown_table(_read("docs/planner.md"), "| cell | strategies | Spearman |")
  assert [r["cell"] for r in docs] == list(main)
  for r in docs:
    m, t = main[r["cell"]], top[r["cell"]]
    assert [r[k] for k in ("strategies", "Spearman", "pick / best", "pick / best jit")] == [
      m[k] for k in ("strategies", "Spearman", "pick / best", "pick / best jit")
    ], r
    assert (r["pick"], r["XLA's best"]) == (m["planner's pick"], m["XLA's best"].split(" (")[0])
    assert (r["compile-top pick"], r["its / best"], r["its / best jit"]) == (
      t["pick"],
      t["pick / XLA's best"],
      t["pick / best jit"],
    ), r
  ratio = lambda x: float(x) if x != "-" else None
  met = sum(m["goals"] == "met" for m in main.values())
  spearman = sum(float(m["Spearman"]) >= 0.9 for m in main.values())
  near = sum(ratio(m["pick / best"]) <= 1.05 for m in main.values())
  jit = [ratio(m["pick / best jit"]) for m in main.values() if m["pick / best jit"] != "-"]
  top_near = sum(ratio(t["pick / XLA's best"]) <= 1.05 for t in top.values())
  top_jits = [ratio(t["pick / best jit"]) for t in top.values() if t["pick / best jit"] != "-"]
  top_jit = sum(x <= 1 for x in top_jits)
  readme = _flat(_read("README.md"))
  assert (
    f"all three of its goals are met in {met} cells: Spearman ≥ 0.9 in {spearman}, its pick "
    f"within 5% of XLA's best in {near}, at least as fast as the better plain-jit baseline in "
    f"{sum(x <= 1 for x in jit)} of {len(jit)}"
  ) in readme
  assert f"within 5% of XLA's best in all {top_near}" in readme and top_near == len(top)
  assert f"as fast as the better baseline in {top_jit} of {len(top_jits)}" in readme
  below = re.search(r"XLA's step is below the link floor in (\d+) of (\d+) fitting", page)
  quoted = f"in {below.group(1)} of the {below.group(2)} "
  for doc in ("README.md", "docs/gpu.md", "docs/planner.md"):
    assert quoted in _flat(_read(doc)).replace("grid's ", ""), doc


def test_int8_error_figures_are_the_error_page():
  """What docs/collectives.md, README.md and the parity page say int8 does to one step, derived
  again from the record of experiments/results/int8_error/ (block 32, round to nearest: the
  defaults)."""
  record = json.loads(INT8_ERROR.read_text())
  grads, params = record["grads"], record["params"]

  def row(rows, **want):
    return next(r for r in rows if all(r[k] == v for k, v in want.items()))

  ef, noef, sr_ef, sr_noef = (
    row(grads, block=32, rounding=rounding, error_feedback=feedback)
    for rounding in ("nearest", "stochastic")
    for feedback in (True, False)
  )
  delta, plain = (
    row(params, block=32, rounding="nearest", delta=d, bf16_parts=[]) for d in (True, False)
  )
  finest = min(record["blocks"])
  finest_row = row(grads, block=finest, rounding="nearest", error_feedback=True)
  finest_gain = ef["step_error"] / finest_row["step_error"]
  worst = max(plain["parts_vs_bf16"], key=plain["parts_vs_bf16"].get)
  part = {"embed": "the embedding", "layers": "the layers", "head": "the head"}[worst]
  assert max(ef["loss_delta_max_rel"], delta["loss_delta_max_rel"]) < 0.00005
  for doc in ("docs/collectives.md", "README.md", "experiments/results/compress_parity/README.md"):
    assert "under 0.005%" in _flat(_read(doc)), doc
  assert 0.5e-4 <= ef["sum_error"] < 1.5e-4 and delta["vs_bf16"] < 1.01  # "1e-4", "within bf16"
  expected = [
    "exact sum within about 1e-4",
    f"about {noef['sum_error'] / ef['sum_error']:.0f}x closer than without feedback",
    f"{plain['vs_bf16']:.1f}x that, {part} the worst",
    f"({sr_noef['step_error'] / noef['step_error']:.1f}x a step's gradient error, "
    f"{sr_ef['update_error'] / ef['update_error']:.1f}x",
    f"block {finest} would cut a step's gradient error {finest_gain:.1f}x",
  ]
  docs = _flat(_read("docs/collectives.md"))
  missing = [e for e in expected if e not in docs]
  assert not missing, "docs/collectives.md no longer quotes the int8 error page:\n" + "\n".join(
    missing
  )


def test_sample_outputs_are_what_the_code_prints():
  """`$ paro-jax plan|inspect ...` blocks in README.md and docs/ match the current output."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as a user runs it
  done = subprocess.run(
    [sys.executable, "tests/docs_samples.py", "--check"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, (
    "a sample output in the docs is stale: run `python tests/docs_samples.py`, review "
    f"the diff (and the prose around it), commit:\n{done.stdout}{done.stderr[-3000:]}"
  )


# The project's own tracker (its issue numbers) is not the product's: code, tests, docs and results
# pages say what a change is, and commits name history by hash. (Other projects' trackers, named
# with their repository, e.g. "MaxText #551", are a citation, not this.)
TRACKER = re.compile(r"\bissues?\s+#?\d+\b|(?<![\w/&])#\d{2,}\b(?!\s*-)", re.IGNORECASE)
CITED = re.compile(r"\b[A-Z][\w.-]*\s+#\d+")  # a repository's own issue, named with it


def tracker_numbers(text: str) -> list[str]:
  """The tracker numbers `text` names, not counting other projects' issues cited by name."""
  found = []
  for m in TRACKER.finditer(text):
    start = max(0, m.start() - 40)
    if CITED.search(text[start : m.end()]) and m.group(0).startswith("#"):
      continue
    found.append(m.group(0))
  return found


def test_the_product_names_no_tracker_numbers():
  files = subprocess.run(
    ["git", "ls-files", "paro_jax", "models", "tests", "experiments", "docs", "examples"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()
  bad = []
  for name in [*files, "README.md", "pyproject.toml"]:
    path = ROOT / name
    if path.suffix not in (".py", ".md", ".toml", ".txt", ".jinja", ".sh") or not path.is_file():
      continue
    for number in tracker_numbers(path.read_text(errors="replace")):
      bad.append(f"{name}: {number!r}")
  assert not bad, "say what the change is, not its tracker number:\n" + "\n".join(bad)


def test_the_tracker_check_catches_a_number():
  issue, hashed = "issue" + " 45", "#" + "45"
  assert tracker_numbers(f"before {issue}'s changes; see {hashed}") == [issue, hashed]
  assert tracker_numbers("MaxText " + hashed + " and torchtune " + hashed) == []
  assert tracker_numbers("#" + " 64 bytes; a-#1; x#45") == []
