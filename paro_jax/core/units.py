"""Units: sizes, rates, latencies and dtype sizes as the command line writes them. Imports no jax.

Sizes and rates are strings on the command line ('80GB', '300GB/s', '100gbit'); each parser
returns plain bytes, bits or bytes per second, or seconds, and refuses anything else with an
example of what it takes.
"""

from __future__ import annotations

import re

GB = 1e9

# Bytes per value of each compute dtype a run may choose (`--dtype`).
COMPUTE_DTYPE_BYTES = {"bf16": 2, "fp32": 4}

_RATE_UNITS = {
  "bit": 1,
  "kbit": 1e3,
  "mbit": 1e6,
  "gbit": 1e9,
  "tbit": 1e12,
  "bps": 8,
  "kbps": 8e3,
  "mbps": 8e6,
  "gbps": 8e9,
  "tbps": 8e12,
}


def parse_rate(text: str) -> float:
  """A tc rate ('1gbit', '500mbit', '100mbps') in bits per second; a clear error otherwise."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
  if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
    raise ValueError(
      f"bad rate {text!r}: write a number and one of {sorted(_RATE_UNITS)}, e.g. 1gbit or 500mbit"
    )
  return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def parse_delay(text: str | None) -> float:
  """'0.5ms' / '200us' / '0' -> seconds."""
  if text is None or text.strip() in ("", "0", "none"):
    return 0.0
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)\s*", text.lower())
  if not m:
    raise ValueError(f"bad latency {text!r}: write e.g. 0.5ms, 200us or 0")
  return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]


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
    raise ValueError(
      f"bad {what} {text!r}: write a positive number and a unit, e.g. 80GB "
      f"(10^9 bytes) or 80GiB (2^30 bytes)"
    )
  return float(m.group(1)) * factor


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
  """A rate -> bytes per second: '300GB/s' (bytes), '100Gb/s' or '100gbit' (bits), or any tc rate.

  In 'X/s' forms a capital B means bytes and a small b bits; tc's own units (gbit, mbps, ...)
  follow tc, where 'mbps' is megabytes per second.
  """
  try:
    return parse_rate(text) / 8
  except ValueError:
    pass
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtTpP]i?)?(B|b|bit)/s\s*", str(text))
  factor = _prefix(m.group(2) or "") if m else None
  if not m or factor is None or float(m.group(1)) <= 0:
    raise ValueError(
      f"bad {what} {text!r}: write e.g. 300GB/s (bytes per second), 100Gb/s or "
      f"100gbit (bits per second)"
    )
  return float(m.group(1)) * factor / (8 if m.group(3) != "B" else 1)


def parse_latency(text: str, what: str = "latency") -> float:
  """'10us', '0.5ms', '0' -> seconds."""
  try:
    return parse_delay(text)
  except ValueError:
    raise ValueError(f"bad {what} {text!r}: write e.g. 10us, 0.5ms or 0") from None


def human_bytes(x: float) -> str:
  """Decimal units, as GPU memory and --device-memory are given."""
  if x >= GB:
    return f"{x / GB:.1f} GB"
  return f"{x / 1e6:.1f} MB" if x >= 1e6 else f"{x / 1e3:.1f} kB"


def human_count(n: float) -> str:
  """A parameter count as people write it: 1.05M, 6.74B."""
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
