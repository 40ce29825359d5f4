"""XLA flags that shape the GPU program, and the XLA_FLAGS helpers that set them before jax starts.

Every flag here changes the compiled GPU step; `paro-jax inspect --target` shows what each one
does, and tests/analysis/test_gpu_program.py checks that each changes the program. Names are checked
against the pinned jaxlib 0.10.2: XLA aborts at start-up on an unknown flag
(tests/core/test_xla_flags.py starts jax with them set).

The latency-hiding scheduler already runs by default in this XLA, so its enabling flag is not
set: it would change nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

# The compile options on XLA:CPU of the programs whose layer loops carry bf16 weights: the eval
# forward (core/forward.py) and the step of a LoRA run, whose frozen base is held in the compute
# dtype (core/engine.py). XLA:CPU computes bf16 in f32: each layer's weights, cut from the stacked
# weights inside the layer loop, are converted to f32, and loop-invariant code motion turns that
# into one convert of the whole stack before the loop: an f32 copy of every weight a device
# holds, twice the bf16 weights (the Llama 3.2 1B shape's eval forward, temporaries per device:
# 4953 -> 239 MiB on one device, 886 -> 296 MiB on 1x8 under GGG, where the H100 compile has
# 255 MiB). Without the pass each layer is converted as it is cut. A full run's step keeps the
# pass: its stacks are the fp32 master, with no convert to hoist.
CPU_BF16_WEIGHTS_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}

# XLA:CPU orders a device's kernels, by default, so that independent ones can run side by side,
# at a cost in memory. In a LoRA step it converts each rematerialised layer's gathered bf16
# weights to f32 all at once before the layer's first product and keeps those copies for its
# backward's products: a layer held in f32 beside the next one in bf16 (the Llama 3.2 1B
# shape's LoRA step on ING 2x4, temporaries per device: 398 MiB, 257 in the memory-first order;
# two gathered layers in bf16 are 243). XLA:CPU reads the flag from XLA_FLAGS only (a program's
# compiler_options leave it as it is, jax 0.10.2), so it is set for the whole process of a LoRA
# run (cli.py), where the memory is the point: the same step runs slower in this order.
CPU_MEMORY_FIRST_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def bf16_weights_options(mesh) -> dict | None:
  """`jax.jit`'s compiler_options for a program on `mesh` whose layer loops carry bf16 weights:
  CPU_BF16_WEIGHTS_OPTIONS on XLA:CPU, none elsewhere."""
  return CPU_BF16_WEIGHTS_OPTIONS if mesh.devices.flat[0].platform == "cpu" else None


def cpu_gathers_as_bits(mesh) -> bool:
  """Whether a LoRA step on `mesh` gathers its weights (the frozen base and the adapters, each
  micro-batch) as their bits (core/buckets.py as_bits; the Engine's `gather_bits`): on XLA:CPU,
  which runs a bf16 all-gather in f32, so that each gathered layer was held in f32, twice its
  bytes (the Llama 3.2 1B shape, ING 2x4, 16 layers: 524 -> 398 MiB of temporaries per
  device; every device's in the one process's memory). No gradient passes through those gathers
  (the adapters' is the gather's own backward, a reduce-scatter). GPUs move bf16 as it is. Full
  training keeps its gathers: `paro-jax inspect` checks their bytes on CPU against the f32
  formula."""
  return mesh.devices.flat[0].platform == "cpu"


# name -> value. The same settings go to XLA_FLAGS for real GPU runs (`paro-jax train`) and to
# `compile(compiler_options=...)` for compiles against a GPU target (`paro-jax inspect --target`).
GPU_FLAGS = {
  # Up to four collectives in flight at once (XLA's default is one; every async collective holds
  # the same scheduler resource, so this caps them all together): an HO-Ring step's intra and
  # inter permutes (each pinned to its own communication stream by horing.py) beside a
  # prefetched gather or a gradient reduce-scatter of another tensor. With 2, the embedding's and
  # the head's HO-Ring gathers outside the layer loops queue behind each other and some of their
  # inter steps run alone (`paro-jax inspect --target h100 --model 7b --mesh 2x4 --strategy GGG
  # --collectives horing`: 198 of 202 steps with both levels in flight; 202 of 202 with 4).
  "xla_gpu_experimental_parallel_collective_overlap_limit": 4,
  # XLA:GPU makes an async collective synchronous when nothing but other collectives' starts and
  # dones is scheduled between its start and its done (GpuConvertAsyncCollectivesToSync), and
  # moves its start next to its done: an HO-Ring step with no compute beside it (the first steps
  # of a chain, the gathers outside the loops) would then run its intra and its inter transfer
  # one after the other. Kept async, both are in flight together on their two streams.
  "xla_disable_hlo_passes": "gpu-convert-async-collectives-to-sync",
}
GPU_OVERLAP_FLAGS = tuple(f"--{name}={str(v).lower()}" for name, v in GPU_FLAGS.items())


def add_xla_flags(flags=GPU_OVERLAP_FLAGS) -> list[str]:
  """Append flags to XLA_FLAGS (before jax starts), leaving any the user set alone."""
  current = os.environ.get("XLA_FLAGS", "")
  added = [f for f in flags if f.split("=")[0] not in current]
  if added:
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
  return added


def provide_cpu_devices(count: int) -> None:
  """Ask XLA for `count` virtual CPU devices; must run before jax is imported.

  The flag only shapes the host (CPU) platform, so it is harmless where a GPU is the backend.
  A count the user already set in XLA_FLAGS is left alone. Where JAX's CUDA plugin is installed
  without an NVIDIA driver, jax is kept on the CPU quietly instead of logging the plugin's failed
  start (`cpu_without_gpu_driver`; the reason goes to the `paro_jax` logger).
  """
  add_xla_flags([f"{DEVICE_COUNT_FLAG}={count}"])
  if note := cpu_without_gpu_driver():
    logging.getLogger("paro_jax").info(note)


def cpu_without_gpu_driver() -> str | None:
  """Keep jax on the CPU where JAX's CUDA plugin is installed but no NVIDIA driver is.

  Without this, jax tries the plugin at start-up, logs a traceback ("Unable to load CUDA") and
  then runs on the CPU anyway. Returns the line to tell the user, or None when nothing changed
  (a platform chosen in JAX_PLATFORMS, no plugin, or a driver present).
  """
  if "JAX_PLATFORMS" in os.environ:
    return None
  try:
    plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    plugin = False
  if not plugin or any(
    os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl")
  ):
    return None
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" not in sys.modules:  # later, the plugin's libraries are loaded already
    sys.meta_path.insert(0, _WithoutCudaPlugin())
  return (
    "no NVIDIA driver on this machine: running on the CPU without probing JAX's CUDA plugin "
    "(set JAX_PLATFORMS to choose)"
  )


class _WithoutCudaPlugin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Hide JAX's CUDA plugin from this process: jax imports its libraries at start-up even with
  JAX_PLATFORMS=cpu, and each load logs "cudart_stub.cc ... Could not find cuda drivers" from
  C++. The runtime packages are absent to jax; the plugin's entry point is an empty module."""

  HIDDEN = ("jax_cuda12_plugin", "jax_cuda13_plugin")
  EMPTY = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")

  def find_spec(self, name, path=None, target=None):
    if name in self.EMPTY:
      return importlib.machinery.ModuleSpec(name, self)
    if any(name == h or name.startswith(h + ".") for h in self.HIDDEN):
      raise ModuleNotFoundError(f"{name} is hidden: no NVIDIA driver", name=name)
    return None

  def create_module(self, spec):
    return None

  def exec_module(self, module) -> None:
    module.initialize = lambda: None  # registers no platform
