"""A process's stderr under SLURM / mpirun (paro_jax/cluster/native_stderr.py): passed on as it
is, until a native fatal error (JAX's C++ client aborting the process): from there one line
naming it and the log, the error and its stack in the log."""

import os
import subprocess
import sys

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


def test_a_native_abort_is_one_line_and_its_stack_goes_to_the_log(tmp_path):
  log = tmp_path / "paro-jax.node1.log"
  native = open(os.path.join(FIXTURE, "jax_coordination_abort.txt"), "rb").read()
  code = (
    "import os, sys\n"
    "from paro_jax.cluster import native_stderr\n"
    f"native_stderr.fold({str(log)!r}, 'process 1: ')\n"
    "sys.stderr.write('paro-jax: warning: something\\n'); sys.stderr.flush()\n"
    "os.write(2, b'\\r 40%|####  | 4/10')\n"  # a progress bar's partial line: passed on at once
    "import time; time.sleep(0.5); os.write(2, b'\\n')\n"
    f"os.write(2, {native!r})\n"  # what JAX's client writes to fd 2 as it aborts the process
    "os.abort()\n"
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
  err = done.stderr.decode()
  assert done.returncode < 0  # SIGABRT, as before: only the terminal's text changes
  assert "Check failure" not in err and "@     0x" not in err, err
  lines = [line for line in err.replace("\r", "\n").splitlines() if line]
  assert lines[0] == "paro-jax: warning: something"
  assert lines[1] == " 40%|####  | 4/10"
  # the service's errors (and the lines continuing them) and the abort: one line here naming
  # the fatal error, all of it in the log
  assert len(lines) == 3, lines
  assert lines[2].startswith(
    "paro-jax: error: process 1: aborted by a native fatal error: Terminating process because "
    "the JAX distributed service detected fatal errors."
  )
  assert lines[2].endswith(f"(the rest of it and its stack are in {log})")
  kept = log.read_text()
  assert kept.startswith("E1126 23:06:49.468235") and "The tasks have crashed." in kept
  assert "*** Check failure stack trace: ***" in kept and "client.h:80" in kept


def test_other_native_lines_and_later_output_pass(tmp_path):
  """A native warning that is not the coordination's passes; after a folded one, the process's
  own next line passes again (a live process's output is never swallowed)."""
  log = tmp_path / "paro-jax.node1.log"
  code = (
    "import os\n"
    "from paro_jax.cluster import native_stderr\n"
    f"native_stderr.fold({str(log)!r}, 'process 1: ')\n"
    "os.write(2, b'W1127 01:53:03.971009   12762 gpu_helpers.cc:1] some XLA warning\\n')\n"
    "os.write(2, b'W1127 01:53:03.971009   12762 preemption_sync_manager.cc:147] Failed to "
    "retrieve preemption notice from coordination service: UNAVAILABLE\\n')\n"
    "os.write(2, b'Additional GRPC error information from remote target\\n')\n"
    "os.write(2, b'paro-jax: warning: the run goes on\\n')\n"
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
  assert done.returncode == 0
  assert done.stderr.decode().splitlines() == [
    "W1127 01:53:03.971009   12762 gpu_helpers.cc:1] some XLA warning",
    "paro-jax: warning: the run goes on",
  ]
  assert "Additional GRPC error information" in log.read_text()
