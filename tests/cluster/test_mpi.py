"""`mpirun -np 2 paro-jax train`: JAX's own Open MPI detection joins the two processes
(paro_jax/cluster/distributed.py).

Marker `mpi`: not in the default run (`python -m pytest -m mpi -q -n0 tests/cluster/test_mpi.py`);
skipped where Open MPI's `mpirun` is missing (Debian package openmpi-bin). JAX reads Open MPI's
environment (OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_*): no mpi4py is needed.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.cluster.repro_bound import multiprocess_bound
from tests.fast_compile import FAST_COMPILE

pytestmark = pytest.mark.mpi

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = "train --model tiny --strategy IIG --batch-size 8 --seq-len 16 --warmup 1 --steps 6 "
TRAIN += "--dtype fp32 --mesh 2x4"
RTOL = multiprocess_bound()  # measured: two-process fp32 runs are not bit-reproducible


def _env() -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = FAST_COMPILE
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
  return env


def _losses(out) -> list[float]:
  return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _mpirun_is_open_mpi() -> bool:
  if not shutil.which("mpirun"):
    return False
  version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
  return "Open MPI" in version


@pytest.mark.skipif(not _mpirun_is_open_mpi(), reason="no Open MPI mpirun (apt-get openmpi-bin)")
def test_mpirun_two_processes_match_one(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  cmd = [sys.executable, "-m", "paro_jax", *TRAIN.split()]
  proc = subprocess.run([*cmd, "--out", str(one)], env=_env(), capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  mpirun = ["mpirun", "-np", "2", "--oversubscribe", "--tag-output"]
  if os.geteuid() == 0:
    mpirun.append("--allow-run-as-root")
  proc = subprocess.run(
    [*mpirun, *cmd, "--out", str(two)], env=_env(), capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "on mesh 2x4 (8 cpu devices)" in proc.stdout
  rows = [line for line in proc.stdout.splitlines() if '{"step"' in line]
  assert len(rows) == 6 and all(line.startswith("[1,0]<stdout>:") for line in rows), rows
  np.testing.assert_allclose(_losses(two), _losses(one), rtol=RTOL)
