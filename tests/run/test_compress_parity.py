"""CI loss parity: `tiny` on the built-in corpus, IIG on 2x4, int8 inter-node parameter syncs and
gradient reductions (error feedback and the delta parameter sync on, their defaults) against the
uncompressed run with the same seed and batches (CI_RUN: short sequences and 150 steps to keep it
affordable): the eval losses at the end within THRESHOLD.

The two runs share everything but the wire format; the check also asks that the runs differ (the
int8 path was taken) and that training did learn (the loss fell well below its start), so a step
that does nothing, or ignores the flags, fails it. The threshold's margins, measured with the
real quantizer and with broken ones at this very run, are in
experiments/results/compress_parity/ci_margin/margin.md (its page names the retired script that
measured them and the commit to rerun it at); the second test checks that page still puts the
threshold between them and was measured at this very run.
"""

import json
import os

from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.run.train import train

# The CI test's run (the margin page records it as `ci_run`).
CI_RUN = dict(
  model="tiny",
  strategy="IIG",
  mesh=(2, 4),
  batch_size=16,
  seq_len=32,
  steps=150,
  warmup=10,
  eval_batches=16,
  dtype="fp32",
)
# |eval-loss gap| allowed: between the measured gaps of the correct and the broken quantizers
# (margin.md). One pair of runs differs by about 1-2% with no compression error at all (a
# trajectory perturbed anywhere drifts: experiments/results/compress_parity/), so the threshold
# catches gross breaks (saturation, misplaced scales), not subtle ones: those are
# tests/core/test_compress.py's (its round-trip bounds).
THRESHOLD = 0.04
# The broken quantizers the threshold must catch (measured beyond it on the page).
CAUGHT = ("saturating", "swapped")

MARGIN = os.path.join(
  os.path.dirname(__file__), "../../experiments/results/compress_parity/ci_margin/margin.json"
)


def run(tmp, wire):
  paths = {"steps": "optimizer.steps", "warmup": "optimizer.warmup", "eval_batches": "eval.batches"}
  options = {paths.get(k, k): v for k, v in CI_RUN.items()}  # CI_RUN names its flags
  options |= {"eval.every": CI_RUN["steps"], "wire.inter_params": wire, "wire.inter_grads": wire}
  cfg = make_config(RunConfig, {**options, "out": os.path.join(tmp, wire)})
  rows = [json.loads(line) for line in open(train(cfg))]
  return [r["eval_loss"] for r in rows if "eval_loss" in r], [r["loss"] for r in rows]


def test_iig_int8_eval_loss_within_threshold(tmp_path):
  same, same_train = run(str(tmp_path), "same")
  int8, int8_train = run(str(tmp_path), "int8")
  assert len(same) == len(int8) == 1
  assert same[-1] < 0.6 * same_train[0]  # it learned
  assert int8_train != same_train  # int8 did cross the wire
  assert abs(int8[-1] / same[-1] - 1) <= THRESHOLD, (int8, same)


def test_threshold_separates_correct_and_broken_quantizers():
  """The measured margins: the real quantizer's gap within the threshold, the broken ones it is
  meant to catch beyond it (measured at CI_RUN, which must still be this test's run)."""
  with open(MARGIN) as f:
    page = json.load(f)
  assert page["ci_run"] == {k: list(v) if isinstance(v, tuple) else v for k, v in CI_RUN.items()}
  assert page["threshold"] == THRESHOLD
  results = page["results"]
  assert abs(results["correct"]["gap"]) <= THRESHOLD
  assert set(CAUGHT) <= set(results) and list(page["caught"]) == list(CAUGHT)
  assert all(abs(results[k]["gap"]) > THRESHOLD for k in CAUGHT), results
