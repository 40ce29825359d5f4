"""experiments/gpu_measure.py: measured step time against XLA's estimate, on the GPUs present."""

import os
import subprocess
import sys

import jax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "gpu_measure.py")
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": REPO}
  env.pop("XLA_FLAGS", None)
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
