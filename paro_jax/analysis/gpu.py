"""Compile the training step for a GPU cluster on any machine, no GPU needed.

JAX's CUDA plugin can describe a GPU topology without a device: `get_topology_desc` takes a
`GpuTargetConfigProto` (the GPU's SM count, memory, compute capability, ...; one per target in
`targets/`, written from each GPU's published specification) and returns compile-only devices,
one process per host. The step compiled on a mesh of those is the executable a real cluster
would run: its scheduled HLO, its memory analysis and (from an XLA dump) its thunk sequence with
the stream of every async collective. Nothing runs, so nothing is timed.
"""

from __future__ import annotations

import importlib.util
import os

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
# --target name -> (target file, the planner's GPU entry in analysis/hardware.py)
TARGETS = {
  "h100": ("h100.txtpb", "h100"),
  "h200": ("h200.txtpb", "h200"),
  "a100-80gb": ("a100-80gb.txtpb", "a100-80gb"),
  "a100-40gb": ("a100-40gb.txtpb", "a100-40gb"),
}
PLUGIN = "jax_plugins.xla_cuda12"
INSTALL_HINT = 'pip install -e ".[gpu-compile]"'


def check_target(name: str) -> str:
  key = name.strip().lower()
  if key not in TARGETS:
    raise ValueError(f"unknown --target {name!r}; choose one of {', '.join(TARGETS)}")
  return key


def plugin_available() -> bool:
  try:
    return importlib.util.find_spec(PLUGIN) is not None
  except ModuleNotFoundError:
    return False


def prepare_environment() -> None:
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
  with open(os.path.join(TARGETS_DIR, TARGETS[check_target(name)][0])) as f:
    return f.read()


def target_gpu(name: str):
  """The planner's entry (peak FLOP/s, memory) for a target."""
  from paro_jax.analysis.hardware import GPUS

  return GPUS[TARGETS[check_target(name)][1]]


def devices(name: str, inter: int, intra: int) -> list:
  """Compile-only GPU devices of `inter` hosts with `intra` GPUs each (process index = host)."""
  from jax.experimental import topologies

  topology = topologies.get_topology_desc(
    platform="cuda", target_config=target_config(name), topology=f"1x{inter}x{intra}"
  )
  return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def compile_step(engine, batch_size: int, seq_len: int, flags: dict, dump_dir: str):
  """engine.train_step compiled for the engine's (GPU-topology) mesh, dumped into dump_dir."""
  from paro_jax.analysis.inspector import abstract_inputs

  state, batch = abstract_inputs(engine, batch_size, seq_len)
  lowered = engine.train_step.lower(state, batch)
  compiled = lowered.compile(compiler_options={**flags, "xla_dump_to": dump_dir})
  platform = engine.mesh.devices.flat[0].platform
  if platform not in ("gpu", "cuda"):  # lowering for CUDA on CPU devices silently compiles CPU
    raise RuntimeError(f"expected a GPU compile, got one for {platform!r} devices")
  return compiled
