"""Accelerators: peak FLOP/s (for MFU and the planner) and the GPU models the planner knows.

One table of peaks, matched against jax's `device_kind`; the planner's GPU list refers to it by
kind, so a peak is written once.
"""

from __future__ import annotations

import dataclasses

from paro_jax.core.units import GB

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, matched against
# jax's `device_kind` by substring, most specific first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
  ("H200", 989e12),
  ("H100 PCIe", 756e12),
  ("H100", 989e12),  # SXM
  ("A100", 312e12),
  ("A10G", 125e12),  # AWS's A10; NVIDIA publishes no separate figure: taken as the A10's
  ("A10", 125e12),
  ("L40S", 362e12),
  ("L4", 121e12),
  ("V100", 125e12),  # no bf16: its fp16 tensor-core peak
)
# Tensor cores run an fp32 matmul as TF32 at half the dense bf16 rate on A100, H100 and H200
# (datasheets, dense: A100 156 / 312, H100 SXM 494.7 / 989.4, H200 494.7 / 989.4 TFLOP/s).
TF32_OVER_BF16 = 0.5


def peak_flops(device_kind: str) -> float | None:
  """Peak bf16 FLOP/s of one device of this kind; None when unknown (e.g. CPU)."""
  for name, flops in PEAK_BF16_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return None


def mfu(flops_per_step: float, step_time_s: float, devices: int, device_kind: str) -> float | None:
  """Model FLOPs per second over the devices' summed peak; None when the peak is unknown."""
  peak = peak_flops(device_kind)
  if peak is None or step_time_s <= 0:
    return None
  return flops_per_step / step_time_s / (peak * devices)


@dataclasses.dataclass(frozen=True)
class Gpu:
  """A GPU model: its peak (from PEAK_BF16_FLOPS above), nominal memory (10^9 bytes per GB) and
  the bandwidth each device has to the others of its node, in one direction (half the vendors'
  bidirectional NVLink figure; PCIe x16 for the cards without NVLink)."""

  name: str
  kind: str  # the key into PEAK_BF16_FLOPS
  memory_bytes: float
  intra_bandwidth: float  # bytes/s per device and direction inside a node
  intra_link: str  # what carries it

  @property
  def peak_flops(self) -> float:
    return peak_flops(self.kind)


# Nominal capacities in 10^9 bytes: a little below the real 2^30-byte GB of most cards, which
# errs on the safe side.
# Intra-node links from the datasheets, per direction: NVLink 3 (A100 SXM) 600 GB/s, NVLink 4
# (H100/H200 SXM) 900 GB/s, NVLink 2 (V100 SXM2) 300 GB/s bidirectional; PCIe 5.0 x16 64 GB/s and
# PCIe 4.0 x16 32 GB/s per direction.
NVLINK3, NVLINK4, NVLINK2 = 300 * GB, 450 * GB, 150 * GB
PCIE5, PCIE4 = 64 * GB, 32 * GB
GPUS: dict[str, Gpu] = {
  "a100-40gb": Gpu("A100 40GB", "A100", 40 * GB, NVLINK3, "NVLink 3"),
  "a100-80gb": Gpu("A100 80GB", "A100", 80 * GB, NVLINK3, "NVLink 3"),
  "h100": Gpu("H100 SXM 80GB", "H100", 80 * GB, NVLINK4, "NVLink 4"),
  "h100-pcie": Gpu("H100 PCIe 80GB", "H100 PCIe", 80 * GB, PCIE5, "PCIe 5.0 x16"),
  "h200": Gpu("H200 141GB", "H200", 141 * GB, NVLINK4, "NVLink 4"),
  "l40s": Gpu("L40S 48GB", "L40S", 48 * GB, PCIE4, "PCIe 4.0 x16"),
  "l4": Gpu("L4 24GB", "L4", 24 * GB, PCIE4, "PCIe 4.0 x16"),
  "a10g": Gpu("A10G 24GB", "A10G", 24 * GB, PCIE4, "PCIe 4.0 x16"),
  "v100-16gb": Gpu("V100 16GB", "V100", 16 * GB, NVLINK2, "NVLink 2"),
  "v100-32gb": Gpu("V100 32GB", "V100", 32 * GB, NVLINK2, "NVLink 2"),
}
