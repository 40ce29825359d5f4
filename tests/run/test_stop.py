"""Stopping `paro-jax train` with signals, in a real process: SIGTERM (preemption) and Ctrl-C
checkpoint the last finished step with its metrics row; a stop during the first compile leaves
nothing; a stop during an asynchronous save neither saves twice nor hangs."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.fast_compile import FAST_COMPILE, cache_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(out, *extra, steps=2000):
  env = {**os.environ, "XLA_FLAGS": FAST_COMPILE}  # the CLI adds its device count
  env["JAX_COMPILATION_CACHE_DIR"] = cache_dir()  # later processes hit the first one's compile
  # python -m paro_jax (paro_jax/__main__.py), as the launchers run it
  cmd = [sys.executable, "-m", "paro_jax", "train", "--model", "test", "--mesh", "2x4"]
  cmd += ["--batch-size", "8", "--seq-len", "16", "--dtype", "fp32", "--warmup", "1"]
  cmd += ["--steps", str(steps), "--out", str(out), *extra]
  return subprocess.Popen(
    cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def _wait_for_row(proc, step):
  """Read stdout (one JSON row per step without a terminal) until `step` is logged."""
  for line in proc.stdout:
    if line.startswith("{") and json.loads(line)["step"] >= step:
      return
  pytest.fail(f"the run ended before step {step}: {proc.stderr.read()[-3000:]}")


def _finish(proc, timeout=120):
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, err


def _rows(out):
  if not (out / "metrics.jsonl").exists():
    return []
  return [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]


def _steps(out):
  d = out / "checkpoints"
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if d.exists() else []


def test_sigterm_checkpoints_the_last_finished_step(tmp_path):
  out = tmp_path / "run"
  proc = _start(out)
  _wait_for_row(proc, 3)
  proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc)
  assert code == 128 + signal.SIGTERM, err[-3000:]
  assert "SIGTERM: stopping after this step" in err and "Traceback" not in err
  rows = _rows(out)
  assert _steps(out) == [rows[-1]] and rows == list(range(1, rows[-1] + 1))
  # ... and the same command with --resume continues from it
  proc = _start(out, "--resume", steps=rows[-1] + 2)
  code, err = _finish(proc)
  assert code == 0, err[-3000:]
  assert _rows(out) == list(range(1, rows[-1] + 3))


def test_a_stop_during_the_first_compile_leaves_nothing(tmp_path):
  out = tmp_path / "run"
  proc = _start(out)
  for line in proc.stdout:  # the banner: the step is about to be compiled
    if line.startswith("paro-jax: test"):
      break
  proc.send_signal(signal.SIGINT)
  code, err = _finish(proc)
  assert code == 128 + signal.SIGINT, err[-3000:]
  assert _steps(out) == [] and _rows(out) == []
  # The same command (no --resume) is not refused.
  proc = _start(out, steps=2)
  assert _finish(proc)[0] == 0


def test_two_sigterms_during_the_first_compile_say_nothing_was_being_written(tmp_path):
  out = tmp_path / "run"
  proc = _start(out)
  for line in proc.stdout:  # the banner: the step is about to be compiled
    if line.startswith("paro-jax: test"):
      break
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc)
  assert code == 128 + signal.SIGTERM, err[-3000:]
  assert "stopped at once; no checkpoint was being written during the first compile" in err
  assert "is not kept" not in err and _steps(out) == []


@pytest.mark.parametrize("second", [False, True])
def test_ctrl_c_during_asynchronous_saves(tmp_path, second):
  """A checkpoint every step: Ctrl-C lands while one is being written. The stop saves no step
  twice; every checkpoint has its metrics row; a second Ctrl-C right after exits at once."""
  out = tmp_path / "run"
  proc = _start(out, "--checkpoint-every", "1", "--keep", "100")
  _wait_for_row(proc, 4)
  proc.send_signal(signal.SIGINT)
  if second:
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
  code, err = _finish(proc, timeout=60)  # no hang
  assert code == 128 + signal.SIGINT, err[-3000:]
  assert "already exists" not in err and "Traceback" not in err
  steps, rows = _steps(out), _rows(out)
  assert steps and set(steps) <= set(rows)
  assert steps == list(range(1, steps[-1] + 1))
  proc = _start(out, "--resume", "--checkpoint-every", "1", steps=steps[-1] + 1)
  code, err = _finish(proc)
  assert code == 0, err[-3000:]


def test_a_signal_after_a_stop_still_exits_with_its_code(monkeypatch):
  """After a stop the handler stays: a SIGTERM while the process shuts down (srun's, once another
  task has exited 143, while jax.distributed waits on it) exits 143, not by SIGTERM's default
  action; without a stop, leaving restores the handlers that were there before."""
  from paro_jax.run.stopping import StopSignals

  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

  class Exited(Exception):
    pass

  def fake_exit(code):
    raise Exited(code)

  monkeypatch.setattr(os, "_exit", fake_exit)
  monkeypatch.setattr(os, "write", lambda fd, data: len(data))
  try:
    with StopSignals():
      pass
    assert {s: signal.getsignal(s) for s in before} == before
    with StopSignals() as stop:
      stop._handle(signal.SIGTERM, None)  # the first SIGTERM: stop after this step
    handler = signal.getsignal(signal.SIGTERM)
    assert handler == stop._handle
    with pytest.raises(Exited) as e:
      handler(signal.SIGTERM, None)  # the one srun sends while the process shuts down
    assert e.value.args == (128 + signal.SIGTERM,)
  finally:
    for s, h in before.items():
      signal.signal(s, h)


# A signal raised inside a gc callback, as one can arrive while jax's runs: Python's own SIGINT
# handler raises KeyboardInterrupt there, which the interpreter prints as "Exception ignored"
# and drops; the process then runs on past it.
_SIGNAL_IN_A_GC_CALLBACK = """
import gc, os, signal
{install}
gc.callbacks.append(lambda phase, info: phase == "start" and os.kill(os.getpid(), signal.SIGINT))
gc.collect()
print("ran on", flush=True)
"""


@pytest.mark.parametrize(
  "install",
  ["", "from paro_jax.run.train_command import _exit_on_signals_until_the_loop as f; f()"],
)
def test_a_signal_before_the_loop_is_never_swallowed(install):
  """Before its loop takes the signals over, `paro-jax train` ends at once on SIGINT or SIGTERM
  (exit 128 + the signal, one line): a node of `paro-jax launch` whose KeyboardInterrupt was
  dropped in one of jax's gc callbacks ran on, and the launcher waited --stop-grace for it."""
  code = _SIGNAL_IN_A_GC_CALLBACK.format(install=install)
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
  if not install:  # the failure the handler is for: the interrupt is lost
    assert "ran on" in p.stdout and "Exception ignored" in p.stderr, p.stderr
  else:
    assert p.returncode == 128 + signal.SIGINT and "ran on" not in p.stdout, p.stderr
    assert "paro-jax: SIGINT before the first step: nothing to save; exiting" in p.stderr


_AFTER_THE_LOOP = """
import os, signal
from paro_jax.run.train_command import _exit_on_signals_until_the_loop as until_the_loop
from paro_jax.run.stopping import StopSignals

until_the_loop()
with StopSignals():
  pass
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
until_the_loop()
try:
  with StopSignals():
    raise ValueError("a collective failed")
except ValueError:
  os.kill(os.getpid(), signal.SIGTERM)  # srun's, while the failure is reported: noted
  print("reported", flush=True)
  os.kill(os.getpid(), signal.SIGTERM)  # a second one ends the process
  print("not reached", flush=True)
"""


def test_after_the_loop_signals_are_pythons_again_and_a_failure_is_reported_first():
  """The handler of before the loop is not given back when the loop ends: a run that finished
  has Python's own handlers again; a run whose loop failed (a collective with a lost process)
  says its one line before a first signal ends it (srun sends one to the other tasks once one is
  lost), and a second signal ends it at once."""
  p = subprocess.run(
    [sys.executable, "-c", _AFTER_THE_LOOP], cwd=REPO, capture_output=True, text=True
  )
  assert p.stdout.split() == ["True", "True", "reported"], p.stdout + p.stderr[-2000:]
  assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
