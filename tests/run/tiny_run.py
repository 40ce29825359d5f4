"""The small run the checkpoint and resume tests train (test_checkpoint.py,
test_feedback_resume.py), and the losses of a run directory. RUN's keys are the RunConfig
options' paths (paro_jax/core/config.py `options`):
`make_config(RunConfig, {**RUN, "checkpoints.every": 2})`."""

import json
import os

# `test` IIG on 2x4, A=2, 8 x 16 tokens, fp32, 6 steps (2 of warmup)
RUN = dict(
  model="test",
  strategy="IIG",
  mesh=(2, 4),
  micro_batches=2,
  batch_size=8,
  seq_len=16,
  dtype="fp32",
  **{"optimizer.steps": 6, "optimizer.warmup": 2},
)


def losses(run_dir):
  """(steps, losses) of the run in `run_dir`, from its metrics.jsonl."""
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return [r["step"] for r in rows], [r["loss"] for r in rows]
