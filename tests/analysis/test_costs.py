"""costs.py against the formulas of docs/design.md, transcribed case by case."""

import pytest

from paro_jax.analysis.planner.costs import model_state_bytes, step_traffic
from paro_jax.core.strategy import VALID_NAMES, parse_strategy

PSI, G, M, A = 1_000_000, 2, 4, 3
N = G * M


def paro_md_inter_bytes(name):
  """Inter-group bytes per device and step, written from docs/design.md's per-case list."""
  p, gr, os_ = name
  psi = PSI
  total = 0.0
  if p == "G":
    total += A * 2 * (N - 1) / N * 2 * psi
  if gr == "G":
    total += A * (N - 1) / N * 2 * psi
  total += {
    ("I", "G"): (G - 1) / G * 2 * psi / M,
    ("I", "I"): 2 * (G - 1) / G * 2 * psi / M,
    ("N", "G"): (N - 1) / N * 2 * psi,
    ("N", "I"): 2 * (G - 1) / G * 2 * psi / M,
    ("N", "N"): 2 * (N - 1) / N * 2 * psi,
  }.get((gr, os_), 0.0)
  total += {("G", "I"): (G - 1) / G * 2 * psi / M, ("G", "N"): (N - 1) / N * 2 * psi}.get(
    (os_, p), 0.0
  )
  return total


def paro_md_intra_bytes(name):
  p, gr, os_ = name
  total = 0.0
  if p == "I":
    total += A * 2 * (M - 1) / M * 2 * PSI
  if gr == "I":
    total += A * (M - 1) / M * 2 * PSI
  if (gr, os_) == ("N", "I"):
    total += (M - 1) / M * 2 * PSI
  if (os_, p) == ("I", "N"):
    total += (M - 1) / M * 2 * PSI
  return total


@pytest.mark.parametrize("name", VALID_NAMES)
def test_traffic_matches_paro_md(name):
  t = step_traffic(parse_strategy(name), PSI, PSI, G, M, A)
  assert t.inter == pytest.approx(paro_md_inter_bytes(name))
  assert t.intra == pytest.approx(paro_md_intra_bytes(name))


def test_two_level_rings_split_each_collective_by_level():
  """GGG with the two-level rings: each all-gather / reduce-scatter of S bytes over all G*M
  devices sends (M-1)/M * S inside the node and (G-1)/G * S/M across nodes (H-Ring's levels);
  the same total per device as one flat ring, (GM-1)/(GM) * S."""
  flat = step_traffic(parse_strategy("GGG"), PSI, PSI, G, M, A)
  rings = step_traffic(parse_strategy("GGG"), PSI, PSI, G, M, A, two_level=True)
  S = 2 * PSI  # bf16 parameters or gradients
  per_collective = {"intra": (M - 1) / M * S, "inter": (G - 1) / G * S / M}
  # Per micro-batch: forward gather, backward re-gather, gradient reduce-scatter; GGG has no
  # boundary collectives (everything is sharded over all devices already).
  assert rings.intra == pytest.approx(3 * A * per_collective["intra"])
  assert rings.inter == pytest.approx(3 * A * per_collective["inter"])
  assert rings.intra + rings.inter == pytest.approx(flat.inter + flat.intra)
  # Strategies whose collectives span one axis each are unchanged.
  for name in ("IIG", "NNI", "III"):
    one, two = (step_traffic(parse_strategy(name), PSI, PSI, G, M, A, two_level=b) for b in (0, 1))
    assert (one.intra, one.inter) == pytest.approx((two.intra, two.inter)), name


def test_inter_traffic_frequency():
  # Inter traffic grows with A only when gradients or parameters are globally sharded.
  for name in VALID_NAMES:
    s = parse_strategy(name)
    one, eight = (step_traffic(s, PSI, PSI, G, M, a).inter for a in (1, 8))
    assert (eight > one) == ("G" in name[:2]), name


@pytest.mark.parametrize(
  "name,expected",
  [
    ("NNN", 2 + 2 + 12),
    ("GGG", (2 + 2 + 12) / 8),
    ("IIG", 2 / 4 + 2 / 4 + 12 / 8),
    ("ING", 2 / 4 + 2 + 12 / 8),
    ("NIG", 2 + 2 / 4 + 12 / 8),
  ],
)
def test_memory_formula(name, expected):
  assert model_state_bytes(parse_strategy(name), PSI, PSI, G, M)["total"] == pytest.approx(
    expected * PSI
  )
