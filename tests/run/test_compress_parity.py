"""CI loss parity: `tiny` on the built-in corpus, IIG on 2x4, 300 steps (short sequences to keep
it affordable), int8 inter-node gradient reduction against the uncompressed run with the same seed
and batches: the eval loss at step 300 within 1.5%.

Gradients only: int8 *parameter* gathers do not meet the target yet (+4.4% at step 300 with
64-token sequences, experiments/results/compress_parity.md), and a shorter-sequence run that
happened to pass would only hide that.

The two runs share everything but the wire format; the check also asks that the runs differ (the
int8 path was taken) and that training did learn (the loss fell well below its start), so a step
that does nothing, or ignores the flags, fails it.
"""

import json
import os

import pytest

from paro_jax.run.train import RunConfig, train

STEPS = 300


def eval_losses(tmp, grads):
  cfg = RunConfig(
    model="tiny",
    strategy="IIG",
    mesh=(2, 4),
    batch_size=16,
    seq_len=32,
    steps=STEPS,
    warmup=10,
    eval_every=STEPS // 3,
    inter_grads=grads,
    out=os.path.join(tmp, grads),
  )
  rows = [json.loads(line) for line in open(train(cfg))]
  return [r["eval_loss"] for r in rows if "eval_loss" in r], [r["loss"] for r in rows]


@pytest.mark.benchmark
def test_iig_int8_gradients_eval_loss_within_1_5_percent(tmp_path):
  same, same_train = eval_losses(str(tmp_path), "same")
  int8, int8_train = eval_losses(str(tmp_path), "int8")
  assert len(same) == len(int8) == 3
  assert same[-1] < 0.6 * same_train[0]  # it learned
  assert int8_train != same_train  # int8 did cross the wire
  assert int8[-1] == pytest.approx(same[-1], rel=0.015), (int8, same)
