"""A roofline cost of compiled GPU HLO, for what XLA's own estimate does not cost.

XLA's latency-hiding scheduler costs only the computations it schedules: those that hold an
async collective (a layer body without communication, as in NNG, is never costed), and inside
them it charges cuDNN's fused attention kernels and plain copies nothing. For those, each kernel
is charged max(FLOPs / peak, bytes moved / memory bandwidth): the FLOPs of its matmuls (the dots
of a fusion, cuBLAS calls, cuDNN attention) and the bytes of its operands and results. No launch
gaps, no efficiency below peak: a lower bound, named as such wherever it is used.
"""

from __future__ import annotations

import dataclasses
import math
import re

from paro_jax.analysis.hlo.collectives import DTYPE_BYTES, walk

_ARRAY_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
# Bookkeeping ops: no kernel, no traffic of their own (a while's body is costed by itself).
FREE_OPS = {
  "parameter",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "constant",
  "while",
  "call",
  "conditional",
  "after-all",
  "partition-id",
  "replica-id",
  "optimization-barrier",
  "opt-barrier",
}
ATTENTION_TARGET = "__cudnn$fmha"


@dataclasses.dataclass
class Instr:
  name: str
  type_text: str
  op: str
  operands: list[str]
  attrs: str
  args: str = ""  # the text between the parentheses (a parameter's number)


def _split_operands(rest: str) -> tuple[str, str]:
  """'a, b), attrs' -> ('a, b', 'attrs'): the operand list ends at its closing parenthesis."""
  depth = 0
  for i, ch in enumerate(rest):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      if depth == 0:
        return rest[:i], rest[i + 1 :]
      depth -= 1
  return rest, ""


def parse_computations(hlo_text: str) -> tuple[dict[str, list[Instr]], str | None]:
  """computation name -> its instructions (in scheduled order), and the entry's name."""
  comps, entry = {}, None
  for comp, is_entry, instr in walk(hlo_text):
    if instr is None:
      comps[comp] = []
      entry = comp if is_entry else entry
      continue
    name, type_text, op, rest = instr
    operands, attrs = _split_operands(rest)
    names = re.findall(r"%([\w.\-]+)", operands)
    comps[comp].append(Instr(name, type_text, op, names, attrs, operands.strip()))
  return comps, entry


def type_bytes(type_text: str) -> int:
  """Bytes of every array in a (possibly tuple) type; layouts and tokens count nothing."""
  return sum(
    DTYPE_BYTES.get(dt, 0) * math.prod(int(d) for d in dims.split(",") if d)
    for dt, dims in _ARRAY_RE.findall(type_text)
  )


def _dims(type_text: str) -> list[int]:
  m = _ARRAY_RE.search(type_text)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dot_flops(instr: Instr, types: dict[str, str]) -> float:
  out = _dims(instr.type_text)
  lhs = _dims(types.get(instr.operands[0], "")) if instr.operands else []
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
  contract = [int(d) for d in m.group(1).split(",") if d] if m else []
  k = math.prod(lhs[d] for d in contract if d < len(lhs))
  return 2.0 * math.prod(out) * k


def _attention_flops(instr: Instr) -> float:
  """cuDNN fused attention: 4 B H Lq Lk D forward (QK^T and PV), 2.5x that backward, half
  under a causal mask (fully masked tiles are skipped); shapes from the layout constraints."""
  m = re.search(r"operand_layout_constraints=\{(.*?)\}\s*,\s*\w+=", instr.attrs)
  shapes = [
    [int(d) for d in dims.split(",") if d] for _, dims in _ARRAY_RE.findall(m.group(1) if m else "")
  ]
  if len(shapes) < 2 or len(shapes[0]) != 4:
    return 0.0
  (b, lq, h, d), lk = shapes[0], shapes[1][1]
  flops = 4.0 * b * h * lq * lk * d
  if "Backward" in instr.attrs or "bwd" in instr.name:
    flops *= 2.5
  if re.search(r'"mask_type":"CAUSAL', instr.attrs):
    flops /= 2
  return flops


def is_attention(instr: Instr) -> bool:
  return instr.op == "custom-call" and ATTENTION_TARGET in instr.attrs


def instruction_flops(instr: Instr, comps: dict[str, list[Instr]], types: dict) -> float:
  if instr.op == "dot":
    return _dot_flops(instr, types)
  if is_attention(instr):
    return _attention_flops(instr)
  if instr.op == "custom-call" and "gemm" in instr.attrs:
    m = re.search(r'"lhs_contracting_dimensions":\["?([\d",]*)"?\]', instr.attrs)
    contract = [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []
    lhs = _dims(types.get(instr.operands[0], "")) if instr.operands else []
    out = _dims(instr.type_text)
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contract if d < len(lhs))
  total = 0.0
  for callee in _CALLS_RE.findall(instr.attrs) if instr.op == "fusion" else ():
    inner = comps.get(callee, [])
    inner_types = {i.name: i.type_text for i in inner}
    total += sum(instruction_flops(i, comps, inner_types) for i in inner)
  return total


def _sliced_operands(fused: list[Instr]) -> tuple[dict[int, int], int | None]:
  """What a fusion really touches of the parameters it only slices: operand index -> bytes
  (a layer's weights read out of the stacked [L, ...] array with dynamic-slice, or an update
  written into a parameter's buffer in place with dynamic-update-slice, not the whole array),
  and the bytes written in place (the result's real traffic), if any."""
  index = {i.name: int(i.args) for i in fused if i.op == "parameter" and i.args.isdigit()}
  types = {i.name: i.type_text for i in fused}
  touched, whole, written = {}, set(), None
  for i in fused:
    for pos, o in enumerate(i.operands):
      if o not in index:
        continue
      k = index[o]
      if i.op == "dynamic-slice" and pos == 0:
        touched[k] = touched.get(k, 0) + type_bytes(i.type_text)
      elif i.op == "dynamic-update-slice" and pos == 0 and len(i.operands) > 1:
        update = type_bytes(types.get(i.operands[1], ""))
        touched[k] = touched.get(k, 0) + update
        written = (written or 0) + update
      else:
        whole.add(k)
  return {k: v for k, v in touched.items() if k not in whole}, written


def instruction_seconds(
  instr: Instr, comps: dict, types: dict, peak_flops: float, memory_bandwidth: float
) -> float:
  if instr.op in FREE_OPS or instr.op.endswith("-done") or instr.op.endswith("-start"):
    return 0.0
  sliced, written = {}, None
  if instr.op == "fusion" and (callee := _CALLS_RE.search(instr.attrs)):
    sliced, written = _sliced_operands(comps.get(callee.group(1), []))
  result = type_bytes(instr.type_text) if written is None else written
  moved = result + sum(
    sliced.get(k, type_bytes(types.get(o, ""))) for k, o in enumerate(instr.operands)
  )
  flops = instruction_flops(instr, comps, types)
  return max(flops / peak_flops, moved / memory_bandwidth)


def computation_seconds(
  comps: dict, name: str, peak_flops: float, memory_bandwidth: float, only=None
) -> float:
  """The roofline of one computation's kernels (those `only` accepts, when given)."""
  instrs = comps.get(name, [])
  types = {i.name: i.type_text for i in instrs}
  return sum(
    instruction_seconds(i, comps, types, peak_flops, memory_bandwidth)
    for i in instrs
    if only is None or only(i)
  )
