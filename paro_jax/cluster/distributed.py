"""Joining several processes (hosts) into one JAX program with `jax.distributed`.

Either the three flags `--coordinator HOST:PORT --num-processes N --process-id I` are given, or
the process runs under SLURM (`srun`) or Open MPI (`mpirun`) with more than one task, and JAX's
own cluster auto-detection (`jax.distributed.initialize()` without arguments) finds the rest.
Nothing in this module touches devices: it must run before anything else does.
"""

from __future__ import annotations

import math
import os

from paro_jax.cluster import gloo_rs

# JAX's coordination service (process 0) aborts every process (SIGABRT: a C++ check failure and
# its stack; `client.h: Terminating process because the JAX distributed service detected fatal
# errors`) once a process sent it no heartbeat for this long; a client does the same when the
# service stops answering. It names no process to the user. Ours name the frozen one (the
# launcher's heartbeat files, train's PeerWatch) after their --heartbeat-timeout: JAX's must be
# longer. It fired 0.85-0.9 of its timeout after a SIGSTOP here (17.8 s of 20, 36.9 of 40, 82
# of 100 on a loaded machine): twice ours plus 30 s leaves room.
JAX_HEARTBEAT_TIMEOUT = 100  # jax.distributed.initialize's default heartbeat_timeout_seconds
HEARTBEAT_TIMEOUT_ENV = "PARO_JAX_HEARTBEAT_TIMEOUT"  # the launcher's, for its nodes


def coordination_heartbeat(watch_timeout: float) -> int:
  """JAX's coordination-service heartbeat timeout when ours is `watch_timeout` s (0: off)."""
  if not watch_timeout:
    return JAX_HEARTBEAT_TIMEOUT
  return max(JAX_HEARTBEAT_TIMEOUT, math.ceil(2 * watch_timeout + 30))


# The variables JAX's SlurmCluster / OmpiCluster need (jax/_src/clusters/*.py, jax 0.10.2).
_SLURM_VARS = (
  "SLURM_JOB_ID",
  "SLURM_STEP_NODELIST",
  "SLURM_NTASKS",
  "SLURM_PROCID",
  "SLURM_LOCALID",
)
_OMPI_URI = "OMPI_MCA_orte_hnp_uri"


def detect_cluster(environ=None) -> tuple[str, int] | None:
  """(scheduler, process count) when SLURM or Open MPI started more than one task, else None."""
  env = os.environ if environ is None else environ
  if all(v in env for v in _SLURM_VARS) and int(env["SLURM_NTASKS"]) > 1:
    return "slurm", int(env["SLURM_NTASKS"])
  if _OMPI_URI in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return "ompi", int(env["OMPI_COMM_WORLD_SIZE"])
  return None


def one_process_per_node(environ=None) -> bool:
  """Whether the scheduler started a single task on this node (SLURM / Open MPI variables)."""
  env = os.environ if environ is None else environ
  if "OMPI_COMM_WORLD_LOCAL_SIZE" in env:
    return env["OMPI_COMM_WORLD_LOCAL_SIZE"] == "1"
  nodes = env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES"))
  if "SLURM_NTASKS" in env and nodes:
    return env["SLURM_NTASKS"] == nodes
  return True


def _check_flags(coordinator, num_processes, process_id) -> bool:
  """True when explicit flags ask for a multi-process run; loud errors for incomplete ones."""
  given = {
    "--coordinator": coordinator,
    "--num-processes": num_processes,
    "--process-id": process_id,
  }
  if all(v is None for v in given.values()):
    return False
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(
      f"multi-process training needs --coordinator HOST:PORT, --num-processes N and "
      f"--process-id I together; missing {', '.join(missing)}"
    )
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"bad --coordinator {coordinator!r}: write HOST:PORT, e.g. 10.0.0.1:12355")
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(
      f"--process-id must be in [0, --num-processes={num_processes}), got {process_id}"
    )
  return True


def process_count(coordinator=None, num_processes=None, process_id=None, environ=None) -> int:
  """How many processes the run will have, known before jax is imported (for the CPU devices)."""
  if _check_flags(coordinator, num_processes, process_id):
    return num_processes
  detected = detect_cluster(environ)
  return detected[1] if detected else 1


def maybe_initialize(
  coordinator=None,
  num_processes=None,
  process_id=None,
  gloo_reduce_scatter=False,
  heartbeat_timeout: float = 0.0,
) -> bool:
  """Call `jax.distributed.initialize` when flags or a SLURM/Open MPI environment ask for it.

  Returns whether it did. On CPU, cross-process collectives use gloo (jax 0.10.2's default
  `jax_cpu_collectives_implementation`; an explicit JAX_CPU_COLLECTIVES_IMPLEMENTATION is kept),
  and reduce-scatters then run as an all-reduce and a slice (`gloo_rs`: gloo's own reduce-scatter
  can corrupt its result); `gloo_reduce_scatter=True` keeps gloo's, to show that it does.
  JAX's coordination heartbeat is set longer than the frozen-process watch that names the
  process: the launcher's (its nodes' env HEARTBEAT_TIMEOUT_ENV) or `heartbeat_timeout`, train's.
  """
  explicit = _check_flags(coordinator, num_processes, process_id)
  detected = None if explicit else detect_cluster()
  if not explicit and detected is None:
    return False
  import jax  # importing jax does not touch devices; initialize must precede the first use

  if jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if explicit and num_processes == 1:
    return False
  # Under SLURM / Open MPI, JAX gives each process only GPU number SLURM_LOCALID (one process per
  # GPU). With one process per node, that process must keep all of its node's devices: they are
  # its intra group. `[]` means "all visible devices" (an explicit JAX_LOCAL_DEVICE_IDS wins).
  local = None
  if "JAX_LOCAL_DEVICE_IDS" not in os.environ and (explicit or one_process_per_node()):
    local = []
  watch = float(os.environ.get(HEARTBEAT_TIMEOUT_ENV, heartbeat_timeout))
  beat = {"heartbeat_timeout_seconds": coordination_heartbeat(watch)}
  if explicit:
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=num_processes,
      process_id=process_id,
      local_device_ids=local,
      **beat,
    )
  else:  # JAX's own SLURM / Open MPI detection
    jax.distributed.initialize(local_device_ids=local, **beat)
  if not gloo_reduce_scatter:
    gloo_rs.register_if_gloo()
  return True
