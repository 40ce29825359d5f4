"""Every test runs on 8 virtual CPU devices; the flags must be set before jax is imported."""

import os
import signal

import pytest

from paro_jax.core.xla_flags import add_xla_flags  # imports no jax
from tests.fast_compile import FAST_COMPILE_FLAGS, cache_dir

# 8 virtual devices, compiled fast (tests/fast_compile.py).
add_xla_flags(("--xla_force_host_platform_device_count=8", *FAST_COMPILE_FLAGS))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A suite started in the background of a shell without job control (`pytest ... &`, nohup) has
# SIGINT ignored, and every process it starts inherits that: the tests that stop a command with
# Ctrl-C (tests/run/test_stop.py, tests/data/test_prepare.py) would see it run on. Python's own
# handler is restored here; a handler is reset to the default on exec, so children start as from
# a terminal (Python then installs its KeyboardInterrupt).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def compilation_cache():
  """Each train() builds a new engine whose programs jax would compile again from scratch; a
  persistent compilation cache turns those repeats into cache hits (seconds, not tens), within a
  module and across the modules of a worker that ask for it (the same tiny runs recur: a run to
  resume, export or score). A module that trains repeatedly asks for it with
  `pytestmark = pytest.mark.usefixtures(...)`; the others compile as a user's run does (their
  XLA dumps and compile counts are what some of them check)."""
  import jax  # after the flags above
  from jax.experimental.compilation_cache import compilation_cache as cache

  jax.config.update("jax_compilation_cache_dir", cache_dir())  # one per worker
  cache.reset_cache()  # (jax reads the directory once, when it first compiles with one)
  yield
  jax.config.update("jax_compilation_cache_dir", None)
  cache.reset_cache()
