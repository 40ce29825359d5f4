"""A real two-node SLURM cluster on one machine (root): `python -m tests.cluster.slurm_cluster up`.

`up` installs slurm-wlm and munge with apt-get where they are missing, and starts:
- two "nodes", each a network namespace (the launcher's `NamespaceNetwork`: a veth pair,
  10.77.0.1 and 10.77.0.2, shaped with tc) in which a slurmd runs in its own UTS namespace with
  its own host name (pjnode0, pjnode1): `srun -N2` really spans two hosts, and the tasks' gloo
  collectives cross the link between them;
- munged (its key and socket in a temporary directory) and slurmctld (on pjnode0).
It waits until both nodes are idle and writes where everything is to STATE. Client commands
(`srun`, `sbatch`, `squeue`, `scancel`, `scontrol`) run on pjnode0, as on a login node:
`python -m tests.cluster.slurm_cluster exec -- sbatch job.sh`. `down` stops every daemon and process
of the cluster and removes the namespaces and the directory; `up` does the same when it fails.

Debian's slurmd is built without multiple-slurmd support (one slurmd per host name), which is why
each node is a namespace of its own. Only root can create them; elsewhere `up` raises Unavailable.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from paro_jax.cluster.netns import NamespaceNetwork

STATE = "/tmp/paro-jax-slurm.json"  # where `down` finds a cluster started by another process
NODES = ("pjnode0", "pjnode1")
PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "sbatch")


class Unavailable(RuntimeError):
  """SLURM cannot run here (not root, no apt-get, or a daemon did not start); says why."""


def ensure_installed() -> None:
  """apt-get install slurm-wlm and munge where a daemon is missing (root only)."""
  if all(shutil.which(d) for d in DAEMONS):
    return
  if os.geteuid() != 0 or not shutil.which("apt-get"):
    raise Unavailable("SLURM is not installed, and installing it needs root and apt-get")
  env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
  for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
      raise Unavailable(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-500:]}")
  missing = [d for d in DAEMONS if not shutil.which(d)]
  if missing:
    raise Unavailable(f"{', '.join(missing)} still missing after installing {PACKAGES}")


def slurm_conf(root: str, addresses: list[str], cpus: int) -> str:
  """slurm.conf of the two nodes, every path under `root`."""
  nodes = "\n".join(
    f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN"
    for name, addr in zip(NODES, addresses)
  )
  return f"""ClusterName=parojax
SlurmctldHost={NODES[0]}({addresses[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=600
KillWait=30
Waittime=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _on_node(namespace: str, hostname: str, argv: list[str]) -> list[str]:
  """argv run as on host `hostname`: in `namespace`'s network, with a UTS namespace of its own
  and that namespace's hosts file bound over /etc/hosts in a mount namespace of its own.

  Not `ip netns exec`: it remounts /sys, which hides the cgroup file systems slurmd needs."""
  script = (
    f'mount --bind /etc/netns/{namespace}/hosts /etc/hosts && hostname {hostname} && exec "$@"'
  )
  return [
    "nsenter",
    f"--net=/var/run/netns/{namespace}",
    "unshare",
    "--uts",
    "--mount",
    "sh",
    "-c",
    script,
    "sh",
    *argv,
  ]


class Cluster:
  """A running cluster: `exec_argv(argv)` runs a client command on pjnode0."""

  def __init__(self, state: dict):
    self.state = state
    self.root = state["root"]
    self.conf = os.path.join(self.root, "slurm.conf")

  def env(self, extra: dict | None = None) -> dict:
    return {**os.environ, "SLURM_CONF": self.conf, **(extra or {})}

  def exec_argv(self, argv: list[str]) -> list[str]:
    return _on_node(self.state["namespaces"][0], NODES[0], argv)

  def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    env = self.env(kwargs.pop("env", None))
    return subprocess.run(self.exec_argv(argv), env=env, **kwargs)

  def node_states(self) -> dict[str, str]:
    out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())

  def log(self, name: str) -> str:
    path = os.path.join(self.root, name)
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def _spawn(argv: list[str], log: str, env: dict) -> int:
  with open(log, "ab") as f:
    proc = subprocess.Popen(
      argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env, start_new_session=True
    )
  return proc.pid


def up(inter_bandwidth: str = "10gbit", timeout: float = 60.0) -> Cluster:
  """Start the cluster (see the module's docstring); on any failure, remove what was started."""
  if os.geteuid() != 0:
    raise Unavailable("a SLURM cluster of network namespaces needs root")
  for tool in ("ip", "tc", "nsenter", "unshare"):
    if not shutil.which(tool):
      raise Unavailable(f"`{tool}` not found (packages iproute2, util-linux)")
  if os.path.exists(STATE):
    down()  # a cluster left by an earlier run: its daemons would hold the ports
  ensure_installed()
  root = tempfile.mkdtemp(prefix="paro-jax-slurm-")
  os.chmod(root, 0o700)  # munged refuses a key or socket in a directory others can write
  # The namespaces carry the PID of a process that lives as long as the cluster: the launcher's
  # stale-namespace cleanup (remove_stale_namespaces) then leaves them alone until `down`.
  holder = subprocess.Popen(["sleep", "infinity"], start_new_session=True)
  state = {"root": root, "pids": [holder.pid], "tag": holder.pid, "namespaces": []}
  try:
    net = NamespaceNetwork(2, inter_bandwidth, None, None, tag=holder.pid)
    state["namespaces"] = net.all_namespaces()
    _save(state)
    try:
      net.open()
    except (RuntimeError, OSError) as e:  # no netns here (a container without the capability)
      raise Unavailable(f"could not create the nodes' network namespaces: {e}") from e
    hosts = "127.0.0.1 localhost\n" + "".join(
      f"{addr} {name}\n" for addr, name in zip(net.addresses, NODES)
    )
    for ns in net.namespaces:
      with open(f"/etc/netns/{ns}/hosts", "w") as f:
        f.write(hosts)
    for sub in ("state", *(f"spool-{n}" for n in NODES)):
      os.makedirs(os.path.join(root, sub))
    key = os.path.join(root, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o400), "wb") as f:
      f.write(os.urandom(1024))
    conf = os.path.join(root, "slurm.conf")
    with open(conf, "w") as f:
      f.write(slurm_conf(root, net.addresses, os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": conf}
    munged = [
      "munged",
      "--foreground",
      "--force",
      f"--key-file={key}",
      f"--socket={root}/munge.socket",
      f"--pid-file={root}/munged.pid",
      f"--log-file={root}/munged.log",
      f"--seed-file={root}/munged.seed",
    ]
    state["pids"].append(_spawn(munged, f"{root}/munged.out", env))
    _wait(lambda: os.path.exists(f"{root}/munge.socket"), 10, "munged", root, "munged.log")
    ctld = _on_node(net.namespaces[0], NODES[0], ["slurmctld", "-D", "-i", "-f", conf])
    state["pids"].append(_spawn(ctld, f"{root}/slurmctld.out", env))
    for ns, name in zip(net.namespaces, NODES):
      slurmd = _on_node(ns, name, ["slurmd", "-D", "-N", name, "-f", conf])
      state["pids"].append(_spawn(slurmd, f"{root}/slurmd-{name}.out", env))
    _save(state)
    cluster = Cluster(state)
    _wait(
      lambda: (
        set(cluster.node_states().values()) == {"idle"} and len(cluster.node_states()) == len(NODES)
      ),
      timeout,
      "both nodes idle",
      root,
      "slurmctld.log",
    )
    return cluster
  except BaseException:
    down(state)
    raise


def _wait(ready, timeout: float, what: str, root: str, log: str) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if ready():
      return
    time.sleep(0.5)
  tail = ""
  path = os.path.join(root, log)
  if os.path.exists(path):
    tail = "".join(open(path, errors="replace").readlines()[-15:])
  raise Unavailable(f"SLURM did not start: no {what} after {timeout:g} s. {log}:\n{tail}")


def _save(state: dict) -> None:
  with open(STATE + ".tmp", "w") as f:
    json.dump(state, f)
  os.replace(STATE + ".tmp", STATE)


def down(state: dict | None = None) -> None:
  """Stop every process of the cluster (daemons, jobs' tasks) and remove what `up` wrote."""
  if state is None:
    if not os.path.exists(STATE):
      return
    with open(STATE) as f:
      state = json.load(f)
  for ns in state["namespaces"]:  # jobs' tasks and slurmstepds live in the nodes' namespaces
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in pids.split():
      _kill(int(pid))
  for pid in state["pids"]:
    try:
      os.killpg(pid, signal.SIGKILL)  # each daemon was started in a session of its own
    except (ProcessLookupError, PermissionError):
      pass
    try:
      os.waitpid(pid, 0)  # reaped, where this process started it (not left a zombie)
    except ChildProcessError:
      pass
  for ns in state["namespaces"]:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
  shutil.rmtree(state["root"], ignore_errors=True)
  if os.path.exists(STATE):
    with open(STATE) as f:
      same = json.load(f).get("root") == state["root"]
    if same:
      os.remove(STATE)


def _kill(pid: int) -> None:
  try:
    os.kill(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def current() -> Cluster:
  if not os.path.exists(STATE):
    raise SystemExit(f"no cluster is up ({STATE} is missing): run `up` first")
  with open(STATE) as f:
    return Cluster(json.load(f))


def main(argv: list[str]) -> int:
  usage = "usage: python -m tests.cluster.slurm_cluster up | down | exec -- COMMAND..."
  if not argv or argv[0] not in ("up", "down", "exec"):
    print(usage, file=sys.stderr)
    return 2
  if argv[0] == "up":
    try:
      cluster = up()
    except Unavailable as e:
      print(f"cluster: {e}", file=sys.stderr)
      return 1
    print(f"cluster up: nodes {', '.join(NODES)}; SLURM_CONF={cluster.conf}")
    return 0
  if argv[0] == "down":
    down()
    return 0
  command = argv[2:] if argv[1:2] == ["--"] else argv[1:]
  cluster = current()
  return subprocess.run(cluster.exec_argv(command), env=cluster.env()).returncode


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
