"""Read the communication schedule out of compiled HLO text.

Every collective instruction is found with its computation; each computation's multiplicity is
the product of the trip counts (`known_trip_count`) of the while loops that call it, so a
collective inside the layer scan inside the micro-batch scan counts L x A times per step.
Device ids in replica groups and permute pairs are positions in the mesh's flattened device
array (SPMD partition ids), turned into (inter, intra) coordinates to tell the level.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

from paro_jax.core.names import LEVEL_GLOBAL, LEVEL_INTER, LEVEL_INTRA

HLO_COLLECTIVE_OPS = (
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "collective-permute",
  "all-to-all",
)
DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
}

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_CALLEE_RE = re.compile(
  r"\b(condition|body|calls|to_apply|true_computation|false_computation)"
  r"=%?([\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Collective:
  name: str
  kind: str  # all-gather, reduce-scatter, all-reduce, collective-permute, all-to-all
  computation: str
  out_bytes: int  # bytes of the (local) result
  dtypes: tuple[str, ...]
  groups: list[list[int]] | None  # replica groups (None: all devices)
  pairs: list[tuple[int, int]] | None  # source-target pairs of a permute
  op_name: str
  count: int = 1  # executions per step (product of enclosing trip counts)


def _array_bytes(type_text: str) -> tuple[int, tuple[str, ...]]:
  total, dtypes = 0, []
  for dtype, dims in _ARRAY_RE.findall(type_text):
    if dtype not in DTYPE_BYTES:
      continue
    total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    dtypes.append(dtype)
  return total, tuple(dtypes)


def _split_top_level(text: str) -> list[str]:
  """Split a tuple type '(a, (b, c), d)' into its top-level elements."""
  inner, depth, parts, cur = text.strip()[1:-1], 0, [], ""
  for ch in inner:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append(cur)
      cur = ""
    else:
      cur += ch
  if cur.strip():
    parts.append(cur)
  return [p.strip() for p in parts]


def _result_type(kind: str, type_text: str) -> str:
  """The part of an op's type that is its result (async -start ops also carry their inputs)."""
  if not kind.endswith("-start") or not type_text.startswith("("):
    return type_text
  parts = _split_top_level(type_text)
  base = kind[: -len("-start")]
  # (operands, results, ...): XLA:GPU's starts of permutes, all-gathers and reduce-scatters.
  if base in ("collective-permute", "all-gather", "reduce-scatter") and len(parts) >= 2:
    return parts[1]
  return type_text


def _parse_groups(attrs: str) -> list[list[int]] | None:
  m = re.search(
    r"replica_groups=(\{\{[\d,{}\s]*\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs
  )
  if not m or m.group(1) == "{}":
    return None
  text = m.group(1)
  if text.startswith("{"):
    return [
      [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]+)\}", text)
    ]
  # Iota form: [G,S]<=[dims]T(perm): arange(prod(dims)).reshape(dims).transpose(perm).reshape(G,S)
  shape, rest = text.split("<=")
  out_shape = [int(x) for x in shape.strip("[]").split(",")]
  dims = [int(x) for x in re.match(r"\[([\d,]+)\]", rest).group(1).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if t := re.search(r"T\(([\d,]+)\)", rest):
    ids = ids.transpose([int(x) for x in t.group(1).split(",")])
  return ids.reshape(out_shape).tolist()


def _parse_pairs(attrs: str) -> list[tuple[int, int]] | None:
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if not m:
    return None
  return [(int(a), int(b)) for a, b in re.findall(r"\{?(\d+),(\d+)\}?", m.group(1) + "}")]


def walk(hlo_text: str):
  """The computation headers and instructions of an HLO module's text, in order:
  (computation, is_entry, None) at a header, (computation, is_entry, (name, type, op, rest)) at
  each of its instructions."""
  comp, entry = None, False
  for line in hlo_text.splitlines():
    # Computation headers start at column 0 and open a block; instructions are indented.
    if not line[:1].isspace() and line.rstrip().endswith("{") and (m := _COMP_RE.match(line)):
      comp, entry = m.group(2), bool(m.group(1))
      yield comp, entry, None
      continue
    m = _INSTR_RE.match(line)
    if m and comp is not None:
      yield comp, entry, m.groups()


def computation_counts(hlo_text: str) -> dict[str, int]:
  """Executions per step of every computation reached from the entry: the sum over its call
  sites of the caller's count x the trip count of a calling while loop (1 for other callers)."""
  calls = defaultdict(list)  # computation -> [(callee, factor)]
  entry = None
  for comp, is_entry, instr in walk(hlo_text):
    if instr is None:
      entry = comp if is_entry else entry
      continue
    _, _, op, rest = instr
    trip = _TRIP_RE.search(rest)
    # An async-done names the computation its async-start already called: count it once.
    for role, callee in [] if op.endswith("-done") else _CALLEE_RE.findall(rest):
      factor = int(trip.group(1)) if (op == "while" and role == "body" and trip) else 1
      calls[comp].append((callee, factor if role != "condition" else 0))
    for b in _BRANCHES_RE.findall(rest):
      for callee in re.findall(r"%?([\w.\-]+)", b):
        calls[comp].append((callee, 1))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  mult = defaultdict(int)

  def visit(c, m):
    mult[c] += m
    for callee, factor in calls.get(c, ()):
      if factor:
        visit(callee, m * factor)

  visit(entry, 1)
  return dict(mult)


def _operands(rest: str) -> list[str]:
  """The operand names of an instruction, from the text after its `op(`."""
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if depth < 0:
      return re.findall(r"%([\w.\-]+)", rest[:i])
  return []


def _inherited_name(name: str, graph: dict[str, tuple[str, list[str]]]) -> str:
  """The op_name of the nearest named producer of `name`'s operands (breadth first, within its
  computation). XLA's passes that make a collective (a combined all-reduce of concatenated
  gradients, XLA:GPU's) may give it no op_name; the data it carries names its phase."""
  seen, frontier = {name}, list(graph[name][1])
  while frontier:
    named = [graph[n][0] for n in frontier if n in graph and graph[n][0]]
    if named:
      return named[0]
    seen.update(frontier)
    frontier = [m for n in frontier if n in graph for m in graph[n][1] if m not in seen]
  return ""


def parse_collectives(hlo_text: str) -> list[Collective]:
  """All collectives of an HLO module with their per-step execution counts. A collective without
  an op_name takes its operands' (`_inherited_name`)."""
  found = []
  graphs = defaultdict(dict)  # computation -> {instruction: (op_name, operands)}
  for comp, _, instr in walk(hlo_text):
    if instr is None:
      continue
    name, type_text, op, rest = instr
    opname = _OPNAME_RE.search(rest)
    graphs[comp][name] = (opname.group(1) if opname else "", _operands(rest))
    base = op[: -len("-start")] if op.endswith("-start") else op
    if base in HLO_COLLECTIVE_OPS and not op.endswith("-done"):
      nbytes, dtypes = _array_bytes(_result_type(op, type_text))
      found.append(
        Collective(
          name,
          base,
          comp,
          nbytes,
          dtypes,
          _parse_groups(rest),
          _parse_pairs(rest) if base == "collective-permute" else None,
          opname.group(1) if opname else "",
        )
      )
  mult = computation_counts(hlo_text)
  for c in found:
    c.count = mult.get(c.computation, 0)
    c.op_name = c.op_name or _inherited_name(c.name, graphs[c.computation])
  return [c for c in found if c.count]


def phase_of(op_name: str) -> str:
  """Which part of the step a collective belongs to, from the named scopes of core/step.py."""
  if "param_sync" in op_name:
    return "parameter sync"
  if "grad_sync" in op_name:
    return "gradient sync"
  if "micro_batches" in op_name:
    # The prefetching layer stack (core/prefetch.py) names its collectives.
    if "layer_regather" in op_name:
      return "backward (remat)"
    if "layer_grad_scatter" in op_name:
      return "backward"
    if "transpose(" not in op_name:
      return "forward"
    return "backward (remat)" if "rematted_computation" in op_name else "backward"
  if "optimizer" in op_name:
    return "optimizer"
  return "other"


def device_bytes(c: Collective, n_devices: int) -> dict[int, float]:
  """Ring cost each device sends for one execution: (k-1)/k*S for all-gather (S = result) and
  reduce-scatter (S = input = k x result), twice that for all-reduce, S per permute send."""
  if c.kind == "collective-permute":
    sent = defaultdict(float)
    for src, dst in c.pairs or ():
      if src != dst:
        sent[src] += c.out_bytes
    return dict(sent)
  groups = c.groups or [list(range(n_devices))]
  out = {}
  for g in groups:
    k = len(g)
    if k <= 1:
      continue
    per = {
      "all-gather": (k - 1) / k * c.out_bytes,
      "reduce-scatter": (k - 1) * c.out_bytes,
      "all-reduce": 2 * (k - 1) / k * c.out_bytes,
      "all-to-all": (k - 1) / k * c.out_bytes,
    }[c.kind]
    for d in g:
      out[d] = per
  return out


def level_of(c: Collective, intra: int) -> str:
  """intra (one group), inter (same local rank, several groups) or global (both)."""
  if c.kind == "collective-permute":
    pairs = [(s, t) for s, t in (c.pairs or ()) if s != t]
    crosses = {s // intra != t // intra for s, t in pairs}
    return {frozenset({False}): LEVEL_INTRA, frozenset({True}): LEVEL_INTER}.get(
      frozenset(crosses), "mixed"
    )
  groups = c.groups
  if groups is None:
    return LEVEL_GLOBAL
  spans_inter = any(len({d // intra for d in g}) > 1 for g in groups)
  spans_intra = any(len({d % intra for d in g}) > 1 for g in groups)
  if spans_inter and spans_intra:
    return LEVEL_GLOBAL
  return LEVEL_INTER if spans_inter else LEVEL_INTRA


def crosses_groups(c: Collective, device: int, intra: int) -> bool:
  """Whether this device's traffic for c goes over an inter-group link."""
  if c.kind == "collective-permute":
    return any(s == device and s // intra != t // intra for s, t in c.pairs or ())
  return level_of(c, intra) in (LEVEL_INTER, LEVEL_GLOBAL)


def packed_attention(hlo_text: str) -> str:
  """How a compiled step keeps packed rows' examples apart: cuDNN's fused attention kernel in
  its packed layout, or attention written out with a segment mask."""
  kernels = hlo_text.count('custom_call_target="__cudnn$fmhaSoftmax')
  if kernels:
    return f"cuDNN's fused kernel in its packed layout ({kernels} calls forward and backward)"
  return "written out in XLA, a segment mask per sequence (no fused kernel)"
