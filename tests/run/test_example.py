"""examples/custom_loop.py: a script of its own trains through the public API
(paro_jax/__init__.py)."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_custom_loop_trains():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = REPO
  proc = subprocess.run(
    [sys.executable, os.path.join(REPO, "examples", "custom_loop.py"), "--steps", "16"],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
  assert len(losses) == 4, proc.stdout  # steps 0, 5, 10 and 15 (the last)
  # Byte-level tokens start near ln(256) = 5.55; 16 steps of AdamW at 3e-3 take off over a nat.
  assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0, losses
