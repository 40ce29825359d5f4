"""Every test runs on 8 virtual CPU devices; the flags must be set before jax is imported."""

import os

# Tests compile many tiny programs: LLVM's optimisation of the generated CPU code costs far more
# than it saves (about 4x faster compiles). HLO passes, which decide the communication schedule
# the tests check, still run in full.
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true")
_current = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_current] + [f for f in _FLAGS if f.split("=")[0] not in
                                                 _current]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
