"""When error feedback and the delta parameter sync run, and their sizes (core/feedback.py runs
them). No jax: the planner (`paro-jax plan`) counts their memory without it."""

from __future__ import annotations

import math

from paro_jax.core.names import INTER
from paro_jax.core.wire import WireConfig


def feedback_size(n: int, devices: int, inter: int) -> int:
  """Elements of the error-feedback residual of a flat `n`-element operand reduced over axes of
  `devices` devices spanning `inter` nodes: what this device quantizes, its share of its node's
  partial sums (n / (devices / inter), n padded to a multiple of `devices`)."""
  return -(-n // devices) * inter


def resolve(strategy, wire: WireConfig, grad_dtype, requested: bool | None, active=None):
  """(on, why): whether error feedback runs, and a phrase saying why (for the run's header).

  `requested`: None (the default: on with int8 gradients where it applies), True or False.
  `active`: whether the codec compresses `grad_dtype` (asked of the codec, with jax, if None)."""
  codec = wire.grads_codec
  if active is None:
    active = codec.active_for(grad_dtype)
  if requested is False:
    return False, "off (--no-error-feedback)"
  if not active:
    if requested:
      raise ValueError(
        f"error feedback corrects compressed gradients, but --inter-grads {wire.grads} does not "
        f"compress {grad_dtype} gradients: pass --inter-grads int8 or drop --error-feedback"
      )
    return False, "off (gradients not compressed)"
  if INTER in strategy.grad_scatter_axes:
    if requested:
      raise ValueError(
        f"{strategy.name} reduces each layer's gradient over nodes in backward (Gr = G); error "
        f"feedback covers the accumulation boundary's reduction only: pass --no-error-feedback, "
        f"or a strategy whose gradients are not sharded across nodes"
      )
    return False, f"off ({strategy.name} quantizes per layer in backward: not covered)"
  if requested is None and wire.grads != "int8":
    return False, f"off (default with --inter-grads {wire.grads})"
  return True, "on"


def residual_size(strategy, local_sizes: tuple[int, int], inter: int, intra: int):
  """Elements of one device's residual. `local_sizes`: (elements of its trained leaves at Gr,
  at OS). The inter level is the boundary's reduce-scatter if OS shards `inter`, else its
  all-reduce (after the reduce-scatter over the intra axis, if any)."""
  size = {INTER: inter}
  scatter, reduce = strategy.sync_scatter_axes, strategy.sync_reduce_axes
  if INTER in scatter:
    n, axes = local_sizes[0], scatter
  else:
    n, axes = local_sizes[1], reduce
  devices = math.prod(size.get(a, intra) for a in axes)
  return feedback_size(n, devices, inter)


def residual_bytes(
  strategy,
  trainable: int,
  inter: int,
  intra: int,
  wire,
  grad_itemsize: int,
  requested: bool | None = None,
):
  """Per-device bytes of the residual, for the memory model (0 where error feedback is off:
  by default, or `requested` False, as `resolve` decides)."""
  grad_dtype = "float32" if grad_itemsize == 4 else "bfloat16"
  active = wire.grads_codec.compresses(grad_itemsize)
  if not resolve(strategy, wire, grad_dtype, requested, active)[0]:
    return 0
  placements = (strategy.grads, strategy.opt)
  local = tuple(-(-trainable // p.shard_count(inter, intra)) for p in placements)
  return 4 * residual_size(strategy, local, inter, intra)


def outer_residual_size(strategy, local: int, inter: int, intra: int, state: str = "G") -> int:
  """Elements of one device's residual of the outer loop's pseudo-gradient (core/outer.py): what
  it quantizes of its flat pseudo-gradient. With the outer state at G (`state`): `local`
  elements at OS (N or I), reduced over the axes between OS and G (all devices for N, `inter`
  for I); at I: `local` elements of the device's I shard, all-reduced over `inter`."""
  over_inter = state == "I" or strategy.opt.axes
  devices = inter if over_inter else inter * intra  # over inter alone, or over all devices
  return feedback_size(local, devices, inter)


def outer_residual_bytes(
  strategy, trainable: int, inter: int, intra: int, wire, requested=None, state: str = "G"
):
  """Per-device bytes of that residual (0 where the pseudo-gradient's wire, `wire.grads`, sends
  fp32 as it is, or `requested` is False); `state`: --outer-state."""
  if requested is False or not wire.grads_codec.compresses(4):
    return 0
  ways = intra if state == "I" else strategy.opt.shard_count(inter, intra)
  local = -(-trainable // ways)
  return 4 * outer_residual_size(strategy, local, inter, intra, state)


def reference_bytes(
  strategy,
  trainable: int,
  inter: int,
  intra: int,
  wire,
  itemsize: int,
  requested: bool | None = None,
):
  """Per-device bytes of the delta parameter sync's reference (0 where it is off: by default,
  or `requested` False, as `resolve_params` decides)."""
  if not resolve_params(strategy, wire, requested)[0]:
    return 0
  return itemsize * -(-trainable // strategy.params.shard_count(inter, intra))


def resolve_params(strategy, wire: WireConfig, requested: bool | None):
  """(on, why) for the delta parameter sync (`delta_param_sync`). `requested`: None (the
  default: on with int8 parameters where the step's parameter sync crosses nodes), True, False."""
  if requested is False:
    return False, "off (--no-param-delta)"
  if wire.params != "int8" or INTER not in strategy.param_sync_axes:
    if requested:
      raise ValueError(
        f"--param-delta applies to an int8 parameter sync across nodes: {strategy.name} with "
        f"--inter-params {wire.params} has none; pass --inter-params int8 and a strategy whose "
        f"parameters are not sharded across nodes (P = N or I), or drop --param-delta"
      )
    return False, "off"
  return True, "on"
