"""experiments/gpu_measure.py: measured step time against XLA's estimate, on the GPUs present."""

import os
import subprocess
import sys

import jax
import pytest

from tests.fast_compile import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "gpu_measure.py")
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": REPO}
  env.pop("XLA_FLAGS", None)
  if not HAS_GPU:  # the CPU's dry run compiles fast; a GPU's measured step compiles as a run's
    env["XLA_FLAGS"] = FAST_COMPILE
  return subprocess.run(
    [sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=timeout
  )


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
def test_says_so_without_a_gpu():
  p = _run("--model", "test", "--steps", "1")
  assert p.returncode == 2 and p.stdout.strip().startswith("gpu_measure: no GPU here")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_measures_and_estimates_briefly(tmp_path):
  import json

  p = _run("--model", "test", "--mesh", "1x1", "--seq-len", "64", "--warmup", "1",
           "--steps", "3", "--out", str(tmp_path))  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  r = json.loads((tmp_path / "gpu_measure.json").read_text())
  assert r["measured_step_s"] > 0 and len(r["measured_steps_s"]) == 3
  assert r["estimate"]["step_s"] > 0 and r["measured_over_estimate"] > 0


def test_suite_dry_run_on_the_cpu(tmp_path):
  """The before/after suite's plumbing on the CPU (`--dry-run`: the `test` model): each run
  compiles its own program (the step of before differs from today's), runs, and the page has a
  row per run and the goal's comparison; the import and export run (a tiny fixture) has its
  table, each path beside safetensors' own, and leaves no model directory behind."""
  p = _run("--suite", "--dry-run", "--only", "7b-L4-A1,7b-L4-A1-before,io-1b", "--steps", "2",
           "--warmup", "1", "--out", str(tmp_path))  # fmt: skip
  assert p.returncode == 0, p.stderr[-3000:]
  page = (tmp_path / "README.md").read_text()
  assert "| 7b-L4-A1 |" in page and "| 7b-L4-A1-before |" in page
  assert "- 7b-L4-A1: " in page and "against" in page and "losses over its 3 steps" in page
  assert (tmp_path / "7b-L4-A1" / "step.hlo").read_text() != (
    tmp_path / "7b-L4-A1-before" / "step.hlo"
  ).read_text()
  import json

  before = json.loads((tmp_path / "7b-L4-A1-before.json").read_text())
  assert before["old"] == ["head-backward", "loss", "one-device", "zero-fill", "weights-copy",
                           "per-leaf"] and before["measured_step_s"] > 0  # fmt: skip
  from experiments.io_timing import EXPORT, ONE, READ, WRITE

  io = json.loads((tmp_path / "io-1b.json").read_text())
  assert set(io["seconds"]) >= {READ, ONE, WRITE, EXPORT} and io["directory_bytes"] > 0
  assert "## Import and export on one GPU (io-1b)" in page
  for what in (ONE, EXPORT):
    assert f"| {what} | {io['seconds'][what]} |" in page
  assert sorted(q.name for q in tmp_path.iterdir() if q.is_dir()) == ["7b-L4-A1", "7b-L4-A1-before"]


def test_every_change_can_be_undone():
  """Each change of experiments/gpu_variants.py puts back other code: the step it traces (the
  `test` model, two micro-batches, the GPUs' program) differs from today's, and every module
  attribute is restored afterwards."""
  import jax.numpy as jnp

  from experiments import gpu_variants
  from models.presets import get_config
  from models.llama import Llama
  from paro_jax.analysis.inspect.abstract import abstract_inputs
  from paro_jax.core.state import OptimConfig
  from paro_jax.core.engine import Engine
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.step import StepProgram
  from paro_jax.core.strategy import parse_strategy

  engine = Engine(
    Llama(get_config("test"), jnp.bfloat16), parse_strategy("IIG"),
    make_mesh(1, 1, devices=jax.devices()[:1]), OptimConfig(), micro_batches=2,
    program=StepProgram.SYNC_IN_BACKWARD,
  )  # fmt: skip
  state, batch = abstract_inputs(engine, 1, 16)
  trace = lambda: str(jax.make_jaxpr(engine._train_step)(state, batch))  # not the cached jit
  today = trace()
  for name in ("head-backward", "loss", "one-device", "zero-fill"):
    with gpu_variants.undone((name,)):
      assert trace() != today, name
  assert trace() == today  # put back
  assert gpu_variants.engine_options(("weights-copy",)) == {"weights_copy": False}
  with pytest.raises(ValueError, match="unknown change 'heads'"):
    gpu_variants.parse("heads")


RESULTS = os.path.join(REPO, "experiments", "results", "gpu_measure")


def test_report_terms_agree_with_the_runs(tmp_path):
  """The report's fit, checked against differences of the raw measurements (no GPU needed)."""
  import json
  import shutil

  folder = tmp_path / "gpu_measure"
  shutil.copytree(RESULTS, folder)
  (folder / "README.md").unlink()
  p = _run("--report", str(folder))
  assert p.returncode == 0, p.stderr[-2000:]
  page = (folder / "README.md").read_text().split("## 7b:")[1]  # 7b's section

  def step(name):
    return json.loads((folder / f"{name}.json").read_text())["measured_step_s"] * 1e3

  def term(name):
    row = next(line for line in page.splitlines() if line.startswith(f"| {name} |"))
    return float(row.split("|")[2])

  # t(8,1) - t(4,1) = 4 (per layer + per layer-micro-batch); t(8,2) - t(4,2) = 4 (per layer +
  # 2 per layer-micro-batch): the per layer-micro-batch term is the difference of the two / 4.
  lm = ((step("7b-L8-A2") - step("7b-L4-A2")) - (step("7b-L8-A1") - step("7b-L4-A1"))) / 4
  assert term("per layer micro batch") == pytest.approx(lm, rel=0.05)
  # the 12-layer run, left to the fit's other five, is predicted within 3%
  assert step("7b-L12-A1") == pytest.approx(
    step("7b-L8-A1") + 4 * (step("7b-L8-A1") - step("7b-L4-A1")) / 4, rel=0.03
  )
  # XLA's per micro-batch term holds the overpriced head; repriced, it is within 2x of measured
  measured, xla_row = (
    term("per micro batch"),
    next(line for line in page.splitlines() if line.startswith("| per micro batch |")),
  )
  xla, repriced = float(xla_row.split("|")[3]), float(xla_row.split("|")[5])
  assert xla > 10 * measured and 0.5 < measured / repriced < 2


def test_a_failed_import_timing_is_on_the_page_and_costs_nothing_else(monkeypatch):
  """io-1b's failure (a child's error) becomes its record's error, its page section says it, and
  the page renders with no step's run beside it; the temporary directory is removed."""
  import argparse
  import glob
  import tempfile

  from experiments import gpu_io, model_io
  from experiments.gpu_measure import suite_page

  def fail(what, *args):
    raise RuntimeError(f"{what}: boom")

  monkeypatch.setattr(model_io, "time_child", fail)
  before = set(glob.glob(os.path.join(tempfile.gettempdir(), "gpu_io-*")))
  io = gpu_io.io_run("cpu", jax.__version__, dry_run=True)
  assert io["error"] == "RuntimeError: time-import: boom" and "seconds" not in io
  assert set(glob.glob(os.path.join(tempfile.gettempdir(), "gpu_io-*"))) == before
  args = argparse.Namespace(steps=2, warmup=1, dry_run=True, budget_s=450.0)
  page = suite_page([], [], args, io)
  assert "## Import and export on one GPU (io-1b)" in page
  assert "Failed: RuntimeError: time-import: boom" in page
