"""Every test runs on 8 virtual CPU devices; the flags must be set before jax is imported."""

import os

from paro_jax.core.xla_flags import add_xla_flags  # imports no jax

# Tests compile many tiny programs: LLVM's optimisation of the generated CPU code costs far more
# than it saves, and so do XLA:CPU's MLIR fusion emitters: the older elemental emitters compile
# the same steps with the same collectives and bytes in much less CPU time
# (experiments/results/compile_cost/). HLO passes, which decide the communication schedule the
# tests check, still run in full.
add_xla_flags(
  (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
  )
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
