"""The configuration of `paro-jax plan`: a cluster and a workload.

Its fields are flags as the step's are (paro_jax/core/config.py `option`); pure Python (no jax,
no numpy): the CLI builds its parser before jax starts, and `plan` never starts it.
"""

from __future__ import annotations

import dataclasses

from models.config import ATTENTION_IMPLS
from paro_jax.analysis.gpu.hardware import GPUS
from paro_jax.analysis.planner.inputs import DEFAULT_MFU, USABLE_MEMORY
from paro_jax.core.config import (
  COMPUTE_DTYPES,
  MODEL_HELP,
  WireOptions,
  OuterOptions,
  check_outer_formats,
  group,
  option,
  parse_model,
)
from paro_jax.core.names import (
  AUTO_OUTER_STATE,
  COLLECTIVE_IMPLS,
  OUTER_STATES,
  parse_outer_state,
)
from paro_jax.core.units import COMPUTE_DTYPE_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanConfig:
  """`paro-jax plan`: a cluster and a workload, as the command line gives them (strings with
  units). The values are checked here; analysis/planner/planner.py run_plan converts the strings
  (and checks --target, which needs JAX's CUDA plugin)."""

  model: str = option("7b", MODEL_HELP, type=parse_model)
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
  wire: WireOptions = group(WireOptions)
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
  outer_sync: int | None = option(
    None,
    "H: rank the outer loop (DiLoCo, `train --outer-sync H`): the strategies of N and I letters "
    "as each node's step, the pseudo-gradient on the wire as --inter-grads says once every H "
    "steps, beside the 14 synchronous strategies",
    flag="--outer-sync",
    metavar="H",
    type=int,
  )
  outer_fragments: int = option(
    1,
    "F: with --outer-sync, Streaming DiLoCo's fragments (`train --outer-fragments F`): a sync "
    "step moves 1/F of the round's bytes (default %(default)s)",
    flag="--outer-fragments",
    metavar="F",
    type=int,
  )
  outer_delay: int = option(
    0,
    "TAU: with --outer-sync, `train --outer-delay TAU`: its kept copy of the master weights "
    "counted in memory (default %(default)s)",
    flag="--outer-delay",
    metavar="TAU",
    type=int,
  )
  outer_state: str = option(
    "G",
    "with --outer-sync, `train --outer-state`: the outer weights and momentum over all devices "
    "(G: a round sends 8 + w bytes a parameter) or a copy per node over its devices (I: 2w "
    "bytes, 8 bytes a parameter over m devices) or auto: I for each strategy whose memory "
    "fits, else G (default %(default)s)",
    flag="--outer-state",
    type=parse_outer_state,
    choices=(*OUTER_STATES, AUTO_OUTER_STATE),
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
    if self.outer_sync is not None and self.outer_sync < 1:
      raise ValueError(
        f"--outer-sync must be >= 1 (steps between the nodes' syncs), got {self.outer_sync}; "
        f"omit it to rank the synchronous strategies alone"
      )
    check_outer_formats(self.wire, self.outer_sync)
    # train's checks of --outer-fragments and --outer-delay, in train's words
    OuterOptions(
      sync=self.outer_sync,
      fragments=self.outer_fragments,
      delay=self.outer_delay,
      state=self.outer_state,
    )
    if self.outer_sync is not None and self.target is not None:
      raise ValueError(
        "--target compiles a step and XLA's estimate would count the outer loop's round in "
        "every step, where it runs once every H: drop --target with --outer-sync"
      )
    if self.peak_tflops is not None and self.peak_tflops <= 0:
      raise ValueError(f"--peak-tflops must be positive, got {self.peak_tflops}")
