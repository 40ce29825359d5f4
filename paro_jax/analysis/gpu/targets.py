"""The GPU targets a step compiles for on any machine, no GPU needed.

JAX's CUDA plugin can describe a GPU topology without a device: `get_topology_desc` takes a
`GpuTargetConfigProto` (the GPU's SM count, memory, compute capability, ...; one per target in
`specs/`, written from each GPU's published specification) and returns compile-only devices,
one process per host. The step compiled on a mesh of those (inspect/abstract.py
`compile_for_target`) is the executable a real cluster would run: its scheduled HLO, its memory
analysis and (from an XLA dump) its thunk sequence with the stream of every async collective.
Nothing runs, so nothing is timed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from unittest import mock

from paro_jax.analysis.gpu.hardware import GPUS

SPECS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")
# --target name -> (its file in SPECS_DIR, the planner's GPU entry in gpu/hardware.py)
TARGETS = {
  "h100": ("h100.txtpb", "h100"),
  "h200": ("h200.txtpb", "h200"),
  "a100-80gb": ("a100-80gb.txtpb", "a100-80gb"),
  "a100-40gb": ("a100-40gb.txtpb", "a100-40gb"),
}
# JAX's CUDA plugin: the cuda12 build this project pins, or the cuda13 build of newer jax (which
# a GPU machine's image may bring); either describes GPU topologies without a device.
PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
INSTALL_HINT = 'pip install -e ".[gpu-compile]"'


def check_target(name: str) -> str:
  key = name.strip().lower()
  if key not in TARGETS:
    raise ValueError(f"unknown --target {name!r}; choose one of {', '.join(TARGETS)}")
  return key


def plugin_available() -> bool:
  for plugin in PLUGINS:
    try:
      if importlib.util.find_spec(plugin) is not None:
        return True
    except ModuleNotFoundError:
      pass
  return False


def prepare_deviceless_compile() -> None:
  """Before jax starts: a compile for a GPU target needs no device, so keep jax on the CPU.

  With the CUDA plugin installed and no GPU, jax would otherwise try (and log a failure of) the
  CUDA runtime at start-up; the plugin still describes GPU topologies with JAX_PLATFORMS=cpu.
  A platform the user chose is left alone.
  """
  if not plugin_available():
    raise ValueError(
      f"--target compiles with JAX's CUDA plugin, which is not installed: {INSTALL_HINT} "
      "(about 180 MB; no GPU or CUDA driver needed)"
    )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def target_config(name: str) -> str:
  with open(os.path.join(SPECS_DIR, TARGETS[check_target(name)][0])) as f:
    return f.read()


def _target_version(name: str, block: str) -> tuple[int, ...]:
  """(major, minor[, patch]) of a version block (`cuda_compute_capability`, `dnn_version_info`)
  in the target's description."""
  m = re.search(block + r"\s*\{([^}]*)\}", target_config(name))
  if m is None:
    raise ValueError(f"target {name!r} has no {block}")
  fields = dict(re.findall(r"(\w+):\s*(\d+)", m.group(1)))
  return tuple(int(fields.get(k, 0)) for k in ("major", "minor", "patch"))


@contextlib.contextmanager
def cudnn_checks(name: str):
  """While tracing for a target: jax's cuDNN attention answered from the target, not the host.

  `jax.nn.dot_product_attention(implementation="cudnn")` checks the cuDNN library's version and
  the compute capability of the first local GPU while it traces; a compile-only topology has
  neither, although XLA compiles the fused kernel for it fine. For the duration of the trace the
  two checks read the target's description instead (its `dnn_version_info`, encoded as cuDNN
  does: major * 10000 + minor * 100 + patch, and its `cuda_compute_capability`).
  tests/analysis/test_gpu_program.py fails if a jax upgrade renames them.
  """
  # jax only once a GPU compile is asked for: `plan` and the CLI import this module without it
  from jax._src.cudnn import fused_attention_stablehlo as fa

  major, minor, patch = _target_version(name, "dnn_version_info")
  capability = _target_version(name, "cuda_compute_capability")[:2]
  at_least = lambda c: capability >= tuple(int(x) for x in c.split("."))
  equal = lambda c: capability == tuple(int(x) for x in c.split("."))
  with (
    mock.patch.object(fa, "check_cudnn_version", lambda: major * 10000 + minor * 100 + patch),
    mock.patch.object(fa, "check_compute_capability", at_least),
    mock.patch.object(fa, "is_cuda_compute_capability_equal", equal),
  ):
    yield


def compute_capability(name: str) -> tuple[int, int]:
  return _target_version(name, "cuda_compute_capability")[:2]


def memory_bandwidth(name: str) -> float:
  """The target's memory bandwidth in bytes per second, from its description."""
  m = re.search(r"memory_bandwidth:\s*(\d+)", target_config(name))
  if m is None:
    raise ValueError(f"target {name!r} has no memory_bandwidth")
  return float(m.group(1))


def target_gpu(name: str):
  """The planner's entry (peak FLOP/s, memory) for a target."""
  return GPUS[TARGETS[check_target(name)][1]]


def devices(name: str, inter: int, intra: int) -> list:
  """Compile-only GPU devices of `inter` hosts with `intra` GPUs each (process index = host)."""
  from jax.experimental import topologies  # jax only here: this module is imported without it

  topology = topologies.get_topology_desc(
    platform="cuda", target_config=target_config(name), topology=f"1x{inter}x{intra}"
  )
  return sorted(topology.devices, key=lambda d: (d.process_index, d.id))
