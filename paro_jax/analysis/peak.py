"""Peak dense bf16 FLOP/s of known accelerators, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

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


def peak_flops(device_kind: str) -> float | None:
  """Peak bf16 FLOP/s of one device of this kind; None when unknown (e.g. CPU)."""
  for name, flops in PEAK_BF16_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return None


def mfu(flops_per_step: float, step_time_s: float, devices: int,
        device_kind: str) -> float | None:
  """Model FLOPs per second over the devices' summed peak; None when the peak is unknown."""
  peak = peak_flops(device_kind)
  if peak is None or step_time_s <= 0:
    return None
  return flops_per_step / step_time_s / (peak * devices)
