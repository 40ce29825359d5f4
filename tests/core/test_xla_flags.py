import os
import subprocess
import sys

from paro_jax.core.xla_flags import GPU_OVERLAP_FLAGS, add_xla_flags

PROGRAM = "import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))"


def start_jax(xla_flags: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120
  )


def test_gpu_overlap_flags_exist_in_pinned_xla():
  ok = start_jax(" ".join(GPU_OVERLAP_FLAGS))
  assert ok.returncode == 0 and ok.stdout.strip() == "3.0", ok.stderr[-2000:]
  # The check can fail: XLA refuses a flag it does not know.
  bad = start_jax("--xla_gpu_no_such_flag_for_paro=true")
  assert bad.returncode != 0 and "Unknown flag" in bad.stderr


def test_add_xla_flags_keeps_user_settings(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_parallel_collective_overlap_limit=4")
  added = add_xla_flags(("--xla_gpu_experimental_parallel_collective_overlap_limit=2", "--xla_b=1"))
  assert added == ["--xla_b=1"]
  assert "overlap_limit=4" in os.environ["XLA_FLAGS"]
  assert "overlap_limit=2" not in os.environ["XLA_FLAGS"]
