"""examples/custom_loop.py: a script of its own trains through the public API
(paro_jax/__init__.py)."""

import os
import re
import subprocess
import sys

from tests.fast_compile import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_custom_loop_trains():
  env = {**os.environ, "XLA_FLAGS": FAST_COMPILE, "PYTHONPATH": REPO}  # it adds its devices
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
