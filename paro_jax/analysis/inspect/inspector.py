"""`paro-jax inspect`: compile a training step from abstract shapes and report its communication.

Nothing is allocated: the state and batch are `ShapeDtypeStruct`s with their shardings, so
models far larger than this machine's memory compile (XLA's compile time is then the limit).
Measured traffic is read from the compiled HLO (paro_jax/analysis/hlo/collectives.py) and set beside
the analytic formulas of docs/design.md (paro_jax/analysis/planner/costs.py).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import shutil
import tempfile

import jax.numpy as jnp

from models.config import get_config
from paro_jax.analysis.gpu import estimate, instruction_costs, targets
from paro_jax.analysis.gpu.estimate import captured_stderr, format_estimate
from paro_jax.analysis.hlo import overlap
from paro_jax.analysis.hlo.collectives import (
  crosses_groups,
  device_bytes,
  level_of,
  packed_attention,
  parse_collectives,
  phase_of,
)
from paro_jax.analysis.inspect.abstract import compile_for_target, compile_step
from paro_jax.analysis.inspect.config import InspectConfig
from paro_jax.analysis.planner.costs import model_state_bytes, step_traffic
from paro_jax.analysis.planner.inputs import Workload
from paro_jax.analysis.planner.memory import step_memory
from paro_jax.core.engine import Engine
from paro_jax.core.factory import build_engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.names import LEVEL_GLOBAL, LEVEL_INTER, LEVEL_INTRA, MIXED_IMPLS
from paro_jax.core.units import human_bytes, parse_rate
from paro_jax.core.xla_flags import GPU_FLAGS


def expected_traffic(engine: Engine, bf16_as_f32: bool = False):
  """The formulas' bytes of one step; with `bf16_as_f32`, those XLA:CPU moves (bf16 collectives
  run in f32 there: a bf16 compute, accumulation or inter wire counts 4 bytes, int8 stays)."""
  psi, trained = engine.model.param_count(), engine.model.trainable_count()
  itemsize = jnp.dtype(engine.compute_dtype).itemsize
  acc_bytes = jnp.dtype(engine.grad_dtype).itemsize
  wire = engine.wire
  if bf16_as_f32:
    itemsize, acc_bytes = 4, 4
    wire = dataclasses.replace(
      wire, **{k: "same" for k in ("params", "grads") if getattr(wire, k) == "bf16"}
    )
  # Only the layer stack is gathered again in backward (models/llama.py: Llama.apply).
  regathered = engine.model.stack_param_count() if engine.model.remat != "none" else 0
  return step_traffic(
    engine.strategy,
    psi,
    trained,
    engine.inter,
    engine.intra,
    engine.micro_batches,
    itemsize,
    itemsize,
    regathered=regathered,
    wire=wire,
    acc_bytes=acc_bytes,
    # The two-level rings, alone or as the mixed impls' two-axis choice, split their bytes by level.
    two_level=MIXED_IMPLS.get(engine.collectives, engine.collectives) in ("hring", "horing"),
  )


def report(engine: Engine, compiled) -> dict:
  """The communication schedule and memory of one compiled step, as a JSON-able dict."""
  n, intra = engine.inter * engine.intra, engine.intra
  collectives = parse_collectives(compiled.as_text())
  per_device = collections.defaultdict(lambda: {LEVEL_INTER: 0.0, LEVEL_INTRA: 0.0})
  rows = collections.OrderedDict()
  for c in collectives:
    sent = device_bytes(c, n)
    for device, nbytes in sent.items():
      level = LEVEL_INTER if crosses_groups(c, device, intra) else LEVEL_INTRA
      per_device[device][level] += c.count * nbytes
    key = (c.kind, phase_of(c.op_name), level_of(c, intra), c.dtypes)
    row = rows.setdefault(
      key,
      {
        "kind": c.kind,
        "phase": key[1],
        "level": key[2],
        "dtype": ",".join(sorted(set(c.dtypes))),
        "ops": 0,
        "count_per_step": 0,
        "bytes_per_device": 0.0,
      },
    )
    row["ops"] += 1
    row["count_per_step"] += c.count
    row["bytes_per_device"] += c.count * max(sent.values(), default=0.0)
  measured = {
    "inter_bytes": max((d[LEVEL_INTER] for d in per_device.values()), default=0.0),
    "intra_bytes": max((d[LEVEL_INTRA] for d in per_device.values()), default=0.0),
  }
  exp = expected_traffic(engine)
  expected = {"inter_bytes": exp.inter, "intra_bytes": exp.intra, "phases": exp.phases}
  psi, trained = engine.model.param_count(), engine.model.trainable_count()
  itemsize = jnp.dtype(engine.compute_dtype).itemsize
  mem = compiled.memory_analysis()
  notes = []
  wire = {dt for c in collectives for dt in c.dtypes}
  bf16_wire = "bf16" in (engine.wire.params, engine.wire.grads)
  as_f32 = bool(
    (engine.compute_dtype == jnp.bfloat16 or bf16_wire) and "f32" in wire and "bf16" not in wire
  )
  if as_f32:
    notes.append(
      "XLA:CPU runs bf16 collectives in f32: the expected bytes above are the formula in f32, "
      "what this compile moves (int8 stays int8); GPUs move the bf16 formula's (JSON: "
      "`expected`), half of the bf16 traffic (--target compiles for one)"
    )
  here = expected_traffic(engine, bf16_as_f32=True) if as_f32 else exp
  return {
    "strategy": engine.strategy.name,
    "mesh": {"inter": engine.inter, "intra": engine.intra},
    "micro_batches": engine.micro_batches,
    "collectives_impl": engine.collectives,
    "step_program": engine.program.value,  # the platform's choice (core/step.py)
    "wire": {
      "inter_params": engine.wire.params,
      "inter_grads": engine.wire.grads,
      "int8_block": engine.wire.block,
    },
    "grad_dtype": jnp.dtype(engine.grad_dtype).name,
    "params": psi,
    "trainable_params": trained,
    "dtype": jnp.dtype(engine.compute_dtype).name,
    "remat": engine.model.remat,
    "attention": engine.model.attention,
    "measured": measured,
    "expected": expected,
    "expected_here": {"inter_bytes": here.inter, "intra_bytes": here.intra},
    "difference": {k: measured[k] - expected[k] for k in ("inter_bytes", "intra_bytes")},
    "collectives": list(rows.values()),
    "memory": {
      "model_states": model_state_bytes(
        engine.strategy,
        psi,
        trained,
        engine.inter,
        engine.intra,
        itemsize,
        jnp.dtype(engine.grad_dtype).itemsize,
        residual_bytes=4 * engine.residual_size,
        reference_bytes=engine.reference_bytes,
      ),
      "compiled": {
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "peak_bytes": (
          mem.argument_size_in_bytes
          + mem.output_size_in_bytes
          - mem.alias_size_in_bytes
          + mem.temp_size_in_bytes
        ),
      },
    },
    "notes": notes,
  }


def format_report(r: dict) -> str:
  mib = 2**20
  lines = [
    f"strategy {r['strategy']} on mesh {r['mesh']['inter']}x{r['mesh']['intra']}, "
    f"A={r['micro_batches']}, {r['params'] / 1e6:.2f}M params"
    + (
      f" ({r['trainable_params'] / 1e6:.3f}M trained)"
      if r["trainable_params"] != r["params"]
      else ""
    )
    + f", {r['dtype']}, "
    f"remat={r['remat']}, attention={r['attention']}, "
    f"collectives={r['collectives_impl']}, inter wire params={r['wire']['inter_params']} "
    f"grads={r['wire']['inter_grads']}"
    + (f" (int8 block {r['wire']['int8_block']})" if "int8" in r["wire"].values() else "")
    + f", grads in {r['grad_dtype']}, step program {r['step_program']}",
    "",
    f"{'kind':20s}{'phase':20s}{'level':8s}{'dtype':7s}{'ops':>5s}{'count/step':>12s}"
    f"{'MiB/device/step':>17s}",
  ]
  for c in r["collectives"]:
    lines.append(
      f"{c['kind']:20s}{c['phase']:20s}{c['level']:8s}{c['dtype']:7s}{c['ops']:5d}"
      f"{c['count_per_step']:12d}{c['bytes_per_device'] / mib:17.3f}"
    )
  lines += [
    "",
    f"{'per device and step':24s}{'measured MiB':>14s}{'expected MiB':>14s}{'difference':>12s}",
  ]
  for k in ("inter_bytes", "intra_bytes"):
    m, e = r["measured"][k], r["expected_here"][k]
    rel = f"{(m - e) / e * 100:+.2f}%" if e else ("0" if not m else "n/a")
    lines.append(f"{k:24s}{m / mib:14.3f}{e / mib:14.3f}{rel:>12s}")
  ms, comp = r["memory"]["model_states"], r["memory"]["compiled"]
  lines += [
    "",
    f"model states per device: {ms['total'] / mib:.2f} MiB (params {ms['params'] / mib:.2f}"
    f", grads {ms['grads'] / mib:.2f}, optimizer {ms['opt'] / mib:.2f})",
    f"compiled per device: peak {comp['peak_bytes'] / mib:.2f} MiB (arguments "
    f"{comp['argument_bytes'] / mib:.2f}, temporaries {comp['temp_bytes'] / mib:.2f})",
  ]
  lines += [f"note: {note}" for note in r["notes"]]
  return "\n".join(lines)


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
  return "\n".join(lines)


def inspect(cfg: InspectConfig) -> dict:
  """Build the engine for a configuration, compile its step and print the report.

  With `cfg.target` (a GPU name), the step is compiled for a cluster of those GPUs (`cfg.mesh`
  nodes x GPUs per node) without one, and the report adds the GPU schedule and memory against the
  plan and XLA's estimate of the step's time (its network model set from `cfg.inter_bandwidth`, a
  rate per node, by cli.py before jax started: estimate.prepare_environment).
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
