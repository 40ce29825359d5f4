"""One optimizer step on one device (the body of the Engine's `shard_map`), in four phases.

The phases, numbered as in docs/design.md and README.md and named as their `jax.named_scope`s
(which `paro-jax inspect` prints):

  0. `param_sync`: cast the fp32 master shard (OS placement) to the compute dtype and all-gather
     it over S(OS) minus S(P) to the P placement (with the engine's `weights_copy`, the shard
     the optimizer already wrote in the compute dtype: no cast);
  1. `micro_batches`: for each of the A micro-batches (a `lax.scan`), forward and backward through
     the layer stack; each layer's weights are all-gathered over S(P) (with full remat one layer
     ahead: core/prefetch.py) and again in backward; each layer's gradient leaves backward
     reduce-scattered over S(Gr) into a zero "gradient sink" of the Gr shape and is accumulated;
  2. `grad_sync`: reduce-scatter over S(OS) minus S(Gr), all-reduce over the axes OS replicates;
  3. `optimizer`: clip by the true global norm and apply optax AdamW to the OS shard (and write
     its compute-dtype copy, with `weights_copy`).

Phase 0 is the parameter sync of the previous step moved to the start of this one: the same
traffic once per step, and the P-placed copy never has to outlive the step.

The step runs one of two programs (`StepProgram`, the Engine's `program`): the layers' gradients
synced in phase 2 like the rest, or inside the last micro-batch's backward, each layer's as soon
as it is final (with the prefetching stack; the default on GPUs). The functions take the Engine
(paro_jax/core/engine.py) that holds the step's configuration.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax

from models.config import LAYERS
from models.loss import weighted_sum
from paro_jax.core import buckets, feedback, prefetch
from paro_jax.core.batch import Batch, inputs_of, take
from paro_jax.core.wire import WireConfig
from paro_jax.core.names import GLOBAL_AXES
from paro_jax.core.rings import to_varying
from paro_jax.core.sharding import local_shape
from paro_jax.core.shards import Shard, is_shard, join_trainable, make_gather


class LayerStack(enum.Enum):
  """How the micro-batches run the layer stack."""

  MODEL_SCAN = "model-scan"  # the model's own scan; each layer gathered through `materializer`
  PREFETCH = "prefetch"  # core/prefetch.py: the next layer's gather beside this one's compute


class StepProgram(enum.Enum):
  """Where the layers' gradients are synced (the platform's choice: see Engine)."""

  BOUNDARY_SYNC = "boundary-sync"  # in phase 2, after the micro-batch loop, with the rest
  SYNC_IN_BACKWARD = "sync-in-backward"  # in the last micro-batch's backward, layer by layer


# --- phase 0 ------------------------------------------------------------------------------------
def param_sync(engine, master, frozen, reference, weights=None):
  """The compute-dtype parameters at P from the master shards at OS; (params, new reference).
  `weights`: the master shards already in the compute dtype (the optimizer's copy, when the
  engine keeps one), gathered as they are: no cast of the master here."""
  s, impl, compute_dtype = engine.strategy, engine.collectives, engine.compute_dtype
  # Each leaf gathered as its own flat bucket, with every implementation. One bucket of the whole
  # model keeps every chunk of the gathered buffer alive beside the unpacked leaves (7b NGG on
  # 2x4 H100 with HO-Ring: 33% above the plan). And XLA's all-gather of a leaf along its sharded
  # dimension returns it in a layout with that dimension major; the layer loops want the default
  # one, so XLA kept the gathered leaf for the whole step and made a transposed copy for each user
  # of it (the micro-batch loop and the last micro-batch, with sync in backward): one more copy
  # of the parameters (7b NGG with XLA's collectives: 44% above the plan; NII, NIG: 30%). A flat
  # bucket is unpacked by a fusion whose layout XLA picks for its users, and the gathered buffer
  # dies there. Same bytes either way.
  if engine.param_delta:
    params = feedback.delta_param_sync(
      master, reference, engine.trained_dims, s.param_sync_axes, impl, engine.wire, compute_dtype
    )
    reference = params
  else:
    shards = weights if weights is not None else master
    params = jax.tree.map(
      lambda w, dim: buckets.all_gather_bucket(
        [w.astype(compute_dtype)], s.param_sync_axes, [dim], impl, wire=engine.wire.params_codec
      )[0],
      shards,
      engine.trained_dims,
    )
  if engine.lora:  # the frozen base is already at P, in the compute dtype
    params = join_trainable(engine.mask, params, frozen)
  return params, reference


# --- phase 1 ------------------------------------------------------------------------------------
def micro_batches(engine, params, batch_AxBxL1, targets_per_step):
  """(the gradients summed over the micro-batches at Gr, each micro-batch's loss). With
  `SYNC_IN_BACKWARD` the layers' sum is already synced (at OS) by the last one's backward.
  `batch_AxBxL1`: the tokens, or a Batch (core/batch.py); `targets_per_step`: how many targets
  the whole step counts (over every micro-batch and device)."""
  sinks = make_sinks(engine)
  materialize = materializer(engine)

  def micro_grads(batch_BxL1, sinks, final=False, acc=None, after=None):
    # Tie the parameters to this micro-batch: otherwise XLA hoists the loop-invariant gathers
    # (embedding, head) out of the micro-batch loop and keeps their full copies alive for the
    # whole step, which is not the schedule (nor the memory) the strategy promises. `after` (the
    # accumulated gradients of the earlier micro-batches) ties the last micro-batch to them too:
    # otherwise XLA may run its forward before the earlier backward, with two micro-batches'
    # activations alive at once (7b IGG on 2x4 H100: 18% above the plan).
    params_mb, _ = lax.optimization_barrier((params, (batch_BxL1, after)))

    def loss_fn(sinks):
      # Each device's share of the step's mean loss: summed over devices and micro-batches it is
      # the mean over all targets of the step.
      loss = micro_loss(engine, params_mb, sinks, batch_BxL1, materialize, final, acc)
      if isinstance(batch_BxL1, Batch):  # a sum over this device's counted targets
        return loss / targets_per_step
      return loss * (batch_BxL1[:, 1:].size / targets_per_step)

    return jax.value_and_grad(loss_fn)(sinks)

  def micro_step(acc, batch_BxL1):
    if engine.layer_stack is LayerStack.MODEL_SCAN:
      loss, grads = micro_grads(batch_BxL1, sinks)
      return jax.tree.map(jnp.add, acc, grads), loss
    # The prefetching stack adds its layers' gradients into the accumulator itself.
    loss, grads = micro_grads(batch_BxL1, sinks, acc=acc[LAYERS])
    rest = {k: jax.tree.map(jnp.add, acc[k], grads[k]) for k in acc if k != LAYERS}
    return {**rest, LAYERS: grads[LAYERS]}, loss

  A = batch_AxBxL1.shape[0]
  with jax.named_scope("micro_batches"):
    if engine.program is StepProgram.BOUNDARY_SYNC:
      return lax.scan(micro_step, sinks, batch_AxBxL1)
    # The layers' gradients are synced inside the last micro-batch's backward, each as soon as it
    # is final (the last layer's first), beside the backward of the layers below it; only the
    # embedding's and the head's wait for phase 2. Same sums in the same order.
    acc, losses = sinks, jnp.zeros((0,), jnp.float32)
    if A > 1:
      acc, losses = accumulate(micro_grads, micro_step, sinks, take(batch_AxBxL1, slice(None, -1)))
    final_sinks = {**sinks, LAYERS: make_sinks(engine, synced=True)[LAYERS]}
    earlier = acc if A > 1 else None
    loss, last = micro_grads(
      take(batch_AxBxL1, -1),
      final_sinks,
      final=True,
      acc=acc[LAYERS] if A > 1 else None,
      after=earlier,
    )
    losses = jnp.concatenate([losses, loss[None]])
  rest = {k: v for k, v in acc.items() if k != LAYERS}
  rest = jax.tree.map(jnp.add, rest, {k: last[k] for k in rest})
  return {**rest, LAYERS: last[LAYERS]}, losses


def accumulate(micro_grads, micro_step, sinks, batch_MxBxL1):
  """(the gradients summed over the M micro-batches, their losses): the first micro-batch's
  gradients are the accumulator, written, not added to zeros (a zero-filled accumulator whose
  rows are then read, added to and written back: for 7b with 4 layers on one H100, 4.9 GB of
  HBM traffic), and the loop adds the others. One more copy of the micro-batch program to
  compile where M > 1 (at M = 1 it replaces the loop's one iteration)."""
  loss, acc = micro_grads(take(batch_MxBxL1, 0), sinks)
  if batch_MxBxL1.shape[0] == 1:
    return acc, loss[None]
  acc, losses = lax.scan(micro_step, acc, take(batch_MxBxL1, slice(1, None)))
  return acc, jnp.concatenate([loss[None], losses])


def make_sinks(engine, synced: bool = False):
  """Zero gradient sinks at the Gr placement, trained leaves only (inside the shard_map), typed
  varying over every axis. `synced`: at the OS placement, for gradients synced at the boundary,
  typed varying over every axis but those the sync all-reduces over (it leaves them invariant
  there): the axes OS shards, and `inter` too where the groups of the outer loop train apart."""
  placement = engine.strategy.opt if synced else engine.strategy.grads
  ways = placement.shard_count(engine.inter, engine.intra)
  reduced = engine.strategy.sync_reduce_axes
  axes = tuple(a for a in GLOBAL_AXES if a not in reduced) if synced else GLOBAL_AXES

  def sink_like(shape_struct, dim):
    zeros = jnp.zeros(local_shape(shape_struct.shape, dim, ways), engine.grad_dtype)
    return to_varying(zeros, axes)

  return jax.tree.map(sink_like, engine.trained_shapes, engine.trained_dims)


def micro_loss(engine, params, sinks, batch_BxL1, materialize, final=False, acc=None):
  """This device's next-token loss on its rows of a micro-batch, from the P-placed parameters:
  the mean over its tokens, or for a Batch the sum over its counted targets. Differentiated with
  respect to the sinks, it gives the gradients at Gr. `final`, `acc`: for the prefetching stack
  (`prefetch_layers`)."""
  # Frozen leaves get no sink (None): they are gathered without a gradient.
  shards = jax.tree.map(
    lambda m, p, k, d: Shard(p, k if m else None, d), engine.mask, params, sinks, engine.dims
  )
  inputs, targets, weights, segments = inputs_of(batch_BxL1)
  run_layers = None
  if engine.layer_stack is LayerStack.PREFETCH:
    run_layers = prefetch_layers(engine, final, acc)
  # The head's product and the cross-entropy tiled over the vocabulary (models/loss.py): no fp32
  # logits of the whole micro-batch, in forward or backward.
  ce_BxL = engine.model.token_losses(shards, inputs, targets, materialize, run_layers, segments)
  with jax.named_scope("loss"):  # its kernels' bytes are told apart by it (analysis/gpu/traffic)
    return jnp.mean(ce_BxL) if weights is None else weighted_sum(ce_BxL, weights)


def materializer(engine, wire: WireConfig | None = None):
  """The model's `materialize` hook: full weights of a subtree of Shards (a module's), gathered
  over S(P) just before use (`make_gather`: one bucket with the hand-written rings), each
  gradient reduce-scattered over S(Gr) into its Shard's sink. `wire`: the inter-node precision
  (default the engine's)."""
  s = engine.strategy
  gather = make_gather(
    s.param_gather_axes,
    s.grad_scatter_axes,
    engine.collectives,
    engine.wire if wire is None else wire,
    engine.grad_dtype,
    bits=engine.gather_bits,
  )

  def frozen(param, dim):  # a frozen LoRA base weight: gathered, no gradient
    (full,) = buckets.tree_all_gather(
      [lax.stop_gradient(param)],
      [dim % param.ndim],
      s.param_gather_axes,
      engine.collectives,
      bits=engine.gather_bits,
    )
    return to_varying(full, GLOBAL_AXES)

  def materialize(tree):
    shards, treedef = jax.tree.flatten(tree, is_leaf=is_shard)
    trained = [sh for sh in shards if sh.sink is not None]
    full = iter(
      gather(*(tuple(getattr(sh, f) for sh in trained) for f in ("param", "sink", "dim")))
      if trained
      else ()
    )
    return treedef.unflatten(
      [frozen(sh.param, sh.dim) if sh.sink is None else next(full) for sh in shards]
    )

  return materialize


def prefetch_layers(engine, final: bool = False, acc=None):
  """The model's `run_layers` hook for `LayerStack.PREFETCH`: the prefetching layer stack.

  `acc`: the stack's part of the accumulator (the layers' gradients of the earlier micro-batches,
  at Gr; None: none). The stack's backward adds each layer's gradient to it in place and hands
  back the sum as the sinks' gradient, so no second gradient buffer of the layer stack is held
  beside the accumulator. `final`: the last micro-batch's stack with `SYNC_IN_BACKWARD`. Its
  backward also syncs each layer's sum at once (`boundary_sync`); the sinks it fills are then at
  the OS placement."""
  s = engine.strategy
  return functools.partial(
    prefetch.run_layers,
    acc=acc,
    gather_axes=s.param_gather_axes,
    scatter_axes=s.grad_scatter_axes,
    impl=engine.collectives,
    wire=engine.wire,
    sync=functools.partial(boundary_sync, engine) if final else None,
    bucket=engine.bucket_layers,
    bits=engine.gather_bits,
  )


# --- phase 2 ------------------------------------------------------------------------------------
def grad_sync(engine, acc, residual):
  """The accumulated gradients synced to the OS placement, in fp32; (grads, new residual)."""
  with jax.named_scope("grad_sync"):  # in the accumulator's dtype (compute or fp32)
    if engine.error_feedback:
      grads, residual = feedback.boundary_sync(
        acc, engine.trained_dims, residual, engine.strategy, engine.collectives, engine.wire
      )
    elif engine.program is StepProgram.BOUNDARY_SYNC:
      grads = boundary_sync(engine, acc, engine.trained_dims)
    else:  # the layers' were synced in the last micro-batch's backward
      rest = {k: v for k, v in acc.items() if k != LAYERS}
      grads = boundary_sync(engine, rest, {k: engine.trained_dims[k] for k in rest})
      grads[LAYERS] = acc[LAYERS]
  return jax.tree.map(lambda g: g.astype(jnp.float32), grads), residual


def boundary_sync(engine, acc, dims):
  """The gradient sync at the accumulation boundary, of a tree of accumulated gradients at Gr:
  reduce-scatter over S(OS) minus S(Gr), all-reduce over the axes OS replicates."""
  s, impl, wire = engine.strategy, engine.collectives, engine.wire.grads_codec
  grads = buckets.tree_reduce_scatter(acc, dims, s.sync_scatter_axes, impl, wire)
  return buckets.tree_all_reduce(grads, s.sync_reduce_axes, impl, wire)


# --- phase 3 ------------------------------------------------------------------------------------
def optimizer(engine, master, opt_state, grads, loss, residual, new_residual):
  """AdamW on the OS shard, the gradients clipped by their global norm; a step whose loss or norm
  is not finite changes nothing. (master, opt_state, residual, grad_norm, weights): `weights`,
  the updated master in the compute dtype when the engine keeps that copy (`weights_copy`),
  written by the update's own kernels, else None."""
  with jax.named_scope("optimizer"):
    # Each OS shard is held by every device outside S(OS): sum squares over S(OS) only.
    local_sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    axes = engine.strategy.opt.axes
    grad_norm = jnp.sqrt(lax.psum(local_sq, axes) if axes else local_sq)
    clip = engine.optim.clip_norm
    scale = jnp.where(grad_norm < clip, 1.0, clip / grad_norm)
    updates, new_opt_state = engine.tx.update(
      jax.tree.map(lambda g: g * scale, grads), opt_state, master
    )
    # A step whose loss or gradient norm is NaN/Inf changes nothing (not even Adam's count). Both
    # are the same on every device (psum results), so every shard skips alike.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)
    master = jax.tree.map(keep, optax.apply_updates(master, updates), master)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    if engine.error_feedback:
      residual = keep(new_residual, residual)
    weights = None
    if engine.weights_copy:  # an extra output of the update's fusions, not a pass of its own
      weights = jax.tree.map(lambda w: w.astype(engine.compute_dtype), master)
  return master, opt_state, residual, grad_norm, weights


# --- the four together ----------------------------------------------------------------------------
def local_step(
  engine,
  master,
  opt_state,
  frozen,
  residual,
  reference,
  weights,
  batch_AxBxL1,
  *,
  targets_per_step,
):
  """Phases 0-3 on this device's shards; (master, opt_state, residual, reference, weights,
  loss, norm)."""
  with jax.named_scope("param_sync"):
    params, reference = param_sync(engine, master, frozen, reference, weights)
  acc, losses = micro_batches(engine, params, batch_AxBxL1, targets_per_step)
  grads, new_residual = grad_sync(engine, acc, residual)
  # Scalar metrics: not worth a ring; lax.psum is exact and cheap.
  loss = lax.psum(jnp.sum(losses), engine.strategy.data_axes)
  master, opt_state, residual, grad_norm, weights = optimizer(
    engine, master, opt_state, grads, loss, residual, new_residual
  )
  return master, opt_state, residual, reference, weights, loss, grad_norm
