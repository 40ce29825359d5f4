"""`train --strategy auto`: the planner's pick for the run's own mesh, checked on H100 and H200
GPUs by XLA's estimate of the compiled step.

The mesh is probed briefly (probe.py: each collective at two sizes, a matmul) and the 14
strategies are ranked by the analytic model (planner.py) for the run's model, batch, A, dtype and
wire, with what the probe measured. On GPUs whose XLA has a time-based cost model (H100, H200:
the targets of `inspect --target`), the analytic candidates (rerank.candidates: the top
`--compile-top` K, any within 10% of the first, any faster one just over the memory budget) are
then compiled for this cluster, each with the run's own step flags and, for XLA's network model,
each node's inter-node rate as the probe measured it; the pick is the fastest by XLA's estimate
with that link shared among the collectives in flight (link.link_shared: never below the
link's floor) whose compiled memory fits (docs/planner.md). On CPUs, on GPUs without such a
model (A100), with `--compile-top 0`, or where no compiled candidate fits, the analytic pick
stands and the run says why.

With `--outer-sync H` the candidates are the strategies of N and I letters as each group's step
in the outer loop (planner.py), and the analytic pick stands (XLA's estimate of the compiled
step would count the round's end, which runs once every H steps, in every step).

Every process probes and plans alike (the probe's numbers are process 0's) and compiles the same
candidates; process 0's pick is broadcast, so all processes run one strategy.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from models.hf_config import CONFIG
from paro_jax.analysis.planner import planner, rerank
from paro_jax.analysis.planner.memory import available_memory
from paro_jax.core.config import StepConfig
from paro_jax.core.flags import step_flags
from paro_jax.analysis.planner.probe import QUICK_SIZES, probe
from paro_jax.core.mesh import mesh_shape
from paro_jax.core.names import ALL_GATHER, LEVEL_INTER
from paro_jax.core.strategy import VALID_NAMES
from paro_jax.core.units import COMPUTE_DTYPE_BYTES

# A GPU's device_kind (e.g. "NVIDIA H100 80GB HBM3") -> the `inspect --target` that describes it.
TARGET_OF_KIND = (("H100", "h100"), ("H200", "h200"), ("A100", "a100-80gb"))


def gpu_target(device_kind: str) -> tuple[str | None, str]:
  """(target, "") for a GPU whose step XLA's estimate can time, else (None, why not)."""
  key = next((t for part, t in TARGET_OF_KIND if part in device_kind.upper()), None)
  if key is None:
    return None, f"no --target describes a {device_kind}"
  try:
    return rerank.rankable_target(key), ""
  except ValueError as e:  # the plugin missing, or no time-based estimator (A100)
    return None, str(e)


def inter_node_bits_per_s(profile: dict, intra: int) -> float | None:
  """Each node's inter-node rate from a probe: its all-gather over `inter` was timed with every
  device of the node sending, at the fitted ring bytes per device per second."""
  fit = profile.get("collectives", {}).get(ALL_GATHER, {}).get(LEVEL_INTER)
  return fit["bandwidth"] * intra * 8 if fit and fit.get("bandwidth", 0) > 0 else None


def run_step_flags(cfg: StepConfig, mesh: tuple[int, int], collectives: str, attention: str):
  """The run's step as `inspect` flags (no --strategy): its model (an --init-from directory's
  config.json), mesh and the implementations the run resolved."""
  model = cfg.model
  init_from = getattr(cfg, "init_from", None)
  if init_from:
    model = init_from if init_from.endswith(".json") else os.path.join(init_from, CONFIG)
  return step_flags(
    cfg, strategy=None, model=model, mesh=mesh, collectives=collectives, attention=attention
  )


def check_by_xla(
  plan, flags: list[str], device_kind: str, inter_bits_per_s: float | None, compile_top: int
) -> tuple[str, str, str | None]:
  """(pick, why, the two rankings' table or None): the analytic plan checked by XLA's estimate
  where this GPU has one."""
  if compile_top < 1:
    return plan.pick, "--compile-top 0: the analytic pick, not checked by XLA's estimate", None
  target, reason = gpu_target(device_kind)
  if target is None:
    return plan.pick, f"the analytic pick, not checked by XLA's estimate ({reason})", None
  r = rerank.rerank(plan, compile_top, target, step_flags=flags, inter_bits_per_s=inter_bits_per_s)
  table = rerank.format_rerank(plan, r)
  if r["pick"] is None:
    return plan.pick, "the analytic pick: no compiled candidate fits by XLA's memory", table
  best = next(c for c in r["compiled"] if c["strategy"] == r["pick"])
  rate = (
    "XLA's default network"
    if inter_bits_per_s is None
    else (f"{inter_bits_per_s / 1e9:.3g} Gbit/s per node (probed)")
  )
  why = (
    f"fastest by XLA's estimate of the compiled step for {target} at {rate}: "
    f"{best['estimate']['step_s']:.4g} s/step of {len(r['compiled'])} compiled "
    f"(analytic pick {plan.pick})"
  )
  return r["pick"], why, table


def auto_strategy(
  mesh: Mesh,
  cfg: StepConfig,
  model_cfg,
  params: int,
  trainable: int,
  collectives: str,
  attention: str,
  compile_top: int,
) -> tuple[str, str, str | None]:
  """`train --strategy auto`: (pick, why, the rankings' table when XLA's estimate ranked)."""
  inter, intra = mesh_shape(mesh)
  profile = probe(mesh, QUICK_SIZES, repeats=3)
  device = jax.local_devices()[0]
  # What the allocator may use (on GPUs XLA_PYTHON_CLIENT_MEM_FRACTION of the card); a CPU's
  # host memory is not planned for.
  gpu = device.platform != "cpu"
  usable = available_memory(jax.local_devices())[0] if gpu else None
  itemsize = COMPUTE_DTYPE_BYTES[cfg.dtype]
  plan = planner.plan_for_profile(
    model_cfg,
    inter,
    intra,
    max(1, cfg.batch_size // (inter * intra)),
    cfg.micro_batches,
    cfg.seq_len,
    itemsize,
    profile,
    params=params,
    trainable=trainable,
    device_memory=usable,
    collectives=collectives,
    remat=cfg.remat != "none",
    fused_attention=attention == "cudnn",
    wire=cfg.wire.formats(),
    grad_itemsize=cfg.wire.grad_itemsize(itemsize),
    outer_sync=cfg.outer.sync,
    outer_fragments=cfg.outer.fragments,
    outer_delay=cfg.outer.delay,
    outer_state=cfg.outer.state,
  )
  if plan.pick is None:
    raise ValueError(f"--strategy auto: {plan.explain}")
  if not gpu:
    return plan.pick, plan.explain, None
  if cfg.outer.sync:  # a compiled step holds the round's end, which runs once every H steps
    why = "the analytic pick: XLA's estimate of the step would count the outer sync every step"
    return plan.pick, f"{why}; {plan.explain}", None
  flags = run_step_flags(cfg, (inter, intra), collectives, attention)
  rate = inter_node_bits_per_s(profile, intra)
  pick, why, table = check_by_xla(plan, flags, device.device_kind, rate, compile_top)
  if jax.process_count() > 1:  # one strategy for all: process 0's
    index = multihost_utils.broadcast_one_to_all(np.int32(VALID_NAMES.index(pick)))
    pick = VALID_NAMES[int(index)]
  return pick, f"{why}; {plan.explain}", table
