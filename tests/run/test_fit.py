"""A run that cannot fit is refused before anything is compiled, in one line with the planner's
estimate and the fix."""

import dataclasses
import os

import pytest

from paro_jax import cli
from paro_jax.run import fit
from paro_jax.run.config import RunConfig
from paro_jax.run.train import build

FIXTURE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hf_tiny"
)


def refused(tmp_path, capsys, *argv):
  """Train with `argv`: the one error line (the run directory was never made: build() failed,
  and build compiles nothing)."""
  out = tmp_path / "run"
  with pytest.raises(SystemExit) as e:
    cli.main(["train", *argv, "--out", str(out)])
  err = capsys.readouterr().err
  lines = [x for x in err.splitlines() if x.startswith("paro-jax: error:")]
  assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err
  assert not out.exists()
  return lines[0]


def test_a_sequence_length_that_cannot_fit_is_refused(tmp_path, capsys):
  line = refused(tmp_path, capsys, "--model", "tiny", "--mesh", "2x4", "--seq-len", "100000")
  assert "this run needs about" in line and "2 sequence(s) of 100000 tokens" in line
  assert "available host memory shared by 8 CPU devices" in line
  assert "lower --seq-len or --batch-size" in line and "--no-memory-check" in line


def test_65b_on_eight_cpu_devices_is_refused(tmp_path, capsys):
  line = refused(tmp_path, capsys, "--model", "65b", "--mesh", "1x8", "--strategy", "GGG")
  # 65.2e9 parameters x (2 + 2 + 12) bytes / 8 devices: the model states alone.
  assert "model states 121.6 GiB with strategy GGG" in line
  assert "shards more" not in line  # GGG already shards everything


def test_a_longer_sequence_than_the_hf_model_has_positions_is_refused(tmp_path, capsys):
  line = refused(tmp_path, capsys, "--init-from", FIXTURE, "--mesh", "2x4", "--seq-len", "4096")
  assert "--seq-len 4096 is longer than the 2048 positions of" in line
  assert "pass --seq-len 2048 or less" in line


def test_the_check_compares_the_estimate_with_the_device_memory(monkeypatch):
  cfg = RunConfig(model="tiny", mesh=(2, 4), batch_size=16, seq_len=64)
  # The planner's estimate for this run, computed independently of fit.py's call.
  from paro_jax.analysis.costs import model_state_bytes
  from paro_jax.analysis.planner import Workload, activation_bytes
  from paro_jax.core.strategy import parse_strategy
  from models.llama import get_config

  strategy, model = parse_strategy("IIG"), get_config("tiny")
  w = Workload(model, micro_batch=2, micro_batches=1, seq_len=64, itemsize=2)
  need = model_state_bytes(strategy, model.param_count(), model.param_count(), 2, 4)["total"]
  need += activation_bytes(strategy, w, 2, 4)["total"]
  monkeypatch.setattr(fit, "device_memory", lambda devices: (need, "the test's memory"))
  build(cfg)  # exactly enough: accepted
  monkeypatch.setattr(fit, "device_memory", lambda devices: (need - 1, "the test's memory"))
  with pytest.raises(ValueError, match="more than the the test's memory"):
    build(cfg)
  build(dataclasses.replace(cfg, memory_check=False))  # the user's call
