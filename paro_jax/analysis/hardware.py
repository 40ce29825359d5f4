"""Device and link figures for the planner: a table of GPUs and parsers for sizes and rates.

Sizes and rates are strings on the command line ('80GB', '300GB/s', '100gbit'); each parser
returns plain bytes or bytes per second and refuses anything else with an example.
"""

from __future__ import annotations

import dataclasses
import re

from paro_jax.analysis.peak import peak_flops

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Gpu:
  """A GPU model: its peak (from paro_jax.analysis.peak) and nominal memory (10^9 bytes per GB)."""

  name: str
  kind: str  # the key into paro_jax.analysis.peak.PEAK_BF16_FLOPS
  memory_bytes: float

  @property
  def peak_flops(self) -> float:
    return peak_flops(self.kind)


# Nominal capacities in 10^9 bytes: a little below the real 2^30-byte GB of most cards, which
# errs on the safe side.
GPUS: dict[str, Gpu] = {
    "a100-40gb": Gpu("A100 40GB", "A100", 40 * GB),
    "a100-80gb": Gpu("A100 80GB", "A100", 80 * GB),
    "h100": Gpu("H100 SXM 80GB", "H100", 80 * GB),
    "h100-pcie": Gpu("H100 PCIe 80GB", "H100 PCIe", 80 * GB),
    "h200": Gpu("H200 141GB", "H200", 141 * GB),
    "l40s": Gpu("L40S 48GB", "L40S", 48 * GB),
    "l4": Gpu("L4 24GB", "L4", 24 * GB),
    "a10g": Gpu("A10G 24GB", "A10G", 24 * GB),
    "v100-16gb": Gpu("V100 16GB", "V100", 16 * GB),
    "v100-32gb": Gpu("V100 32GB", "V100", 32 * GB),
}


# --- sizes and rates ---------------------------------------------------------------------------
_SI = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BIN = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}


def _prefix(p: str) -> float | None:
  p = p.lower()
  return _BIN.get(p) if p.endswith("i") else _SI.get(p)


def parse_size(text: str, what: str = "memory size") -> float:
  """'80GB' (10^9), '80GiB' (2^30), '512MiB', '1e9' -> bytes; a clear error otherwise."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(?:([kmgtpKMGTP]i?)?[bB])?\s*", str(text))
  factor = _prefix(m.group(2) or "") if m else None
  if not m or factor is None or float(m.group(1)) <= 0:
    raise ValueError(f"bad {what} {text!r}: write a positive number and a unit, e.g. 80GB "
                     f"(10^9 bytes) or 80GiB (2^30 bytes)")
  return float(m.group(1)) * factor


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
  """A rate -> bytes per second: '300GB/s' (bytes), '100Gb/s' or '100gbit' (bits), or any tc rate.

  In 'X/s' forms a capital B means bytes and a small b bits; tc's own units (gbit, mbps, ...)
  follow tc, where 'mbps' is megabytes per second.
  """
  from paro_jax.cluster.launch import parse_rate  # tc's units; stdlib only

  try:
    return parse_rate(text) / 8
  except ValueError:
    pass
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtTpP]i?)?(B|b|bit)/s\s*", str(text))
  factor = _prefix(m.group(2) or "") if m else None
  if not m or factor is None or float(m.group(1)) <= 0:
    raise ValueError(f"bad {what} {text!r}: write e.g. 300GB/s (bytes per second), 100Gb/s or "
                     f"100gbit (bits per second)")
  return float(m.group(1)) * factor / (8 if m.group(3) != "B" else 1)


def parse_latency(text: str, what: str = "latency") -> float:
  """'10us', '0.5ms', '0' -> seconds."""
  from paro_jax.cluster.launch import parse_delay

  try:
    return parse_delay(text)
  except ValueError:
    raise ValueError(f"bad {what} {text!r}: write e.g. 10us, 0.5ms or 0") from None


def human_bytes(x: float) -> str:
  """Decimal units, as GPU memory and --device-memory are given."""
  return f"{x / GB:.1f} GB" if x >= GB else f"{x / 1e6:.1f} MB"
