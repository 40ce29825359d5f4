"""What a compiled GPU step does with its collectives: async or not, on which stream, beside what.

XLA:GPU turns each collective into a start/done pair (or an `async-start` wrapping it) and its
latency-hiding scheduler moves work between the two; a pair with nothing worth hiding in between
is marked `"is_sync":true` and runs synchronously. The order of instructions in a scheduled
computation is the order they are issued, so a collective's *window* is the instructions between
its start and its done. The runtime's stream of every async start is in the thunk sequence that
`--xla_dump_to` writes (`*.thunk_sequence.txt`, names in `*.thunk_metadata.txt`).

What a compile can show: which collectives are async, what compute is scheduled inside each
window, which collectives are in flight together and on which streams. What it cannot: whether
the hardware really overlaps them, and how long anything takes.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from paro_jax.analysis.hlo import collectives
from paro_jax.core.names import LEVEL_INTER, LEVEL_INTRA

# Compute worth hiding communication behind: matrix multiplications (and attention, made of them
# or of cuDNN kernels). Elementwise fusions are not counted.
_COMPUTE_CALL_RE = re.compile(r'custom_call_target="[^"]*(gemm|matmul|cublas|cudnn)', re.I)
# A fusion XLA turned into a GEMM kernel says so in its backend config (operand names, which may
# contain "gemm", do not count).
_GEMM_FUSION_RE = re.compile(r'"kind":"__(triton_gemm|triton_nested_gemm_fusion|cub)', re.I)
_CALLS_RE = re.compile(r"\b(?:calls|body|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_SYNC_RE = re.compile(r'"is_sync":\s*true')


@dataclasses.dataclass
class _Instr:
  name: str
  op: str
  rest: str  # everything after the op's opening parenthesis: operands, then attributes


def _computations(hlo_text: str) -> dict[str, list[_Instr]]:
  comps = {}
  for comp, _, instr in collectives.walk(hlo_text):
    if instr is None:
      comps.setdefault(comp, [])
    else:
      name, _, op, rest = instr
      comps[comp].append(_Instr(name, op, rest))
  return comps


class _Compute:
  """Whether an instruction is (or calls) a matmul, memoised per computation."""

  def __init__(self, comps: dict[str, list[_Instr]]):
    self.comps, self.memo = comps, {}

  def computation(self, name: str) -> bool:
    if name not in self.memo:
      self.memo[name] = False  # breaks cycles
      self.memo[name] = any(self.instr(i) for i in self.comps.get(name, ()))
    return self.memo[name]

  def instr(self, i: _Instr) -> bool:
    if i.op in ("dot", "convolution"):
      return True
    if i.op == "custom-call":
      return bool(_COMPUTE_CALL_RE.search(i.rest))
    if i.op in ("fusion", "while", "call", "conditional"):
      if i.op == "fusion" and _GEMM_FUSION_RE.search(i.rest):
        return True
      return any(self.computation(c) for c in _CALLS_RE.findall(i.rest))
    return False


def _done_of(instrs: list[_Instr], k: int) -> int | None:
  """Index of the done that consumes the start at index k."""
  ref = re.compile(r"^%?" + re.escape(instrs[k].name) + r"[),\s]")
  for j in range(k + 1, len(instrs)):
    if instrs[j].op.endswith("-done") and ref.match(instrs[j].rest):
      return j
  return None


@dataclasses.dataclass
class Window:
  """Where one collective is issued and what runs while it is in flight."""

  computation: str
  start: int  # instruction index of its start (or of the op itself when synchronous)
  done: int  # instruction index of its done (== start when synchronous)
  is_async: bool
  compute_ops: int  # matmul-like instructions (or loops/calls containing them) in the window
  start_name: str  # the instruction the runtime launches (its thunk's name)


def collective_windows(hlo_text: str) -> dict[str, Window]:
  """Collective instruction name (as collectives.parse_collectives names it) -> its Window."""
  comps = _computations(hlo_text)
  compute = _Compute(comps)
  wrapped_by = {}  # async wrapped computation -> (caller, index of the async-start)
  for cname, instrs in comps.items():
    for k, i in enumerate(instrs):
      if i.op == "async-start":
        for callee in _CALLS_RE.findall(i.rest):
          wrapped_by[callee] = (cname, k)
  out = {}
  for cname, instrs in comps.items():
    for k, i in enumerate(instrs):
      base = i.op[: -len("-start")] if i.op.endswith("-start") else i.op
      if base not in collectives.HLO_COLLECTIVE_OPS:
        continue
      where, at = (cname, k)
      if cname in wrapped_by:  # the collective inside an async wrapper: time it at the wrapper
        where, at = wrapped_by[cname]
      seq = comps[where]
      starts = seq[at].op.endswith("-start")
      done = _done_of(seq, at) if starts else None
      is_async = done is not None and not _SYNC_RE.search(seq[at].rest)
      inside = seq[at + 1 : done] if is_async else []
      out[i.name] = Window(
        where,
        at,
        done if done is not None else at,
        is_async,
        sum(compute.instr(x) for x in inside),
        seq[at].name,
      )
  return out


def thunk_streams(dump_dir: str) -> dict[str, str]:
  """HLO instruction name -> the stream its async start runs on, from an XLA dump directory."""
  streams = {}
  for seq_path in glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt")):
    meta_path = seq_path.replace(".thunk_sequence.txt", ".thunk_metadata.txt")
    names = {}
    if os.path.exists(meta_path):
      text = open(meta_path).read()
      for ann, tid in re.findall(r'profile_annotation:\s*"([^"]+)"\s*thunk_id:\s*(\d+)', text):
        names[int(tid)] = ann
    for line in open(seq_path):
      m = re.match(r"\s*(\d+):\s*kAsyncStart\b.*?stream=([\w\[\]]+)", line)
      if m and int(m.group(1)) in names:
        streams[names[int(m.group(1))]] = m.group(2)
  return streams


def _overlaps(a: Window, b: Window) -> bool:
  return a.computation == b.computation and a.start < b.done and b.start < a.done


MICRO_BATCH_PHASES = ("forward", "backward", "backward (remat)")


def overlap(hlo_text: str, n_devices: int, intra: int, streams: dict[str, str] | None) -> dict:
  """The overlap summary of a compiled step, with one row per collective instruction.

  `collective_bytes_fraction`: of the bytes each device sends per micro-batch (count x bytes,
  phases forward/backward), the share sent by async collectives with compute in their window.
  HO-Ring (collectives under the `horing` scope): every inter permute of a two-level collective
  is one ring step that has both levels; it is *concurrent* when an intra HO-Ring collective (a
  sub-round: the runtime's all-gather or reduce-scatter over the node) is in flight at the same
  time on another stream. Without a thunk sequence (no GPU compile) streams
  are unknown and concurrency is None.
  """
  found = collectives.parse_collectives(hlo_text)
  win = collective_windows(hlo_text)
  rows, mb_total, mb_hidden, all_total, all_hidden = [], 0.0, 0.0, 0.0, 0.0
  for c in found:
    w = win[c.name]
    sent = max(collectives.device_bytes(c, n_devices).values(), default=0.0) * c.count
    hidden = w.is_async and w.compute_ops > 0
    phase = collectives.phase_of(c.op_name)
    all_total += sent
    all_hidden += sent if hidden else 0.0
    if phase in MICRO_BATCH_PHASES:
      mb_total += sent
      mb_hidden += sent if hidden else 0.0
    rows.append(
      {
        "name": c.name,
        "kind": c.kind,
        "phase": phase,
        "level": collectives.level_of(c, intra),
        "count_per_step": c.count,
        "bytes_per_device": sent,
        "async": w.is_async,
        "stream": (streams or {}).get(w.start_name) if w.is_async else "compute (sync)",
        "compute_in_window": w.compute_ops,
        "horing": "horing" in c.op_name,
        "op_name": c.op_name,
      }
    )
  steps = concurrent = 0
  intra_ring = [r for r in rows if r["horing"] and r["level"] == LEVEL_INTRA]
  for r in rows:
    if not (r["horing"] and r["kind"] == "collective-permute" and r["level"] == LEVEL_INTER):
      continue
    steps += r["count_per_step"]
    w = win[r["name"]]
    if streams and any(
      w.is_async
      and q["async"]
      and _overlaps(w, win[q["name"]])
      and q["stream"] not in (None, r["stream"])
      for q in intra_ring
    ):
      concurrent += r["count_per_step"]
  return {
    "collective_bytes_fraction": mb_hidden / mb_total if mb_total else None,
    "step_collective_bytes_fraction": all_hidden / all_total if all_total else None,
    "async_collectives": sum(r["async"] for r in rows),
    "sync_collectives": sum(not r["async"] for r in rows),
    "streams": sorted({r["stream"] for r in rows if r["async"] and r["stream"]}),
    "horing_steps": steps,
    "horing_steps_concurrent": concurrent if streams else None,
    "collectives": rows,
  }
