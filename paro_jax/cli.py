"""The `paro-jax` command: the subcommands' parsers (each beside the code it runs), the devices
set up before jax starts, and one line for every error."""
# (the parser's description is DESCRIPTION below, not this docstring)

from __future__ import annotations

import argparse
import os
import sys

from paro_jax import report
from paro_jax.analysis.inspect import command as inspect_command
from paro_jax.analysis.planner import command as planner_command
from paro_jax.cluster import distributed, launch_command, watch
from paro_jax.cluster.restart import _flag
from paro_jax.core.flags import HelpFormatter, Invocation, check_shape, note_cpu_platform
from paro_jax.core.names import parse_mesh_shape
from paro_jax.core.xla_flags import CPU_MEMORY_FIRST_FLAGS, add_xla_flags, provide_cpu_devices
from paro_jax.data import prepare_command
from paro_jax.run import eval_command, export_command, generate_command, plot, train_command

# The modules that import jax (or numpy) are imported inside the commands, once the device flags
# are set: `import paro_jax`, the parser and `plan` start no jax (tests/test_layers.py).

DESCRIPTION = (
  "Train Flax LLaMA models with PaRO sharding strategies in JAX, and inspect, plan, probe, "
  "launch, export and plot such runs. `paro-jax COMMAND --help` shows each command's options "
  "and their defaults."
)
# Each command's parser, in the order `paro-jax --help` lists them.
PARSERS = (
  train_command.add_parser,
  inspect_command.add_parser,
  plot.add_parser,
  export_command.add_parser,
  launch_command.add_parser,
  eval_command.add_parser,
  generate_command.add_parser,
  prepare_command.add_parser,
  planner_command.add_plan_parser,
  planner_command.add_probe_parser,
)
# The commands run without devices (their own jax, if any, starts inside them) ...
NO_DEVICES = {
  "prepare-data": prepare_command.main,
  "plot": plot.main,
  "plan": planner_command.plan_main,
}
# ... and those run once the devices exist (train, probe and export may join a multi-process run).
ON_DEVICES = {
  "export": export_command.main,
  "probe": planner_command.probe_main,
  "inspect": inspect_command.main,
  "eval": eval_command.main,
  "generate": generate_command.main,
  "train": train_command.main,
}
MAX_CPU_DEVICES = 1024  # virtual CPU devices per process: beyond, XLA's start-up eats memory


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="paro-jax", description=DESCRIPTION, formatter_class=HelpFormatter
  )
  sub = parser.add_subparsers(dest="command", required=True)
  for add in PARSERS:
    add(sub)
  for p in sub.choices.values():
    p.formatter_class = HelpFormatter
  return parser


def _parse(argv: list[str]) -> argparse.Namespace:
  """The arguments; an unknown flag is answered with its subcommand's usage (argparse would show
  the top level's), `export`'s run directory taken positionally or as --run."""
  parser = build_parser()
  args, unknown = parser.parse_known_args(argv)
  sub = parser._subparsers._group_actions[0].choices[args.command]
  if unknown:
    sub.error(f"unrecognized arguments: {' '.join(unknown)}")
  if args.command == "export":
    export_command.check_args(args, sub.error)
  return args


def _check_node_command(child_argv: list[str]) -> None:
  """`launch -- train ...` (or `export ...`): the per-node flags parsed here first, so that a bad
  one is one line before any node starts (not the usage of every node)."""
  command = child_argv[0]
  parser = build_parser()._subparsers._group_actions[0].choices[command]

  def fail(message):
    raise ValueError(f"the per-node command after --: {message} (see paro-jax {command} --help)")

  parser.error = fail
  args, unknown = parser.parse_known_args(child_argv[1:])
  if unknown:
    fail(f"unrecognized arguments: {' '.join(unknown)}")
  if command == "export":
    export_command.check_args(args, fail)


def _log_place(args, child_argv: list[str]) -> tuple[str | None, str]:
  """Where the full texts of this command go: its run directory, a name per process."""
  if args.command == "train":
    return args.out, train_command.log_name(args)
  if args.command == "export":
    return args.run, train_command.log_name(args)
  if args.command == "launch" and child_argv[:1] == ["train"]:
    return _flag(child_argv, "--out", "runs/latest"), "paro-jax.launch.log"
  return None, report.LOG_NAME


def cpu_flags(args) -> tuple[str, ...]:
  """XLA:CPU's flags for this process: a LoRA run's kernels in the memory-first order
  (xla_flags.CPU_MEMORY_FIRST_FLAGS; they shape nothing where a GPU is the backend)."""
  return CPU_MEMORY_FIRST_FLAGS if args.command == "train" and getattr(args, "lora.rank", 0) else ()


def _set_up_devices(args, inv: Invocation) -> None:
  """This process's devices (virtual CPU devices for --mesh), the XLA flags, and the join of a
  multi-process run, before anything uses a device."""
  mesh = inv.mesh
  multi = (
    getattr(args, "coordinator", None),
    getattr(args, "num_processes", None),
    getattr(args, "process_id", None),
  )
  processes = distributed.process_count(*multi)
  if mesh:
    if (mesh[0] * mesh[1]) % processes:
      raise ValueError(
        f"--mesh {args.mesh} has {mesh[0] * mesh[1]} devices, not divisible by "
        f"the {processes} processes"
      )
    per_process = mesh[0] * mesh[1] // processes
    if per_process > MAX_CPU_DEVICES:
      raise ValueError(
        f"--mesh {args.mesh} asks for {per_process} devices per process; at most "
        f"{MAX_CPU_DEVICES} virtual CPU devices are emulated (each costs memory and threads). "
        f"Use a smaller mesh, or `inspect --target h100 --mesh NODESxGPUS` to compile for a "
        f"large GPU cluster without its devices"
      )
    provide_cpu_devices(per_process)
    add_xla_flags(cpu_flags(args))
  check_shape(args, mesh)
  add_xla_flags()  # GPU collective overlap (HO-Ring); harmless elsewhere
  beat = getattr(args, "heartbeat_timeout", 0.0)
  if not beat >= 0:
    raise ValueError(f"--heartbeat-timeout must be >= 0 seconds (0: off), got {beat}")
  if args.command == "train":
    train_command.fold_native_stderr(args, inv, distributed.detect_cluster())
  distributed.maybe_initialize(*multi, heartbeat_timeout=beat)  # before anything uses devices


def main(argv=None) -> None:
  """The `paro-jax` command. Its reporter (paro_jax/report.py) stays installed until the process
  exits (libraries print their noise at shutdown too); a caller in Python that passes `argv`
  gets its own warning, logging and exception hooks back on return."""
  restore = report.install()
  try:
    _main(argv)
  finally:
    if argv is not None:
      restore()


def _main(argv) -> None:
  command_line = argv is None  # not a caller in Python, whose stderr is its own
  argv = list(sys.argv[1:] if argv is None else argv)
  child_argv = []
  if argv[:1] == ["launch"] and "--" in argv:  # everything after -- is the child train command
    cut = argv.index("--")
    argv, child_argv = argv[:cut], argv[cut + 1 :]
  args = _parse(argv)
  report.set_log_dir(*_log_place(args, child_argv))
  try:
    if args.command == "launch":
      if child_argv[:1] in (["train"], ["export"]):
        _check_node_command(child_argv)
      launch_command.main(args, child_argv)
    mesh = parse_mesh_shape(args.mesh) if getattr(args, "mesh", None) else None
    inv = Invocation(mesh=mesh, command_line=command_line)
    if args.command in NO_DEVICES:
      NO_DEVICES[args.command](args, inv)
      return
    if args.command == "inspect":
      inspect_command.check_args(args)
      if args.target:
        inspect_command.main_for_target(args, inv)
        return
    if args.command == "train":
      train_command.before_devices(args, inv)
    note_cpu_platform(args)
    _set_up_devices(args, inv)
    ON_DEVICES[args.command](args, inv)
  except (ValueError, OSError) as e:  # OSError: missing files, a full disk while checkpointing
    report.error(e)
    sys.exit(2)
  except watch.PeerLost as e:  # another process of the run is gone: one line, as for a hang
    report.error(e)
    sys.exit(watch.LOST_EXIT)
  except KeyboardInterrupt as e:  # 128 + the signal: 130 for SIGINT, 143 for SIGTERM
    code = 128 + getattr(e, "signum", 2)
    jax = sys.modules.get("jax")
    if getattr(e, "signum", None) is not None and jax is not None and jax.process_count() > 1:
      # A stop of a multi-process run is complete here: every process saved the agreed step.
      # Exiting through the interpreter (jax.distributed's shutdown, which waits on the other
      # processes, then finalization) was seen to last until srun's SIGTERM to the tasks, sent
      # once one has exited 143 (--kill-on-bad-exit), killed this one by the signal's default
      # action ("Terminated") instead of it exiting 143. Nothing is left to do: exit now.
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    sys.exit(code)
