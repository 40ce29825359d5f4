"""The configuration of a training step (`StepConfig`: model, strategy, mesh, batch, precision,
wire formats, LoRA) and the flag metadata every command's config is declared with (`option`).

Each field that is also a command-line flag is declared with `option()`: its default, its help and
how argparse reads it are written here once, and core/flags.py builds the flags from them. A
config nests its groups (`group()`: the wire formats, the adapters; a run's data, optimizer,
checkpoints) as dataclasses of their own, whose options are flags like the others: `options()`
lists them by path (`lora.rank`), `make_config()` makes a config from values by path.
Pure Python (no jax, no numpy): the CLI builds its parser before jax starts, and `plan` never
starts it. `RunConfig` (paro_jax/run/config.py) is the step's configuration plus a run's;
`InspectConfig` (paro_jax/analysis/inspect/config.py) and `PlanConfig`
(paro_jax/analysis/planner/config.py) are the analysis commands'.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os

from models.config import ATTENTION_IMPLS, LoraConfig
from paro_jax.core.names import (
  AUTO_COLLECTIVES,
  COLLECTIVE_IMPLS,
  DEFAULT_INT8_BLOCK,
  GRAD_DTYPES,
  AUTO_OUTER_STATE,
  OUTER_ONLY_FORMATS,
  OUTER_STATES,
  WIRE_FORMATS,
  parse_outer_state,
)
from paro_jax.core.strategy import ALIASES, GroupStrategy, parse_strategy
from paro_jax.core.units import COMPUTE_DTYPE_BYTES
from paro_jax.core.wire import WireConfig


def option(default=dataclasses.MISSING, help: str = "", *, flag: str | None = None, **add_argument):
  """A config field that is also a command-line flag.

  `help` is its --help text (argparse appends the default; "%(default)s" places it instead),
  `flag` its option string (default: --the-field-name), and `add_argument` any other keywords of
  argparse's (type, choices, metavar, action, nargs). No default: the flag is required.
  """
  return dataclasses.field(default=default, metadata={"help": help, "flag": flag, **add_argument})


def option_like(cls, name: str):
  """A field declared as the option `name` of the config class `cls` is (its default, help and
  argparse keywords): for another command's config taking the same flag (`eval`'s --strategy)."""
  field = cls.__dataclass_fields__[name]
  return dataclasses.field(default=field.default, metadata=dict(field.metadata))


def group(cls):
  """A config field holding a group of options: a config dataclass of its own, by default its
  fields' defaults. Its options are flags like the config's own; the config reads
  `cfg.<group>.<field>`."""
  return dataclasses.field(default_factory=cls, metadata={"group": cls})


def options(cls, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
  """(path, field) of every option of the config class `cls`, its groups' included, in field
  order: the path of the field `rank` of the group `lora` is `lora.rank` (the CLI's argparse
  dest). Fields that are neither options nor groups keep their defaults."""
  out = []
  for field in dataclasses.fields(cls):
    if "group" in field.metadata:
      out += options(field.metadata["group"], f"{prefix}{field.name}.")
    elif "help" in field.metadata:
      out.append((prefix + field.name, field))
  return out


def flag_of(field: dataclasses.Field) -> str:
  """An option's flag: its `flag`, else --the-field-name."""
  return field.metadata["flag"] or f"--{field.name.replace('_', '-')}"


def make_config(cls, values: dict):
  """The config `cls` from values by path (`options`; a group's fields that are no options too),
  each group built from its own values; a field without a value keeps its default. A path that
  names no field is an error, not a value silently dropped."""
  kwargs, used = {}, set()
  for field in dataclasses.fields(cls):
    if "group" in field.metadata:
      inner = f"{field.name}."
      own = {k[len(inner) :]: v for k, v in values.items() if k.startswith(inner)}
      kwargs[field.name] = make_config(field.metadata["group"], own)
      used.update(inner + k for k in own)
    elif field.name in values:
      kwargs[field.name] = values[field.name]
      used.add(field.name)
  unknown = sorted(set(values) - used)
  if unknown:
    raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
  return cls(**kwargs)


def value_at(cfg, path: str):
  """The value of the option at `path` (`options`) of the config `cfg`."""
  return functools.reduce(getattr, path.split("."), cfg)


MODEL_HELP = (
  "preset: tiny, small, 7b, 13b, 65b, llama3.1-8b, llama3.1-70b, llama3.1-405b, llama3.2-1b, "
  "llama3.2-3b, qwen3-0.6b, qwen3-8b, qwen3-32b, qwen2.5-7b, mistral-7b; or an HF config.json "
  "of a Llama, Qwen2, Qwen3 or Mistral (its shapes, from scratch)"
)
COMPUTE_DTYPES = tuple(COMPUTE_DTYPE_BYTES)  # bf16, fp32


def parse_model(value: str) -> str:
  """--model: preset names in any case; a path as given."""
  return value if os.sep in value or value.endswith(".json") else value.lower()


def check_outer_formats(wire, outer_sync: int | None) -> None:
  """A wire format only the outer loop's pseudo-gradient takes (int4), refused without it."""
  for flag, fmt in (("--inter-params", wire.inter_params), ("--inter-grads", wire.inter_grads)):
    if fmt in OUTER_ONLY_FORMATS and outer_sync is None:
      raise ValueError(
        f"{flag} {fmt} is the outer loop's pseudo-gradient format (--outer-sync H "
        f"--inter-grads {fmt}); for the step's traffic across nodes pass int8"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class WireOptions:
  """What the parameter gathers and gradient reductions carry across nodes (core/wire.py), and
  the gradients' accumulation dtype."""

  inter_params: str = option(
    "same",
    "parameter gathers across nodes: same (the compute dtype), bf16, or int8 with a scale "
    "per block (default %(default)s)",
    type=str.lower,
    choices=WIRE_FORMATS,
  )
  inter_grads: str = option(
    "same",
    "gradient reductions across nodes: same (the accumulation dtype), bf16, or int8 sent "
    "once to each chunk's owner and summed in fp32; with --outer-sync the pseudo-gradient's, "
    "where int4 (two values a byte) is also allowed (default %(default)s)",
    type=str.lower,
    choices=WIRE_FORMATS,
  )
  int8_block: int = option(
    DEFAULT_INT8_BLOCK,
    "elements per fp32 scale of the int8 and int4 formats (default %(default)s)",
  )
  grad_dtype: str = option(
    "compute",
    "gradient accumulation and boundary reduction dtype (default: the compute dtype)",
    type=str.lower,
    choices=GRAD_DTYPES,
  )

  def __post_init__(self):
    self.formats()  # their checks
    if self.grad_dtype not in GRAD_DTYPES:
      raise ValueError(f"unknown --grad-dtype {self.grad_dtype!r}; choose compute or fp32")

  def formats(self) -> WireConfig:
    """The engine's wire formats (core/wire.py)."""
    return WireConfig(self.inter_params, self.inter_grads, self.int8_block)

  def grad_itemsize(self, compute_itemsize: int) -> int:
    """Bytes per gradient element accumulated and synced: fp32's, or the compute dtype's."""
    return 4 if self.grad_dtype == "fp32" else compute_itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraOptions:
  """Low-rank adapters to train instead of the whole model (models/config.py LoraConfig)."""

  rank: int = option(
    0, "adapter rank (default %(default)s: full training)", flag="--lora-rank", metavar="R"
  )
  alpha: float = option(
    16.0,
    "adapter scale alpha (the update is alpha/R x A B; default %(default)g)",
    flag="--lora-alpha",
  )
  targets: str = option(
    "wq,wv",
    "comma-separated weights to adapt, from wq,wk,wv,wo,w_gate,w_up,w_down (default %(default)s)",
    flag="--lora-targets",
  )

  def __post_init__(self):
    self.adapters()  # their checks

  def adapters(self) -> LoraConfig | None:
    """The model's adapters; None for rank 0 (full training)."""
    return LoraConfig.from_flags(self.rank, self.alpha, self.targets)

  @classmethod
  def of(cls, lora: LoraConfig | None) -> LoraOptions:
    """The options that give `lora` (a checkpoint's adapters; None: full training)."""
    if lora is None:
      return cls()
    return cls(rank=lora.rank, alpha=lora.alpha, targets=",".join(lora.targets))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterOptions:
  """The outer loop (DiLoCo, arXiv 2311.08105; core/outer.py): each node takes `sync` steps on
  its own, then the nodes average their pseudo-gradients and take one outer step."""

  sync: int | None = option(
    None,
    "H: each node (group) trains on its own slice of every batch with no collective across "
    "nodes, and every H steps the nodes average their weights' change (on the wire as "
    "--inter-grads says) into one outer Nesterov step (default: off; strategies of N and I "
    "letters only)",
    flag="--outer-sync",
    metavar="H",
    type=int,
  )
  lr: float = option(
    0.7, "the outer step's learning rate (default %(default)g)", flag="--outer-lr", metavar="LR"
  )
  momentum: float = option(
    0.9,
    "the outer step's Nesterov momentum (default %(default)g)",
    flag="--outer-momentum",
    metavar="MU",
  )
  fragments: int = option(
    1,
    "Streaming DiLoCo: sync the weights in F fragments (1/F of the layers and vocabulary each), "
    "each every H steps, H/F steps apart (F must divide H; default %(default)s: all at once)",
    flag="--outer-fragments",
    metavar="F",
    type=int,
  )
  delay: int = option(
    0,
    "Streaming DiLoCo's overlap: a fragment's exchange runs during the TAU-th step after its "
    "sync step, beside that step's compute, and is applied after it (TAU below H/F; default "
    "%(default)s: at once)",
    flag="--outer-delay",
    metavar="TAU",
    type=int,
  )
  mix: float = option(
    0.0,
    "Streaming DiLoCo's merge: a synced fragment restarts from ALPHA x the group's own weights "
    "+ (1 - ALPHA) x the new outer weights (the paper's 0.5 with --outer-delay; default "
    "%(default)g: the outer weights)",
    flag="--outer-mix",
    metavar="ALPHA",
  )

  state: str = option(
    "G",
    "the outer weights and momentum over all devices (G: a round gathers them, 8 + w bytes a "
    "parameter) or over each node's devices, a copy per node (I: a round all-reduces the "
    "pseudo-gradient alone, 2w bytes), or auto: I where the run's memory fits (default "
    "%(default)s)",
    flag="--outer-state",
    type=parse_outer_state,
    choices=(*OUTER_STATES, AUTO_OUTER_STATE),
  )

  def __post_init__(self):
    if self.state not in (*OUTER_STATES, AUTO_OUTER_STATE):
      raise ValueError(
        f"--outer-state must be one of {', '.join(OUTER_STATES)} or {AUTO_OUTER_STATE} (where "
        f"the outer weights live), got {self.state!r}"
      )
    if self.state != "G" and self.sync is None:
      raise ValueError(
        f"--outer-state {self.state} places the outer loop's state, and there is none: pass "
        f"--outer-sync H too, or drop --outer-state"
      )
    if self.sync is not None and self.sync < 1:
      raise ValueError(
        f"--outer-sync must be >= 1 (steps between the nodes' syncs), got {self.sync}; omit it "
        f"for a synchronous run"
      )
    if not (math.isfinite(self.lr) and self.lr > 0):
      raise ValueError(f"--outer-lr must be a positive finite number, got {self.lr}")
    if not 0 <= self.momentum < 1:
      raise ValueError(f"--outer-momentum must be in [0, 1), got {self.momentum}")
    if self.fragments != 1 and self.sync is None:
      raise ValueError(
        f"--outer-fragments {self.fragments} splits the outer loop's syncs, and there is none: "
        f"pass --outer-sync H too, or drop --outer-fragments"
      )
    if self.fragments < 1 or (self.sync is not None and self.sync % self.fragments):
      raise ValueError(
        f"--outer-fragments {self.fragments} must divide --outer-sync {self.sync} (the "
        f"fragments are synced H/F steps apart): pass a divisor of {self.sync}"
      )
    if self.delay and self.sync is None:
      raise ValueError(
        f"--outer-delay {self.delay} delays the outer loop's syncs, and there is none: pass "
        f"--outer-sync H too, or drop --outer-delay"
      )
    if not 0 <= self.mix < 1:
      raise ValueError(
        f"--outer-mix must be in [0, 1) (the share of the group's own weights in a restart), "
        f"got {self.mix}"
      )
    apart = self.sync // self.fragments if self.sync else 1
    if not 0 <= self.delay < apart:
      raise ValueError(
        f"--outer-delay must be in [0, H/F) = [0, {apart}) (one fragment's exchange in flight "
        f"at a time), got {self.delay}: pass a smaller delay or fewer --outer-fragments"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
  """One training step: the model, its strategy on a mesh, its batch, precision and memory."""

  model: str = option("tiny", MODEL_HELP, type=parse_model)
  strategy: str = option(
    "IIG",
    "three letters P,G,OS from {N,I,G} (e.g. IIG, any case) or an alias: "
    + ", ".join(f"{k}={v}" for k, v in ALIASES.items())
    + "; train also takes auto (probe the mesh, take the planner's pick) (default %(default)s)",
  )
  # (inter, intra); None: one group per process. The flag's text is parsed by the CLI.
  mesh: tuple[int, int] | None = option(
    None, "GROUPSxDEVICES, e.g. 2x4 (default: one group per process)"
  )
  micro_batches: int = option(1, "A: micro-batches per step")
  batch_size: int = option(16, "global micro-batch size (sequences)")
  seq_len: int = option(64, "tokens per sequence")
  dtype: str = option("bf16", "compute dtype", type=str.lower, choices=COMPUTE_DTYPES)
  collectives: str = option(
    "xla",
    "how collectives over all devices run: xla (XLA's own) and hring in two levels, ring "
    "flat, horing two overlapped levels, hring+xla / horing+xla the rings over both axes and "
    "XLA's over one; auto: hring+xla where XLA's would cross nodes on every hop (CPU "
    "processes), else xla",
    type=str.lower,
    choices=(AUTO_COLLECTIVES, *COLLECTIVE_IMPLS),
  )
  attention: str = option(  # models/config.py resolve_attention
    "auto",
    "xla: attention written out (scores, mask, softmax); cudnn: cuDNN's fused kernel "
    "(GPUs, bf16); auto: cudnn where it applies, else xla",
    type=str.lower,
    choices=ATTENTION_IMPLS,
  )
  wire: WireOptions = group(WireOptions)
  error_feedback: bool | None = option(  # of int8 gradients (core/feedback.py)
    None,
    "keep each device's int8 gradient rounding error and add it to the next step's "
    "gradient (default: on with --inter-grads int8 where the strategy reduces gradients across "
    "nodes at the step's end; --no-error-feedback to compare)",
    action=argparse.BooleanOptionalAction,
  )
  param_delta: bool | None = option(
    None,
    "int8 parameter syncs send each weight's change since the last step against a copy "
    "every device keeps (default: on with --inter-params int8 where the step's parameter sync "
    "crosses nodes; --no-param-delta to compare)",
    action=argparse.BooleanOptionalAction,
  )
  remat: str = option(  # models/llama.py REMAT_POLICIES
    "full",
    "what backward recomputes per layer: full (all, weight gather included), "
    "layer (all but matmul outputs), none (keeps every layer's weights)",
    type=str.lower,
    choices=("full", "layer", "none"),
  )
  lora: LoraOptions = group(LoraOptions)
  outer: OuterOptions = group(OuterOptions)

  def __post_init__(self):
    for name in ("micro_batches", "batch_size", "seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
    if self.outer.sync is not None:
      self._check_outer()
    check_outer_formats(self.wire, self.outer.sync)

  def _check_outer(self):
    """One line for what --outer-sync cannot run with (known before jax starts; one node is
    refused where the mesh is known, core/groups.py)."""
    if self.strategy.strip().lower() != "auto":  # auto picks among N and I letters
      GroupStrategy.of(parse_strategy(self.strategy))  # its check: no G placement
    if self.param_delta:
      raise ValueError(
        "--param-delta applies to the step's parameter sync across nodes, and with "
        "--outer-sync the step has none: drop --param-delta"
      )
    if self.wire.inter_params != "same":
      raise ValueError(
        f"--inter-params {self.wire.inter_params} compresses the step's parameter gathers "
        f"across nodes, and with --outer-sync the step has none (the pseudo-gradient's wire is "
        f"--inter-grads): drop --inter-params"
      )
