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

The per-node command is `train ...` (run as `python -m paro_jax train ...`) or a Python script,
`python SCRIPT [args]` or `SCRIPT.py [args]` (run with this interpreter, e.g.
experiments/bench_collectives.py); either gets --mesh GxM and the multi-process flags appended, and
the env var PARO_JAX_LINK describes the link (shaped or not).

From Python: `launch(["train", "--steps", "2", ...], nodes=2, devices_per_node=2)` returns the
exit code.
"""

from __future__ import annotations

import collections
import math
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
from paro_jax.cluster.watch import HEARTBEAT_ENV, Watch
from paro_jax.core.names import parse_mesh_shape
from paro_jax.core.units import parse_delay, parse_rate
from paro_jax.core.xla_flags import DEVICE_COUNT_FLAG

NS_PREFIX = "paro"  # namespaces: paro<pid>n<k>, paro<pid>br (bridge)
IF_PREFIX = "pj"  # interfaces: pj<pid>v<k> (node side), pj<pid>p<k> (bridge side)
SUBNET = "10.77.0"  # node k has 10.77.0.(k+1), only inside our own namespaces
COORD_PORT = 29500  # free: each namespace is fresh
MAX_NODES, MAX_DEVICES_PER_NODE = 64, 1024  # processes / virtual CPU devices one machine emulates
RESERVED = ("--coordinator", "--num-processes", "--process-id")
_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)(?:n\d+|br)$")


def _tbf(dev: str, rate: str, latency: str) -> list[str]:
  burst = max(32 * 1024, int(parse_rate(rate) / 8 / 500))  # >= 2 ms of traffic at the rate
  return [
    "tc",
    "qdisc",
    "add",
    "dev",
    dev,
    "root",
    "handle",
    "1:",
    "tbf",
    "rate",
    rate,
    "burst",
    str(burst),
    "latency",
    latency,
  ]


def _run(cmd: list[str]) -> None:
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")


def _quiet(cmd: list[str]) -> None:
  subprocess.run(cmd, capture_output=True)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _our_namespaces() -> list[str]:
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def node_link(tag: int, node: int) -> tuple[str, str]:
  """(network namespace, node-side veth) of node `node` in the launch whose names carry `tag`
  (the launcher's PID): where `tc` shapes and counts that node's inter-node traffic."""
  return f"{NS_PREFIX}{tag}n{node}", f"{IF_PREFIX}{tag}v{node}"


def sent_bytes(tag: int, node: int) -> int | None:
  """Bytes node `node` of launch `tag` has sent over its link so far, as `tc -s qdisc` counts
  them at the root qdisc of its veth; None where there is none (not namespaced, or removed, or
  no `ip`).
  Safe to call while the launch runs (experiments/bench/runs.py samples it per step)."""
  namespace, dev = node_link(tag, node)
  try:
    out = subprocess.run(
      ["ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", dev],
      capture_output=True,
      text=True,
    ).stdout
  except FileNotFoundError:  # no `ip`: the launcher ran unshaped
    return None
  m = re.search(r"Sent (\d+) bytes", out)
  return int(m.group(1)) if m else None


def remove_stale_namespaces() -> list[str]:
  """Delete namespaces (and /etc/netns dirs) of launchers whose PID no longer exists."""
  removed = []
  for name in _our_namespaces():
    m = _NS_RE.match(name)
    if m and not _pid_alive(int(m.group(1))):
      _quiet(["ip", "netns", "del", name])
      shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
      removed.append(name)
  return removed


class NamespaceNetwork:
  """Namespaces, veths, bridge and tc shaping for one launch; `close()` removes all of it."""

  def __init__(
    self,
    nodes: int,
    inter_bandwidth: str,
    inter_latency: str | None,
    intra_bandwidth: str | None,
    tag: int | None = None,
  ):
    tag = self.tag = os.getpid() if tag is None else tag
    self.nodes = nodes
    links = [node_link(tag, k) for k in range(nodes)]
    self.namespaces = [ns for ns, _ in links]
    self.bridge_ns = f"{NS_PREFIX}{tag}br" if nodes > 2 else None
    self.ifaces = [dev for _, dev in links]
    self.peers = [f"{IF_PREFIX}{tag}p{k}" for k in range(nodes)]
    self.bridge = f"{IF_PREFIX}{tag}br"
    self.addresses = [f"{SUBNET}.{k + 1}" for k in range(nodes)]
    self.inter_bandwidth, self.intra_bandwidth = inter_bandwidth, intra_bandwidth
    self.delay = parse_delay(inter_latency)
    self.inter_latency = inter_latency
    self.notes: list[str] = []
    self._created: list[str] = []

  def all_namespaces(self) -> list[str]:
    return self.namespaces + ([self.bridge_ns] if self.bridge_ns else [])

  def open(self) -> None:
    try:
      self._open()
    except BaseException:
      self.close()
      raise

  def _open(self) -> None:
    hostname = socket.gethostname()
    for ns in self.all_namespaces():
      _run(["ip", "netns", "add", ns])
      self._created.append(ns)
    for k, ns in enumerate(self.namespaces):
      # `ip netns exec` bind-mounts /etc/netns/NS/hosts over /etc/hosts: gloo binds to the
      # address the host name resolves to, which must be this node's, not 127.0.0.1.
      os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
      with open(f"/etc/netns/{ns}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost\n{self.addresses[k]} {hostname}\n")
      _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    if self.nodes == 2:
      _run(
        [
          "ip",
          "link",
          "add",
          self.ifaces[0],
          "netns",
          self.namespaces[0],
          "type",
          "veth",
          "peer",
          "name",
          self.ifaces[1],
          "netns",
          self.namespaces[1],
        ]
      )
    elif self.nodes > 2:
      br = self.bridge_ns
      _run(["ip", "-n", br, "link", "add", self.bridge, "type", "bridge"])
      _run(["ip", "-n", br, "link", "set", self.bridge, "up"])
      for k, ns in enumerate(self.namespaces):
        _run(
          [
            "ip",
            "link",
            "add",
            self.ifaces[k],
            "netns",
            ns,
            "type",
            "veth",
            "peer",
            "name",
            self.peers[k],
            "netns",
            br,
          ]
        )
        _run(["ip", "-n", br, "link", "set", self.peers[k], "master", self.bridge])
        _run(["ip", "-n", br, "link", "set", self.peers[k], "up"])
    if self.nodes >= 2:
      for k, ns in enumerate(self.namespaces):
        _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[k]}/24", "dev", self.ifaces[k]])
        _run(["ip", "-n", ns, "link", "set", self.ifaces[k], "up"])
      self._shape_inter()
    if self.intra_bandwidth:
      for ns in self.namespaces:
        _run(["ip", "netns", "exec", ns, *_tbf("lo", self.intra_bandwidth, "100ms")])

  def _shape_inter(self) -> None:
    """Each node's egress: tbf at the rate, netem delay below it (when the kernel has netem)."""
    netem_ok = True
    for k, ns in enumerate(self.namespaces):
      dev = self.ifaces[k]
      _run(["ip", "netns", "exec", ns, *_tbf(dev, self.inter_bandwidth, "50ms")])
      if self.delay and netem_ok:
        proc = subprocess.run(
          [
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "parent",
            "1:1",
            "handle",
            "10:",
            "netem",
            "delay",
            f"{self.delay * 1e6:.0f}us",
            "limit",
            "100000",
          ],
          capture_output=True,
          text=True,
        )
        if proc.returncode:
          netem_ok = False
          self.notes.append(
            f"latency {self.inter_latency} NOT emulated: tc netem is not available "
            f"({proc.stderr.strip()}); only the rate is shaped"
          )

  def link_bytes(self) -> dict[int, int]:
    """Bytes each node has sent over its shaped link (tc's count: real inter-node traffic)."""
    sent = {}
    for k in range(self.nodes if self.nodes >= 2 else 0):
      if (nbytes := sent_bytes(self.tag, k)) is not None:
        sent[k] = nbytes
    return sent

  def describe(self) -> str:
    if self.nodes == 1:
      return f"1 node in namespace {self.namespaces[0]}"
    link = "veth pair" if self.nodes == 2 else f"bridge in namespace {self.bridge_ns}"
    text = (
      f"{self.nodes} namespaces {self.namespaces[0]}..{self.namespaces[-1]} joined by a "
      f"{link}, {SUBNET}.1-{self.nodes}; each node's link shaped to {self.inter_bandwidth}"
    )
    if self.delay and not self.notes:
      text += f" + {self.inter_latency} delay"
    if self.intra_bandwidth:
      text += f"; intra (loopback) {self.intra_bandwidth}"
    return text

  def close(self) -> None:
    """Remove everything this launch created; safe to call twice or after a partial open()."""
    for ns in reversed(self._created):
      _quiet(["ip", "netns", "del", ns])  # takes its veths, bridge and qdiscs with it
    for dev in self.ifaces + self.peers + [self.bridge]:  # any left in the root namespace
      if os.path.exists(f"/sys/class/net/{dev}"):
        _quiet(["ip", "link", "del", dev])
    for ns in self.all_namespaces():
      shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    self._created = []


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _is_python(token: str) -> bool:
  return re.fullmatch(r"python[0-9.]*", os.path.basename(token)) is not None


def child_argv(train_argv: list[str], nodes: int, devices_per_node: int) -> list[str]:
  """The children's argv, checked; --mesh GxM is added unless given (and equal).

  `train ...` stays as it is (run by `python -m paro_jax`); `python ARGS` and `SCRIPT.py ARGS`
  become `[SCRIPT.py, ...]` / `[ARGS...]`, run by this interpreter (see `_command`).
  """
  if train_argv and _is_python(train_argv[0]):
    train_argv = train_argv[1:]
    if not train_argv:
      raise ValueError("`python` after -- needs a script, e.g. `-- python experiments/x.py`")
  elif not train_argv or (train_argv[0] != "train" and not train_argv[0].endswith(".py")):
    raise ValueError(
      f"put the train command or a Python script after --, e.g. `paro-jax launch "
      f"--nodes 2 --devices-per-node 2 -- train --model tiny` or `... -- python "
      f"experiments/bench_collectives.py`; got {train_argv!r}"
    )
  if train_argv[0].endswith(".py") and not os.path.isfile(train_argv[0]):
    raise ValueError(f"no such script: {train_argv[0]}")
  for flag in RESERVED:
    if any(a == flag or a.startswith(flag + "=") for a in train_argv):
      raise ValueError(f"{flag} is set by the launcher; leave it out of the train command")
  argv = list(train_argv)
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
  if argv[0] == "train":
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


_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class _Node:
  """A node's process and the threads that pass its output on, each line prefixed `[node K]`.

  Kept out of the terminal (into the launcher's log): Gloo's connection messages, unless
  `show_gloo`, and Python tracebacks, which are those of nodes that lost a peer (the launcher's
  own line names the node that failed first and shows the end of its stderr).
  """

  def __init__(self, index: int, proc: subprocess.Popen, out, err, lock, show_gloo=False):
    self.index, self.proc, self.show_gloo = index, proc, show_gloo
    self.tail = collections.deque(maxlen=15)
    self.in_traceback = self.after_traceback = False
    self.threads = [
      threading.Thread(target=self._pump, args=(proc.stdout, out, lock, False), daemon=True),
      threading.Thread(target=self._pump, args=(proc.stderr, err, lock, True), daemon=True),
    ]
    for t in self.threads:
      t.start()

  def _pump(self, pipe, sink, lock, keep) -> None:
    prefix = f"[node {self.index}] "
    for raw in iter(pipe.readline, b""):
      line = raw.decode(errors="replace").rstrip("\r\n")
      if keep:
        self.tail.append(line)
      if self._hidden(line, keep):
        report.log(prefix + line)
        continue
      with lock:
        sink.write(prefix + line + "\n")
        sink.flush()
    pipe.close()

  def _hidden(self, line: str, stderr: bool) -> bool:
    if line.startswith("[Gloo] "):
      return not self.show_gloo
    if not stderr:
      return False
    if line.startswith(("Traceback (most recent call last)", *_CHAINED)):
      self.in_traceback = True
      return True
    if self.in_traceback:
      if line and not line[0].isspace():
        self.in_traceback = False  # the exception's own line ends the block (into the log too)
        self.after_traceback = True
      return True
    if self.after_traceback and not line.strip():
      return True  # the blank line before a chained exception's "During handling ..."
    self.after_traceback = False
    return False

  def join(self, timeout: float = 5.0) -> None:
    for t in self.threads:
      t.join(timeout)


def _describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit code {code}"


def _signal_all(nodes: list[_Node], sig: signal.Signals) -> None:
  for n in nodes:
    if n.proc.poll() is None:
      try:
        os.killpg(n.proc.pid, sig)  # its own session: the group id is its pid
      except (ProcessLookupError, PermissionError):
        pass


def _stop(nodes: list[_Node], first: signal.Signals = signal.SIGKILL, grace: float = 10.0) -> None:
  """Send `first` to each live child's process group; SIGKILL what is left after `grace` s.

  Not SIGTERM: jax.distributed's preemption notifier catches it and the process runs on.
  SIGINT lets `paro-jax train` checkpoint and stop (on Ctrl-C); after a failure the others
  are likely blocked in a collective with the dead process, so they get SIGKILL at once.
  """
  live = [n for n in nodes if n.proc.poll() is None]
  for sig in dict.fromkeys((first, signal.SIGKILL)):
    _signal_all(live, sig)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
      live = [n for n in live if n.proc.poll() is None]
      time.sleep(0.05)
    if not live:
      break
  for n in nodes:
    try:
      n.proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
      pass


def _stop_together(nodes: list[_Node], grace: float, straggle: float = 30.0) -> None:
  """After Ctrl-C: SIGINT to every node; they checkpoint an agreed step and exit together. Who is
  still running `grace` s later, or `straggle` s after the first node exited (a node that got the
  signal before its handler was in place exits alone, and its peers then hang), gets SIGKILL."""
  _signal_all(nodes, signal.SIGINT)
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline:
    codes = [n.proc.poll() for n in nodes]
    if all(c is not None for c in codes):
      return
    if any(c is not None for c in codes):
      deadline = min(deadline, time.monotonic() + straggle)
      straggle = float("inf")  # set the deadline once
    time.sleep(0.05)
  _stop(nodes)


class _Interrupted(Exception):
  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


class _Reaper:
  """The process that cleans up if this launcher is SIGKILLed (paro_jax/cluster/reaper.py)."""

  def __init__(self, env: dict):
    self.proc = subprocess.Popen(
      [sys.executable, "-m", "paro_jax.cluster.reaper"],
      stdin=subprocess.PIPE,
      stdout=subprocess.DEVNULL,
      env=env,
      start_new_session=True,  # Ctrl-C on the terminal is not for it
      text=True,
    )

  def tell(self, kind: str, value) -> None:
    try:
      self.proc.stdin.write(f"{kind} {value}\n")
      self.proc.stdin.flush()
    except (BrokenPipeError, OSError):
      pass

  def done(self) -> None:
    try:
      self.proc.stdin.write("done\n")
      self.proc.stdin.close()
    except (BrokenPipeError, OSError):
      pass
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.proc.kill()


def _flag(argv: list[str], name: str, default: str | None) -> str | None:
  """The last value of `--name V` / `--name=V` in argv."""
  value = default
  for i, a in enumerate(argv):
    if a == name and i + 1 < len(argv):
      value = argv[i + 1]
    elif a.startswith(name + "="):
      value = a.split("=", 1)[1]
  return value


def _without(argv: list[str], name: str) -> list[str]:
  """argv without `--name V` / `--name=V`."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a == name:
      skip = True
    elif not a.startswith(name + "="):
      out.append(a)
  return out


def checkpoint_steps(out: str) -> list[int]:
  """The finished checkpoints of run directory `out` (paro_jax/run/checkpoint.py, no jax)."""
  d = os.path.join(out, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def restart_argv(train_argv: list[str], nodes: int, devices_per_node: int) -> tuple[list, str]:
  """The train command continuing a failed run on `nodes` nodes, and what changes; ValueError
  where the run cannot continue there."""
  if not train_argv or train_argv[0] != "train":
    raise ValueError("only a `train` command can be restarted")
  if nodes < 1:
    raise ValueError("no node is left")
  out = _flag(train_argv, "--out", "runs/latest")
  steps = checkpoint_steps(out)
  if not steps:
    raise ValueError(
      f"{out} holds no checkpoint to continue from: pass --checkpoint-every N to the train "
      f"command so that a run can restart"
    )
  batch = int(_flag(train_argv, "--batch-size", "16"))
  old = [a for i, a in enumerate(train_argv) if a == "--mesh" or a.startswith("--mesh=")]
  was = nodes + 1
  devices = nodes * devices_per_node
  if batch % devices:
    raise ValueError(
      f"the global batch of {batch} sequences cannot be kept on {nodes} nodes x "
      f"{devices_per_node} devices ({batch} is not divisible by {devices}): pass a --batch-size "
      f"divisible by the device counts the run may shrink to (e.g. "
      f"{math.lcm(devices, was * devices_per_node)})"
    )
  argv = _without(train_argv, "--mesh") if old else list(train_argv)
  if "--resume" not in argv:
    argv.append("--resume")
  rows = (batch // (was * devices_per_node), batch // devices)
  why = (
    f"continuing on {nodes} nodes (mesh {nodes}x{devices_per_node}) from checkpoint step "
    f"{steps[-1]} in {out}/checkpoints (states resharded, the steps after it redone): the global "
    f"batch stays {batch} sequences per micro-batch, in the same order, now {rows[1]} rows per "
    f"device instead of {rows[0]}"
  )
  return argv, why


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

  children: list[_Node] = []
  lock = threading.Lock()
  old_handlers, interrupted = {}, []

  def on_signal(signum, _frame):
    if not interrupted:
      interrupted.append(signum)
      raise _Interrupted(signum)
    # A second Ctrl-C: the nodes stop at once (their own second-signal rule); the cleanup goes on.
    _signal_all(children, signal.SIGINT)

  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):
      old_handlers[sig] = signal.signal(sig, on_signal)
  network = None
  base_env = child_env(devices_per_node, env)
  beats = tempfile.mkdtemp(prefix=f"paro-jax-launch-{os.getpid()}-")
  reaper = _Reaper(base_env)
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
      children.append(_Node(k, proc, out, err, lock, show_gloo))
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
          what = f"failed with {_describe_exit(code)}"
        else:
          bad, code = children[verdict[0]], 124
          what = verdict[1]
        if failure is not None:  # a lost node (killed, frozen, hung), not an error of the run
          failure.update(node=bad.index, lost=code < 0 or code == 124)
        if watch:
          watch.read()
        _stop(children)
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
  except _Interrupted as e:
    say(
      f"got {signal.Signals(e.signum).name}: passing SIGINT on to the {nodes} nodes (they "
      f"checkpoint an agreed step and stop; SIGKILL after {stop_grace:g} s; Ctrl-C again to "
      f"stop them at once), then cleaning up"
    )
    _stop_together(children, stop_grace)
    if watch:
      watch.read()
      say(f"stopped. Last step finished: {watch.last_steps()}")
    return 128 + e.signum
  finally:
    _stop(children)
    for sig, handler in old_handlers.items():
      signal.signal(sig, handler)
    if network:
      network.close()
    shutil.rmtree(beats, ignore_errors=True)
    reaper.done()
