"""Training under a real two-node SLURM cluster on this machine (tests/cluster/slurm_cluster.py):
SLURM's processes joined (paro_jax/cluster/distributed.py), a frozen one named by the peer watch
(paro_jax/cluster/watch.py).

Marker `slurm`: not in the default run (`python -m pytest -m slurm -q -n0
tests/cluster/test_slurm.py`). The module's cluster is started once (it installs slurm-wlm and
munge with apt-get where they are missing) and every test is skipped, with the reason, where it
cannot be. The batch script is read from docs/multinode.md, so the page and the test cannot drift.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.cluster.repro_bound import multiprocess_bound

from tests.cluster import slurm_cluster as slurm
from tests.fast_compile import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slurm

STEPS = 12
TRAIN = [
  "train",
  "--model",
  "tiny",
  "--strategy",
  "IIG",
  "--batch-size",
  "8",
  "--seq-len",
  "16",
  "--warmup",
  "1",
  "--steps",
  str(STEPS),
  "--dtype",
  "fp32",
  "--mesh",
  "2x4",
]
RTOL = multiprocess_bound()  # measured: two-process fp32 runs are not bit-reproducible


def _env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "SLURM_CONF")}
  env["XLA_FLAGS"] = FAST_COMPILE  # the same on both sides
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
  env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
  return {**env, **extra}


def _losses(out) -> list[float]:
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
  return [r["loss"] for r in rows]


def doc_script() -> str:
  """The batch script of docs/multinode.md's "Preemption and requeue" section."""
  text = open(os.path.join(REPO, "docs", "multinode.md")).read()
  section = text[text.index("### Preemption and requeue") :]
  return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def cluster():
  try:
    c = slurm.up()
  except slurm.Unavailable as e:
    pytest.skip(f"no SLURM cluster here: {e}")
  yield c
  slurm.down(c.state)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """Losses of one process on the same 2x4 mesh."""
  out = tmp_path_factory.mktemp("one_process")
  cmd = [sys.executable, "-m", "paro_jax", *TRAIN, "--out", str(out)]
  proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return _losses(out)


def _wait_rows(path, rows: int, timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if path.exists() and len(path.read_text().splitlines()) >= rows:
      return
    time.sleep(0.5)
  raise AssertionError(f"{path} did not reach {rows} rows in {timeout:g} s")


def _job(cluster, job: str, field: str) -> str:
  out = cluster.run(["scontrol", "show", "job", job]).stdout
  m = re.search(rf"\b{field}=(\S+)", out)
  return m.group(1) if m else ""


def _why(cluster, job: str, log) -> str:
  """What an assertion about a job prints: the tail of its log, `scontrol show job`, and what the
  SLURM daemons logged about it (a launch they refused never reaches the job's log)."""
  text = log.read_text()[-3000:] if log.exists() else f"(no {log})"
  show = cluster.run(["scontrol", "show", "job", job]).stdout
  mentions = re.compile(rf"(JobId={job}\b|job {job}\b|\[{job}\.|StepId={job}\.)")
  daemons = ""
  for name in ("slurmctld.log", *(f"slurmd-{node}.log" for node in slurm.NODES)):
    lines = [line for line in cluster.log(name).splitlines() if mentions.search(line)]
    daemons += f"{name}:\n" + "\n".join(lines[-15:]) + "\n"
  return f"{log.name}:\n{text}\n{show}\n{daemons}"


def _nodes_done_with(cluster, job: str, since: float, timeout: float = 60) -> None:
  """Wait until the nodes are done with the job's previous run, as SLURM's requeue delay would.

  SLURM holds a requeued job back (`Reason=BeginTime`, SchedulerParameters=requeue_delay, by
  default 120 s); `scontrol update StartTime=now` skips that, and the test waits itself for what
  the delay is for. The requeue revoked the job's credential, and slurmd refuses a launch whose
  credential is not newer in whole seconds: a run started in the second of the requeue ends at
  once, FAILED with exit code 1 ("Job JOB already killed, do not launch batch job"), hence a
  second later than `since` (a time after the requeue). And the requeued run has the same step
  ids (JOB.0 again), while the previous run's slurmstepd processes outlive their tasks by a few
  seconds with the same named sockets (`NODE_JOB.STEP` in slurmd's spool directory): none of
  them may be left."""
  pattern = re.compile(rf"_{job}\.\d+$")
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    stepds = [
      p
      for p in os.listdir("/proc")
      if p.isdigit() and _cmdline(p).startswith(f"slurmstepd: [{job}.".encode())
    ]
    sockets = [
      name
      for node in slurm.NODES
      for name in os.listdir(os.path.join(cluster.root, f"spool-{node}"))
      if pattern.search(name)
    ]
    if not stepds and not sockets and int(time.time()) > int(since):
      return
    time.sleep(0.2)
  raise AssertionError(f"job {job}: slurmstepd {stepds} and sockets {sockets} still there")


def _wait_state(cluster, job: str, states: set[str], timeout: float) -> str:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    state = _job(cluster, job, "JobState")
    if state in states:
      return state
    time.sleep(1)
  raise AssertionError(f"job {job} is {_job(cluster, job, 'JobState')}, not in {states}")


def test_srun_two_nodes_matches_one_process(cluster, reference, tmp_path):
  out = tmp_path / "run"
  srun = ["srun", "--label", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
  cmd = [*srun, sys.executable, "-m", "paro_jax", *TRAIN, "--out", str(out)]
  proc = cluster.run(cmd, env=_env(), timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  # jax.distributed found the two tasks on the two hosts: one process per node, 8 devices.
  assert "on mesh 2x4 (8 cpu devices)" in proc.stdout
  rows = [line for line in proc.stdout.splitlines() if '{"step"' in line]
  assert len(rows) == STEPS and all(line.startswith("0: ") for line in rows)  # task 0 only
  np.testing.assert_allclose(_losses(out), reference, rtol=RTOL)


@pytest.mark.parametrize("batch", [True, False], ids=["batch-shell", "tasks"])
def test_sbatch_preempted_requeued_completes(cluster, reference, tmp_path, batch):
  """SIGTERM to the batch shell (what `#SBATCH --signal=B:TERM@120` sends before the time limit;
  the script passes it on) or to the tasks directly (`scancel --signal=TERM JOB`): the same stop."""
  script = tmp_path / "job.sh"
  script.write_text(doc_script())
  out = tmp_path / "run"
  env = _env(OUT=str(out), STEPS=str(STEPS))
  submit = cluster.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)], env=env)
  assert submit.returncode == 0, submit.stderr
  job = submit.stdout.strip().split(";")[0]
  log = tmp_path / f"paro-tiny-{job}.out"
  _wait_rows(out / "metrics.jsonl", 3, timeout=300)
  where = ["--batch"] if batch else []
  assert cluster.run(["scancel", "--signal=TERM", *where, job]).returncode == 0
  _wait_state(cluster, job, {"PENDING"}, timeout=300)  # requeued by the script
  requeued = time.time()
  text = log.read_text()
  stopped = re.search(r"stopped; checkpoint step (\d+) is in", text)
  assert stopped, text[-3000:]
  step = int(stopped.group(1))
  assert 3 <= step < STEPS
  assert sorted(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())[-1] == step
  assert len(_losses(out)) == step  # both tasks stopped after the same step
  for task, node in ((0, "pjnode0"), (1, "pjnode1")):
    assert f"{node}: task {task}: Exited with exit code 143" in text, text[-3000:]
  assert "paro-jax job: srun exited with 143" in text, text[-3000:]
  assert _job(cluster, job, "Restarts") == "1"
  _nodes_done_with(cluster, job, since=requeued)
  cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
  state = _wait_state(cluster, job, {"COMPLETED", "FAILED"}, timeout=600)
  assert state == "COMPLETED", _why(cluster, job, log)
  text = log.read_text()
  assert f"resumed from {out}/checkpoints/{step}" in text, text[-3000:]
  assert "paro-jax job: srun exited with 0" in text, text[-3000:]
  np.testing.assert_allclose(_losses(out), reference, rtol=RTOL)


def test_time_limit_signal_stops_and_requeues(cluster, tmp_path):
  """The docs' script under a real time limit: SLURM itself sends `--signal=B:TERM@90` to the
  batch shell (up to 60 s early, the resolution of slurmctld's time-limit check: here 30-90 s
  after the start of a 3-minute job), the tasks stop at one step with its checkpoint, and the
  script requeues the job before the limit (no TIMEOUT)."""
  script = tmp_path / "job.sh"
  script.write_text(doc_script())
  out = tmp_path / "run"
  env = _env(OUT=str(out), STEPS="1000000")  # runs into the time limit
  limit = ["--time=3", "--signal=B:TERM@90"]  # override the script's #SBATCH --signal=B:TERM@120
  submit = cluster.run(
    ["sbatch", "--parsable", *limit, f"--chdir={tmp_path}", str(script)], env=env
  )
  assert submit.returncode == 0, submit.stderr
  job = submit.stdout.strip().split(";")[0]
  log = tmp_path / f"paro-tiny-{job}.out"
  try:
    _wait_rows(out / "metrics.jsonl", 1, timeout=150)
    _wait_state(cluster, job, {"PENDING"}, timeout=240)  # stopped by the signal, requeued
    text = log.read_text()
    stopped = re.search(r"stopped; checkpoint step (\d+) is in", text)
    assert stopped, _why(cluster, job, log)
    step = int(stopped.group(1))
    assert sorted(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())[-1] == step
    assert len(_losses(out)) == step  # both tasks stopped after the same step
    for task, node in ((0, "pjnode0"), (1, "pjnode1")):
      assert f"{node}: task {task}: Exited with exit code 143" in text, text[-3000:]
    assert "paro-jax job: srun exited with 143" in text, text[-3000:]
    assert "DUE TO TIME LIMIT" not in text, text[-3000:]
    assert _job(cluster, job, "Restarts") == "1"
  finally:
    cluster.run(["scancel", job])
    _wait_state(cluster, job, {"CANCELLED"}, timeout=120)


def test_sigkilled_task_ends_the_job(cluster, tmp_path):
  out = tmp_path / "run"
  train = [*TRAIN, "--steps", "500", "--progress-timeout", "120", "--out", str(out)]
  srun = ["srun", "--label", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
  cmd = cluster.exec_argv([*srun, sys.executable, "-m", "paro_jax", *train])
  proc = subprocess.Popen(
    cmd, env=cluster.env(_env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  try:
    _wait_rows(out / "metrics.jsonl", 2, timeout=300)
    node1 = cluster.state["namespaces"][1]
    pids = subprocess.run(["ip", "netns", "pids", node1], capture_output=True, text=True).stdout
    tasks = [p for p in pids.split() if b"paro_jax\0train" in _cmdline(p)]
    assert len(tasks) == 1, pids
    os.kill(int(tasks[0]), signal.SIGKILL)
    killed = time.monotonic()
    output, _ = proc.communicate(timeout=120)  # --progress-timeout
    took = time.monotonic() - killed
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode != 0
  assert "pjnode1: task 1: Killed" in output, output[-3000:]
  assert took < 60, took
  last = len(_losses(out))
  assert re.search(rf'^0: {{"step": {last},', output, re.M), output[-3000:]
  # The task left names itself and the step the run got to, in one line (srun named the lost one).
  lost = rf"^0: paro-jax: error: process 0 of 2: a collective failed after step {last}, .*"
  # The kernel reports the killed peer's socket as closed (FIN) or, when data was in flight to it,
  # reset (RST): which one is a race, the line names either.
  peer = r"Connection (closed|reset) by peer .*--resume"
  # A race with srun (--kill-on-bad-exit): about 1 run in 6 here, task 0 is still blocked in the
  # step's collective when srun cancels the step, and SLURM ends it before it can say its line
  # (srun's own lines name task 1 as the one lost, asserted above). Either way the job ends.
  cancelled = re.search(
    r"^srun: error: pjnode0: task 0: (Killed|Exited with exit code 143)$", output, re.M
  )
  assert re.search(lost + peer, output, re.M) or cancelled, output[-3000:]
  assert "Traceback" not in output, output[-3000:]


def test_frozen_task_is_named(cluster, tmp_path):
  """SIGSTOP of one task: the other names it after --heartbeat-timeout s (their beats through
  JAX's coordination key-value store) and exits 124 with one line; srun ends the job. JAX's
  coordination service, given a longer heartbeat timeout (70 s here), never aborts the task that
  still runs (SIGABRT and a C++ stack, naming no one: what happened at ~90 s before). The stopped
  task, which SLURM continues in order to end it, finds the service gone and is aborted by JAX's
  client: its stderr passes through a child that folds that abort into its log
  (cluster/native_stderr.py), so no C++ stack reaches the terminal from either task."""
  out = tmp_path / "run"
  train = [*TRAIN, "--steps", "500", "--heartbeat-timeout", "20", "--out", str(out)]
  srun = ["srun", "--label", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
  cmd = cluster.exec_argv([*srun, sys.executable, "-m", "paro_jax", *train])
  proc = subprocess.Popen(
    cmd, env=cluster.env(_env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  try:
    _wait_rows(out / "metrics.jsonl", 2, timeout=300)
    node1 = cluster.state["namespaces"][1]
    pids = subprocess.run(["ip", "netns", "pids", node1], capture_output=True, text=True).stdout
    tasks = [p for p in pids.split() if b"paro_jax\0train" in _cmdline(p)]
    assert len(tasks) == 1, pids
    os.kill(int(tasks[0]), signal.SIGSTOP)
    stopped = time.monotonic()
    output, _ = proc.communicate(timeout=120)
    took = time.monotonic() - stopped
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode != 0
  line = (
    r"^0: paro-jax: error: process 0 of 2: process 1 sent no heartbeat for \d+ s "
    r"\(--heartbeat-timeout 20\): it is stopped \(SIGSTOP\) or frozen; exiting\. The last step "
    r"this process finished: \d+$"
  )
  assert re.search(line, output, re.M), output[-3000:]
  assert "pjnode0: task 0: Exited with exit code 124" in output, output[-3000:]
  # The stopped task, continued by SLURM to be ended, does not blame the one that named it.
  assert "1: paro-jax: error: process 1 of 2: process 0" not in output, output[-3000:]
  assert 19 <= took < 60, took  # the last beat came up to a second (its period) before the stop
  assert "Check failure" not in output and "Traceback" not in output, output[-3000:]
  assert "@     0x" not in output, output[-3000:]


def _cmdline(pid: str) -> bytes:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read()
  except OSError:
    return b""


def test_checkpoint_unreadable_on_one_node(cluster, reference, tmp_path):
  """Step 12 is unreadable on pjnode1 only (an empty directory over its `meta` in that node's
  mount namespace): both processes fall back to step 8 together and redo steps 9-12."""
  out = tmp_path / "run"
  srun = ["srun", "--label", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
  train = [*srun, sys.executable, "-m", "paro_jax", *TRAIN, "--checkpoint-every", "4"]
  first = cluster.run([*train, "--out", str(out)], env=_env(), timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  meta = out / "checkpoints" / str(STEPS) / "meta"
  empty = tmp_path / "empty"
  empty.mkdir()
  slurmd1 = str(cluster.state["pids"][-1])  # pjnode1's slurmd: its jobs share its mounts
  mount = ["nsenter", "--mount", "--target", slurmd1, "mount", "--bind", str(empty), str(meta)]
  subprocess.run(mount, check=True, capture_output=True)
  try:
    again = cluster.run([*train, "--resume", "--out", str(out)], env=_env(), timeout=600)
  finally:  # the step was set aside (renamed) with the mount inside it
    for path in (meta, out / "checkpoints" / f"damaged-{STEPS}" / "meta"):
      umount = ["nsenter", "--mount", "--target", slurmd1, "umount", "-l", str(path)]
      subprocess.run(umount, capture_output=True)
  assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
  for task in (0, 1):
    assert f"{task}: paro-jax: resumed from {out}/checkpoints/8 " in again.stdout, again.stdout
  assert "unreadable on another process of the run" in again.stderr, again.stderr[-3000:]
  assert (out / "checkpoints" / f"damaged-{STEPS}").is_dir()
  np.testing.assert_allclose(_losses(out), reference, rtol=RTOL)
