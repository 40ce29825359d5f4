"""CI loss parity: `tiny` on the built-in corpus, IIG on 2x4, int8 inter-node parameter syncs and
gradient reductions (error feedback and the delta parameter sync on, their defaults) against the
uncompressed run with the same seed and batches (experiments/compress_ci_margin.py CI_RUN: short
sequences and 150 steps to keep it affordable): the eval losses at the end within THRESHOLD.

The two runs share everything but the wire format; the check also asks that the runs differ (the
int8 path was taken) and that training did learn (the loss fell well below its start), so a step
that does nothing, or ignores the flags, fails it. The threshold's margins, measured with the
real quantizer and with broken ones at this very run, are in
experiments/results/compress_parity/ci_margin/margin.md; the second test checks that page still
puts the threshold between them.
"""

import json
import os

from experiments.compress_ci_margin import CAUGHT, CI_RUN, THRESHOLD
from paro_jax.run.train import RunConfig, train

MARGIN = os.path.join(
  os.path.dirname(__file__), "../../experiments/results/compress_parity/ci_margin/margin.json"
)


def run(tmp, wire):
  cfg = RunConfig(
    **CI_RUN,
    eval_every=CI_RUN["steps"],
    inter_params=wire,
    inter_grads=wire,
    out=os.path.join(tmp, wire),
  )
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
