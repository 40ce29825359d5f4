"""experiments/int8_error.py: its round trips and feedback against the engine's, and its
results page against its record (the page's conclusions must follow from the numbers)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import int8_error as ie
from paro_jax.core.compress import Codec, with_feedback

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "results", "int8_error")


def _x(n=1000, seed=0):
  return jax.random.normal(jax.random.key(seed), (n,)) * jnp.linspace(0.1, 3.0, n)


def test_stochastic_rounding_is_unbiased_and_noisier_than_nearest():
  """Each element lands on one of its two neighbouring int8 steps, the mean over draws is the
  element itself, and its mean-square error exceeds rounding to nearest's (the tail block of 1000
  = 31 x 32 + 8 elements has its own scale)."""
  x = _x()
  block = 32
  scale = np.repeat(np.abs(np.asarray(x)).reshape(-1)[:992].reshape(-1, block).max(1) / 127, block)
  scale = np.concatenate([scale, np.full(8, np.abs(np.asarray(x)[992:]).max() / 127)])
  near = np.asarray(ie.roundtrip(x, block, "nearest"))
  assert np.all(np.abs(near - x) <= scale / 2 * (1 + 1e-4))
  draws = np.stack(
    [np.asarray(ie.roundtrip(x, block, "stochastic", jax.random.key(k))) for k in range(400)]
  )
  # within one step (up to float32's rounding of x / scale, which XLA may compute as x * 1/scale)
  assert np.all(np.abs(draws - np.asarray(x)) <= scale * (1 + 1e-4))
  # The mean of 400 draws: each draw's error is within one step, so the mean's standard error is
  # at most scale / (2 sqrt(400)) = scale / 40; allow 5 of those.
  assert np.all(np.abs(draws.mean(0) - np.asarray(x)) < 5 * scale / 40)
  rms = lambda e: float(np.sqrt(np.mean(e**2)))
  assert rms(draws[0] - np.asarray(x)) > 1.2 * rms(near - np.asarray(x))


def test_error_feedback_is_the_engines():
  """One node's gradient with its residual through `grad_wire` equals core/compress.py's
  with_feedback (what the engine's boundary sync runs) for one chunk: the same sent values and
  the same new residual."""
  g, r = _x(640, 1), _x(640, 2) * 1e-3
  (q, [new]) = ie.grad_wire([{"w": g}], [{"w": r}], jax.random.key(0), (32, "nearest", True))
  corrected, residual = with_feedback(g[None], r, Codec("int8", 32))
  np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(residual))
  np.testing.assert_allclose(np.asarray(q["w"]), np.asarray(corrected[0] - residual), atol=1e-7)


def test_delta_sync_tracks_the_master_to_bf16s_rounding():
  """The delta sync's weights, over 50 small updates, stay within bf16's rounding of the master
  (what quantizing the change instead of the weight buys); the weights' own round trip is further
  off; keeping a part in bf16 leaves it at bf16(w) exactly."""
  w = {"embed": _x(512, 3), "layers": _x(2048, 4), "head": _x(512, 5)}
  ref = ie._bf16(w)
  key = jax.random.key(0)
  for step in range(50):
    w = jax.tree.map(lambda a, i=step: a + 1e-3 * jnp.sin(a * 7 + i), w)
    ref = ie.param_wire(w, ref, key, (32, "nearest", True, ()))
  err = ie.rel(ref, w)
  bf16 = ie.rel(ie._bf16(w), w)
  assert err < 1.5 * bf16, (err, bf16)
  plain = ie.param_wire(w, None, key, (32, "nearest", False, ()))
  assert ie.rel(plain, w) > 1.5 * bf16
  kept = ie.param_wire(w, None, key, (32, "nearest", False, ("embed", "head")))
  np.testing.assert_array_equal(np.asarray(kept["head"]), np.asarray(ie._bf16(w)["head"]))
  assert ie.rel(kept["layers"], w["layers"]) > 1.5 * ie.rel(ie._bf16(w)["layers"], w["layers"])


@pytest.fixture(scope="module")
def record():
  with open(os.path.join(PAGE, "error.json")) as f:
    return json.load(f)


def test_page_is_its_record(record):
  with open(os.path.join(PAGE, "error.md")) as f:
    assert f.read() == ie.report(record, record["argv"])
  assert record["setting"] == ie.SETTING and record["blocks"] == list(ie.BLOCKS)
  assert len(record["grads"]) == len(ie.grad_choices(ie.BLOCKS))
  assert len(record["params"]) == len(ie.param_choices(ie.BLOCKS))


def test_the_pages_conclusions_follow_from_its_numbers(record):
  """What the page says in words: error feedback brings the sum closer; stochastic rounding costs
  more error per step and per update and its sum is further off than feedback's; the delta sync
  keeps the weights closer to the master than their own round trip; smaller blocks, smaller
  errors (every rounding and feedback setting)."""
  f = ie.findings(record)
  assert f["ef_sum_gain"] > 1
  assert f["sr_step_cost"] > 1 and f["sr_update_cost"] > 1 and f["sr_sum_vs_ef"] > 1
  assert f["delta_vs_bf16"] < f["plain_vs_bf16"]
  for rounding in ie.ROUNDINGS:
    for ef in (True, False):
      rows = [r for r in record["grads"] if r["rounding"] == rounding and r["error_feedback"] == ef]
      errors = [r["step_error"] for r in sorted(rows, key=lambda r: r["block"])]
      assert errors == sorted(errors), (rounding, ef, errors)


def test_docs_quote_the_page(record):
  """docs/collectives.md, README.md and the parity page quote the findings as measured."""
  f = ie.findings(record)
  root = os.path.join(os.path.dirname(__file__), "..", "..")
  docs = open(os.path.join(root, "docs", "collectives.md")).read()
  readme = open(os.path.join(root, "README.md")).read()
  parity = open(os.path.join(root, "experiments", "results", "compress_parity", "README.md")).read()
  assert f["default_max_loss"] < 0.00005  # "under 0.005%"
  for text in (docs, readme, parity):
    assert "under 0.005%" in " ".join(text.split())
  docs = " ".join(docs.split())
  assert f"about {f['ef_sum_gain']:.0f}x closer than without feedback" in docs
  assert "1e-4" in docs and 0.5e-4 <= f["ef_sum_error"] < 1.5e-4
  assert f"{f['plain_vs_bf16']:.1f}x that, {ie.PART_NAMES[f['worst_part']]} the worst" in docs
  assert f"({f['sr_step_cost']:.1f}x a step's gradient error, {f['sr_update_cost']:.1f}x" in docs
  assert (
    f"block {f['finest']} would cut a step's gradient error {f['finest_step_gain']:.1f}x" in docs
  )
  assert f["delta_vs_bf16"] < 1.01  # "within bf16's own rounding"
