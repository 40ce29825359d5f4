"""What XLA's scheduler charges each instruction, and the matmuls it prices out of line.

With `xla_dump_latency_hiding_schedule` on, the compile dumps, beside the HLO, the schedule of
every computation that XLA's latency-hiding scheduler ordered (`*.schedule.txt`, an HloModule
text proto followed by one `computation_schedules` per computation): each instruction's start
and end in the scheduler's simulated time (microseconds for the SoL estimator). Its end less
its start is what XLA charged it.

Measured on an H100 (experiments/results/gpu_measure/), XLA's cost of a layer's matmuls is near
their roofline, while it charges the language-model head's matmul (a bf16 [tokens, dim] x
[dim, vocab] product with a float32 result, and its two transposes in the backward) many times
its roofline: for 7b, 44 ms for a product whose roofline is 0.7 ms and that ran in well under
3 ms on the GPU. `overpriced` finds such matmuls in any program: a matmul whose XLA cost over
its roofline exceeds OUTLIER times the median of that ratio over the program's matmuls (weighted
by their roofline time per step), and what it would cost at that median.
"""

from __future__ import annotations

import glob
import os
import re

from paro_jax.analysis.gpu import roofline
from paro_jax.analysis.hlo.collectives import computation_counts

# A matmul is out of line when XLA charges it more than this many times the program's median
# cost-over-roofline of matmuls: the layer matmuls sit within 1.5x of that median, the head's
# forward product of 7b at 65x it.
OUTLIER = 4.0
_COMP_RE = re.compile(r'^  computations \{\n    name: "([^"]+)"', re.M)
_INSTR_RE = re.compile(
  r'^    instructions \{\n      name: "([^"]+)"\n(?:.*\n)*?      id: (\d+)\n', re.M
)
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_SCHED_RE = re.compile(
  r"id: (\d+)\n\s+start_timestamp_cycles: ([-\d.e+]+)\n\s+end_timestamp_cycles: ([-\d.e+]+)"
)


def schedule_file(dump_dir: str) -> str | None:
  """The train step's schedule dump in dump_dir (the largest one), or None."""
  files = glob.glob(os.path.join(dump_dir, "*.schedule.txt"))
  return max(files, key=os.path.getsize) if files else None


def read(text: str) -> dict[str, dict[str, float]]:
  """computation -> instruction -> seconds XLA charged it, from a schedule dump's text."""
  module, _, schedules = text.partition("\ncomputation_schedules {")
  starts = [(m.start(), m.group(1)) for m in _COMP_RE.finditer(module)]
  where = {}
  k = 0
  for m in _INSTR_RE.finditer(module):
    while k + 1 < len(starts) and starts[k + 1][0] < m.start():
      k += 1
    if starts:
      where[m.group(2)] = (starts[k][1], m.group(1))
  costs: dict[str, dict[str, float]] = {}
  for iid, start, end in _SCHED_RE.findall(schedules):
    if iid in where:
      comp, name = where[iid]
      costs.setdefault(comp, {})[name] = (float(end) - float(start)) * 1e-6
  return costs


def overpriced(
  costs: dict[str, dict[str, float]], hlo_text: str, peak_flops: float, memory_bandwidth: float
) -> dict:
  """The matmuls XLA charges out of line with the program's others, per step.

  Returns `median_over_roofline` (XLA's cost over roofline: the median over the matmuls it
  costed, weighted by roofline time per step), `matmuls` (each out-of-line one: where it is, its
  op name, XLA's and the roofline's seconds, its executions per step and the overcharge per
  step: XLA's cost less the median ratio times its roofline) and `overcharge_s`, their sum.
  """
  comps, _ = roofline.parse_computations(hlo_text)
  counts = computation_counts(hlo_text)
  rows = []
  for comp, charged in costs.items():
    instrs = comps.get(comp, [])
    types = {i.name: i.type_text for i in instrs}
    for i in instrs:
      if i.name not in charged or roofline.is_attention(i):
        continue
      if roofline.instruction_flops(i, comps, types) <= 0:
        continue
      roof = roofline.instruction_seconds(i, comps, types, peak_flops, memory_bandwidth)
      op_name = _OP_NAME_RE.search(i.attrs)
      rows.append((comp, i.name, op_name.group(1) if op_name else "", charged[i.name], roof))
  rows = [r for r in rows if r[4] > 0]
  if not rows:
    return {"median_over_roofline": None, "matmuls": [], "overcharge_s": 0.0}
  # the median weighted by roofline time per step (a layer body's matmul counts once per layer)
  weight = {(r[0], r[1]): counts.get(r[0], 1) * r[4] for r in rows}
  half, acc, median = sum(weight.values()) / 2, 0.0, None
  for r in sorted(rows, key=lambda r: r[3] / r[4]):
    acc += weight[(r[0], r[1])]
    if acc >= half:
      median = r[3] / r[4]
      break
  out = []
  for comp, name, op_name, xla_s, roof in rows:
    if xla_s > OUTLIER * median * roof:
      n = counts.get(comp, 1)
      over = n * (xla_s - median * roof)
      out.append(
        {
          "computation": comp,
          "instruction": name,
          "op_name": op_name,
          "xla_s": xla_s,
          "roofline_s": roof,
          "executions": n,
          "overcharge_s": over,
        }
      )
  out.sort(key=lambda r: -r["overcharge_s"])
  return {
    "median_over_roofline": median,
    "matmuls": out,
    "overcharge_s": sum(r["overcharge_s"] for r in out),
  }
