"""A training state's parts: `TrainState` (what the step carries and a checkpoint saves),
`OptimConfig` (AdamW with warmup and cosine decay, clipped by the engine), the weight-decay mask,
and the compute dtypes by name."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from models.config import LAYERS

DTYPES = {
  "bf16": jnp.bfloat16,
  "bfloat16": jnp.bfloat16,
  "fp32": jnp.float32,
  "float32": jnp.float32,
}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 3e-3
  warmup_steps: int = 10
  total_steps: int = 1000
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0

  def __post_init__(self):
    if self.learning_rate <= 0 or self.total_steps <= 0 or self.warmup_steps < 0:
      raise ValueError(
        f"OptimConfig: learning_rate and total_steps must be positive and "
        f"warmup_steps >= 0, got {self}"
      )

  def lr_schedule(self):
    warmup = min(self.warmup_steps, self.total_steps)
    return optax.warmup_cosine_decay_schedule(
      0.0,
      self.learning_rate,
      warmup,
      max(self.total_steps, warmup + 1),
      end_value=self.learning_rate * self.min_lr_ratio,
    )

  def adamw(self, decay_mask):
    """AdamW without clipping: the engine clips by the global norm across shards itself."""
    return optax.adamw(
      self.lr_schedule(),
      b1=self.b1,
      b2=self.b2,
      eps=self.eps,
      weight_decay=self.weight_decay,
      mask=decay_mask,
    )

  def reference_tx(self, decay_mask):
    """The same optimizer as one plain optax chain, for a single-device reference."""
    return optax.chain(optax.clip_by_global_norm(self.clip_norm), self.adamw(decay_mask))


def decay_mask(logical_tree):
  """Weight decay on matrices only (not on norm scales)."""
  return jax.tree.map(
    lambda axes: len([a for a in axes if a != LAYERS]) >= 2,
    logical_tree,
    is_leaf=lambda x: isinstance(x, tuple),
  )


class TrainState(NamedTuple):
  step: jax.Array  # scalar int32, replicated
  master: Any  # fp32 trained parameters at the OS placement
  opt_state: Any  # optax state; moments at the OS placement
  frozen: Any = None  # LoRA: the frozen base weights, compute dtype, P placement
  residual: Any = None  # error feedback (core/feedback.py): fp32, one vector per device
  reference: Any = None  # delta parameter sync (core/feedback.py): compute dtype, P placement
  weights: Any = None  # `weights_copy`: master in the compute dtype, OS placement (not saved)
  outer: Any = None  # the outer loop (core/outer.py OuterState): outer weights and momentum, G
