"""The import's and the export's seconds against safetensors' own read and write of the same
bytes (the goal: near 1x, docs/memory.md), in this process: `time_import`, `time_export`.
experiments/model_io.py runs them in child processes with the code of before and of after
(`import-page`), on the CPU's virtual devices; experiments/gpu_io.py on one GPU (gpu_measure.py's
suite), where the check, the conversion and the gather run on the device rather than on the
host's cores.

jax is imported inside each function, after the platform's options are set: the caller may put
another tree's paro_jax first on sys.path (model_io.py's `--code`).
"""

from __future__ import annotations

import functools
import os
import time

READ, ONE, EIGHT = (
  "safetensors get_tensor, every tensor",
  "import_hf bf16, 1x1",
  "import_hf bf16, G on 1x8",
)
WRITE, EXPORT = "safetensors save_file, every file", "stream_hf bf16, 1x1"
PLATFORMS = ("cpu", "gpu")


def _platform(platform: str, devices: int) -> None:
  """jax's options for `platform`, before jax starts: on the CPU, `devices` virtual devices; on
  the GPU, none of the CPU's (the GPUs present)."""
  if platform == "cpu":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
  else:
    os.environ.pop("XLA_FLAGS", None)
    os.environ["JAX_PLATFORMS"] = "cuda"


def importer(directory: str):
  """(the directory's LlamaConfig, `load(mesh, placement)`: import_hf of the whole model in bf16
  at that placement, blocked on); jax already configured by the caller."""
  import jax
  import jax.numpy as jnp

  from models.hf_config import read_config
  from models.llama import Llama
  from paro_jax.core.sharding import named, shard_dims, tree_specs
  from paro_jax.hf.stream import import_hf
  from paro_jax.hf.weights import expected_shapes

  cfg = read_config(directory)
  shapes = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
    expected_shapes(cfg),
    is_leaf=lambda x: isinstance(x, tuple),
  )
  dims = shard_dims(Llama(cfg).logical_axes())

  def load(mesh, placement):
    target = named(mesh, tree_specs(shapes, dims, placement, mesh))
    return jax.block_until_ready(import_hf(directory, cfg, target, jnp.bfloat16))

  return cfg, load


def time_import(directory: str, repeats: int, platform: str = "cpu") -> dict:
  """safetensors' read of every tensor, then import_hf in bf16 at 1x1 (one device) and, on the
  CPU, at G on 1x8 (8 virtual devices); each once untimed first (the files in the page cache, the
  programs compiled), then timed `repeats` times in turn, the least of each kept (a shared
  machine's other work only ever adds to a time)."""
  _platform(platform, 8)
  import jax
  from safetensors import safe_open

  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.strategy import Placement
  from paro_jax.hf.weights import weight_files

  _, load = importer(directory)

  def read_all():
    for path in weight_files(directory):
      with safe_open(path, framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
          f.get_tensor(name)

  one = make_mesh(1, 1, devices=jax.devices()[:1])
  cases = {READ: read_all, ONE: lambda: load(one, Placement.N)}
  if platform == "cpu":
    eight = make_mesh(1, 8)
    cases[EIGHT] = lambda: load(eight, Placement.G)
  for run in cases.values():
    run()
  seconds: dict = {what: [] for what in cases}
  for _ in range(repeats):
    for what, run in cases.items():
      start = time.perf_counter()
      run()
      seconds[what].append(round(time.perf_counter() - start, 2))
  return {what: min(times) for what, times in seconds.items()}


def time_export(directory: str, out: str, repeats: int, platform: str = "cpu") -> dict:
  """On one device: safetensors' write of every file of `directory` (its tensors
  read first, untimed), then stream_hf of the model imported on 1x1 in bf16, to `out` in bf16;
  each once untimed, then `repeats` times in turn, the least kept. Each timed from a clean start
  (`sync` first) to its bytes on the disk (`sync` last), of tensors made afresh: on this VM the
  kernel wrote a buffer it had written before several times faster than a fresh one."""
  _platform(platform, 1)
  import shutil

  import jax

  from safetensors.numpy import load_file, save_file

  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.strategy import Placement
  from paro_jax.hf.stream_out import stream_hf
  from paro_jax.hf.weights import weight_files

  cfg, load = importer(directory)
  params = load(make_mesh(1, 1, devices=jax.devices()[:1]), Placement.N)

  def synced(write) -> float:
    os.sync()
    start = time.perf_counter()
    write()
    os.sync()
    return time.perf_counter() - start

  def write_all() -> float:
    seconds = 0.0
    for path in weight_files(directory):
      tensors = load_file(path)
      out_path = os.path.join(out, os.path.basename(path))
      seconds += synced(functools.partial(save_file, tensors, out_path, metadata={"format": "pt"}))
    return seconds

  cases = {
    WRITE: write_all,
    EXPORT: lambda: synced(functools.partial(stream_hf, cfg, params, out, dtype="bf16")),
  }
  seconds: dict = {what: [] for what in cases}
  for n in range(repeats + 1):
    for what, run in cases.items():
      shutil.rmtree(out, ignore_errors=True)
      os.makedirs(out)
      took = run()
      if n:  # the first untimed
        seconds[what].append(round(took, 2))
  shutil.rmtree(out, ignore_errors=True)
  return {what: min(times) for what, times in seconds.items()}
