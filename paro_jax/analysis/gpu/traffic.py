"""Where a compiled GPU step's HBM traffic goes: the bytes of its kernels other than matmuls, by
purpose, per GPU per step.

Each kernel's bytes are what it moves (roofline.kernel_bytes: a fusion as far as its results
need its operands, updates in place as the update, allocations as nothing), times its executions
per step (the product of the enclosing loops' trip counts). A kernel is a matmul when it
computes one (a GEMM fusion, a library GEMM, cuDNN's attention: reported aside); every other
kernel is memory-bound, and its time is its bytes over the memory bandwidth. Each is named by
purpose from the named scopes its results carry (the op_name metadata of core/step.py's phases,
the prefetching stack's, the model's modules): `PURPOSES`, in order, the first that matches;
`other` when none does.
"""

from __future__ import annotations

import dataclasses
import re

from paro_jax.analysis.gpu import roofline
from paro_jax.analysis.gpu.estimate import sequenced_computations
from paro_jax.analysis.hlo.collectives import computation_counts

# (purpose, pattern on a result's op_name); the order decides between them.
PURPOSES = (
  ("gradient norm", re.compile(r"/optimizer/.*(reduce_sum|square|integer_pow)")),
  ("optimizer", re.compile(r"/optimizer/")),
  ("weight casts", re.compile(r"param_sync/.*convert_element_type")),
  # packing a bucket before its collective, unpacking it after (slices, concatenations and
  # transposes in the collectives' scopes)
  ("collective pack/unpack", re.compile(
    r"(param_sync|layer_gather|layer_regather|layer_grad_scatter|layer_grad_sync|grad_sync)\)?"
    r"/(slice|concatenate|transpose|pad)\b")),
  ("weight copies", re.compile(r"param_sync|layer_gather|layer_regather")),
  ("gradient accumulation", re.compile(
    r"layer_grad_scatter|layer_grad_sync|grad_sync|transpose\(.*dynamic_update_index_in_dim|"
    r"micro_batches/add|micro_batches/while/body/add")),
  ("norms", re.compile(r"_norm/|/norm/|RMSNorm")),
  ("loss", re.compile(r"\bloss\b|Head|Embed|softmax|cross_entropy|one_hot")),
  ("activations", re.compile(r"layer|Block|dynamic_update_index_in_dim")),
)  # fmt: skip
_OPNAME_RE = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Kernel:
  computation: str
  name: str
  executions: int  # per step
  bytes: float  # per execution
  flops: float  # per execution; > 0: a matmul (attention included)
  attention: bool
  purpose: str


LAYOUT = "layout copies"


def purpose(op_names: list[str]) -> str:
  for name, pattern in PURPOSES:
    if any(pattern.search(n) for n in op_names):
      return name
  return "other"


def _purpose_of(instr, comps) -> str:
  names = result_op_names(instr, comps)
  if not names and (instr.op in ("copy", "transpose") or "transpose" in instr.name):
    return LAYOUT
  return purpose(names)


def result_op_names(instr, comps) -> list[str]:
  """The op_names of a kernel's results (a fusion's: its root's operands', through the
  instructions that carry none)."""
  if instr.op == "fusion" and (callee := roofline._CALLS_RE.search(instr.attrs)):
    fused = comps.get(callee.group(1)) or []
    by_name = {i.name: i for i in fused}
    root = fused[-1] if fused else None
    names = []
    for o in root.operands if root and root.op == "tuple" else [root.name] if root else []:
      i = by_name.get(o)
      # through what carries no op_name of its own (bitcasts, layout transposes)
      while i is not None and not _OPNAME_RE.search(i.attrs) and i.operands:
        i = by_name.get(i.operands[0])
      if i is not None and (m := _OPNAME_RE.search(i.attrs)):
        names.append(m.group(1))
    if names:
      return names
  m = _OPNAME_RE.search(instr.attrs)
  return [m.group(1)] if m else []


def kernels(hlo_text: str) -> list[Kernel]:
  """Every kernel that runs (in the entry and the computations that run as sequences of their
  own, as estimate.py costs them) with its executions per step, bytes, FLOPs and purpose."""
  comps, entry = roofline.parse_computations(hlo_text)
  counts = computation_counts(hlo_text)
  out = []
  for comp in sorted({entry} | sequenced_computations(comps)):
    n = counts.get(comp, 0)
    instrs = comps.get(comp, []) if n else []
    types = {i.name: i.type_text for i in instrs}
    for i in instrs:
      moved = roofline.kernel_bytes(i, comps, types)
      if moved:
        flops = roofline.instruction_flops(i, comps, types)
        out.append(
          Kernel(
            comp, i.name, n, moved, flops, roofline.is_attention(i),
            _purpose_of(i, comps),
          )
        )  # fmt: skip
  return out


def breakdown(ks: list[Kernel]) -> dict:
  """Per step and GPU: the non-matmul bytes by purpose (largest first) and their total; the
  matmuls' and attention's bytes aside."""
  by: dict[str, float] = {}
  for k in ks:
    if k.flops <= 0:
      by[k.purpose] = by.get(k.purpose, 0.0) + k.executions * k.bytes
  return {
    "non_matmul_bytes": sum(by.values()),
    "by_purpose": dict(sorted(by.items(), key=lambda kv: -kv[1])),
    "matmul_bytes": sum(k.executions * k.bytes for k in ks if k.flops > 0 and not k.attention),
    "attention_bytes": sum(k.executions * k.bytes for k in ks if k.attention),
  }


def format_breakdown(b: dict) -> str:
  lines = [
    f"HBM bytes of the kernels other than matmuls: {b['non_matmul_bytes'] / 1e9:.2f} GB per GPU "
    f"per step (aside: matmuls {b['matmul_bytes'] / 1e9:.2f} GB, attention "
    f"{b['attention_bytes'] / 1e9:.2f} GB)"
  ]
  lines += [f"  {k:24s}{v / 1e9:8.2f} GB" for k, v in b["by_purpose"].items()]
  return "\n".join(lines)
