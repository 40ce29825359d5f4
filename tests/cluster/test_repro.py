"""Bit-reproducible two-process fp32 training on CPU with `--collectives ring`.

XLA:CPU's own reduce-scatter over the devices of one process, inside the backward's layer loop,
does not sum in a fixed order when the run spans processes (the step probe in
experiments/results/multiprocess_repro/probe.md); the ring implementation (collective-permutes and
adds in a fixed order) does. Two identical launches must then agree to the bit on every logged
loss and gradient norm: with XLA's collectives the gradient norm already differs at step 1.
"""

import io
import json
import os


from paro_jax.cluster.launch import launch

FAST_COMPILE = "--xla_backend_optimization_level=0"  # same flag in both runs


def _env():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = FAST_COMPILE
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _run(out) -> list[tuple[float, float]]:
  argv = "train --model tiny --strategy IIG --batch-size 8 --seq-len 32 --steps 3 --warmup 1"
  argv = argv.split() + ["--dtype", "fp32", "--collectives", "ring", "--out", str(out)]
  log, err = io.StringIO(), io.StringIO()
  code = launch(argv, nodes=2, devices_per_node=2, shaped=False, env=_env(), stdout=log, stderr=err)
  assert code == 0, err.getvalue()[-3000:]
  assert "collectives=ring" in log.getvalue(), log.getvalue()[-2000:]
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [(r["loss"], r["grad_norm"]) for r in rows]


def test_two_process_ring_runs_are_bit_identical(tmp_path):
  first, second = _run(tmp_path / "a"), _run(tmp_path / "b")
  assert len(first) == 3
  assert first == second  # exact: floats read back from the same JSON text
