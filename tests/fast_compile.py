"""The XLA flags that compile the tests' tiny programs fast (imports no jax).

Tests compile many tiny programs: LLVM's optimisation of the generated CPU code costs far more
than it saves, and so do XLA:CPU's MLIR fusion emitters: the older elemental emitters compile
the same steps with the same collectives and bytes in much less CPU time
(experiments/results/compile_cost/). HLO passes, which decide the communication schedule the
tests check, still run in full. The tests' own processes get them (tests/conftest.py), and so do
the processes they start that do not run as a user runs them (`FAST_COMPILE`, the value for
their XLA_FLAGS: the CLI adds its device count to it).

The last flag is gone from newer XLA (jaxlib 0.11 refuses to start with it): only the pinned
jaxlib gets it, so that `pytest -m gpu` runs on a GPU machine whose image brings a newer jax.
"""

import atexit
import functools
import shutil
import tempfile
from importlib.metadata import version

FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
) + (("--xla_cpu_use_fusion_emitters=false",) if version("jaxlib").startswith("0.10.") else ())
FAST_COMPILE = " ".join(FAST_COMPILE_FLAGS)


@functools.cache
def cache_dir() -> str:
  """This test process's persistent compilation cache directory (one per xdist worker: jax writes
  an entry without a lock, so workers do not share one), made on first use and removed when the
  process exits (tests/conftest.py's `compilation_cache`; the CLI's processes tests/run/test_stop.py
  starts one after another)."""
  path = tempfile.mkdtemp(prefix="paro-jax-jit-")
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path
