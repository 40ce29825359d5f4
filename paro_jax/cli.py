"""The `paro-jax` command line: subcommands, their flags, the device set-up before jax starts."""
# (the parser's description is DESCRIPTION below, not this docstring)

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
import sys

from paro_jax import report
from paro_jax.analysis.gpu import targets
from paro_jax.analysis.inspect.config import InspectConfig
from paro_jax.analysis.planner.config import PlanConfig
from paro_jax.analysis.planner.planner import run_plan
from paro_jax.cluster import distributed, native_stderr, watch
from paro_jax.cluster.launch import launch
from paro_jax.cluster.restart import _flag
from paro_jax.core.config import LoraOptions, WireOptions, flag_of, make_config, options
from paro_jax.core.names import check_batch_divides, parse_mesh_shape
from paro_jax.core.units import parse_rate
from paro_jax.core.xla_flags import add_xla_flags, cpu_without_gpu_driver, provide_cpu_devices
from paro_jax.run.config import BIN_DTYPE_NAMES, DataConfig, EvalConfig, RunConfig
from paro_jax.run.plot import plot_runs

# The modules that import jax (or numpy) are imported inside the commands, once the device flags
# are set: `import paro_jax`, the parser and `plan` start no jax (tests/test_layers.py).

DESCRIPTION = (
  "Train Flax LLaMA models with PaRO sharding strategies in JAX, and inspect, plan, probe, "
  "launch, export and plot such runs. `paro-jax COMMAND --help` shows each command's options "
  "and their defaults."
)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
  """Every option's help ends with its default, unless it says it already or there is none."""

  def _get_help_string(self, action):
    help = action.help or ""
    if (
      "default" in help.lower()
      or action.required
      or action.default is None
      or action.default is False
      or (action.default is True and action.nargs == 0)  # a --no-X flag: off unless given
      or action.default == argparse.SUPPRESS
      or not action.option_strings
    ):
      return help
    return f"{help} (default: %(default)s)" if help else "(default: %(default)s)"


MAX_CPU_DEVICES = 1024  # virtual CPU devices per process: beyond, XLA's start-up eats memory


def _check_shape(args, mesh) -> None:
  """Batch and sequence flags of train / inspect, before anything compiles."""
  for name in ("micro_batches", "batch_size", "seq_len"):
    value = getattr(args, name, None)
    if value is not None and value < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  if mesh and args.command in ("inspect", "train"):
    check_batch_divides(args.batch_size, *mesh)


def _note_cpu_platform(args) -> None:
  """Before jax starts: with the CUDA plugin but no GPU driver, run on the CPU and say so (on
  stdout, with the run's other notes: stderr is for problems; beside --json output, stderr)."""
  if note := cpu_without_gpu_driver():
    report.note(note, file=sys.stderr if getattr(args, "as_json", False) else sys.stdout)


# --- flags from the config dataclasses -----------------------------------------------------------
def add_options(p, cls, *paths: str) -> None:
  """The flags of these options of the config dataclass `cls` (by path, `lora.rank` for a
  group's: paro_jax/core/config.py `options`), each from its field: the default, and the help
  and argparse keywords of its `option()`. The flag's value lands in `args.<path>`."""
  fields = dict(options(cls))
  for path in paths:
    if path not in fields:
      raise KeyError(f"{cls.__name__} has no field {path!r}: renamed? update paro_jax/cli.py")
    field = fields[path]
    kwargs = dict(field.metadata)
    flag = flag_of(field)
    del kwargs["flag"]
    if field.default is not dataclasses.MISSING:
      kwargs["default"] = field.default
      if "action" not in kwargs and "type" not in kwargs:
        if isinstance(field.default, bool):
          kwargs["action"] = "store_true"
        elif isinstance(field.default, (int, float)):
          kwargs["type"] = type(field.default)
    else:
      kwargs["required"] = True
    named = flag[2:].replace("-", "_")
    if path != named and "action" not in kwargs and not {"metavar", "choices"} & kwargs.keys():
      kwargs["metavar"] = named.upper()  # argparse's from the dest: the flag's, not the path's
    p.add_argument(flag, dest=path, **kwargs)


def group_options(cls, name: str) -> list[str]:
  """The paths of the options of the group `name` of the config class `cls`."""
  return [path for path, _ in options(cls) if path.startswith(f"{name}.")]


def config_of(args: argparse.Namespace, cls, **given):
  """The config dataclass `cls` from the parsed flags, `given` replacing or adding values (by
  option path). Every option must be a flag of the command or given: a field renamed without its
  flag is an error, not a default silently used."""
  paths = {path for path, _ in options(cls)}
  parsed = vars(args)
  unknown = sorted(set(given) - paths)
  missing = sorted(n for n in paths if n not in given and n not in parsed)
  if unknown or missing:
    raise TypeError(
      f"{cls.__name__} and the flags of `{args.command}` disagree: "
      f"given but no field {unknown}, field but no flag {missing}"
    )
  return make_config(cls, {n: given[n] if n in given else parsed[n] for n in paths})


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


def _add_wire(p: argparse.ArgumentParser, cls) -> None:
  """--inter-params, --inter-grads, --int8-block, --grad-dtype (train, inspect, plan)."""
  w = p.add_argument_group(
    "communication precision",
    "what the parameter gathers and gradient reductions carry across nodes (the inter level, "
    "also of a collective over all devices); intra-node traffic keeps the compute / "
    "accumulation dtype (docs/collectives.md)",
  )
  add_options(w, cls, *(f"wire.{path}" for path, _ in options(WireOptions)))


def _add_common(p: argparse.ArgumentParser, cls) -> None:
  """The flags of a training step (StepConfig), shared by train and inspect."""
  add_options(
    p,
    cls,
    *("model", "strategy", "mesh", "micro_batches", "batch_size", "seq_len", "dtype"),
    *("collectives", "attention"),
  )
  _add_wire(p, cls)
  # the int8 corrections are on where they apply; `plan` counts their memory
  add_options(p.add_argument_group("int8 corrections"), cls, "error_feedback", "param_delta")
  add_options(p, cls, "remat")
  lora = p.add_argument_group(
    "LoRA",
    "train low-rank adapters only; the base weights are frozen "
    "(held once, at the P placement, with no gradient or optimizer state)",
  )
  add_options(lora, cls, *(f"lora.{path}" for path, _ in options(LoraOptions)))


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="paro-jax", description=DESCRIPTION, formatter_class=_Help)
  sub = parser.add_subparsers(dest="command", required=True)
  train = sub.add_parser("train", help="train a Flax LLaMA with a PaRO strategy")
  _add_common(train, RunConfig)
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
  ckpt = train.add_argument_group(
    "checkpoints",
    "saved asynchronously into OUT/checkpoints/, also at the end and on Ctrl-C or SIGTERM "
    "(then the run stops after the current step; a second signal stops at once)",
  )
  add_options(ckpt, RunConfig, "checkpoints.every", "checkpoints.keep", "max_bad_steps")
  _divergence_args(train)
  add_options(train, RunConfig, "memory_check")
  add_options(ckpt, RunConfig, "checkpoints.resume")
  add_options(train, RunConfig, "init_from")
  dist = train.add_argument_group(
    "multi-process",
    "one process per node, joined by jax.distributed (auto-detected under "
    "SLURM srun / Open MPI mpirun); --mesh GxM then counts all processes' devices",
  )
  _add_process_flags(dist)
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
  inspect = sub.add_parser(
    "inspect", help="compile a training step (no allocation) and report its communication"
  )
  _add_common(inspect, InspectConfig)
  add_options(inspect, InspectConfig, "as_json", "target", "inter_bandwidth", "prefetch")
  add_options(inspect, InspectConfig, "hlo_out", "pack")
  plot = sub.add_parser("plot", help="PNG of loss (train, eval) and throughput of runs")
  plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (--out of train)")
  plot.add_argument("--out", default="runs/plot.png", help="the PNG to write")
  export = sub.add_parser("export", help="the newest checkpoint of a run as an HF LLaMA directory")
  export.add_argument("run", nargs="?", metavar="RUN_DIR", help="a run directory (--out of train)")
  export.add_argument("--run", dest="run_flag", metavar="RUN_DIR", help="the same, as an option")
  export.add_argument(
    "--out",
    required=True,
    metavar="HF_DIR",
    help="directory to write the HF model into: config.json, the safetensors weights, the "
    "tokenizer files and generation_config.json",
  )
  export.add_argument(
    "--overwrite", action="store_true", help="replace the files of an existing, non-empty --out"
  )
  export.add_argument(
    "--dtype",
    default=None,
    type=str.lower,
    choices=("bf16", "fp16", "fp32"),
    help="the weights' dtype (default: the dtype of the --init-from weights the run started "
    "from; bf16 for a run trained from scratch)",
  )
  export.add_argument(
    "--max-shard-size",
    default="5GB",
    metavar="SIZE",
    help="split the weights into safetensors shards of at most SIZE (KB, MB, GB, TB: decimal "
    "units, as transformers' max_shard_size) with model.safetensors.index.json",
  )
  export.add_argument(
    "--adapter",
    action="store_true",
    help="for a LoRA run started from --init-from: write the adapters alone as a PEFT adapter "
    "(adapter_config.json, adapter_model.safetensors) instead of the merged model",
  )
  launch = sub.add_parser(
    "launch",
    help="emulate a cluster here: one train process per node, shaped links",
    usage="paro-jax launch --nodes G --devices-per-node M [options] -- train [train options]",
    description="Start G `paro-jax train` processes with M virtual CPU devices each, joined by "
    "jax.distributed; as root with ip/tc each runs in its own network namespace behind a "
    "shaped link, otherwise on loopback without shaping. Everything after -- is the per-node "
    "command: `train ...` or `python SCRIPT [args]`; the launcher adds --mesh GxM and the "
    "multi-process flags.",
  )
  launch.add_argument("--nodes", type=int, required=True, help="G: processes (nodes)")
  launch.add_argument("--devices-per-node", type=int, required=True, help="M: devices per node")
  launch.add_argument("--inter-bandwidth", default="1gbit", help="tc rate of each node's link")
  launch.add_argument("--inter-latency", default="0.5ms", help="one-way delay (netem); 0 for none")
  launch.add_argument(
    "--intra-bandwidth",
    default=None,
    help="tc rate of each node's loopback (intra-node traffic); default unshaped",
  )
  launch.add_argument(
    "--heartbeat-timeout",
    type=float,
    default=60.0,
    metavar="S",
    help="a node with no heartbeat for S s (stopped, frozen) fails the run "
    "(default %(default)g; 0: off)",
  )
  launch.add_argument(
    "--progress-timeout",
    type=float,
    default=900.0,
    metavar="S",
    help="a node that finished no step for S s (hung), the first compile included, fails the "
    "run (default %(default)g; 0: off)",
  )
  launch.add_argument(
    "--stop-grace",
    type=float,
    default=120.0,
    metavar="S",
    help="after Ctrl-C, how long the nodes get to checkpoint and exit before SIGKILL "
    "(default %(default)g)",
  )
  launch.add_argument(
    "--max-restarts",
    type=int,
    default=0,
    metavar="K",
    help="when a node dies, freezes or hangs, continue the run from its newest checkpoint on the "
    "nodes left (one fewer, mesh rebuilt, global batch and data order kept), up to K times",
  )
  launch.add_argument(
    "--show-gloo",
    action="store_true",
    help="print the nodes' Gloo connection messages (kept in OUT/paro-jax.launch.log otherwise)",
  )
  launch.add_argument(
    "--loopback",
    action="store_true",
    help="plain processes on 127.0.0.1, no namespaces and no shaping",
  )
  _add_eval(sub)
  prep = sub.add_parser(
    "prepare-data",
    help="tokenize text/JSONL/Parquet files into .bin shards for train --data 'OUT/*.bin'",
    description="Tokenize text, JSONL and Parquet files (byte-level, or an HF tokenizer.json) "
    "into .bin shards of token ids (instruction records: with their target masks), a block at a "
    "time (memory stays small whatever the data's size), with a progress bar. Train on them "
    "with --data 'OUT/*.bin': the shards are read by memory map, each process reading only the "
    "tokens of its rows.",
  )
  prep.add_argument(
    "inputs", nargs="+", metavar="PATH", help="text / .jsonl / .parquet files and globs"
  )
  prep.add_argument("--out", required=True, metavar="DIR", help="directory for the shards")
  add_options(prep, DataConfig, "tokenizer", "text_field")  # as train reads them
  add_options(prep, DataConfig, "data_format", "chat_template")
  prep.add_argument(
    "--shard-tokens", type=int, default=100_000_000, metavar="N", help="token ids per shard"
  )
  prep.add_argument(
    "--bin-dtype",
    default=None,
    type=str.lower,
    choices=BIN_DTYPE_NAMES,
    help="token dtype (default: uint16, or uint32 when the tokenizer's vocab exceeds 65536)",
  )
  _add_planner_commands(sub)
  for p in sub.choices.values():
    p.formatter_class = _Help
  return parser


def _add_eval(sub) -> None:
  """`eval SOURCE`: a model's mean loss on --data (paro_jax/run/evaluate.py)."""
  ev = sub.add_parser(
    "eval",
    help="score a run's newest checkpoint or an HF model on --data: mean loss and perplexity",
    description="The mean next-token cross-entropy and perplexity of SOURCE over --data: a "
    "token stream in consecutive, non-overlapping windows of --seq-len + 1 tokens from token 0 "
    "(a trailing partial window dropped), instruction data over the target tokens training "
    "counts; the same whatever --batch-size, --mesh and --strategy.",
  )
  fields = dict(options(EvalConfig))
  ev.add_argument("source", metavar="SOURCE", help=fields["source"].metadata["help"])
  add_options(ev, EvalConfig, "strategy", "mesh", "batch_size", "seq_len", "dtype")
  add_options(ev, EvalConfig, "collectives", "attention")
  data = ev.add_argument_group("data", "as train reads it (default: the built-in corpus)")
  add_options(data, EvalConfig, "data.paths", "data.text_field", "data.tokenizer")
  add_options(data, EvalConfig, "data.bin_dtype", "data.data_format", "data.chat_template")
  add_options(data, EvalConfig, "data.long_examples")
  add_options(ev, EvalConfig, "as_json")


def _add_process_flags(group) -> None:
  """--coordinator, --num-processes, --process-id (train, probe): cluster/distributed.py."""
  group.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  group.add_argument(
    "--num-processes", type=int, default=None, help="N: processes in all (with --coordinator)"
  )
  group.add_argument(
    "--process-id", type=int, default=None, help="I: this process, 0..N-1 (with --coordinator)"
  )


def _add_planner_commands(sub) -> None:
  """`plan` (no devices needed) and `probe` (measures the mesh it runs on)."""
  plan = sub.add_parser(
    "plan", help="rank the 14 strategies for a cluster: memory, step time, the pick and why"
  )
  own = [path for path, _ in options(PlanConfig) if not path.startswith("wire.")]
  add_options(plan, PlanConfig, *own)
  _add_wire(plan, PlanConfig)
  probe = sub.add_parser(
    "probe",
    help="measure collectives (per level) and FLOP/s of this mesh "
    "into a JSON profile for `plan --profile`",
  )
  probe.add_argument(
    "--mesh", default=None, help="GROUPSxDEVICES, e.g. 2x4 (default: one group per process)"
  )
  probe.add_argument(
    "--sizes",
    default="64KiB,1MiB,4MiB",
    help="per-device buffer sizes, comma-separated (default %(default)s)",
  )
  probe.add_argument("--repeats", type=int, default=5, help="timed calls per size (median)")
  probe.add_argument("--no-flops", action="store_true", help="skip the matmul FLOP/s")
  probe.add_argument("--out", default="probe.json", help="the JSON profile to write")
  _add_process_flags(probe.add_argument_group("multi-process", "as for train"))


def _parse(argv: list[str]) -> argparse.Namespace:
  """The arguments; an unknown flag is answered with its subcommand's usage (argparse would show
  the top level's), `export`'s run directory taken positionally or as --run."""
  parser = build_parser()
  args, unknown = parser.parse_known_args(argv)
  sub = parser._subparsers._group_actions[0].choices[args.command]
  if unknown:
    sub.error(f"unrecognized arguments: {' '.join(unknown)}")
  if args.command == "export":
    if args.run and args.run_flag and args.run != args.run_flag:
      sub.error(f"two run directories: {args.run} and --run {args.run_flag}; give one")
    args.run = args.run or args.run_flag
    if not args.run:
      sub.error("the run directory is required: paro-jax export RUN_DIR --out HF_DIR")
  return args


def _check_node_command(child_argv: list[str]) -> None:
  """`launch -- train ...`: the per-node flags parsed here first, so that a bad one is one line
  before any node starts (not the usage of every node)."""
  train = build_parser()._subparsers._group_actions[0].choices["train"]

  def fail(message):
    raise ValueError(f"the per-node command after --: {message} (see paro-jax train --help)")

  train.error = fail
  _, unknown = train.parse_known_args(child_argv[1:])
  if unknown:
    fail(f"unrecognized arguments: {' '.join(unknown)}")


def _log_place(args, child_argv: list[str]) -> tuple[str | None, str]:
  """Where the full texts of this command go: its run directory, a name per process."""
  if args.command == "train":
    rank = args.process_id
    if rank is None:  # under SLURM / Open MPI the rank is in the environment
      ranks = (os.environ.get(v, "") for v in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))
      rank = next((int(r) for r in ranks if r.isdigit()), 0)
    return args.out, report.LOG_NAME if not rank else f"paro-jax.node{rank}.log"
  if args.command == "export":
    return args.run, report.LOG_NAME
  if args.command == "launch" and child_argv[:1] == ["train"]:
    return _flag(child_argv, "--out", "runs/latest"), "paro-jax.launch.log"
  return None, report.LOG_NAME


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
      if child_argv[:1] == ["train"]:
        _check_node_command(child_argv)

      sys.exit(
        launch(
          child_argv,
          nodes=args.nodes,
          devices_per_node=args.devices_per_node,
          inter_bandwidth=args.inter_bandwidth,
          inter_latency=args.inter_latency,
          intra_bandwidth=args.intra_bandwidth,
          shaped=not args.loopback,
          heartbeat_timeout=args.heartbeat_timeout,
          progress_timeout=args.progress_timeout,
          stop_grace=args.stop_grace,
          max_restarts=args.max_restarts,
          show_gloo=args.show_gloo,
        )
      )
    if args.command == "prepare-data":
      from paro_jax.run.prepare import prepare_data  # numpy: not at the CLI's start

      try:
        meta = prepare_data(
          args.inputs,
          args.out,
          args.tokenizer,
          args.text_field,
          args.shard_tokens,
          args.bin_dtype,
          data_format=args.data_format,
          chat_template=args.chat_template,
        )
      except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (prepare.Stopped)
        name = signal.Signals(getattr(e, "signum", signal.SIGINT)).name
        print(
          f"\nparo-jax: stopped by {name}: nothing was published in {args.out} (the partial "
          f"shards were removed): run the same command again",
          file=sys.stderr,
          flush=True,
        )
        raise
      if meta.get("dropped"):
        n = meta["dropped"]["no target"]
        print(f"paro-jax: {n} records with no target token left out (no completion or answer)")
      examples = f"{meta['examples']} {meta['format']} examples, " if "examples" in meta else ""
      print(
        f"paro-jax: wrote {examples}{meta['tokens']} tokens ({meta['dtype']}) in "
        f"{len(meta['shards'])} "
        f"shards to {args.out}: train with --data '{os.path.join(args.out, '*.bin')}' "
        f"--bin-dtype {meta['dtype']}"
      )
      return
    if args.command == "plot":
      print(f"paro-jax: wrote {plot_runs(args.runs, args.out)}")
      return
    if args.command == "export":
      _note_cpu_platform(args)
      from paro_jax.run.export import export_run  # jax: after the CUDA plugin note

      done = export_run(
        args.run,
        args.out,
        overwrite=args.overwrite,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        adapter=args.adapter,
      )
      what = "its LoRA adapters (PEFT)" if args.adapter else "the model"
      shards = [w for w in done.weights if w.startswith("model-")]
      weights = [w for w in done.weights if w not in shards]
      if shards:  # model-00001-of-0000N.safetensors ...: counted, not listed
        weights.insert(1, f"{len(shards)} shards ({shards[0]}, ...)")
      copied = f"; copied {', '.join(done.copied)}" if done.copied else "; no tokenizer files"
      if done.chat_template:
        copied += "; chat_template.jinja: the chat template the run trained with"
      if done.stops:
        copied += (
          f"; generation_config.json: eos_token_id {done.stops} (generation stops at the chat "
          f"template's end of turn, {done.stops[-1]})"
        )
      print(
        f"paro-jax: wrote checkpoint step {done.step} of {args.run} to {args.out}: {what} in "
        f"{done.dtype} ({done.dtype_why}), {', '.join(weights)}{copied}"
      )
      return
    if args.command == "plan":
      run_plan(config_of(args, PlanConfig))
      return
    mesh = parse_mesh_shape(args.mesh) if args.mesh else None
    if args.command == "inspect" and args.inter_bandwidth and not args.target:
      raise ValueError(
        "--inter-bandwidth sets the link of XLA's step-time estimate, made only for a GPU "
        "compile: pass --target h100 (or h200) with it, or leave it out"
      )
    if getattr(args, "target", None):  # a compile for GPUs described, not present: no devices
      _check_shape(args, mesh)
      args.target = targets.check_target(args.target)
      targets.prepare_deviceless_compile()
      from paro_jax.analysis.gpu import estimate  # numpy: not at the CLI's start

      if mesh is None:
        raise ValueError("--target needs --mesh NODESxGPUS, e.g. --mesh 2x8")
      rate = parse_rate(args.inter_bandwidth) if args.inter_bandwidth else None
      estimate.prepare_environment(rate, mesh[1])  # before jax starts: XLA reads it once
      from paro_jax.analysis.inspect.command import inspect  # jax: once XLA's environment is set

      inspect(config_of(args, InspectConfig, mesh=mesh))
      return
    if args.command == "train":
      if command_line:
        _exit_on_signals_until_the_loop()
      if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(
          f"--out {args.out} is a file: pass a directory for the run (metrics.jsonl, checkpoints/)"
        )
      watch.start_heartbeat()  # when paro-jax launch asked for one (env PARO_JAX_HEARTBEAT)
    _note_cpu_platform(args)
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
    _check_shape(args, mesh)
    add_xla_flags()  # GPU collective overlap (HO-Ring); harmless elsewhere
    beat = getattr(args, "heartbeat_timeout", 0.0)
    if not beat >= 0:
      raise ValueError(f"--heartbeat-timeout must be >= 0 seconds (0: off), got {beat}")
    if args.command == "train" and distributed.detect_cluster() and command_line:
      # SLURM / mpirun: a native abort (JAX's client, its service gone) folded into the log.
      # (`paro-jax launch` folds its nodes' output itself.)
      who = f"process {os.environ.get('SLURM_PROCID', os.environ.get('OMPI_COMM_WORLD_RANK'))}: "
      native_stderr.fold(os.path.join(*_log_place(args, [])), who)
    distributed.maybe_initialize(*multi, heartbeat_timeout=beat)  # before anything uses devices
    if args.command == "probe":
      # imports jax: after the device flag is set
      from paro_jax.analysis.planner.probe import run_probe

      run_probe(mesh, args.sizes, args.repeats, not args.no_flops, args.out)
    if args.command == "inspect":
      # imports jax: after the device flag is set
      from paro_jax.analysis.inspect.command import inspect

      inspect(config_of(args, InspectConfig, mesh=mesh))
    if args.command == "eval":
      from paro_jax.run.evaluate import run_eval  # imports jax: after the device flag is set

      # all of --data is scored, one example per row
      unsplit = {"data.pack": False, "data.eval_fraction": 0.0}
      run_eval(config_of(args, EvalConfig, mesh=mesh, **unsplit))
    if args.command == "train":
      from paro_jax.run.train import train  # imports jax: after the device flag is set

      peers = watch.start_peer_watch(beat)  # SLURM / mpirun: frozen processes named
      try:
        train(config_of(args, RunConfig, mesh=mesh))
      finally:
        if peers:
          peers.stop()
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
