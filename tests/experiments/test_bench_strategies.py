"""The strategy benchmark's pieces that need no cluster: link-rate mapping and its compile child."""

import json
import os
import subprocess
import sys

import pytest

from models.llama import get_config

from experiments import bench_strategies as bench

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "bench_strategies.py")


def test_regime_link_rates():
  # 5 GFLOP/s per device, 4 devices a node; paper cloud = 21,000 FLOP per (bf16) byte. With fp32
  # on the wire (4 bytes a value) the link is twice as fast: the same FLOP per value moved.
  regimes = {g["regime"]: g for g in bench.regimes_table(["paper_cloud", "1gbit"], 5e9, 4)}
  want_bps = 4 * 5e9 * (4 / 2) / 21_000 * 8
  assert regimes["paper_cloud"]["rate"] == f"{want_bps / 1e6:.0f}mbit"
  assert regimes["1gbit"]["rate_bps"] == 1e9
  assert regimes["1gbit"]["flop_per_byte"] == pytest.approx(4 * 5e9 * 2 / (1e9 / 8))
  assert list(regimes)[-1] == bench.UNSHAPED  # the reference runs last


def test_inspect_child_strategy_and_baseline():
  """The benchmark's compile child: a PaRO strategy's traffic is the formula's, and the plain-jit
  FSDP baseline (weights constrained to replicated per layer) gathers its weights."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = REPO
  proc = subprocess.run(
    [
      sys.executable,
      SCRIPT,
      "--child",
      "inspect",
      "--model",
      "test",
      "--names",
      "GGG,jit-fsdp",
      "--micro-batches",
      "1",
      "--batch-size",
      "8",
      "--seq-len",
      "8",
      "--dtype",
      "fp32",
      "--mesh",
      "2x4",
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("INSPECT "))
  out = json.loads(line[len("INSPECT ") :])
  ggg, fsdp = out["GGG/1"], out["jit-fsdp/1"]
  assert ggg["measured"]["inter_bytes"] == pytest.approx(ggg["expected"]["inter_bytes"], rel=0.01)
  # The baseline holds fp32 weights and both Adam moments, every leaf sharded 8 ways: 12 bytes a
  # parameter over 8 devices (the moments' step counter adds a few bytes).
  psi = get_config("test").param_count()
  assert fsdp["model_states_bytes"] == pytest.approx(12 * psi / 8, rel=0.01)
  # XLA's schedule gathers every fp32 weight at least once per step, (n-1)/n x 4 bytes x psi per
  # device; with activations batch-sharded it moves no more than a few times GGG's traffic.
  assert 7 / 8 * 4 * psi <= fsdp["measured"]["inter_bytes"] < 4 * ggg["measured"]["inter_bytes"]
