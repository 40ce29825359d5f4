"""LoRA adapters inside the model's projections: a target weight W (in x out) gets A (in x rank)
and B (rank x out), declared in the module that owns W as `{name}_lora_a` and `{name}_lora_b`,
and its output gains (alpha/r) x A B; `is_lora_path` tells the adapters' leaves from the base's."""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from models.config import LoraConfig

LORA_SUFFIXES = ("_lora_a", "_lora_b")


def is_lora_path(path) -> bool:
  """Whether a parameter path (a jax key path) names a LoRA adapter leaf."""
  last = path[-1]
  return str(getattr(last, "key", last)).endswith(LORA_SUFFIXES)


def lora_delta(
  module: nn.Module,
  lora: LoraConfig | None,
  name: str,
  x,
  in_axis: str,
  out_axis: str,
  out_shape: tuple[int, ...],
):
  """(alpha/r) x A B for target `name` (x: ... x in), shaped ... x out_shape; 0 if no adapter.

  Declared inside the module that owns the weight, as `{name}_lora_a` and `{name}_lora_b`.
  """
  if lora is None or name not in lora.targets:
    return 0
  n_in, n_out = x.shape[-1], math.prod(out_shape)
  a = module.param(
    f"{name}_lora_a",
    nn.with_logical_partitioning(
      nn.initializers.normal(1 / math.sqrt(n_in)), (in_axis, "lora_rank")
    ),
    (n_in, lora.rank),
  )
  b = module.param(
    f"{name}_lora_b",
    nn.with_logical_partitioning(nn.initializers.zeros, ("lora_rank", out_axis)),
    (lora.rank, n_out),
  )
  y = (x @ a.astype(x.dtype)) @ b.astype(x.dtype) * jnp.asarray(lora.scale, x.dtype)
  return y.reshape(*x.shape[:-1], *out_shape)
