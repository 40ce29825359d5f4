"""The planner's inputs: the cluster (its links and devices) and the workload of one step.

Pure Python (no jax); the step-time model (paro_jax/analysis/planner/step_model.py) reads these.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from paro_jax.core.wire import WireConfig  # no jax
from paro_jax.core.names import MIXED_IMPLS

if TYPE_CHECKING:
  from models.config import LlamaConfig

GLOBAL_MODELS = ("flat", "hierarchical", "overlapped", "rings")
# How each --collectives implementation runs a collective over both axes. xla on GPUs is NCCL's
# ring over all n devices, one ring per NIC: each of a ring's n-1 steps moves one chunk over every
# link, so a node's link carries every device's ring bytes once (XLA's own model of it,
# `SolGPUCostModel::RingLatency`: (n-1)/n of the payload per GPU, over m NICs of a node); hring
# sends only (g-1)/g of the payload's 1/m between nodes; on CPU (gloo) it is flat
# (validate_planner.py passes "flat").
GLOBAL_MODEL_OF = {
  "xla": "rings",
  "ring": "flat",
  "hring": "hierarchical",
  "horing": "overlapped",
}
GLOBAL_MODEL_OF |= {mixed: GLOBAL_MODEL_OF[ring] for mixed, ring in MIXED_IMPLS.items()}
TIE = 0.01
USABLE_MEMORY = 0.9
DEFAULT_MFU = 0.5  # compute alone; AMSP reports 51-52% end to end for LLaMA-7B/13B on A800s
# Parameter leaves of models/llama.py: 9 per layer (4 attention weights, 3 MLP weights, 2 norm
# scales), 3 outside (embedding, final norm, head). One collective per leaf and use: the layer
# loop gathers each layer's 9, the boundary syncs see the 12 stacked leaves.
LEAVES_PER_LAYER, OTHER_LEAVES = 9, 3


# --- the inputs ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Links:
  """Links of the cluster. Bandwidths in bytes/s; latencies in seconds per collective."""

  inter_bandwidth: float  # each node's inter-node link, shared by its devices
  intra_bandwidth: float  # per device, inside a node
  inter_latency: float = 50e-6
  intra_latency: float = 10e-6
  global_collectives: str = "hierarchical"
  # (collective, level) -> (bandwidth in per-device ring bytes/s, latency s): a probe profile.
  measured: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.global_collectives not in GLOBAL_MODELS:
      raise ValueError(
        f"unknown global collective model {self.global_collectives!r}; choose "
        f"one of {GLOBAL_MODELS}"
      )
    if min(self.inter_bandwidth, self.intra_bandwidth) <= 0:
      raise ValueError("bandwidths must be positive")


@dataclasses.dataclass(frozen=True)
class Cluster:
  nodes: int
  devices_per_node: int
  network: Links
  flop_per_s: float | None  # per device, peak (or measured); None: compute time left out
  mfu: float = DEFAULT_MFU
  device_memory: float | None = None  # bytes; None: no limit (CPU)
  usable_memory: float = USABLE_MEMORY
  overlap: float = 0.0  # fraction of per-micro-batch traffic hidden behind compute (0..1)

  def __post_init__(self):
    if self.nodes < 1 or self.devices_per_node < 1:
      raise ValueError(
        f"--nodes and --devices-per-node must be >= 1, got {self.nodes} and {self.devices_per_node}"
      )
    if not 0 < self.mfu <= 1:
      raise ValueError(f"--mfu must be in (0, 1], got {self.mfu}")
    if not 0 <= self.overlap <= 1:
      raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")
    if not 0 < self.usable_memory <= 1:
      raise ValueError(f"usable memory fraction must be in (0, 1], got {self.usable_memory}")

  @property
  def devices(self) -> int:
    return self.nodes * self.devices_per_node

  @property
  def usable_bytes(self) -> float | None:
    return None if self.device_memory is None else self.device_memory * self.usable_memory


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one optimizer step trains. `micro_batch` is sequences per device and micro-batch."""

  model: LlamaConfig
  micro_batch: int = 1
  micro_batches: int = 8
  seq_len: int = 2048
  params: int | None = None  # Ψ, adapters included; default model.param_count()
  trainable: int | None = None  # Ψ'; default Ψ (full training)
  itemsize: int = 2  # bytes of a compute-dtype value (parameters, gradients, activations)
  remat: bool = True  # the layer stack is recomputed (and regathered) in backward
  wire: WireConfig = WireConfig()  # inter-node wire precision (--inter-params, --inter-grads)
  grad_itemsize: int | None = None  # the gradient accumulator's (--grad-dtype); None: itemsize
  fused_attention: bool = False  # cuDNN's fused kernel (--attention cudnn): no L x L scores
  # --error-feedback / --param-delta (None: on where the wire formats call for them)
  error_feedback: bool | None = None
  param_delta: bool | None = None
  outer_sync: int | None = None  # --outer-sync H (core/outer.py); None: off
  outer_fragments: int = 1  # --outer-fragments F (core/fragments.py): each sync step moves 1/F
  outer_delay: int = 0  # --outer-delay TAU: the master weights kept for the delayed exchange
  outer_state: str = "G"  # --outer-state: the outer weights and momentum over all devices or at I

  def __post_init__(self):
    for name in ("micro_batch", "micro_batches", "seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
    if self.trainable is not None and not 0 < self.trainable <= self.psi:
      raise ValueError(f"trainable parameters ({self.trainable}) must be in (0, {self.psi}]")

  @property
  def acc_itemsize(self) -> int:
    return self.itemsize if self.grad_itemsize is None else self.grad_itemsize

  @property
  def psi(self) -> int:
    return self.model.param_count() if self.params is None else self.params

  @property
  def psi_trained(self) -> int:
    return self.psi if self.trainable is None else self.trainable

  @property
  def layer_params(self) -> int:
    """Parameters of the layer stack: all but the embedding, final norm and head."""
    return self.psi - self.model.outer_param_count()

  @property
  def tokens_per_device(self) -> int:
    return self.micro_batch * self.seq_len * self.micro_batches
