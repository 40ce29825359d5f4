"""A GPU kernel's time: its roofline (analysis/gpu/roofline.py: the FLOPs it computes at the rate
its operands run at, the bytes it moves) at the share of the peaks the GPU's kernels reach,
measured on one H100 (`H100`)."""

from __future__ import annotations

import dataclasses

from paro_jax.analysis.gpu import roofline


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """The share of the peaks a GPU's kernels reach: a matmul's FLOP/s (of the rate its operands
  run at), cuDNN's fused attention's FLOP/s, and a memory-bound kernel's bandwidth."""

  matmul: float = 1.0
  attention: float = 1.0
  memory: float = 1.0


PEAK = Efficiency()  # the plain roofline: a lower bound
# Measured on one H100 SXM (experiments/results/gpu_measure/: 15 runs of 7b's, 13b's and the
# small model's step, each kernel's time from a profiler trace) against the roofline of the same
# programs compiled here (experiments/results/gpu_reestimate/): over all 15, the measured kernel
# time of each kind over its roofline at the peaks (a ratio of sums): matmuls 1 / 0.747 (cuBLAS
# and Triton GEMMs at 74.7% of 989 TFLOP/s), cuDNN's attention 1 / 0.359, the memory-bound
# kernels 1 / 0.819 (2.74 of 3.35 TB/s).
H100 = Efficiency(matmul=0.747, attention=0.359, memory=0.819)


def kernel_seconds(
  instr: roofline.Instr, comps: dict, types: dict, peak_flops: float, memory_bandwidth: float,
  efficiency: Efficiency = PEAK,
) -> float:  # fmt: skip
  """One kernel's time at `efficiency` of the peaks: max(FLOPs / the rate its matmuls reach,
  bytes / the bandwidth it reaches); a kernel without FLOPs is memory-bound."""
  moved = roofline.kernel_bytes(instr, comps, types)
  flops = roofline.instruction_flops(instr, comps, types)
  if not flops:
    return moved / (memory_bandwidth * efficiency.memory)
  share = efficiency.attention if roofline.is_attention(instr) else efficiency.matmul
  rate = roofline.matmul_peak(instr, comps, types, peak_flops) * share
  return max(flops / rate, moved / memory_bandwidth)


def computation_seconds(
  comps: dict, name: str, peak_flops: float, memory_bandwidth: float, only=None,
  efficiency: Efficiency = PEAK,
) -> float:  # fmt: skip
  """The time of one computation's kernels (those `only` accepts, when given), one after the
  other, at `efficiency` of the peaks (PEAK: the plain roofline)."""
  instrs = comps.get(name, [])
  types = {i.name: i.type_text for i in instrs}
  return sum(
    kernel_seconds(i, comps, types, peak_flops, memory_bandwidth, efficiency)
    for i in instrs
    if only is None or only(i)
  )
