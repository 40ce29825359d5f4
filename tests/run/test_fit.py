"""A run that cannot fit is refused before anything is compiled, in one line with the planner's
estimate and the fix."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from paro_jax import cli
from paro_jax.analysis.planner import memory
from paro_jax.run.config import RunConfig
from paro_jax.run.setup import build

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
  from paro_jax.analysis.planner.costs import model_state_bytes
  from paro_jax.analysis.planner.memory import activation_bytes
  from paro_jax.analysis.planner.inputs import Workload
  from paro_jax.core.strategy import parse_strategy
  from models.presets import get_config

  strategy, model = parse_strategy("IIG"), get_config("tiny")
  w = Workload(model, micro_batch=2, micro_batches=1, seq_len=64, itemsize=2)
  need = model_state_bytes(strategy, model.param_count(), model.param_count(), 2, 4)["total"]
  need += activation_bytes(strategy, w, 2, 4)["total"]
  monkeypatch.setattr(memory, "available_memory", lambda devices: (need, "the test's memory"))
  build(cfg)  # exactly enough: accepted
  monkeypatch.setattr(memory, "available_memory", lambda devices: (need - 1, "the test's memory"))
  with pytest.raises(ValueError, match="more than the the test's memory"):
    build(cfg)
  build(dataclasses.replace(cfg, memory_check=False))  # the user's call


# A train whose every device has 1 GiB: each case below is refused, printing its estimate.
REFUSE_ALL = """
import json, sys
from paro_jax import cli
from paro_jax.analysis.planner import memory
memory.available_memory = lambda devices: (2**30, "1 GiB the test gives each device")
for argv in json.loads(sys.argv[1]):
  try:
    cli.main(argv)
  except SystemExit:
    pass
"""
GIB = 2**30


def plan_and_refusals(tmp_path, capsys, step, strategies):
  """`plan --json`'s memory for each of `strategies` on 4 nodes x 8 for the workload `step`,
  and train's refusal line for each (the train runs on 32 CPU devices in a process of its own),
  the figures the two print in common checked equal; ({strategy: memory}, {strategy: line})."""
  cli.main(
    ["plan", *step, "--nodes", "4", "--devices-per-node", "8", "--micro-batch", "1", "--json"]
  )
  planned = {e["strategy"]: e["memory"] for e in json.loads(capsys.readouterr().out)["ranking"]}
  runs = [
    ["train", *step, "--strategy", s, "--mesh", "4x8", "--batch-size", "32"]
    + ["--out", str(tmp_path / s)]
    for s in strategies
  ]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not the tests' 8 devices
  done = subprocess.run(
    [sys.executable, "-c", REFUSE_ALL, json.dumps(runs)],
    cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    env={**env, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=600,
  )
  refusals = [x for x in done.stderr.splitlines() if "this run needs about" in x]
  assert len(refusals) == len(strategies), done.stderr
  for s, line in zip(strategies, refusals):
    plan, states = planned[s], planned[s]["model_states"]
    assert f"needs about {plan['total'] / GIB:.1f} GiB per device" in line, (s, plan, line)
    assert f"model states {states['total'] / GIB:.1f} GiB with strategy {s}" in line, line
    assert not (tmp_path / s).exists()
  return planned, dict(zip(strategies, refusals))


def test_plan_and_trains_refusal_print_the_same_memory(tmp_path, capsys):
  """One memory model: `paro-jax plan --json` and the refusal of `paro-jax train` give the same
  per-device memory for the same workload (7b on 4 nodes x 8, micro-batches of one sequence of
  2048 tokens per device, A=8, int8 parameters and gradients), for a strategy with the error-
  feedback residual and the delta reference (NIG, IIG), with the residual alone (NNI) and with
  neither (GGG). The train runs on 32 CPU devices in a process of its own."""
  strategies = ("NIG", "IIG", "NNI", "GGG")
  step = ["--model", "7b", "--micro-batches", "8", "--seq-len", "2048", "--attention", "xla"]
  step += ["--inter-params", "int8", "--inter-grads", "int8"]
  planned, refusals = plan_and_refusals(tmp_path, capsys, step, strategies)
  for s, line in refusals.items():
    plan, states = planned[s], planned[s]["model_states"]
    assert f"activations {plan['activations']['total'] / GIB:.1f} GiB for 1 sequence(s)" in line
    for key, name in (("residual", "error-feedback residual"), ("reference", "delta reference")):
      assert (key in states) == (name in line), (s, key, line)
      if key in states:
        assert f"{name} {states[key] / GIB:.1f} GiB" in line
  # where the int8 corrections apply, and what they add (7b NIG: its residual and reference)
  assert {"residual", "reference"} <= set(planned["NIG"]["model_states"]) and "reference" not in (
    planned["NNI"]["model_states"]
  )
  assert not {"residual", "reference"} & set(planned["GGG"]["model_states"])


def test_plan_and_trains_refusal_agree_for_the_outer_loop(tmp_path, capsys):
  """The same for the outer loop (`--outer-sync 10` in 2 fragments, each exchanged a step late,
  an int8 pseudo-gradient): `plan`'s figure for each candidate, with the outer weights, momentum,
  residual and --outer-delay's kept weights in its model states, is the
  one train's refusal prints (III: OS = I, its residual over `inter`; NNI: the same, its
  parameters replicated)."""
  strategies = ("III", "NNI")
  step = ["--model", "7b", "--micro-batches", "8", "--seq-len", "2048", "--attention", "xla"]
  step += ["--outer-sync", "10", "--outer-fragments", "2", "--outer-delay", "1"]
  step += ["--inter-grads", "int8"]
  planned, refusals = plan_and_refusals(tmp_path, capsys, step, strategies)
  assert set(refusals) == set(strategies)
  for s in strategies:
    states = planned[s]["model_states"]
    # the outer state (docs/outer.md): fp32 outer weights and momentum over all 32 devices, and
    # the int8 wire's fp32 residual, each device's share of its node's pseudo-gradient (1/8)
    psi = 6738415616  # 7b, a multiple of 32
    assert states["outer"] == 8 * psi // 32 + 4 * psi // 8
    # --outer-delay's kept weights: one fp32 copy of the master weights at OS = I (1/8)
    assert states["kept"] == 4 * psi // 8
