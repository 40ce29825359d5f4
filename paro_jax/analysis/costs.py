"""Analytic memory and traffic of a strategy (docs/design.md, "Memory and traffic").

Traffic is ring cost per device: (k-1)/k * S for an all-gather or reduce-scatter of S bytes over k
devices, twice that for an all-reduce. A collective over `inter` (alone or with `intra`) crosses
groups and counts as inter-group traffic; one over `intra` alone stays inside a group.
"""

from __future__ import annotations

import dataclasses

from paro_jax.core.names import INTER, INTRA
from paro_jax.core.strategy import Strategy


def model_state_bytes(
  strategy: Strategy,
  params: int,
  trainable: int,
  inter: int,
  intra: int,
  param_bytes: int = 2,
  grad_bytes: int = 2,
  opt_bytes: int = 12,
) -> dict:
  """Per-device bytes: params at P, gradients at Gr, fp32 master + Adam moments at OS."""
  f = lambda placement: placement.shard_count(inter, intra)
  out = {
    "params": param_bytes * params // f(strategy.params),
    "grads": grad_bytes * trainable // f(strategy.grads),
    "opt": opt_bytes * trainable // f(strategy.opt),
  }
  out["total"] = sum(out.values())
  return out


@dataclasses.dataclass
class Traffic:
  """Bytes each device sends per optimizer step, split by level and by phase."""

  intra: float = 0.0
  inter: float = 0.0
  phases: dict = dataclasses.field(default_factory=dict)

  def add(self, phase: str, axes: tuple[str, ...], nbytes: float):
    if nbytes == 0:
      return
    if INTER in axes:
      self.inter += nbytes
    else:
      self.intra += nbytes
    level = "inter" if INTER in axes else "intra"
    key = f"{phase}/{level}"
    self.phases[key] = self.phases.get(key, 0.0) + nbytes


def _group_size(axes, inter, intra) -> int:
  return (inter if INTER in axes else 1) * (intra if INTRA in axes else 1)


def _ring(nbytes: float, k: int) -> float:
  return (k - 1) / k * nbytes


def step_traffic(
  strategy: Strategy,
  params: int,
  trainable: int,
  inter: int,
  intra: int,
  micro_batches: int,
  param_bytes: int = 2,
  grad_bytes: int = 2,
  regathered: int | None = None,
) -> Traffic:
  """Expected per-device traffic of one optimizer step of `strategy`, by the schedule's phases.

  `regathered` is how many parameters are gathered a second time in backward (rematerialised);
  docs/design.md's formula assumes all of them (the default); paro_jax's LLaMA recomputes only its
  layer stack (Llama.layer_param_count), not the embedding and head.
  """
  s, t = strategy, Traffic()
  k = lambda axes: _group_size(axes, inter, intra)
  full_p, full_g = param_bytes * params, grad_bytes * trainable
  regathered = params if regathered is None else regathered
  # Per micro-batch: parameters gathered over S(P) in forward and again (remat) in backward.
  t.add(
    "forward params", s.param_gather_axes, micro_batches * _ring(full_p, k(s.param_gather_axes))
  )
  t.add(
    "backward params (remat)",
    s.param_gather_axes,
    micro_batches * _ring(param_bytes * regathered, k(s.param_gather_axes)),
  )
  # Per micro-batch: gradients reduce-scattered over S(Gr) as they leave backward.
  t.add(
    "backward grads", s.grad_scatter_axes, micro_batches * _ring(full_g, k(s.grad_scatter_axes))
  )
  # Boundary: from the Gr shard, reduce-scatter to the OS shard, then all-reduce across replicas.
  at_gr = full_g / k(s.grads.axes)
  t.add("grad sync", s.sync_scatter_axes, _ring(at_gr, k(s.sync_scatter_axes)))
  at_os = full_g / k(s.opt.axes)
  t.add("grad sync", s.sync_reduce_axes, 2 * _ring(at_os, k(s.sync_reduce_axes)))
  # Parameter sync: all-gather the updated OS shard to the P placement (trained parameters only:
  # frozen ones never change and are held at P already).
  t.add(
    "param sync",
    s.param_sync_axes,
    _ring(param_bytes * trainable / k(s.params.axes), k(s.param_sync_axes)),
  )
  return t
