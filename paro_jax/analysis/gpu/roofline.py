"""A roofline cost of compiled GPU HLO, for what XLA's own estimate does not cost.

XLA's latency-hiding scheduler costs only the computations it schedules: those that hold an
async collective (a layer body without communication, as in NNG, is never costed), and inside
them it charges cuDNN's fused attention kernels and plain copies nothing. For those, each kernel
is charged max(FLOPs / peak, bytes moved / memory bandwidth): the FLOPs of its matmuls (the dots
of a fusion, cuBLAS calls, cuDNN attention) and the bytes of its operands and results. No launch
gaps, no efficiency below peak: a lower bound, named as such wherever it is used.

What a kernel costs, as it runs on the GPU: a matmul with an fp32 operand at the TF32 rate
(hardware.TF32_OVER_BF16 of the bf16 peak); cuDNN's causal attention at half the FLOPs of an
unmasked one; a fusion's bytes only as far as its results need its operands (`kernel_bytes`: a
layer's weights sliced out of a stacked array, the part of a bucket one result unpacks, an
update written into a buffer in place as the update alone); a copy as what it reads and writes;
a buffer XLA only allocates (the `AllocateBuffer` custom call) as nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re

from paro_jax.analysis.gpu.hardware import TF32_OVER_BF16
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
# cuDNN's backend config writes `"mask_type": "CAUSAL"` (a space after the colon; PADDING_CAUSAL
# with segment ids): fully masked tiles are skipped.
_CAUSAL_RE = re.compile(r'"mask_type":\s*"(?:PADDING_)?CAUSAL')
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
# Custom calls that only give a buffer its place (lax.empty): no kernel runs, nothing moves.
ALLOCATIONS = {"AllocateBuffer"}


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
  if _CAUSAL_RE.search(instr.attrs):
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


def fp32_matmul(instr: Instr, comps: dict, types: dict) -> bool:
  """A matmul (a dot, or the dots of a GEMM fusion) with an fp32 operand: tensor cores run it
  as TF32."""
  dots = [instr]
  if instr.op == "fusion" and (callee := _CALLS_RE.search(instr.attrs)):
    dots = comps.get(callee.group(1), [])
    types = {i.name: i.type_text for i in dots}
  return any(
    _ARRAY_RE.search(types.get(o, "")) is not None
    and _ARRAY_RE.search(types.get(o, "")).group(1) == "f32"
    for d in dots
    if d.op in ("dot", "convolution")
    for o in d.operands[:2]
  )


def matmul_peak(instr: Instr, comps: dict, types: dict, peak_flops: float) -> float:
  """The FLOP/s a kernel's matmuls run at: the bf16 peak, the TF32 rate for fp32 operands."""
  return peak_flops * (TF32_OVER_BF16 if fp32_matmul(instr, comps, types) else 1.0)


def instruction_seconds(
  instr: Instr, comps: dict, types: dict, peak_flops: float, memory_bandwidth: float
) -> float:
  """max(FLOPs / the rate its matmuls run at, bytes it moves / memory bandwidth)."""
  moved = kernel_bytes(instr, comps, types)
  flops = instruction_flops(instr, comps, types)
  if not flops:
    return moved / memory_bandwidth
  return max(flops / matmul_peak(instr, comps, types, peak_flops), moved / memory_bandwidth)


# --- the bytes a kernel moves --------------------------------------------------------------
# A fusion touches its operands only as far as its results need them. Each fused instruction's
# *demand* (which of its elements its users need: a count, and where known their flat positions
# as runs) is passed from the results back to the parameters, and a parameter is read as far as
# it is demanded.
_SLICE_SPEC_RE = re.compile(r"slice=\{((?:\[[\d:]+\],?\s*)*)\}")
_DIMENSIONS_RE = re.compile(r"dimensions=\{([\d,]*)\}")
MAX_RUNS = 256  # past this many contiguous runs a slice's region is kept as a count only
# one result element from one element of each operand (of the same size), in the same flat order
_ELEMENTWISE = {
  "bitcast", "reshape", "copy", "convert", "negate", "abs", "exponential", "log", "add",
  "subtract", "multiply", "divide", "select", "maximum", "minimum", "compare", "and", "or",
  "xor", "not", "power", "sqrt", "rsqrt", "tanh", "logistic", "clamp", "sign", "floor", "ceil",
  "round-nearest-even", "exponential-minus-one", "log-plus-one", "is-finite", "remainder",
  "atan2", "cosine", "sine",
}  # fmt: skip


@dataclasses.dataclass
class Demand:
  count: int
  runs: list[tuple[int, int]] | None = None  # sorted disjoint [start, end) flat positions

  def merged(self, other: Demand, size: int) -> Demand:
    if self.runs is not None and other.runs is not None:
      runs = _union(self.runs + other.runs)
      return Demand(sum(b - a for a, b in runs), runs)
    return Demand(min(size, self.count + other.count))


def _full(n: int) -> Demand:
  return Demand(n, [(0, n)] if n else [])


def _union(runs):
  out = []
  for a, b in sorted(runs):
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], b))
    elif b > a:
      out.append((a, b))
  return out


def _itemsize(type_text: str) -> int:
  m = _ARRAY_RE.search(type_text)
  return DTYPE_BYTES.get(m.group(1), 0) if m else 0


def _slice_runs(dims: list[int], spec: list[tuple[int, int]]):
  """The flat runs of a slice's region of an array of `dims` (None past MAX_RUNS)."""
  inner, k = 1, len(dims)
  while k > 0 and spec[k - 1] == (0, dims[k - 1]):
    inner *= dims[k - 1]
    k -= 1
  if k == 0:
    return [(0, inner)]
  if math.prod(b - a for a, b in spec[: k - 1]) > MAX_RUNS:
    return None
  strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
  starts = [0]
  for i in range(k - 1):
    starts = [s + j * strides[i] for s in starts for j in range(*spec[i])]
  lo, hi = spec[k - 1]
  return [(s + lo * strides[k - 1], s + hi * strides[k - 1]) for s in starts]


def fusion_bytes(fused: list[Instr]) -> tuple[dict[int, int], int]:
  """(parameter number -> bytes read, bytes written) of a fused computation. A result that is
  a dynamic-update-slice (or a scatter) of a parameter's buffer is updated in place: only the
  update is written, and the rest of the buffer neither read nor written."""
  by_name = {i.name: i for i in fused}
  size = {i.name: math.prod(_dims(i.type_text)) for i in fused}
  demand: dict[str, Demand] = {}

  def need(name: str, d: Demand):
    if name in by_name and d.count > 0:
      d = Demand(min(d.count, size[name]), d.runs)
      demand[name] = demand[name].merged(d, size[name]) if name in demand else d

  root = fused[-1]
  written = 0
  for out in root.operands if root.op == "tuple" else [root.name]:
    base, updates = out, []
    while base in by_name and by_name[base].op in ("bitcast", "dynamic-update-slice"):
      if by_name[base].op == "dynamic-update-slice":
        updates.append(by_name[base])
      base = by_name[base].operands[0]
    i = by_name.get(out)
    if updates and base in by_name and by_name[base].op == "parameter":
      for u in updates:
        written += size[u.operands[1]] * _itemsize(by_name[u.operands[1]].type_text)
        for o in u.operands[1:]:
          need(o, _full(size[o]))
    elif i is not None and i.op == "scatter" and by_name[i.operands[0]].op == "parameter":
      # into a parameter's buffer (an embedding's gradient): the updated rows read and written
      n = sum(size[u] for u in i.operands[len(i.operands) // 2 + 1 :])
      written += n * _itemsize(i.type_text)
      need(i.operands[0], Demand(n))
      for o in i.operands[1:]:
        need(o, _full(size[o]))
    elif i is not None:
      written += type_bytes(i.type_text)
      need(out, _full(size[out]))
  for i in reversed(fused):
    if i.name in demand and i.op not in ("parameter", "tuple"):
      _pass_on(i, demand[i.name], by_name, size, need)
  read = {}
  for i in fused:
    if i.op == "parameter" and i.args.strip().isdigit():
      d = demand.get(i.name)
      read[int(i.args)] = (d.count if d else 0) * _itemsize(i.type_text)
  return read, written


def _pass_on(i: Instr, d: Demand, by_name, size, need) -> None:
  """Instruction i's demand `d` passed on to its operands."""
  ops, n = i.operands, size[i.name]
  whole = d.count >= n
  share = lambda m: _full(m) if whole else Demand(max(1, d.count * m // max(n, 1)))  # noqa: E731
  if i.op in _ELEMENTWISE:
    for o in ops:
      need(o, d if size.get(o) == n else _full(size.get(o, 0)))  # scalars: read whole
  elif i.op == "transpose":
    need(ops[0], _full(n) if whole else Demand(d.count))
  elif i.op == "slice":
    dims = _dims(by_name[ops[0]].type_text) if ops[0] in by_name else []
    m = _SLICE_SPEC_RE.search(i.attrs)
    specs = re.findall(r"\[([\d:]+)\]", m.group(1)) if m else []
    spec = [tuple(int(x) for x in s.split(":")[:2]) for s in specs]
    strided = any(len(s.split(":")) > 2 and s.split(":")[2] != "1" for s in specs)
    runs = _slice_runs(dims, spec) if whole and len(spec) == len(dims) and not strided else None
    need(ops[0], Demand(d.count, runs))
  elif i.op == "concatenate":
    dim = int(_DIMENSIONS_RE.search(i.attrs).group(1))
    contiguous = math.prod(_dims(i.type_text)[:dim]) == 1
    offset = 0
    for o in ops:
      m = size.get(o, 0)
      if d.runs is not None and contiguous:  # its own flat range of the result
        runs = [(max(a, offset) - offset, min(b, offset + m) - offset) for a, b in d.runs
                if min(b, offset + m) > max(a, offset)]  # fmt: skip
        need(o, Demand(sum(b - a for a, b in runs), runs))
      else:
        need(o, share(m))
      offset += m
  elif i.op == "dynamic-slice":
    need(ops[0], Demand(d.count))
    for o in ops[1:]:
      need(o, _full(size.get(o, 0)))
  elif i.op == "dynamic-update-slice":
    upd = size.get(ops[1], 0)
    need(ops[0], Demand(max(0, d.count - upd)))
    need(ops[1], _full(upd) if d.count >= upd else Demand(d.count))
    for o in ops[2:]:
      need(o, _full(size.get(o, 0)))
  else:  # broadcasts, reductions, dots, gathers, iota: in proportion (whole for a whole result)
    for o in ops:
      need(o, share(size.get(o, 0)))


def kernel_bytes(instr: Instr, comps: dict, types: dict) -> float:
  """HBM bytes one execution of a kernel moves: nothing for bookkeeping, async starts and dones
  and allocations (ALLOCATIONS); a fusion as far as its results need its operands
  (`fusion_bytes`); anything else (a copy, a library call) its operands and results."""
  if instr.op in FREE_OPS or instr.op.endswith("-done") or instr.op.endswith("-start"):
    return 0.0
  if instr.op == "custom-call" and (t := _TARGET_RE.search(instr.attrs)):
    if t.group(1) in ALLOCATIONS:
      return 0.0
  if instr.op == "fusion" and (callee := _CALLS_RE.search(instr.attrs)):
    if fused := comps.get(callee.group(1)):
      read, written = fusion_bytes(fused)
      return written + sum(read.get(k, 0) for k in range(len(instr.operands)))
  return type_bytes(instr.type_text) + sum(type_bytes(types.get(o, "")) for o in instr.operands)
