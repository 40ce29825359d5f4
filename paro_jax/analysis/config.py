"""The configurations of a training step, of `paro-jax inspect` and of `paro-jax plan`.

Each field that is also a command-line flag is declared with `option()`: its default, its help and
how argparse reads it are written here once, and paro_jax/cli.py builds the flags from them.
Pure Python (no jax, no numpy): the CLI builds its parser before jax starts, and `plan` never
starts it. `RunConfig` (paro_jax/run/config.py) is the step's configuration plus a run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from models.config import LoraConfig
from paro_jax.analysis.hardware import GPUS
from paro_jax.analysis.plan_inputs import DEFAULT_MFU, USABLE_MEMORY
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


def model_name(value: str) -> str:
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

  model: str = option("tiny", MODEL_HELP, type=model_name)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class InspectConfig(StepConfig):
  """`paro-jax inspect`: compile one step (no allocation) and report its communication."""

  as_json: bool = option(False, "print one JSON object", flag="--json")
  target: str | None = option(
    None,
    "compile for a cluster of these GPUs, no GPU needed: h100, h200, a100-80gb, a100-40gb "
    "(--mesh NODESxGPUS); reports async collectives, streams, overlap and memory vs the plan",
  )
  inter_bandwidth: str | None = option(
    None,
    "with --target: each node's inter-node link for XLA's network model in the step time "
    "estimate, a tc rate such as 100gbit (default: XLA's own network defaults, named in the "
    "output)",
    metavar="RATE",
  )
  prefetch: bool = option(
    True,
    "compile without the prefetching layer stack (each layer's gather waits for its use), "
    "to compare",
    flag="--no-prefetch",
    action="store_false",
  )
  hlo_out: str | None = option(None, "write the compiled (scheduled) HLO text here", metavar="FILE")
  pack: bool = option(
    False,
    "compile the step for packed instruction data (several examples per sequence, kept apart: "
    "train --pack) and say how attention runs (with --target: whether cuDNN's fused kernel "
    "does)",
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig(WireOptions):
  """`paro-jax plan`: a cluster and a workload, as the command line gives them (strings with
  units). The values are checked here; analysis/planner.py run_plan converts the strings (and
  checks --target, which needs JAX's CUDA plugin)."""

  model: str = option("7b", MODEL_HELP, type=model_name)
  nodes: int = option(help="G: nodes (groups)", type=int)
  devices_per_node: int = option(8, "M: devices per node (default %(default)s)")
  gpu: str = option("a100-80gb", f"device model for peak FLOP/s and memory: {', '.join(GPUS)}")
  target: str | None = option(
    None,
    "compile the top strategies for this GPU (h100, h200; no GPU needed) and pick by XLA's "
    "estimate of the compiled step; sets --gpu",
  )
  compile_top: int = option(
    3,
    "with --target: compile the analytic top K, any within 10%% of the first, and any faster "
    "one the analytic memory rules out by less than 30%% (default %(default)s)",
    metavar="K",
  )
  device_memory: str | None = option(None, "per device, e.g. 80GB or 80GiB (default: the GPU's)")
  peak_tflops: float | None = option(
    None, "dense bf16 peak per device (default: the GPU's, or the profile's)", type=float
  )
  mfu: float = option(
    DEFAULT_MFU, "fraction of peak the compute alone reaches (default %(default)s)"
  )
  inter_bandwidth: str = option(
    "100gbit", "each node's inter-node link, shared by its devices (e.g. 100gbit, 400Gb/s, 50GB/s)"
  )
  intra_bandwidth: str | None = option(
    None,
    "per device inside a node, each direction (default: the GPU's NVLink, e.g. 300GB/s for an "
    "A100, 450GB/s for an H100 or H200; PCIe for cards without it)",
  )
  inter_latency: str = option("50us", "per collective between nodes")
  intra_latency: str = option("10us", "per collective inside a node")
  micro_batch: int = option(1, "sequences per device and micro-batch")
  micro_batches: int = option(8, "A: micro-batches per step")
  seq_len: int = option(2048, "tokens per sequence")
  trainable_fraction: float = option(
    1.0, "trainable parameters / all parameters: 1 for full training, e.g. 0.003 for LoRA"
  )
  dtype: str = option("bf16", "compute dtype", type=str.lower, choices=COMPUTE_DTYPES)
  collectives: str = option(
    "xla",
    "how collectives over all devices run: xla (NCCL) and hring in two "
    "levels, ring flat (docs/design.md), horing two overlapped levels",
    type=str.lower,
    choices=COLLECTIVE_IMPLS,
  )
  attention: str = option(
    "auto",
    "the attention the GPUs run (activation memory): auto (cuDNN's fused kernel in bf16), "
    "xla (scores written out) or cudnn",
    type=str.lower,
    choices=ATTENTION_IMPLS,
  )
  overlap: float = option(
    0.0, "fraction of per-micro-batch traffic hidden behind compute (default %(default)g)"
  )
  usable_memory: float = option(
    USABLE_MEMORY, "fraction of device memory the plan may fill (default %(default)s)"
  )
  profile: str | None = option(
    None,
    "a `paro-jax probe` JSON: its measured links (and FLOP/s) override",
    metavar="FILE",
  )
  as_json: bool = option(False, "print one JSON object", flag="--json")

  def __post_init__(self):
    # names compare case-insensitively (--gpu H100)
    object.__setattr__(self, "gpu", self.gpu.strip().lower())
    if self.target is not None and self.compile_top < 1:
      raise ValueError(f"--compile-top must be >= 1, got {self.compile_top}")
    if self.target is None and self.gpu not in GPUS:  # --target sets the GPU
      raise ValueError(
        f"unknown --gpu {self.gpu!r}; choose one of {', '.join(GPUS)} (or give "
        f"--device-memory and --peak-tflops)"
      )
    if not 0 < self.trainable_fraction <= 1:
      raise ValueError(
        f"--trainable-fraction must be in (0, 1] (1: full training, e.g. 0.003 for "
        f"LoRA), got {self.trainable_fraction}"
      )
    if self.dtype not in COMPUTE_DTYPE_BYTES:
      raise ValueError(f"unknown --dtype {self.dtype!r}; choose bf16 or fp32")
    if self.peak_tflops is not None and self.peak_tflops <= 0:
      raise ValueError(f"--peak-tflops must be positive, got {self.peak_tflops}")
    if self.grad_dtype not in GRAD_DTYPES:
      raise ValueError(f"unknown --grad-dtype {self.grad_dtype!r}; choose compute or fp32")
