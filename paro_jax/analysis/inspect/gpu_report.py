"""What a compile for a GPU target adds to the inspector's report: async collectives, their streams
and overlap (hlo/overlap.py), memory against the plan and the device, the HBM bytes of the kernels
other than matmuls by purpose (gpu/traffic.py) and XLA's estimate of the step's time
(gpu/estimate.py)."""

from __future__ import annotations

import jax.numpy as jnp

from paro_jax.analysis.gpu import estimate, instruction_costs, link, targets, traffic
from paro_jax.analysis.hlo import overlap
from paro_jax.analysis.inspect.inspector import report
from paro_jax.analysis.planner.inputs import Workload
from paro_jax.analysis.planner.memory import step_memory
from paro_jax.core.engine import Engine
from paro_jax.core.names import LEVEL_GLOBAL, LEVEL_INTER
from paro_jax.core.units import human_bytes


def gpu_report(
  engine: Engine,
  compiled,
  target: str,
  batch_size: int,
  seq_len: int,
  dump: str,
  log: str | None = None,
  inter_bits_per_s: float | None = None,
) -> dict:
  """report() plus what the GPU compile shows: async collectives, streams, overlap, memory,
  and, given the compile's stderr (`log`), XLA's estimate of the step's time."""
  r = report(engine, compiled)
  text = compiled.as_text()
  r["target"] = target
  r["traffic"] = traffic.breakdown(traffic.kernels(text))
  r["overlap"] = overlap.overlap(
    text, engine.inter * engine.intra, engine.intra, overlap.thunk_streams(dump)
  )
  workload = Workload(
    engine.model.cfg,
    micro_batch=batch_size // (engine.inter * engine.intra),
    micro_batches=engine.micro_batches,
    seq_len=seq_len,
    params=engine.model.param_count(),
    trainable=engine.model.trainable_count(),
    itemsize=jnp.dtype(engine.compute_dtype).itemsize,
    grad_itemsize=jnp.dtype(engine.grad_dtype).itemsize,
    remat=engine.model.remat != "none",
    fused_attention=engine.model.attention == "cudnn",
    wire=engine.wire,
    error_feedback=engine.error_feedback,
    param_delta=engine.param_delta,
  )
  # The plan's figure for this step (analysis/planner/memory.py): what `paro-jax plan` prints.
  planned = step_memory(engine.strategy, workload, engine.inter, engine.intra)["total"]
  device = targets.target_gpu(target).memory_bytes
  compiled_bytes = r["memory"]["compiled"]["peak_bytes"]
  r["memory"].update(
    compiled_bytes=compiled_bytes,
    planned_bytes=planned,
    device_bytes=device,
    fits=compiled_bytes <= device,
  )
  if log is not None:
    dumped, costs = instruction_costs.schedule_file(dump), None
    if dumped:
      with open(dumped) as f:
        costs = instruction_costs.read(f.read())
    r["estimate"] = step_estimate(
      engine, text, log, target, batch_size, seq_len, inter_bits_per_s, costs
    )
    if inter_bits_per_s and r["estimate"].get("step_s"):
      by = {LEVEL_INTER: 0.0, LEVEL_GLOBAL: 0.0}
      for c in r["overlap"]["collectives"]:
        if c["level"] in by:
          by[c["level"]] += c["bytes_per_device"]
      floor = estimate.link_floor(
        by[LEVEL_INTER], by[LEVEL_GLOBAL], engine.inter, engine.intra, inter_bits_per_s
      )
      r["estimate"].update(floor)
      split = link.link_by_computation(text, engine.inter, engine.intra, inter_bits_per_s)
    else:
      split = None
    # The step with the link shared among the collectives in flight: what plan --compile-top and
    # train --strategy auto rank by (the scheduled step where the link does not bind).
    r["estimate"] = link.link_shared(r["estimate"], r["estimate"].get("inter_link_s"), split)
  return r


def step_estimate(
  engine, text, log, target, batch_size, seq_len, inter_bits_per_s, costs=None
) -> dict:
  tokens = engine.micro_batches * batch_size * seq_len
  return estimate.estimate(
    text,
    log,
    compute_capability=targets.compute_capability(target),
    peak_flops=targets.target_gpu(target).peak_flops,
    memory_bandwidth=targets.memory_bandwidth(target),
    devices=engine.inter * engine.intra,
    tokens_per_step=tokens,
    flops_per_step=engine.model.cfg.flops_per_token(seq_len) * tokens,
    inter_bits_per_s=inter_bits_per_s,
    gpus_per_node=engine.intra,
    instruction_costs=costs,
  )


def format_gpu_report(r: dict) -> str:
  o, mem = r["overlap"], r["memory"]
  rows = {}
  for c in o["collectives"]:
    key = (c["kind"], c["phase"], c["level"], c["stream"], c["compute_in_window"] > 0)
    row = rows.setdefault(key, [0, 0.0])
    row[0] += c["count_per_step"]
    row[1] += c["bytes_per_device"]
  lines = [
    f"GPU program for {r['target']} ({r['mesh']['inter']} nodes x {r['mesh']['intra']} GPUs), "
    f"compiled without a GPU: nothing ran, nothing is timed",
    "",
    f"{'kind':20s}{'phase':18s}{'level':8s}{'runs on':26s}{'compute inside':>15s}"
    f"{'count/step':>11s}{'MB/device':>11s}",
  ]
  for (kind, phase, level, stream, hidden), (count, nbytes) in rows.items():
    lines.append(
      f"{kind:20s}{phase:18s}{level:8s}{stream or '?':26s}{'yes' if hidden else 'no':>15s}"
      f"{count:11d}{nbytes / 1e6:11.1f}"
    )
  frac = o["collective_bytes_fraction"]
  lines += [
    "",
    "per-micro-batch collective bytes with compute in their window: "
    + ("n/a" if frac is None else f"{frac:.1%}"),
    f"async collectives {o['async_collectives']}, synchronous {o['sync_collectives']}; "
    f"streams: {', '.join(o['streams']) or 'none'}",
  ]
  if o["horing_steps"]:
    lines.append(
      f"HO-Ring steps with both levels in flight on different streams: "
      f"{o['horing_steps_concurrent']} of {o['horing_steps']}"
    )
  lines.append(
    f"memory per device: compiled {human_bytes(mem['compiled_bytes'])}, planned "
    f"{human_bytes(mem['planned_bytes'])}, device {human_bytes(mem['device_bytes'])} "
    f"({'fits' if mem['fits'] else 'does NOT fit'})"
  )
  if "traffic" in r:
    lines.append(traffic.format_breakdown(r["traffic"]))
  return "\n".join(lines)
