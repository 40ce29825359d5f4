"""metrics.jsonl: one strict-JSON object per step (NaN and Inf written as null). No jax."""

from __future__ import annotations

import json
import math
import warnings

METRICS = "metrics.jsonl"  # in the run directory (train's --out)


def read_rows(metrics_path: str) -> list[dict]:
  """The rows of a metrics.jsonl; a truncated last line (a run killed while writing) is
  dropped with a warning, any other bad line is an error naming the file and line."""
  with open(metrics_path) as f:
    lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
  rows = []
  for i, (n, line) in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      if i == len(lines) - 1 and not line.endswith("\n"):
        warnings.warn(f"{metrics_path}:{n}: ignoring a truncated last line", stacklevel=2)
        continue
      raise ValueError(
        f"{metrics_path}:{n} is not a JSON object ({e}): fix or delete that line"
      ) from e
    if not isinstance(rows[-1], dict) or "step" not in rows[-1]:
      raise ValueError(f"{metrics_path}:{n} is not a metrics row (no step): fix or delete it")
  return rows


def dump_row(row: dict) -> str:
  """One metrics.jsonl line; strict JSON: NaN and Inf are written as null."""
  clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
  return json.dumps(clean, allow_nan=False) + "\n"
