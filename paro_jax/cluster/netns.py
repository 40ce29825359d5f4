"""The network of an emulated cluster: one network namespace per node, their links (a veth pair,
or a bridge), `tc` shaping of each node's link and loopback, and the bytes `tc` counted on them.

All names carry a tag (the launcher's PID), so launches side by side do not collide; namespaces
whose tag is a PID no longer alive are stale and removed by the next launch.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

from paro_jax.core.units import parse_delay, parse_rate

NS_PREFIX = "paro"  # namespaces: paro<pid>n<k>, paro<pid>br (bridge)
IF_PREFIX = "pj"  # interfaces: pj<pid>v<k> (node side), pj<pid>p<k> (bridge side)
SUBNET = "10.77.0"  # node k has 10.77.0.(k+1), only inside our own namespaces
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
