"""The loss-parity script's statistics (experiments/compress_parity.py): the interval of the mean
paired gap, the verdict against a target, the seeds a verdict would need; and its variant names."""

import pytest

from experiments import compress_parity as cp


def test_summary_interval_is_students_t():
  gaps = [0.01, -0.01, 0.02, 0.0, -0.02]  # mean 0, sample std sqrt(0.001 / 4) = 0.0158
  st = cp.summary(gaps)
  assert st["mean"] == pytest.approx(0.0, abs=1e-15)
  assert st["std"] == pytest.approx((0.001 / 4) ** 0.5)
  assert st["se"] == pytest.approx((0.001 / 4) ** 0.5 / 5**0.5)
  # t(0.975, 4 degrees of freedom) = 2.776 (printed tables).
  assert st["high"] == pytest.approx(2.776 * st["se"], rel=1e-3)
  assert st["low"] == pytest.approx(-st["high"])
  assert (st["min"], st["max"], st["n"]) == (-0.02, 0.02, 5)


def test_verdict_met_unresolved_and_not_met():
  tight = cp.summary([0.001, 0.002, 0.0, 0.001])  # interval about 0.1% +- 0.13%
  wide = cp.summary([0.02, -0.02, 0.01, -0.01])
  beyond = cp.summary([0.011, 0.012, 0.010, 0.011])
  assert cp.verdict(tight, 0.005) == "yes"
  assert cp.verdict(wide, 0.005) == "not resolved"
  assert cp.verdict(beyond, 0.005) == "**no**"
  assert cp.verdict(tight, None) == ""  # a variant without a target


def test_seeds_to_resolve():
  st = {"mean": 0.0, "std": 0.01, "n": 5}
  n = cp.seeds_to_resolve(st, 0.005)
  # The first n with t(0.975, n - 1) * 1% / sqrt(n) below 0.5%: t(16) = 2.120 gives 0.514% at
  # 17, t(17) = 2.110 gives 0.497% at 18.
  assert n == 18
  assert cp.seeds_to_resolve({"mean": 0.0, "std": 0.0, "n": 3}, 0.005) == 3
  assert cp.seeds_to_resolve({"mean": 0.005, "std": 0.01, "n": 5}, 0.005) is None


def test_variants_and_targets():
  assert cp.parse_variant("pint8-gint8-noef-b64")["int8_block"] == 64
  assert cp.parse_variant("psame-gsame-ring")["collectives"] == "ring"
  assert cp.target_of("pbf16-gbf16") == cp.TARGETS["bf16"]
  assert cp.target_of("pint8-gint8-nodelta") == cp.TARGETS["int8"]
  assert cp.target_of("psame-gsame-ring") is None
  with pytest.raises(ValueError, match="bad variant"):
    cp.parse_variant("pfp8-gint8")
