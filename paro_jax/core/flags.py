"""The command line's building blocks, shared by every command's parser (each beside the code it
runs: run/train_command.py, analysis/inspect/command.py, ...): flags built from the fields of the
config dataclasses (core/config.py `option`), the config read back from parsed flags, the flag
groups several commands share, and the checks made before jax starts. No jax, no numpy.
"""

from __future__ import annotations

import argparse
import textwrap
import dataclasses
import sys

from paro_jax import report
from paro_jax.core.config import (
  LoraOptions,
  OuterOptions,
  StepConfig,
  WireOptions,
  flag_of,
  make_config,
  options,
  value_at,
)
from paro_jax.core.names import check_batch_divides
from paro_jax.core.xla_flags import cpu_without_gpu_driver


@dataclasses.dataclass(frozen=True)
class Invocation:
  """What the entry point knows beside a command's flags."""

  mesh: tuple[int, int] | None = None  # --mesh, parsed (None: not given, or no such flag)
  command_line: bool = False  # a process of its own (`paro-jax ...`), not a caller in Python


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
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

  def _split_lines(self, text, width):
    # a flag named in a help text (--outer-delay) is never cut at its hyphen
    text = self._whitespace_matcher.sub(" ", text).strip()
    return textwrap.wrap(text, width, break_on_hyphens=False)


def check_shape(args, mesh) -> None:
  """Batch and sequence flags of train / inspect, before anything compiles."""
  for name in ("micro_batches", "batch_size", "seq_len"):
    value = getattr(args, name, None)
    if value is not None and value < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  if mesh and args.command in ("inspect", "train"):
    check_batch_divides(args.batch_size, *mesh)


def note_cpu_platform(args) -> None:
  """Before jax starts: with the CUDA plugin but no GPU driver, run on the CPU and say so (on
  stdout, with the run's other notes: stderr is for problems; beside --json output, stderr)."""
  if note := cpu_without_gpu_driver():
    report.note(note, file=sys.stderr if getattr(args, "as_json", False) else sys.stdout)


def add_options(p, cls, *paths: str) -> None:
  """The flags of these options of the config dataclass `cls` (by path, `lora.rank` for a
  group's: paro_jax/core/config.py `options`), each from its field: the default, and the help
  and argparse keywords of its `option()`. The flag's value lands in `args.<path>`."""
  fields = dict(options(cls))
  for path in paths:
    if path not in fields:
      raise KeyError(f"{cls.__name__} has no field {path!r}: renamed? update the command's parser")
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


def add_wire(p: argparse.ArgumentParser, cls) -> None:
  """--inter-params, --inter-grads, --int8-block, --grad-dtype (train, inspect, plan)."""
  w = p.add_argument_group(
    "communication precision",
    "what the parameter gathers and gradient reductions carry across nodes (the inter level, "
    "also of a collective over all devices); intra-node traffic keeps the compute / "
    "accumulation dtype (docs/collectives.md)",
  )
  add_options(w, cls, *(f"wire.{path}" for path, _ in options(WireOptions)))


def add_step_flags(p: argparse.ArgumentParser, cls) -> None:
  """The flags of a training step (StepConfig), shared by train and inspect."""
  add_options(
    p,
    cls,
    *("model", "strategy", "mesh", "micro_batches", "batch_size", "seq_len", "dtype"),
    *("collectives", "attention"),
  )
  add_wire(p, cls)
  # the int8 corrections are on where they apply; `plan` counts their memory
  add_options(p.add_argument_group("int8 corrections"), cls, "error_feedback", "param_delta")
  add_options(p, cls, "remat")
  lora = p.add_argument_group(
    "LoRA",
    "train low-rank adapters only; the base weights are frozen "
    "(held once, at the P placement, with no gradient or optimizer state)",
  )
  add_options(lora, cls, *(f"lora.{path}" for path, _ in options(LoraOptions)))
  outer = p.add_argument_group(
    "outer loop (DiLoCo)",
    "nodes train on their own and sync every H steps (core/outer.py; docs/outer.md)",
  )
  add_options(outer, cls, *(f"outer.{path}" for path, _ in options(OuterOptions)))


def add_process_flags(group) -> None:
  """--coordinator, --num-processes, --process-id (train, probe): cluster/distributed.py."""
  group.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  group.add_argument(
    "--num-processes", type=int, default=None, help="N: processes in all (with --coordinator)"
  )
  group.add_argument(
    "--process-id", type=int, default=None, help="I: this process, 0..N-1 (with --coordinator)"
  )


def step_flags(cfg: StepConfig, **replace) -> list[str]:
  """The command-line flags that give `cfg`'s StepConfig options (`replace` overriding values by
  path): what `train --strategy auto` hands `paro-jax inspect --target` to compile the run's own
  step. The inverse of the CLI's parsing (tests/test_cli_config.py parses them back)."""
  out = []
  for path, field in options(StepConfig):
    value = replace[path] if path in replace else value_at(cfg, path)
    flag = flag_of(field)
    if value is None:  # the flag's absence is its default (None: decided at run time)
      continue
    if field.metadata.get("action") is argparse.BooleanOptionalAction:
      out.append(flag if value else "--no-" + flag[2:])
    elif path == "mesh":
      out += [flag, "x".join(str(n) for n in value)]
    else:
      out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
  return out
