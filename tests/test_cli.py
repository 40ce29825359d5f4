import json
import os
import subprocess
import sys

import numpy as np
import pytest

from paro_jax.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_quick_start_run(tmp_path):
  """The README's training command in a fresh process: the CLI provides the 8 CPU devices itself,
  the run writes one metrics row per step, and the loss falls clearly over 50 steps."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = tmp_path / "run"
  cmd = [
    sys.executable,
    "-m",
    "paro_jax",
    "train",
    "--model",
    "tiny",
    "--strategy",
    "IIG",
    "--mesh",
    "2x4",
    "--micro-batches",
    "2",
    "--batch-size",
    "16",
    "--seq-len",
    "64",
    "--steps",
    "50",
    "--seed",
    "0",
    "--out",
    str(out),
  ]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "mesh 2x4 (8 cpu devices)" in proc.stdout
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 51))
  assert all({"loss", "tokens_per_s", "grad_norm"} <= r.keys() for r in rows)
  first, last = rows[0]["loss"], np.mean([r["loss"] for r in rows[-5:]])
  assert first > 5.0 and last < first - 1.5, (first, last)


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--strategy", "GNI"], "invalid strategy 'GNI'"),
    (["--strategy", "IXG"], "unknown strategy 'IXG'"),
    (["--mesh", "3x3"], "mesh 3x3 needs 9 devices but 8 are available"),
    (["--mesh", "2by4"], "bad --mesh '2by4'"),
    (["--data", "/nonexistent/corpus.txt"], "data file '/nonexistent/corpus.txt' does not exist"),
    (["--batch-size", "12"], "micro-batch size 12 is not divisible by the 8 devices"),
  ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    main(["train", "--steps", "1", "--out", str(tmp_path), "--mesh", "2x4", *argv])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_help_lists_every_alias_and_names_ignore_case(capsys):
  from paro_jax.core.strategy import ALIASES

  with pytest.raises(SystemExit):
    main(["train", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert all(f"{k}={v}" in text for k, v in ALIASES.items())
  assert "--max-bad-steps N" in text and "(default 3)" in text
  main(["plan", "--nodes", "2", "--devices-per-node", "8", "--gpu", "H100", "--json"])
  assert json.loads(capsys.readouterr().out)["inputs"]["gpu"] == "H100 SXM 80GB"
