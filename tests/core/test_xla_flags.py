import os
import subprocess
import sys

from paro_jax import cli
from paro_jax.core.xla_flags import CPU_MEMORY_FIRST_FLAGS, GPU_OVERLAP_FLAGS, add_xla_flags

PROGRAM = "import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))"


def start_jax(xla_flags: str, program: str = PROGRAM) -> subprocess.CompletedProcess:
  env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
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


# A product of each of six bf16 weights, differentiated: XLA:CPU converts each weight to f32, and
# the default order converts all six before the first product and keeps the copies for the
# backward's products (the LoRA step's layer, in small).
SCHEDULED = """
import jax, jax.numpy as jnp
def f(ws, x):
  return sum(jnp.tanh(x @ w.astype(jnp.float32)).sum() for w in ws)
ws = [jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)] * 6
x = jax.ShapeDtypeStruct((16, 512), jnp.float32)
compiled = jax.jit(jax.grad(f, argnums=1)).lower(ws, x).compile()
print(compiled.memory_analysis().temp_size_in_bytes)
"""


def _temporaries(xla_flags: str) -> int:
  done = start_jax(xla_flags, SCHEDULED)
  assert done.returncode == 0, done.stderr[-2000:]
  return int(done.stdout.split()[-1])


def test_memory_first_order_holds_one_f32_weight_at_a_time():
  weight_f32 = 512 * 512 * 4
  default, memory_first = _temporaries(""), _temporaries(" ".join(CPU_MEMORY_FIRST_FLAGS))
  assert default >= 6 * weight_f32  # every weight's f32 copy at once
  assert memory_first < 2 * weight_f32, (default, memory_first)


def test_only_a_lora_run_asks_for_the_memory_first_order():
  lora = cli._parse(["train", "--lora-rank", "8", "--mesh", "2x4"])
  full = cli._parse(["train", "--mesh", "2x4"])
  assert cli.cpu_flags(lora) == CPU_MEMORY_FIRST_FLAGS
  assert cli.cpu_flags(full) == ()
