"""Probe profiles for the planner: read a `paro-jax probe` JSON, turn its fits into link costs."""

from __future__ import annotations

import json

from paro_jax.core.names import LEVELS, SCHEDULE_COLLECTIVES


def load_profile(path: str) -> dict:
  """A `paro-jax probe` JSON; clear errors for a missing or malformed file."""
  try:
    with open(path) as f:
      profile = json.load(f)
  except FileNotFoundError:
    raise ValueError(
      f"profile {path!r} does not exist: write one with `paro-jax probe --out {path}`"
    ) from None
  except json.JSONDecodeError as e:
    raise ValueError(
      f"profile {path!r} is not JSON ({e}); write it with `paro-jax probe`"
    ) from None
  if not isinstance(profile, dict) or not isinstance(profile.get("collectives"), dict):
    raise ValueError(f"profile {path!r} has no 'collectives' table; write it with `paro-jax probe`")
  return profile


def measured_links(profile: dict) -> dict:
  """{(collective, level): (bandwidth, latency)} of a profile, for Links.measured."""
  out = {}
  for kind, levels in profile.get("collectives", {}).items():
    for level, fit in levels.items():
      if kind in SCHEDULE_COLLECTIVES and level in LEVELS and fit.get("bandwidth", 0) > 0:
        out[(kind, level)] = (float(fit["bandwidth"]), max(0.0, float(fit.get("latency", 0.0))))
  return out
