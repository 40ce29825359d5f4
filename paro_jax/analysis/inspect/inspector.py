"""The report of `paro-jax inspect`: a compiled step's communication and memory.

The step is compiled from abstract inputs (abstract.py): nothing is allocated, so models far
larger than this machine's memory compile (XLA's compile time is then the limit). Measured
traffic is read from the compiled HLO (paro_jax/analysis/hlo/collectives.py) and set beside the
analytic formulas of docs/design.md (paro_jax/analysis/planner/costs.py); a GPU compile's
additions are gpu_report.py's, the command command.py.
"""

from __future__ import annotations

import collections
import dataclasses

import jax.numpy as jnp

from models.config import vocab_passes
from paro_jax.analysis.hlo.collectives import (
  crosses_groups,
  device_bytes,
  level_of,
  parse_collectives,
  phase_of,
)
from paro_jax.analysis.planner.costs import model_state_bytes, step_traffic
from paro_jax.core.engine import Engine
from paro_jax.core.names import LEVEL_INTER, LEVEL_INTRA, MIXED_IMPLS


def expected_traffic(engine: Engine, bf16_as_f32: bool = False):
  """The formulas' bytes of one step; with `bf16_as_f32`, those XLA:CPU moves (bf16 collectives
  run in f32 there: a bf16 compute, accumulation or inter wire counts 4 bytes, int8 stays; a
  LoRA step's per-micro-batch gathers move their bits, at the compute dtype's size:
  Engine.gather_bits)."""
  psi, trained = engine.model.param_count(), engine.model.trainable_count()
  itemsize = jnp.dtype(engine.compute_dtype).itemsize
  gather_bytes = itemsize
  acc_bytes = jnp.dtype(engine.grad_dtype).itemsize
  wire = engine.wire
  if bf16_as_f32:
    itemsize, acc_bytes = 4, 4
    gather_bytes = gather_bytes if engine.gather_bits else 4
    wire = dataclasses.replace(
      wire, **{k: "same" for k in ("params", "grads") if getattr(wire, k) == "bf16"}
    )
  # Only the layer stack is gathered again in backward (models/llama.py: Llama.apply).
  regathered = engine.model.stack_param_count() if engine.model.remat != "none" else 0
  # The table and head as the model sends them: tiled, more than one pass (models/config.py).
  passes = vocab_passes(engine.model.cfg, engine.model.vocab_chunk)
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
    vocab_extra=passes.beyond_stored(trained=engine.model.lora is None),
    gather_bytes=gather_bytes,
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
