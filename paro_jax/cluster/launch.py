"""`paro-jax launch`: emulate a cluster of G nodes x M devices on one machine.

G `paro-jax train` processes, each with M virtual CPU devices, are joined by `jax.distributed`
(process 0 is the coordinator). As root with `ip` and `tc`, every process runs in its own network
namespace; the namespaces are linked by a veth pair (2 nodes) or through a bridge in one more
namespace (more than 2), and each node's link is shaped with `tc` (tbf for the rate, netem for
the delay where the kernel has it); `--intra-bandwidth` shapes each node's loopback, which its
own devices' collectives cross. Without root or without `ip`/`tc`, the processes run on
127.0.0.1 without shaping, and the launcher says so.

All names carry the launcher's PID, so launches running side by side do not collide, and
everything is removed on exit, on SIGINT/SIGTERM and when a process fails: the launcher then
stops the other processes and returns non-zero, naming the failed node and the last step each node
finished. A node that is frozen (no heartbeat for --heartbeat-timeout s: SIGSTOP, a stalled
machine) or stuck (no step finished for --progress-timeout s: a hang in a collective) counts as
failed (paro_jax/cluster/watch.py). Ctrl-C (or SIGTERM) on the launcher is passed on to the nodes
as SIGINT: they agree on a step, checkpoint it together and exit (a second Ctrl-C stops them at
once). A launcher that is itself SIGKILLed leaves nothing running: a reaper process
(paro_jax/cluster/reaper.py) sees its pipe close and kills the nodes and deletes the namespaces.

The per-node command is `train ...` or `export ...` (run as `python -m paro_jax ...`) or a Python
script, `python SCRIPT [args]` or `SCRIPT.py [args]` (run with this interpreter, e.g.
experiments/bench_collectives.py); each gets the multi-process flags (all but export --mesh GxM)
appended, and the env var PARO_JAX_LINK describes the link (shaped or not).

From Python: `launch(["train", "--steps", "2", ...], nodes=2, devices_per_node=2)` returns the
exit code.

This module starts and watches a launch; the rest lives beside it: the namespaces, links and byte
counts in netns.py, stopping and reaping the processes in supervise.py (and reaper.py), the
heartbeats in watch.py, and continuing after a lost node in restart.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from paro_jax import report
from paro_jax.cluster.netns import (
  NamespaceNetwork,
  remove_stale_namespaces,
)
from paro_jax.cluster.distributed import HEARTBEAT_TIMEOUT_ENV
from paro_jax.cluster.restart import restart_argv
from paro_jax.cluster.supervise import (
  LaunchInterrupted,
  Node,
  Reaper,
  describe_exit,
  signal_all,
  stop,
  stop_together,
)
from paro_jax.cluster.watch import HEARTBEAT_ENV, Watch
from paro_jax.core.names import parse_mesh_shape
from paro_jax.core.units import parse_delay, parse_rate
from paro_jax.core.xla_flags import DEVICE_COUNT_FLAG

COORD_PORT = 29500  # free: each namespace is fresh
MAX_NODES, MAX_DEVICES_PER_NODE = 64, 1024  # processes / virtual CPU devices one machine emulates
RESERVED = ("--coordinator", "--num-processes", "--process-id")
COMMANDS = ("train", "export")  # the paro-jax commands a node runs


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_argv(train_argv: list[str], nodes: int, devices_per_node: int) -> list[str]:
  """The children's argv, checked; --mesh GxM is added unless given (and equal).

  `train ...` stays as it is (run by `python -m paro_jax`); `python ARGS` and `SCRIPT.py ARGS`
  become `[SCRIPT.py, ...]` / `[ARGS...]`, run by this interpreter (see `_command`).
  """
  if train_argv and re.fullmatch(r"python[0-9.]*", os.path.basename(train_argv[0])):
    train_argv = train_argv[1:]
    if not train_argv:
      raise ValueError("`python` after -- needs a script, e.g. `-- python experiments/x.py`")
  elif not train_argv or (train_argv[0] not in COMMANDS and not train_argv[0].endswith(".py")):
    raise ValueError(
      f"put the train command (or export) or a Python script after --, e.g. `paro-jax launch "
      f"--nodes 2 --devices-per-node 2 -- train --model tiny` or `... -- python "
      f"experiments/bench_collectives.py`; got {train_argv!r}"
    )
  if train_argv[0].endswith(".py") and not os.path.isfile(train_argv[0]):
    raise ValueError(f"no such script: {train_argv[0]}")
  for flag in RESERVED:
    if any(a == flag or a.startswith(flag + "=") for a in train_argv):
      raise ValueError(f"{flag} is set by the launcher; leave it out of the train command")
  argv = list(train_argv)
  if argv[0] == "export":
    return argv  # it shards over every device of every process: no --mesh
  mesh = [a for i, a in enumerate(argv) if argv[i - 1] == "--mesh" or a.startswith("--mesh=")]
  if mesh:
    text = mesh[-1].split("=", 1)[-1]
    inter, intra = parse_mesh_shape(text)
    if inter * intra != nodes * devices_per_node:
      raise ValueError(
        f"--mesh {text} in the train command does not have the "
        f"{nodes * devices_per_node} devices of {nodes} nodes x {devices_per_node}"
      )
  else:
    argv += ["--mesh", f"{nodes}x{devices_per_node}"]
  return argv


def _command(argv: list[str]) -> list[str]:
  """The interpreter and argv of a child: `python -m paro_jax train ...` or `python ARGS`."""
  if argv[0] in COMMANDS:
    return [sys.executable, "-m", "paro_jax", *argv]
  return [sys.executable, *argv]


def child_env(devices_per_node: int, env: dict | None = None) -> dict:
  """The environment of a child process (a node, or any jax child of an experiment): `env` (or
  this one) with `devices_per_node` virtual CPU devices in XLA_FLAGS, unbuffered output and this
  checkout first on PYTHONPATH."""
  env = dict(os.environ if env is None else env)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
  env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={devices_per_node}"])
  env["PYTHONUNBUFFERED"] = "1"
  # The repository root (above paro_jax/ and models/), so children import this checkout.
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  return env


def launch(
  train_argv: list[str],
  nodes: int,
  devices_per_node: int,
  *args,
  max_restarts: int = 0,
  stderr=None,
  **kwargs,
) -> int:
  """`_launch_once`, and with `max_restarts` K > 0: a run whose node died, froze or hung is
  continued from its newest checkpoint on the nodes left (one fewer each time), up to K times."""
  if max_restarts < 0:
    raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
  err = stderr or sys.stderr
  restarts = 0
  while True:
    failure: dict = {}
    code = _launch_once(
      train_argv, nodes, devices_per_node, *args, stderr=stderr, failure=failure, **kwargs
    )
    if code == 0 or not max_restarts or not failure.get("lost"):
      return code
    if restarts == max_restarts:
      print(f"paro-jax launch: no restart left (--max-restarts {max_restarts})", file=err)
      return code
    try:
      train_argv, why = restart_argv(train_argv, nodes - 1, devices_per_node)
    except ValueError as e:
      print(report.line("error", f"cannot restart: {e}"), file=err, flush=True)
      return code
    restarts += 1
    nodes -= 1
    print(
      f"paro-jax launch: restart {restarts} of {max_restarts} after losing node "
      f"{failure['node']}: {why}",
      file=err,
      flush=True,
    )


def _launch_once(
  train_argv: list[str],
  nodes: int,
  devices_per_node: int,
  inter_bandwidth: str = "1gbit",
  inter_latency: str | None = "0.5ms",
  intra_bandwidth: str | None = None,
  shaped: bool = True,
  env: dict | None = None,
  stdout=None,
  stderr=None,
  link_bytes: dict | None = None,
  heartbeat_timeout: float = 60.0,
  progress_timeout: float = 900.0,
  stop_grace: float = 120.0,
  failure: dict | None = None,
  show_gloo: bool = False,
) -> int:
  """Run `train_argv` ("train ..." or a Python script) as `nodes` processes; returns the exit code.

  0 when every process exited 0; otherwise the failed node's exit code (128+signal when it was
  killed; 124 when it was frozen or stuck), 128+signal when the launcher itself got
  SIGINT/SIGTERM. Raises ValueError for bad arguments before anything is started. With
  namespaces, `link_bytes` (a dict) receives the bytes each node sent over its link, as `tc`
  counted them. `heartbeat_timeout` / `progress_timeout` (s, 0: off) apply to `train` nodes
  (paro_jax/cluster/watch.py); `stop_grace` is how long the nodes get to checkpoint after a
  Ctrl-C before they are killed.
  """
  out, err = stdout or sys.stdout, stderr or sys.stderr
  if nodes < 1 or devices_per_node < 1:
    raise ValueError(
      f"--nodes and --devices-per-node must be >= 1, got {nodes} and {devices_per_node}"
    )
  if nodes > MAX_NODES or devices_per_node > MAX_DEVICES_PER_NODE:
    raise ValueError(
      f"--nodes {nodes} --devices-per-node {devices_per_node}: one machine emulates at most "
      f"{MAX_NODES} nodes of {MAX_DEVICES_PER_NODE} devices; use fewer"
    )
  for name, value in (
    ("heartbeat-timeout", heartbeat_timeout),
    ("progress-timeout", progress_timeout),
    ("stop-grace", stop_grace),
  ):
    if not value >= 0:
      raise ValueError(f"--{name} must be >= 0 seconds (0: off), got {value}")
  argv = child_argv(train_argv, nodes, devices_per_node)
  parse_rate(inter_bandwidth)
  parse_delay(inter_latency)
  if intra_bandwidth:
    parse_rate(intra_bandwidth)

  def say(msg: str) -> None:
    print(f"paro-jax launch: {msg}", file=err, flush=True)

  def warn(msg: str) -> None:
    print(report.line("warning", f"launch: {msg}"), file=err, flush=True)

  children: list[Node] = []
  lock = threading.Lock()
  old_handlers, interrupted = {}, []

  def on_signal(signum, _frame):
    if not interrupted:
      interrupted.append(signum)
      raise LaunchInterrupted(signum)
    # A second Ctrl-C: the nodes stop at once (their own second-signal rule); the cleanup goes on.
    signal_all(children, signal.SIGINT)

  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):
      old_handlers[sig] = signal.signal(sig, on_signal)
  network = None
  base_env = child_env(devices_per_node, env)
  beats = tempfile.mkdtemp(prefix=f"paro-jax-launch-{os.getpid()}-")
  reaper = Reaper(base_env)
  reaper.tell("dir", beats)
  watch = None
  if argv[0] == "train":
    watch = Watch(
      [os.path.join(beats, f"node{k}.json") for k in range(nodes)],
      heartbeat_timeout,
      progress_timeout,
    )
  try:
    if shaped:
      missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
      if os.geteuid() != 0 or missing:
        why = "not root" if os.geteuid() != 0 else f"{' and '.join(missing)} not found"
        warn(f"{why}: running {nodes} plain processes on 127.0.0.1; the link is NOT shaped")
      else:
        remove_stale_namespaces()
        network = NamespaceNetwork(nodes, inter_bandwidth, inter_latency, intra_bandwidth)
        for ns in network.all_namespaces():
          reaper.tell("ns", ns)
        try:
          network.open()
        except (RuntimeError, OSError) as e:
          warn(
            f"could not create the network namespaces ({e}); running on 127.0.0.1 instead: "
            f"the link is NOT shaped"
          )
          network = None
    else:
      say(f"loopback mode: {nodes} plain processes on 127.0.0.1; the link is NOT shaped")
    if network:
      say(network.describe())
      for note in network.notes:
        say(note)
    coordinator = (
      f"{network.addresses[0]}:{COORD_PORT}"
      if network and nodes > 1
      else f"127.0.0.1:{_free_port()}"
    )
    base_env["PARO_JAX_LINK"] = (
      network.describe() + "".join(f"; {n}" for n in network.notes)
      if network
      else f"{nodes} processes on 127.0.0.1, NOT shaped"
    )
    for k in range(nodes):
      cmd = [
        *_command(argv),
        "--coordinator",
        coordinator,
        "--num-processes",
        str(nodes),
        "--process-id",
        str(k),
      ]
      if network:
        cmd = ["ip", "netns", "exec", network.namespaces[k], *cmd]
      node_env = dict(base_env)
      # JAX's coordination service must not abort the healthy nodes before the launcher names
      # a frozen one (cluster/distributed.py sets its heartbeat timeout from this).
      node_env[HEARTBEAT_TIMEOUT_ENV] = f"{heartbeat_timeout:g}"
      if watch:
        node_env[HEARTBEAT_ENV] = watch.paths[k]
      proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=node_env,
        start_new_session=True,
      )
      reaper.tell("group", proc.pid)
      children.append(Node(k, proc, out, err, lock, show_gloo))
    if watch:
      watch.started = watch.clock()
    next_read = 0.0
    while True:
      codes = [n.proc.poll() for n in children]
      failed = [n for n, c in zip(children, codes) if c not in (None, 0)]
      verdict = None
      if watch and not failed and time.monotonic() >= next_read:
        watch.read()
        verdict = watch.verdict()
        next_read = time.monotonic() + 0.5
      if failed or verdict:
        if failed:
          # The node killed by a signal, if any: its peers fail after it (broken connections).
          bad = min(failed, key=lambda n: n.proc.returncode >= 0)
          code = bad.proc.returncode
          what = f"failed with {describe_exit(code)}"
          frozen = [k for k in bad.unhealthy if 0 <= k < nodes and k != bad.index]
          if frozen:  # JAX's coordination service aborted `bad`: the frozen node is the cause
            aborted = bad.index
            bad, code = children[frozen[0]], 124
            what = (
              f"sent JAX's coordination service no heartbeat for its timeout: it is stopped "
              f"(SIGSTOP) or frozen (the service then aborted node {aborted})"
            )
        else:
          bad, code = children[verdict[0]], 124
          what = verdict[1]
        if failure is not None:  # a lost node (killed, frozen, hung), not an error of the run
          failure.update(node=bad.index, lost=code < 0 or code == 124)
        if watch:
          watch.read()
        stop(children)
        bad.join()
        steps = f" Last step finished: {watch.last_steps()}." if watch else ""
        last = next((t.strip() for t in reversed(bad.tail) if t.strip()), "(nothing)")
        report.log(f"the last lines of node {bad.index}'s stderr:\n" + "\n".join(bad.tail))
        where = f" (its last lines: {report.log_path()})" if report.log_path() else ""
        message = (
          f"node {bad.index} (process {bad.index} of {nodes}) {what}; stopped the other "
          f"nodes.{steps} Its last line on stderr: {last}{where}"
        )
        print(report.line("error", message), file=err, flush=True)
        return code if code > 0 else 128 - code
      if all(c == 0 for c in codes):
        for n in children:
          n.join()
        if network and nodes > 1:
          sent = network.link_bytes()
          if link_bytes is not None:
            link_bytes.update(sent)
          say(
            "bytes sent over each node's link (tc): "
            + ", ".join(f"node {k} {b / 2**20:.1f} MiB" for k, b in sorted(sent.items()))
          )
        return 0
      time.sleep(0.1)
  except LaunchInterrupted as e:
    say(
      f"got {signal.Signals(e.signum).name}: passing SIGINT on to the {nodes} nodes (they "
      f"checkpoint an agreed step and stop; SIGKILL after {stop_grace:g} s; Ctrl-C again to "
      f"stop them at once), then cleaning up"
    )
    stop_together(children, stop_grace)
    if watch:
      watch.read()
      say(f"stopped. Last step finished: {watch.last_steps()}")
    return 128 + e.signum
  finally:
    stop(children)
    for sig, handler in old_handlers.items():
      signal.signal(sig, handler)
    if network:
      network.close()
    shutil.rmtree(beats, ignore_errors=True)
    reaper.done()
