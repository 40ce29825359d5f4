"""`paro-jax inspect`'s work: build the engine of a configuration, compile its step from
abstract inputs (on this machine's devices, or for a GPU target without one), print the report."""

from __future__ import annotations

import glob
import json
import shutil
import tempfile

from models.presets import get_config
from paro_jax.analysis.gpu.estimate import captured_stderr, format_estimate
from paro_jax.analysis.hlo.collectives import packed_attention
from paro_jax.analysis.inspect.abstract import compile_for_target, compile_step
from paro_jax.analysis.inspect.gpu_report import format_gpu_report, gpu_report
from paro_jax.analysis.inspect.inspector import format_report, report
from paro_jax.core.factory import build_engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.xla_flags import GPU_FLAGS
from paro_jax.analysis.gpu import targets
from paro_jax.analysis.inspect.config import InspectConfig
from paro_jax.core.units import parse_rate


def inspect(cfg: InspectConfig) -> dict:
  """Build the engine for a configuration, compile its step and print the report.

  With `cfg.target` (a GPU name), the step is compiled for a cluster of those GPUs (`cfg.mesh`
  nodes x GPUs per node) without one, and the report adds the GPU schedule and memory against the
  plan and XLA's estimate of the step's time (its network model set from `cfg.inter_bandwidth`, a
  rate per node, by analysis/inspect/command.py before jax started: estimate.prepare_environment).
  """
  target, mesh = cfg.target, cfg.mesh
  if target is not None:
    if mesh is None:
      raise ValueError("--target needs --mesh NODESxGPUS, e.g. --mesh 2x8")
    grid = make_mesh(*mesh, devices=targets.devices(target, *mesh))  # compile-only GPUs
  else:
    grid = make_mesh(*mesh) if mesh else make_mesh()
  engine = build_engine(cfg, get_config(cfg.model), grid, prefetch=cfg.prefetch)
  with tempfile.TemporaryDirectory(prefix="paro-jax-dump-") as dump:
    try:
      if target is None:
        compiled = compile_step(engine, cfg.batch_size, cfg.seq_len, cfg.pack)
      else:
        with captured_stderr() as log:
          compiled = compile_for_target(
            engine, target, cfg.batch_size, cfg.seq_len, GPU_FLAGS, dump, packed=cfg.pack
          )
    except Exception as e:  # XLA's own limits (e.g. out of host memory while compiling)
      raise RuntimeError(
        f"XLA could not compile the {cfg.model} step for {cfg.strategy} "
        f"{'for ' + target if target else 'on this machine'}: {type(e).__name__}: {str(e)[:500]}"
      ) from e
    if target is None:
      r = report(engine, compiled)
    else:
      rate = parse_rate(cfg.inter_bandwidth) if cfg.inter_bandwidth else None
      r = gpu_report(engine, compiled, target, cfg.batch_size, cfg.seq_len, dump, log[0], rate)
    if cfg.pack:
      r["packed_attention"] = packed_attention(compiled.as_text())
    if cfg.hlo_out:
      _write_hlo(compiled.as_text(), dump, cfg.hlo_out)
  if cfg.as_json:
    print(json.dumps(r, indent=2), flush=True)
  else:
    print(format_report(r), flush=True)
    if target is not None:
      print("\n" + format_gpu_report(r), flush=True)
      print("\n" + format_estimate(r["estimate"]), flush=True)
    if cfg.pack:
      print(f"\npacked rows (--pack): attention {r['packed_attention']}", flush=True)
  return r


def _write_hlo(text: str, dump: str, path: str) -> None:
  """The scheduled HLO at `path` and, for GPU compiles, the thunk sequence beside it."""
  with open(path, "w") as f:
    f.write(text)
  for seq in glob.glob(f"{dump}/*.thunk_sequence.txt"):
    shutil.copy(seq, f"{path}.thunk_sequence.txt")
