"""`paro-jax train`: its flags (built from `RunConfig`'s fields) and its entry, run once the
entry point has set up the devices. Imports no jax: the loop is imported when the run starts."""

from __future__ import annotations

import os
import signal
import threading

from paro_jax import report
from paro_jax.cluster import native_stderr, watch
from paro_jax.core.flags import (
  Invocation,
  add_options,
  add_process_flags,
  add_step_flags,
  config_of,
  group_options,
)
from paro_jax.run.config import RunConfig


def add_parser(sub) -> None:
  train = sub.add_parser("train", help="train a Flax LLaMA with a PaRO strategy")
  add_step_flags(train, RunConfig)
  add_options(train, RunConfig, "optimizer.steps", "seed", "optimizer.lr", "optimizer.warmup")
  add_options(train, RunConfig, "compile_top")
  data = train.add_argument_group(
    "data",
    "text, JSONL, Parquet and pre-tokenized .bin files (default: the built-in corpus, Python's "
    "standard library sources); JSONL and Parquet records of text, prompt-completion or chat",
  )
  add_options(data, RunConfig, *group_options(RunConfig, "data"))
  add_options(data, RunConfig, *group_options(RunConfig, "eval"))
  add_options(train, RunConfig, "out")
  watching = train.add_argument_group(
    "watching the run",
    "each step's metrics row goes to OUT/metrics.jsonl and, from process 0, to the sinks below "
    "(a sink that fails is one warning line; the run goes on); docs/training.md",
  )
  add_options(watching, RunConfig, *group_options(RunConfig, "sinks"))
  add_options(watching, RunConfig, *group_options(RunConfig, "profile"))
  ckpt = train.add_argument_group(
    "checkpoints",
    "saved asynchronously into OUT/checkpoints/, also at the end and on Ctrl-C or SIGTERM "
    "(then the run stops after the current step; a second signal stops at once)",
  )
  add_options(ckpt, RunConfig, "checkpoints.every", "checkpoints.keep", "max_bad_steps")
  _divergence_args(train)
  add_options(train, RunConfig, "memory_check")
  add_options(ckpt, RunConfig, "checkpoints.resume", "checkpoints.keep_base")
  add_options(train, RunConfig, "init_from")
  dist = train.add_argument_group(
    "multi-process",
    "one process per node, joined by jax.distributed (auto-detected under "
    "SLURM srun / Open MPI mpirun); --mesh GxM then counts all processes' devices",
  )
  add_process_flags(dist)
  dist.add_argument(
    "--heartbeat-timeout",
    type=float,
    default=60.0,
    metavar="S",
    help="a process that sent the others no heartbeat for S s (stopped, frozen) is named and the "
    "others exit (code 124): for SLURM/mpirun; under paro-jax launch the launcher's own "
    "--heartbeat-timeout applies (0: off)",
  )
  add_options(dist, RunConfig, "progress_timeout")


def _divergence_args(train) -> None:
  """The divergence guard's flags (paro_jax/run/divergence.py; docs/failures.md)."""
  g = train.add_argument_group(
    "divergence guard",
    "a step is out of band when its loss or gradient norm is NaN/Inf, its loss is above the "
    "cap, or either is more than a factor above the mean of the previous in-band steps; "
    "--divergence-patience such steps in a row stop the run, naming the newest checkpoint "
    "saved before it (never rotated away; later ones are set aside as diverged-<step>)",
  )
  add_options(g, RunConfig, *group_options(RunConfig, "guard"))


def log_name(args) -> str:
  """The name of this process's log in the run directory: one per process."""
  rank = args.process_id
  if rank is None:  # under SLURM / Open MPI the rank is in the environment
    ranks = (os.environ.get(v, "") for v in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))
    rank = next((int(r) for r in ranks if r.isdigit()), 0)
  return report.LOG_NAME if not rank else f"paro-jax.node{rank}.log"


def before_devices(args, inv: Invocation) -> None:
  """What train does before the devices exist: its signals, its --out, its heartbeat."""
  if inv.command_line:
    _exit_on_signals_until_the_loop()
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    raise ValueError(
      f"--out {args.out} is a file: pass a directory for the run (metrics.jsonl, checkpoints/)"
    )
  watch.start_heartbeat()  # when paro-jax launch asked for one (env PARO_JAX_HEARTBEAT)


def fold_native_stderr(args, inv: Invocation, cluster: bool) -> None:
  """Under SLURM / mpirun: a native abort (JAX's client, its service gone) folded into the log
  (`paro-jax launch` folds its nodes' output itself)."""
  if cluster and inv.command_line:
    who = f"process {os.environ.get('SLURM_PROCID', os.environ.get('OMPI_COMM_WORLD_RANK'))}: "
    native_stderr.fold(os.path.join(args.out, log_name(args)), who)


def main(args, inv: Invocation) -> None:
  """The run, with the devices set up."""
  from paro_jax.run.train import train  # imports jax: after the device flag is set

  peers = watch.start_peer_watch(args.heartbeat_timeout)  # SLURM / mpirun: frozen processes named
  try:
    train(config_of(args, RunConfig, mesh=inv.mesh))
  finally:
    if peers:
      peers.stop()


def _exit_on_signals_until_the_loop() -> None:
  """A `paro-jax train` process, until its loop takes SIGINT and SIGTERM over (run/stopping.py
  StopSignals), has nothing to save: either signal ends it at once with 128 + the signal.
  Python's own SIGINT handler raises KeyboardInterrupt instead, which a spot that swallows
  exceptions can lose (a gc callback of jax's: "Exception ignored in ..."): the process then ran
  on, and its peers and `paro-jax launch` waited for it (the launcher until its --stop-grace).
  StopSignals does not give this handler back: after the loop Python's own are in place, and
  after a failed loop a first signal waits for the run's one-line error."""

  def handler(signum, _frame):
    name = signal.Signals(signum).name
    os.write(2, f"\nparo-jax: {name} before the first step: nothing to save; exiting\n".encode())
    os._exit(128 + signum)

  handler.until_the_loop = True  # StopSignals takes over, and does not give it back
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, handler)
