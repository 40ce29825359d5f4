"""The configuration of a training step (`StepConfig`: model, strategy, mesh, batch, precision,
wire formats, LoRA) and the flag metadata every command's config is declared with (`option`).

Each field that is also a command-line flag is declared with `option()`: its default, its help and
how argparse reads it are written here once, and paro_jax/cli.py builds the flags from them.
Pure Python (no jax, no numpy): the CLI builds its parser before jax starts, and `plan` never
starts it. `RunConfig` (paro_jax/run/config.py) is the step's configuration plus a run's;
`InspectConfig` and `PlanConfig` (paro_jax/analysis/config.py) are the analysis commands'.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from models.config import LoraConfig
from paro_jax.core.names import (
  ATTENTION_IMPLS,
  AUTO_COLLECTIVES,
  COLLECTIVE_IMPLS,
  DEFAULT_INT8_BLOCK,
  GRAD_DTYPES,
  WIRE_FORMATS,
)
from paro_jax.core.strategy import ALIASES
from paro_jax.core.units import COMPUTE_DTYPE_BYTES
from paro_jax.core.wire import WireConfig


def option(default=dataclasses.MISSING, help: str = "", *, flag: str | None = None, **add_argument):
  """A config field that is also a command-line flag.

  `help` is its --help text (argparse appends the default; "%(default)s" places it instead),
  `flag` its option string (default: --the-field-name), and `add_argument` any other keywords of
  argparse's (type, choices, metavar, action, nargs). No default: the flag is required.
  """
  return dataclasses.field(default=default, metadata={"help": help, "flag": flag, **add_argument})


MODEL_HELP = (
  "preset: tiny, small, 7b, 13b, 65b, llama3.1-8b, llama3.1-70b, llama3.1-405b, llama3.2-1b, "
  "llama3.2-3b; or an HF LLaMA config.json (its shapes, from scratch)"
)
COMPUTE_DTYPES = tuple(COMPUTE_DTYPE_BYTES)  # bf16, fp32


def parse_model(value: str) -> str:
  """--model: preset names in any case; a path as given."""
  return value if os.sep in value or value.endswith(".json") else value.lower()


@dataclasses.dataclass(frozen=True, kw_only=True)
class WireOptions:
  """What the parameter gathers and gradient reductions carry across nodes (core/wire.py)."""

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
    "once to each chunk's owner and summed in fp32 (default %(default)s)",
    type=str.lower,
    choices=WIRE_FORMATS,
  )
  int8_block: int = option(
    DEFAULT_INT8_BLOCK, "elements per fp32 scale of the int8 format (default %(default)s)"
  )
  grad_dtype: str = option(
    "compute",
    "gradient accumulation and boundary reduction dtype (default: the compute dtype)",
    type=str.lower,
    choices=GRAD_DTYPES,
  )

  def wire(self) -> WireConfig:
    return WireConfig(self.inter_params, self.inter_grads, self.int8_block)

  def grad_itemsize(self, compute_itemsize: int) -> int:
    """Bytes per gradient element accumulated and synced: fp32's, or the compute dtype's."""
    return 4 if self.grad_dtype == "fp32" else compute_itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig(WireOptions):
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
  lora_rank: int = option(0, "adapter rank (default %(default)s: full training)", metavar="R")
  lora_alpha: float = option(
    16.0, "adapter scale alpha (the update is alpha/R x A B; default %(default)g)"
  )
  lora_targets: str = option(
    "wq,wv",
    "comma-separated weights to adapt, from wq,wk,wv,wo,w_gate,w_up,w_down (default %(default)s)",
  )

  def __post_init__(self):
    for name in ("micro_batches", "batch_size", "seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
    self.wire()  # its checks
    if self.grad_dtype not in GRAD_DTYPES:
      raise ValueError(f"unknown grad dtype {self.grad_dtype!r}; choose one of {GRAD_DTYPES}")
    self.lora()  # its checks

  def lora(self) -> LoraConfig | None:
    return LoraConfig.from_flags(self.lora_rank, self.lora_alpha, self.lora_targets)


def step_flags(cfg: StepConfig, **replace) -> list[str]:
  """The command-line flags that give `cfg`'s StepConfig fields (`replace` overriding values):
  what `train --strategy auto` hands `paro-jax inspect --target` to compile the run's own step.
  The inverse of the CLI's parsing (tests/test_cli_config.py parses them back)."""
  out = []
  for field in dataclasses.fields(StepConfig):
    value = replace.get(field.name, getattr(cfg, field.name))
    flag = field.metadata.get("flag") or f"--{field.name.replace('_', '-')}"
    if value is None:  # the flag's absence is its default (None: decided at run time)
      continue
    if field.metadata.get("action") is argparse.BooleanOptionalAction:
      out.append(flag if value else "--no-" + flag[2:])
    elif field.name == "mesh":
      out += [flag, "x".join(str(n) for n in value)]
    else:
      out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
  return out
