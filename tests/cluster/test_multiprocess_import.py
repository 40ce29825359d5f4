"""`train --init-from` across processes (paro_jax/hf/stream.py): each process places only its own
devices' slices of the HF weights, and two processes of 2 devices train exactly as one process of
4 on the same mesh; so does a LoRA run, whose frozen base is placed at P."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.cluster.test_multiprocess import REPO, _env, _losses, launch_on_loopback

FIXTURE = os.path.join(REPO, "tests", "fixtures", "hf_llama", "llama3_gqa")
TEXT = os.path.join(REPO, "tests", "fixtures", "hf_llama", "text.txt")


def _train(out, *extra):
  return [
    "train",
    "--init-from",
    FIXTURE,
    "--data",
    TEXT,
    "--strategy",
    "GGG",
    "--batch-size",
    "4",
    "--seq-len",
    "16",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--lr",
    "1e-4",
    "--dtype",
    "fp32",
    "--out",
    str(out),
    *extra,
  ]


@pytest.mark.parametrize("lora", [(), ("--lora-rank", "4")], ids=["full", "lora"])
def test_two_processes_import_and_train_as_one(tmp_path, lora):
  ref = subprocess.run(
    [sys.executable, "-m", "paro_jax", *_train(tmp_path / "one", *lora), "--mesh", "2x2"],
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert ref.returncode == 0, ref.stderr[-3000:]
  out, _ = launch_on_loopback(_train(tmp_path / "two", *lora))
  assert "mesh 2x2 (4 cpu devices)" in out
  two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
  assert len(two) == 2
  # Step 1's loss is the imported weights' alone: exactly one process's. Later steps went
  # through the two processes' collectives, which sum in another order (as test_multiprocess).
  assert two[0] == one[0]
  np.testing.assert_allclose(two, one, rtol=1e-5)
