"""The divergence guard: a loss or gradient norm that leaves its running band stops the run with
one line naming the step, the value and the band, and the newest checkpoint saved before it,
which --keep never rotated away and from which --resume trains on normally."""

import json
import math
import os

import pytest

from paro_jax import cli
from paro_jax.run.divergence import DivergenceGuard, GuardConfig
from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.run.checkpoint import CHECKPOINTS
from paro_jax.run.stopping import Diverged, NonFiniteSteps
from paro_jax.run.train import train


# --- the band, without training -----------------------------------------------------------------
def test_the_loss_cap_applies_from_the_first_step():
  guard = DivergenceGuard(GuardConfig(), vocab=256)
  assert guard.cap == pytest.approx(2 * math.log(256))
  assert guard.observe(1, 11.0, 1.0) is None
  why = guard.observe(2, 11.2, 1.0)
  assert "loss 11.2 is above the loss cap 11.09" in why and guard.first == 2


def test_a_loss_or_norm_above_its_band_is_out_and_does_not_join_it():
  guard = DivergenceGuard(GuardConfig(window=4, min_history=4, patience=2), vocab=256)
  for step, loss in enumerate([4.0, 4.0, 4.0, 4.0], 1):
    assert guard.observe(step, loss, 1.0) is None
  assert guard.observe(5, 5.9, 9.9) is None  # below 1.5 x 4 and 10 x 1
  why = guard.observe(6, 6.9, 1.0)
  assert "loss 6.9 is above its band (1.5 x 4.475" in why  # mean of 4, 4, 4, 5.9
  assert not guard.tripped
  why = guard.observe(7, 4.0, 33.0)
  assert "gradient norm 33 is above its band (10 x 3.225" in why  # 1, 1, 1, 9.9
  assert guard.tripped and guard.first == 6 and "loss 6.9" in guard.first_why
  assert list(guard.losses) == [4.0, 4.0, 4.0, 5.9]  # the outliers stayed out
  assert guard.observe(8, 4.0, 1.0) is None and guard.streak == 0 and guard.first is None


def test_off_judges_only_non_finite_values():
  guard = DivergenceGuard(GuardConfig(mode="off"), vocab=256)
  assert guard.observe(1, 1e6, 1e6) is None
  assert guard.observe(2, math.nan, 1.0) == "loss nan"
  assert guard.observe(3, 1.0, math.inf) == "gradient norm inf"


def test_a_resumed_run_keeps_its_band():
  guard = DivergenceGuard(GuardConfig(window=3, min_history=3), vocab=256)
  for loss in (2.0, 2.0, 2.0, math.nan, 50.0):  # the non-finite and capped ones are left out
    guard.seed(loss, 1.0)
  assert list(guard.losses) == [2.0, 2.0, 2.0]
  assert "above its band" in guard.observe(4, 3.1, 1.0)


@pytest.mark.parametrize(
  "change,message",
  [
    ({"guard.mode": "loud"}, "--divergence-guard must be one of off, warn, stop"),
    ({"guard.loss_factor": 1.0}, "--divergence-loss-factor must be a finite number above 1"),
    ({"guard.patience": 0}, "--divergence-patience must be >= 1"),
    ({"guard.loss_cap": -1.0}, "--divergence-loss-cap must be >= 0"),
  ],
)
def test_bad_guard_flags_are_refused(change, message):
  with pytest.raises(ValueError, match=message):
    make_config(RunConfig, change)


# --- training runs --------------------------------------------------------------------------
HUGE = {
  "model": "test",
  "strategy": "IIG",
  "mesh": (2, 4),
  "batch_size": 8,
  "seq_len": 32,
  "optimizer.steps": 12,
  "dtype": "fp32",
  "checkpoints.every": 1,
  "checkpoints.keep": 1,
}


def rows_of(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def huge_lr(tmp_path_factory):
  """`--lr 1e30`, a checkpoint every step, --keep 1: (run dir, the error it stopped with)."""
  out = str(tmp_path_factory.mktemp("huge") / "run")
  with pytest.raises((Diverged, NonFiniteSteps)) as e:
    train(make_config(RunConfig, {**HUGE, "optimizer.lr": 1e30, "out": out}))
  return out, str(e.value)


def test_a_huge_lr_stops_naming_the_last_good_checkpoint(huge_lr):
  out, message = huge_lr
  rows = rows_of(out)
  # Warmup starts at lr 0: update 1 changes nothing, update 2 (lr 1e29) wrecks the weights, so
  # step 3 (the loss of checkpoint 2's weights) is the first sign and checkpoint 1 the last good.
  assert rows[1]["step"] == 2 and "out_of_band" not in rows[1] and "skipped" not in rows[1]
  assert "out_of_band" in rows[2] or "skipped" in rows[2]
  directory = os.path.join(out, CHECKPOINTS)
  assert "at step 3" in message or "first sign of divergence: step 3" in message
  assert f"the newest checkpoint before it is step 1 in {directory}" in message
  assert "diverged-2" in message
  # --keep 1 kept the last good one; the later one is set aside, not deleted.
  assert sorted(os.listdir(directory)) == ["1", "diverged-2"]


def test_resuming_the_named_checkpoint_with_a_sane_lr_trains_normally(huge_lr, tmp_path):
  out, _ = huge_lr
  sane = {**HUGE, "optimizer.lr": 3e-3, "checkpoints.keep": 3}
  with pytest.warns(UserWarning, match="--lr 0.003, but the checkpoint .* --lr 1e"):
    train(make_config(RunConfig, {**sane, "out": out, "checkpoints.resume": True}))
  # Update 1 ran at lr 0 in both runs: the resumed run is the uninterrupted sane run, exactly.
  fresh = str(tmp_path / "fresh")
  train(make_config(RunConfig, {**sane, "out": fresh}))
  resumed, want = rows_of(out), rows_of(fresh)
  assert [r["step"] for r in resumed] == list(range(1, 13))
  for got, ref in zip(resumed[1:], want[1:]):
    assert (got["loss"], got["grad_norm"]) == (ref["loss"], ref["grad_norm"])
  assert not any("out_of_band" in r or "skipped" in r for r in resumed)


def test_lr_30_on_tiny_stops_in_one_line(tmp_path, capsys):
  out = tmp_path / "run"
  argv = ["train", "--model", "tiny", "--strategy", "IIG", "--mesh", "2x4", "--lr", "30"]
  with pytest.raises(SystemExit) as e:
    cli.main([*argv, "--batch-size", "8", "--seq-len", "32", "--out", str(out)])
  err = capsys.readouterr().err
  lines = [x for x in err.splitlines() if x.startswith("paro-jax: error:")]
  assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err
  assert "training diverged at step" in lines[0] and "above the loss cap 11.09" in lines[0]
  assert "no checkpoint was saved before it: the same command starts over" in lines[0]
  rows = rows_of(out)
  assert len(rows) < 10 and rows[-1]["step"] < 50
