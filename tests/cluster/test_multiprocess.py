"""Real multi-process training: processes joined by jax.distributed, and `paro-jax launch`.

Every run here is a fresh process (XLA's device count is fixed per process). Children compile with
the tests' fast-compile flags (tests/fast_compile.py), as the tests' own processes do: the same
flags on both sides of each comparison.
"""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from paro_jax.cluster.launch import launch
from paro_jax.cluster.netns import NS_PREFIX
from tests.fast_compile import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch_on_loopback(argv) -> tuple[str, str]:
  """`argv` launched on 2 nodes x 2 devices over loopback (the link not shaped), which must
  succeed: (its output, its error output)."""
  out, err = io.StringIO(), io.StringIO()
  code = launch(argv, nodes=2, devices_per_node=2, shaped=False, env=_env(), stdout=out, stderr=err)
  assert code == 0, err.getvalue()[-3000:]
  return out.getvalue(), err.getvalue()


def _env():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = FAST_COMPILE
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _train(strategy, out, steps=2, *extra):
  return [
    "train",
    "--model",
    "tiny",
    "--strategy",
    strategy,
    "--batch-size",
    "4",
    "--seq-len",
    "16",
    "--steps",
    str(steps),
    "--warmup",
    "1",
    "--dtype",
    "fp32",
    "--out",
    str(out),
    *extra,
  ]


def _losses(out):
  return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _children(pid):
  """PIDs whose parent is `pid` (from /proc)."""
  kids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
      except (OSError, IndexError, ValueError):
        pass
  return kids


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _namespaces_of(pid):
  if shutil.which("ip") is None:
    return []
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  return [
    line.split()[0]
    for line in out.splitlines()
    if line.startswith(f"{NS_PREFIX}{pid}n") or line.startswith(f"{NS_PREFIX}{pid}br")
  ]


def _can_namespace():
  if os.geteuid() != 0:
    return "not root: network namespaces need root"
  missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
  if missing:
    return f"{' and '.join(missing)} not installed (apt-get install iproute2)"
  return None


@pytest.mark.parametrize("strategy", ["IIG", "GGG"])
def test_two_processes_match_one(tmp_path, strategy):
  """2 processes x 2 devices (loopback, gloo) give the losses of 1 process x 4 devices, mesh
  2x2 both; only process 0 writes metrics. GGG asks for `--collectives auto`: XLA's own
  collectives in one process, a ring per level over both axes in two (gloo's would be one flat
  ring)."""
  auto = ["--collectives", "auto"] if strategy == "GGG" else []
  ref = subprocess.run(
    [
      sys.executable,
      "-m",
      "paro_jax",
      *_train(strategy, tmp_path / "one", 2, *auto),
      "--mesh",
      "2x2",
    ],
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert ref.returncode == 0, ref.stderr[-3000:]
  out, err = launch_on_loopback(_train(strategy, tmp_path / "two", 2, *auto))
  assert "the link is NOT shaped" in err
  assert "[node 0] paro-jax: tiny" in out and "mesh 2x2 (4 cpu devices)" in out
  assert '[node 1] {"step"' not in out  # process 1 neither logs nor writes
  if auto:
    assert "collectives=xla" in ref.stdout and "auto: one process" in ref.stdout, ref.stdout
    assert "collectives=hring+xla" in out and "flat ring" in out
  np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-5)
  assert len(_losses(tmp_path / "two")) == 2


def test_bad_train_argument_fails_fast_naming_the_node(tmp_path, monkeypatch):
  """Also: without root the launcher falls back to loopback and says the link is not shaped."""
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  err = io.StringIO()
  start = time.monotonic()
  code = launch(
    _train("IIG", tmp_path, 2, "--batch-size", "3"),
    nodes=2,
    devices_per_node=2,
    env=_env(),
    stdout=io.StringIO(),
    stderr=err,
  )
  assert code == 2
  assert time.monotonic() - start < 60
  text = err.getvalue()
  assert "not root: running 2 plain processes on 127.0.0.1; the link is NOT shaped" in text
  assert "failed with exit code 2" in text and "node " in text, text
  assert "--batch-size 3 is not divisible" in text  # the child's own stderr, quoted
  assert _children(os.getpid()) == []


def test_launcher_refuses_flags_it_sets(tmp_path):
  with pytest.raises(ValueError, match="--process-id is set by the launcher"):
    launch(
      _train("IIG", tmp_path, 1, "--process-id", "0"), nodes=2, devices_per_node=2, shaped=False
    )
  with pytest.raises(ValueError, match="does not have the 4 devices"):
    launch(_train("IIG", tmp_path, 1, "--mesh", "1x2"), nodes=2, devices_per_node=2, shaped=False)


def test_launch_runs_a_python_script(tmp_path):
  """`-- python SCRIPT args` runs the script per node with --mesh and the multi-process flags:
  the collectives benchmark, tiny, on loopback 2x1; only process 0 prints and writes."""
  bench = os.path.join(REPO, "experiments", "bench_collectives.py")
  out, err = io.StringIO(), io.StringIO()
  code = launch(
    [
      "python",
      bench,
      "--max-bytes",
      "1024",
      "--repeats",
      "1",
      "--impls",
      "xla,horing",
      "--out",
      str(tmp_path),
      "--note",
      "t",
    ],
    nodes=2,
    devices_per_node=1,
    shaped=False,
    env=_env(),
    stdout=out,
    stderr=err,
  )
  assert code == 0, err.getvalue()[-3000:]
  data = json.loads((tmp_path / "collectives.json").read_text())
  assert data["meta"]["processes"] == 2 and data["meta"]["mesh"] == {"inter": 2, "intra": 1}
  assert "NOT shaped" in data["meta"]["link"] and data["meta"]["note"] == "t"
  assert len(data["results"]) == 4
  assert "[node 0] all_gather" in out.getvalue() and "[node 1] all_gather" not in out.getvalue()
  with pytest.raises(ValueError, match="no such script"):
    launch(["python", "no/such.py"], nodes=2, devices_per_node=1, shaped=False)


def _start_cli_launch(tmp_path, *launch_args):
  cmd = [
    sys.executable,
    "-m",
    "paro_jax",
    "launch",
    "--nodes",
    "2",
    "--devices-per-node",
    "2",
    *launch_args,
    "--",
    *_train("IIG", tmp_path, 50),
  ]
  proc = subprocess.Popen(
    cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  deadline = time.monotonic() + 60
  kids, nodes = [], []
  while len(nodes) < 2 and time.monotonic() < deadline:
    time.sleep(0.2)
    kids = _children(proc.pid)  # the 2 nodes and the reaper
    nodes = [k for k in kids if "--process-id" in _cmdline(k)]
  assert len(nodes) == 2, "the launcher did not start 2 processes"
  return proc, kids


def _cmdline(pid):
  try:
    with open(f"/proc/{pid}/cmdline") as f:
      return f.read()
  except OSError:
    return ""


def _node(kids, k):
  found = [p for p in kids if f"--process-id\x00{k}" in _cmdline(p)]
  assert len(found) == 1
  return found[0]


def _wait_for_step(proc):
  """Read the launcher's stdout until node 0 logs a step (so every node has heartbeats)."""
  for line in proc.stdout:
    if line.startswith('[node 0] {"step"'):
      time.sleep(2.5)  # a heartbeat (every second) carries the step to the launcher
      return
  pytest.fail(f"the run ended before its first step: {proc.stderr.read()[-3000:]}")


def test_killed_process_fails_the_launch_and_cleans_up(tmp_path):
  """SIGKILL node 1 mid-run: the launcher stops node 0, names node 1, exits non-zero, and
  leaves no process (and, when it used them, no namespace) behind."""
  proc, kids = _start_cli_launch(tmp_path)
  _wait_for_step(proc)
  os.kill(_node(kids, 1), signal.SIGKILL)
  start = time.monotonic()
  _, err = proc.communicate(timeout=60)
  assert time.monotonic() - start < 60
  assert proc.returncode == 128 + signal.SIGKILL
  assert "node 1 (process 1 of 2) failed with killed by SIGKILL" in err, err[-3000:]
  assert re.search(r"Last step finished: node 0: step \d+, node 1: step \d+", err), err[-3000:]
  assert not any(_alive(k) for k in kids)
  assert _namespaces_of(proc.pid) == []
  assert not any(os.path.exists(f"/etc/netns/{NS_PREFIX}{proc.pid}n{k}") for k in range(2))


def test_stopped_process_is_noticed_by_its_heartbeat(tmp_path):
  """SIGSTOP node 1 mid-run: no heartbeat for --heartbeat-timeout s, so the launcher names it
  (exit 124) with each node's last step, kills both (also the stopped one) and cleans up."""
  proc, kids = _start_cli_launch(tmp_path, "--heartbeat-timeout", "6")
  _wait_for_step(proc)
  os.kill(_node(kids, 1), signal.SIGSTOP)
  start = time.monotonic()
  _, err = proc.communicate(timeout=60)
  assert time.monotonic() - start < 6 + 15, err[-3000:]
  assert proc.returncode == 124, err[-3000:]
  assert "node 1 (process 1 of 2) sent no heartbeat for" in err, err[-3000:]
  assert "it is stopped (SIGSTOP) or frozen" in err
  assert "Check failure" not in err and "SIGABRT" not in err  # JAX's coordination service
  assert re.search(r"Last step finished: node 0: step \d+, node 1: step \d+", err), err[-3000:]
  assert not any(_alive(k) for k in kids)
  assert _namespaces_of(proc.pid) == []


def test_sigkilled_launcher_leaves_nothing_behind(tmp_path):
  """kill -9 of the launcher: its reaper (paro_jax/cluster/reaper.py) sees the pipe close, kills
  the nodes and deletes the namespaces and the heartbeat directory within seconds."""
  proc, kids = _start_cli_launch(tmp_path)
  _wait_for_step(proc)
  beats = [
    d for d in os.listdir(tempfile.gettempdir()) if d.startswith(f"paro-jax-launch-{proc.pid}-")
  ]
  assert len(beats) == 1
  proc.kill()
  proc.wait()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and (any(_alive(k) for k in kids) or _namespaces_of(proc.pid)):
    time.sleep(0.2)
  assert not any(_alive(k) for k in kids)
  assert _namespaces_of(proc.pid) == []
  assert not os.path.exists(os.path.join(tempfile.gettempdir(), beats[0]))


def test_ctrl_c_on_the_launcher_checkpoints_an_agreed_step(tmp_path):
  """SIGINT to the launcher is passed on; the nodes agree on one step (an all-reduce of the stop
  flag each step), checkpoint it together and exit 130; --resume continues from it."""
  proc, kids = _start_cli_launch(tmp_path)
  _wait_for_step(proc)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  assert "passing SIGINT on to the 2 nodes" in err
  assert "[node 1] paro-jax: SIGINT: stopping at a step all processes agree on" in err
  m = re.search(r"Last step finished: node 0: step (\d+), node 1: step (\d+)", err)
  assert m and m.group(1) == m.group(2), err[-3000:]
  step = int(m.group(1))
  assert f"stopped; checkpoint step {step} is in" in out
  assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == [step]
  assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step
  assert not any(_alive(k) for k in kids)
  assert _namespaces_of(proc.pid) == []


def test_sigterm_to_the_launcher_stops_everything(tmp_path):
  proc, kids = _start_cli_launch(tmp_path)
  time.sleep(2)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert "got SIGTERM" in err
  assert not any(_alive(k) for k in kids)
  assert _namespaces_of(proc.pid) == []


@pytest.mark.skipif(
  _can_namespace() is not None, reason=f"namespaced launch not possible: {_can_namespace()}"
)
def test_namespaced_launch_trains_and_cleans_up(tmp_path):
  """2 nodes x 2 devices in their own network namespaces, linked by a veth pair shaped to
  1 Gbit/s: trains 2 steps, traffic really crosses the link, and nothing is left behind."""
  out, err, sent = io.StringIO(), io.StringIO(), {}
  code = launch(
    _train("IIG", tmp_path),
    nodes=2,
    devices_per_node=2,
    inter_bandwidth="1gbit",
    env=_env(),
    stdout=out,
    stderr=err,
    link_bytes=sent,
  )
  assert code == 0, err.getvalue()[-3000:]
  assert "joined by a veth pair" in err.getvalue() and "shaped to 1gbit" in err.getvalue()
  assert len(_losses(tmp_path)) == 2
  assert sent.keys() == {0, 1} and min(sent.values()) > 100_000, sent  # gloo went over the veth
  assert _namespaces_of(os.getpid()) == []
  assert not any(os.path.exists(f"/etc/netns/{NS_PREFIX}{os.getpid()}n{k}") for k in range(2))
  assert _children(os.getpid()) == []
  links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
  assert f"pj{os.getpid()}" not in links


SLURM = {
  "SLURM_JOB_ID": "77",
  "SLURM_STEP_NODELIST": "localhost",
  "SLURM_NTASKS": "2",
  "SLURM_PROCID": "0",
  "SLURM_LOCALID": "0",
  "SLURM_STEP_NUM_NODES": "2",
}


def test_cluster_detection_from_environment():
  from paro_jax.cluster import distributed

  assert distributed.detect_cluster({}) is None
  assert distributed.detect_cluster(SLURM) == ("slurm", 2)
  assert distributed.detect_cluster({**SLURM, "SLURM_NTASKS": "1"}) is None
  assert distributed.detect_cluster(
    {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "4"}
  ) == ("ompi", 4)
  assert distributed.process_count(environ=SLURM) == 2
  assert distributed.process_count("h:1", 3, 2, environ=SLURM) == 3  # flags win
  assert distributed.one_process_per_node(SLURM)
  assert not distributed.one_process_per_node({**SLURM, "SLURM_STEP_NUM_NODES": "1"})
  with pytest.raises(ValueError, match="missing --process-id"):
    distributed.process_count("h:1", 2, None)
  with pytest.raises(ValueError, match="bad --coordinator"):
    distributed.process_count("nohost", 2, 0)
  with pytest.raises(ValueError, match="--process-id must be in"):
    distributed.process_count("h:1", 2, 2)


def test_mesh_must_divide_among_processes(tmp_path, capsys):
  from paro_jax.cli import main

  with pytest.raises(SystemExit) as e:
    main(
      [
        "train",
        "--mesh",
        "1x3",
        "--coordinator",
        "127.0.0.1:1",
        "--num-processes",
        "2",
        "--process-id",
        "0",
        "--out",
        str(tmp_path),
      ]
    )
  assert e.value.code == 2
  assert "--mesh 1x3 has 3 devices, not divisible by the 2 processes" in capsys.readouterr().err


def test_slurm_srun_is_auto_detected():
  """Under srun (faked: 2 tasks on 2 'nodes', both localhost), maybe_initialize() with no flags
  joins the processes through JAX's own SLURM detection, each keeping all its devices."""
  with __import__("socket").socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  code = (
    "from paro_jax.cluster.distributed import maybe_initialize; assert maybe_initialize(); "
    "import jax; print(jax.process_index(), jax.process_count(), jax.device_count())"
  )
  procs = []
  for i in range(2):
    env = {
      **_env(),
      **SLURM,
      "SLURM_PROCID": str(i),
      "JAX_COORDINATOR_PORT": str(port),
      "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    procs.append(
      subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
    )
  outs = [p.communicate(timeout=120) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  assert [o[0].splitlines()[-1].split() for o in outs] == [["0", "2", "4"], ["1", "2", "4"]]
  # gloo's reduce-scatter replaced, said once, by process 0 only
  assert [o[0].count("reduce-scatters run as an all-reduce") for o in outs] == [1, 0], outs


def test_watch_names_frozen_and_stuck_nodes(tmp_path):
  """The launcher's verdict from heartbeat files (fake clock): a node whose heartbeat is old is
  frozen; a node whose step has not advanced for the progress timeout is stuck (the one behind
  is named); before its first heartbeat a node gets the startup allowance."""
  from paro_jax.cluster.watch import Watch

  now = [1000.0]
  paths = [str(tmp_path / f"node{k}.json") for k in range(2)]
  w = Watch(paths, heartbeat_timeout=5, progress_timeout=30, startup=20, clock=lambda: now[0])

  def beat(k, step, t):
    with open(paths[k], "w") as f:
      json.dump({"pid": 1, "step": step, "time": t}, f)

  now[0] = 1010.0
  w.read()
  assert w.verdict() is None  # no heartbeat yet, within the startup allowance
  now[0] = 1021.0
  assert w.verdict()[0] == 0 and "since it started" in w.verdict()[1]
  beat(0, 3, 1021.0)
  beat(1, 2, 1021.0)
  w.read()
  assert w.verdict() is None and w.last_steps() == "node 0: step 3, node 1: step 2"
  now[0] = 1027.0
  beat(0, 4, 1027.0)
  w.read()
  k, why = w.verdict()
  assert k == 1 and "no heartbeat for 6 s" in why and "stopped (SIGSTOP) or frozen" in why
  now[0] = 1052.0
  beat(0, 4, 1052.0)
  beat(1, 2, 1052.0)
  w.read()
  k, why = w.verdict()
  assert k == 1 and "finished no step for 31 s (--progress-timeout 30): it is hung" in why


def test_jax_coordination_service_outlasts_our_heartbeat_watch(monkeypatch):
  """JAX's coordination service aborts the healthy processes (SIGABRT, a C++ stack, no name)
  about 0.85-0.9 of its heartbeat timeout after a process stops: it gets more than twice ours
  (the launcher's, passed in its nodes' environment, or train's --heartbeat-timeout), so that
  ours names the frozen process first; JAX's own default when ours is off."""
  import jax

  from paro_jax.cluster import distributed, gloo_rs

  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(jax.config, "update", lambda *a: None)
  monkeypatch.setattr(gloo_rs, "register_if_gloo", lambda: None)
  monkeypatch.delenv(distributed.HEARTBEAT_TIMEOUT_ENV, raising=False)
  flags = ("127.0.0.1:1234", 2, 0)
  for ours, jaxs in ((60, 150), (120, 270), (6, 100), (0, 100)):
    assert distributed.maybe_initialize(*flags, heartbeat_timeout=ours)
    assert calls[-1]["heartbeat_timeout_seconds"] == jaxs
    assert jaxs == 100 or 0.85 * jaxs > ours + 30  # it fires after ours, with room to stop
  monkeypatch.setenv(distributed.HEARTBEAT_TIMEOUT_ENV, "120")  # the launcher's wins
  assert distributed.maybe_initialize(*flags, heartbeat_timeout=60)
  assert calls[-1]["heartbeat_timeout_seconds"] == 270


class _Store:
  """A stand-in for jax.distributed's client: the key-value store PeerWatch beats through."""

  def __init__(self):
    self.kv, self.frozen = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    while self.frozen:  # process 0, which holds the store, is stopped: the call never returns
      time.sleep(0.01)
    self.kv[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in sorted(self.kv.items()) if k.startswith(prefix)]


def test_peer_watch_names_a_frozen_process(capsys):
  """Under SLURM (train --heartbeat-timeout S): a process whose beat stopped for S s is named
  by the others, which exit 124 with one line; a process that ended (`done`) is not watched; a
  store that stops answering names process 0 (it runs JAX's coordination service)."""
  from paro_jax.cluster import watch

  now, codes, store = [0.0], [], _Store()

  def advance(to):  # the clock runs on, a second per tick, while the watch polls
    while now[0] < to:
      now[0] += 1.0
      time.sleep(0.03)

  watch.finished(7)
  peers = watch.PeerWatch(store, 0, 3, 20, interval=0.01, exit=codes.append, clock=lambda: now[0])
  peers.start()
  for t in (5.0, 10.0, 15.0):  # processes 1 and 2 beat; then 2 ends, 1 stops
    advance(t)
    store.kv["paro_jax/beat/1"] = store.kv["paro_jax/beat/2"] = str(t)
    time.sleep(0.05)
  store.kv["paro_jax/beat/2"] = watch.DONE
  advance(35.0)
  assert codes == []
  advance(37.0)
  peers.join(5)
  assert codes == [124]
  err = capsys.readouterr().err
  assert err == (
    "paro-jax: error: process 0 of 3: process 1 sent no heartbeat for 21 s (--heartbeat-timeout "
    "20): it is stopped (SIGSTOP) or frozen; exiting. The last step this process finished: 7\n"
  )
  now[0], codes, store = 0.0, [], _Store()
  peers = watch.PeerWatch(store, 1, 2, 20, interval=0.01, exit=codes.append, clock=lambda: now[0])
  peers.start()
  time.sleep(0.1)
  now[0] = 50.0  # this process itself was stopped for 50 s: it blames no one on waking
  time.sleep(0.1)
  assert codes == [] and capsys.readouterr().err == ""
  store.frozen = True
  advance(72.0)
  peers.join(5)
  assert codes == [124]
  assert "process 1 of 2: process 0, which runs JAX's coordination service, answered no " in (
    capsys.readouterr().err
  )
  store.frozen = False


# What JAX's coordination service prints as it aborts node 0 after node 1 was SIGSTOPped
# (jaxlib 0.10.2, `paro-jax launch --heartbeat-timeout 120` before the fix; the stack shortened).
JAX_ABORT = os.path.join(REPO, "tests", "fixtures", "jax_coordination_abort.txt")

ABORTING_NODE = """import os, resource, signal, sys, time
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if sys.argv[sys.argv.index("--process-id") + 1] == "0":
  time.sleep(0.5)
  print("a line of its own", file=sys.stderr)
  sys.stderr.write(open(sys.argv[1]).read())
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGABRT)
time.sleep(60)
"""


def test_launcher_names_the_node_jax_coordination_found_frozen(tmp_path):
  """When JAX's coordination service aborts a node for another's missing heartbeats (its own
  timeout shorter than the launcher's, or the launcher's off), the launcher names the frozen
  node (exit 124, as its own heartbeat watch does) and keeps the C++ stack out of the terminal."""
  (tmp_path / "node.py").write_text(ABORTING_NODE)
  out, err = io.StringIO(), io.StringIO()
  argv = ["python", str(tmp_path / "node.py"), JAX_ABORT]
  code = launch(argv, nodes=2, devices_per_node=1, shaped=False, stdout=out, stderr=err)
  text = err.getvalue()
  assert code == 124, text
  assert (
    "paro-jax: error: node 1 (process 1 of 2) sent JAX's coordination service no heartbeat for "
    "its timeout: it is stopped (SIGSTOP) or frozen (the service then aborted node 0); stopped "
    "the other nodes."
  ) in text, text
  assert "[node 0] a line of its own" in text
  assert "Check failure" not in text and "@     0x" not in text and "client.h" not in text, text


def test_watchdog_exits_a_process_without_progress(capsys):
  """`train --progress-timeout S` (SLURM): no step for S s -> exit 3, naming the last step."""
  from paro_jax.cluster import watch

  now, codes = [0.0], []
  watch.PROGRESS.since = 0.0
  watch.finished(7)
  dog = watch.Watchdog(
    10, exit=codes.append, clock=lambda: now[0], poll=0.01, who="process 1 of 2: "
  )
  dog.start()
  time.sleep(0.1)
  assert codes == []
  now[0] = 11.0 + watch.PROGRESS.since
  dog.join(5)
  assert codes == [3]
  err = capsys.readouterr().err
  assert err.startswith("paro-jax: error: process 1 of 2: no step finished for 11 s ")  # one line
  assert err.count("\n") == 1 and err.endswith("\n")
  assert "(--progress-timeout 10)" in err
  assert "the last step this process finished: 7" in err


@pytest.mark.parametrize(
  "reason",
  [
    "Connection closed by peer [10.77.0.2]:1228",  # the peer's socket closed (FIN)
    "Read error [10.77.0.2]:65212: Connection reset by peer",  # data was in flight to it (RST)
  ],
)
def test_peer_lost_names_the_process_and_its_last_step(reason):
  """A collective failing because a peer is gone (a SIGKILLed task under srun): one line naming
  this process, its last finished step and the transport's reason, without gloo's source path."""
  from paro_jax.cluster import watch

  watch.finished(41)
  error = RuntimeError(
    f"UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] {reason}"
  )
  line = str(watch.peer_lost(error, 0, 2))
  assert line.startswith("process 0 of 2: a collective failed after step 41, the last step ")
  assert f"(Gloo all-reduce failed: {reason})" in line
  assert "pair.cc" not in line and "UNKNOWN" not in line and "\n" not in line
  assert line.endswith("Run again with --resume: it continues from the newest checkpoint")


def test_restart_argv_keeps_the_batch_or_says_why(tmp_path):
  from paro_jax.cluster.restart import restart_argv

  argv = _train("IIG", tmp_path, 8, "--batch-size", "12", "--mesh", "3x2")
  with pytest.raises(ValueError, match="holds no checkpoint to continue from: pass --checkpoint"):
    restart_argv(argv, 2, 2)
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  new, why = restart_argv(argv, 2, 2)
  assert "--mesh" not in new and new[-1] == "--resume"
  assert "on 2 nodes (mesh 2x2) from checkpoint step 4" in why
  assert "global batch stays 12 sequences" in why and "now 3 rows per device instead of 2" in why
  with pytest.raises(ValueError, match=r"12 is not divisible by 8\): .* \(e.g. 24\)"):
    restart_argv(_train("IIG", tmp_path, 8, "--batch-size", "12"), 2, 4)


def test_node_loss_restarts_on_the_nodes_left(tmp_path):
  """3 nodes x 2 devices (III: 3 does not divide the model), node 2 SIGKILLed mid-run: with
  --max-restarts 1 the run continues from
  its newest checkpoint on 2 nodes (mesh 2x2, batch 12: 3 rows per device instead of 2) and
  finishes; every fp32 loss equals an uninterrupted run's on one process (mesh 3x2)."""
  steps = 40
  train = _train("III", tmp_path / "run", steps, "--batch-size", "12", "--checkpoint-every", "2")
  train[train.index("tiny")] = "test"
  ref = subprocess.run(
    [sys.executable, "-m", "paro_jax", *train, "--out", str(tmp_path / "ref"), "--mesh", "3x2"],
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert ref.returncode == 0, ref.stderr[-3000:]
  cmd = [sys.executable, "-m", "paro_jax", "launch", "--nodes", "3", "--devices-per-node", "2"]
  cmd += ["--loopback", "--max-restarts", "1", "--", *train]
  proc = subprocess.Popen(
    cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  for line in proc.stdout:
    if line.startswith('[node 0] {"step"') and json.loads(line.split(" ", 2)[2])["step"] >= 5:
      break
  node2 = _node(_children(proc.pid), 2)
  os.kill(node2, signal.SIGKILL)
  out, err = proc.communicate(timeout=400)
  assert proc.returncode == 0, err[-4000:]
  assert "node 2 (process 2 of 3) failed with killed by SIGKILL" in err
  m = re.search(
    r"restart 1 of 1 after losing node 2: continuing on 2 nodes \(mesh 2x2\) from "
    r"checkpoint step (\d+)",
    err,
  )
  assert m, err[-4000:]
  assert "now 3 rows per device instead of 2" in err
  assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/{m.group(1)}" in out
  assert "mesh 2x2 (4 cpu devices)" in out
  got = _losses(tmp_path / "run")
  assert len(got) == steps
  np.testing.assert_allclose(got, _losses(tmp_path / "ref"), rtol=1e-5)
