"""Analytic memory and traffic of a strategy (docs/design.md, "Memory and traffic").

Traffic is ring cost per device: (k-1)/k * S for an all-gather or reduce-scatter of S bytes over k
devices, twice that for an all-reduce. A collective over `inter` (alone or with `intra`) crosses
groups and counts as inter-group traffic; one over `intra` alone stays inside a group. With the
two-level rings (`two_level`: `hring`, `horing`) a collective over both axes sends each level its
own share instead: (m-1)/m * S inside the group and (g-1)/g * S/m across groups.
"""

from __future__ import annotations

import dataclasses

from paro_jax.core.names import (
  ALL_GATHER,
  ALL_REDUCE,
  INTER,
  INTRA,
  LEVEL_INTER,
  LEVEL_INTRA,
  REDUCE_SCATTER,
)
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
  residual_bytes: int = 0,
  reference_bytes: int = 0,
) -> dict:
  """Per-device bytes: params at P, gradients at Gr, fp32 master + Adam moments at OS, and with
  error feedback (`residual_bytes`, core/feedback.py) the fp32 residual of the int8 gradients,
  and with the delta parameter sync (`reference_bytes`) the weights at P kept between steps."""
  f = lambda placement: placement.shard_count(inter, intra)
  out = {
    "params": param_bytes * params // f(strategy.params),
    "grads": grad_bytes * trainable // f(strategy.grads),
    "opt": opt_bytes * trainable // f(strategy.opt),
  }
  if residual_bytes:
    out["residual"] = residual_bytes
  if reference_bytes:
    out["reference"] = reference_bytes
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
    level = LEVEL_INTER if INTER in axes else LEVEL_INTRA
    key = f"{phase}/{level}"
    self.phases[key] = self.phases.get(key, 0.0) + nbytes


def _group_size(axes, inter, intra) -> int:
  return (inter if INTER in axes else 1) * (intra if INTRA in axes else 1)


def _ring(nbytes: float, k: int) -> float:
  return (k - 1) / k * nbytes


def _add_collective(
  t, phase, axes, elements, itemsize, codec, inter, intra, times=1.0, two_level=False
):
  """Ring bytes of all-gathers / reduce-scatters (times=2: all-reduces) of `elements` full
  elements over `axes`. With a compressing `codec` (core/compress.py) the inter level carries
  `codec.bytes_per_element` per element of its 1/k_rest share and the other axis, first (a
  reduce-scatter) or last (an all-gather), the full payload at `itemsize`: two levels. With
  `two_level` (the two-level rings) an uncompressed collective over both axes is split the same
  way, at `itemsize` on both levels."""
  k = _group_size(axes, inter, intra)
  compressed = codec is not None and INTER in axes and codec.compresses(itemsize)
  if not compressed and not (two_level and INTER in axes and len(axes) > 1):
    t.add(phase, axes, times * _ring(elements * itemsize, k))
    return
  rest = tuple(a for a in axes if a != INTER)
  k_rest = _group_size(rest, inter, intra)
  if rest:
    t.add(phase, rest, times * _ring(elements * itemsize, k_rest))
  wire = codec.bytes_per_element(itemsize) if compressed else itemsize
  t.add(phase, (INTER,), times * _ring(elements / k_rest * wire, inter))


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
  wire=None,
  acc_bytes: int | None = None,
  two_level: bool = False,
  vocab_extra: tuple[int, int, int] = (0, 0, 0),
  gather_bytes: int | None = None,
) -> Traffic:
  """Expected per-device traffic of one optimizer step of `strategy`, by the schedule's phases.

  `regathered` is how many parameters are gathered a second time in backward (rematerialised);
  docs/design.md's formula assumes all of them (the default); paro_jax's LLaMA recomputes only its
  layer stack (Llama.stack_param_count), not the embedding and head.
  `wire` (a compress.WireConfig): the inter level's precision of parameter gathers and gradient
  reductions; `acc_bytes`: the gradient accumulator's element size (--grad-dtype; default
  `grad_bytes`), what the boundary sync reduces. Per-micro-batch gradients are reduce-scattered
  at `grad_bytes` (the compute dtype). `two_level`: the collectives over both axes are the
  two-level rings (`--collectives hring` or `horing`), each level's bytes counted apart.
  `vocab_extra`: elements of the embedding table and head each micro-batch gathers in forward,
  in backward and scatters beyond one gather and one scatter of each parameter
  (models/config.py `VocabPasses.beyond_stored`: where the vocabulary is tiled, the head's tiles
  are gathered again in backward and a tied table's two uses gather and scatter apart).
  `gather_bytes`: the element size of the per-micro-batch gathers (default `param_bytes`).
  """
  # One body for every case: _add_collective carries the uncompressed ring bytes where `wire` is
  # None or leaves a level at its dtype.
  s, t = strategy, Traffic()
  k = lambda axes: _group_size(axes, inter, intra)
  pc, gc = (wire.params_codec, wire.grads_codec) if wire is not None else (None, None)
  acc_bytes = grad_bytes if acc_bytes is None else acc_bytes
  regathered = params if regathered is None else regathered
  add = lambda phase, axes, n, item, codec, times=1.0: _add_collective(
    t, phase, axes, n, item, codec, inter, intra, times, two_level
  )
  a, (fwd_extra, bwd_extra, scatter_extra) = micro_batches, vocab_extra
  # Per micro-batch: parameters gathered over S(P) in forward and again (remat) in backward;
  # gradients reduce-scattered over S(Gr) as they leave backward.
  gb = param_bytes if gather_bytes is None else gather_bytes
  add("forward params", s.param_gather_axes, params + fwd_extra, gb, pc, a)
  add("backward params (remat)", s.param_gather_axes, regathered + bwd_extra, gb, pc, a)
  add("backward grads", s.grad_scatter_axes, trainable + scatter_extra, grad_bytes, gc, a)
  # Boundary: from the Gr shard, reduce-scatter to the OS shard, then all-reduce across replicas
  # (in the accumulator's dtype).
  add("grad sync", s.sync_scatter_axes, trainable / k(s.grads.axes), acc_bytes, gc)
  add("grad sync", s.sync_reduce_axes, trainable / k(s.opt.axes), acc_bytes, gc, 2)
  # Parameter sync: all-gather the updated OS shard to the P placement (trained parameters only:
  # frozen ones never change and are held at P already).
  add("param sync", s.param_sync_axes, trainable / k(s.params.axes), param_bytes, pc)
  return t


# fp32: the outer weights (core/outer.py OuterState) and the pseudo-gradient before its wire
OUTER_ITEMSIZE = 4
# The round's collectives (core/outer.py) by --outer-state: phase, collective, whether it carries
# the pseudo-gradient (the one `--inter-grads` compresses). At G: `sync`'s three; at I:
# `sync_at_node`'s all-reduce over `inter` and the restart's gather inside the node.
OUTER_PHASES = {
  "G": (
    ("outer start", ALL_GATHER, False),
    ("outer pseudo-gradient", REDUCE_SCATTER, True),
    ("outer restart", ALL_GATHER, False),
  ),
  "I": (
    ("outer pseudo-gradient", ALL_REDUCE, True),
    ("outer restart", ALL_GATHER, False),
  ),
}


def outer_phase_axes(strategy, state: str, phase: str) -> tuple[str, ...]:
  """The axes the round's `phase` runs over with the outer state at `state` (G or I)."""
  if state == "G":
    return strategy.outer_sync_axes
  return (INTER,) if phase == "outer pseudo-gradient" else strategy.outer_node_axes


def outer_round_traffic(
  strategy,
  trainable: int,
  inter: int,
  intra: int,
  wire=None,
  two_level: bool = False,
  state: str = "G",
) -> Traffic:
  """Per-device bytes of one round's end of the outer loop (core/outer.py) for a GroupStrategy.
  With the outer state at G (`state`): the fp32 outer weights all-gathered from G to the groups'
  master placement (OS), the pseudo-gradient reduce-scattered back to G (the inter level at
  `wire.grads`, as step_traffic's gradient syncs), the new outer weights all-gathered to OS,
  each over `strategy.outer_sync_axes` on the OS shard's `trainable / f(OS)` elements. At I: the
  pseudo-gradient of the I shard (`trainable / m` elements) all-reduced over `inter` at
  `wire.grads` (2w bytes per element, times (g-1)/g), and the new outer weights gathered over
  the node to OS (OS = N only). Once every H steps: divide by H for a step's share."""
  t = Traffic()
  codec = wire.grads_codec if wire is not None else None
  at_os = trainable / strategy.opt.shard_count(inter, intra)
  for phase, kind, compressed in OUTER_PHASES[state]:
    axes = outer_phase_axes(strategy, state, phase)
    elements = trainable / intra if kind == ALL_REDUCE else at_os
    _add_collective(
      t,
      phase,
      axes,
      elements,
      OUTER_ITEMSIZE,
      codec if compressed else None,
      inter,
      intra,
      times=2.0 if kind == ALL_REDUCE else 1.0,
      two_level=two_level,
    )
  return t
