"""One training step for all 14 strategies, derived from the three placement letters.

The step is a `shard_map` over the (inter, intra) mesh. Per optimizer step (docs/design.md):
  0. parameter sync: cast the fp32 master shard (OS placement) to the compute dtype and all-gather
     it over S(OS) minus S(P) to the P placement;
  1. for each of the A micro-batches (a `lax.scan`), forward and backward through the layer scan;
     each layer's weights are all-gathered over S(P) (with full remat, one layer ahead:
     `_make_prefetch_stack`) and gathered again in backward; each layer's gradient leaves
     backward reduce-scattered over S(Gr) (a `custom_vjp` routes it into a zero "gradient sink"
     of the Gr shape) and is accumulated;
  2. boundary sync: reduce-scatter over S(OS) minus S(Gr), all-reduce over the axes OS replicates
     (on GPUs the layers' share runs inside the last micro-batch's backward, each layer's as soon
     as its gradient is final: `sync_in_backward`);
  3. clip by the true global norm and apply optax AdamW to the OS shard.
Step 0 is the parameter sync of the previous step moved to the start of this one: the same traffic
once per step, and the P-placed copy never has to outlive the step.

With LoRA (`Llama(lora=...)`) only the adapters are trained: the frozen base weights are held once,
in the compute dtype, at the P placement (TrainState.frozen), gathered like the others but with no
gradient; master weights, gradients and optimizer states exist for the adapters alone. Trees of
trained or frozen leaves keep the full parameter structure with None for the other leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.llama import Llama, next_token_loss
from paro_jax.core import buckets
from paro_jax.core import collectives as comm
from paro_jax.core import feedback
from paro_jax.core.compress import WireConfig
from paro_jax.core.mesh import mesh_shape
from paro_jax.core.sharding import (
  ShardingRules,
  StateSpecs,
  local_shape,
  named,
  shard_dims,
  state_specs,
)
from paro_jax.core.names import (
  BATCH_AXES,
  GLOBAL_AXES,
  GRAD_DTYPES,
  MESH_AXES,
  check_batch_divides,
)
from paro_jax.core.strategy import Strategy

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

  def schedule(self):
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
      self.schedule(),
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
    lambda axes: len([a for a in axes if a != "layers"]) >= 2,
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


def split_trainable(tree, mask, trained: bool = True):
  """The leaves of `tree` where `mask` is `trained`; None in place of the others."""
  return jax.tree.map(lambda m, x: x if m == trained else None, mask, tree)


def join_trainable(mask, trained, frozen):
  """The full tree from its trained and frozen parts (as `split_trainable` splits it)."""
  return jax.tree.map(lambda m, a, b: a if m else b, mask, trained, frozen)


@flax.struct.dataclass
class Shard:
  """One parameter at its P placement, with the Gr-shaped sink its gradient is routed into."""

  param: jax.Array
  sink: jax.Array
  dim: int = flax.struct.field(pytree_node=False)  # sharded dimension, counted from the end


def _is_shard(x) -> bool:
  return isinstance(x, Shard)


class Engine:
  """Builds, for one model, strategy and mesh, the sharded state and the jitted training step."""

  def __init__(
    self,
    model: Llama,
    strategy: Strategy,
    mesh: Mesh,
    optim: OptimConfig,
    micro_batches: int = 1,
    collectives: str = "xla",
    rules: ShardingRules = ShardingRules(),
    wire: WireConfig = WireConfig(),
    grad_dtype: str = "compute",
    prefetch: bool = True,
    sync_in_backward: bool | None = None,
    error_feedback: bool | None = None,
    param_delta: bool | None = None,
  ):
    if grad_dtype not in GRAD_DTYPES:
      raise ValueError(f"unknown grad dtype {grad_dtype!r}; choose one of {GRAD_DTYPES}")
    if micro_batches < 1:
      raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if collectives not in comm.IMPLS:
      raise ValueError(f"unknown collectives {collectives!r}; choose one of {comm.IMPLS}")
    self.model, self.strategy, self.mesh, self.optim = model, strategy, mesh, optim
    self.micro_batches, self.collectives = micro_batches, collectives
    # Prefetching layer stack (`_make_prefetch_stack`): only with full remat, the default.
    self.prefetch = prefetch and model.remat == "full"
    # The layers' gradient sync inside the last micro-batch's backward (`_local_step`): with the
    # prefetching stack; by default on GPUs, where it can run beside the backward's compute.
    # XLA:CPU runs collectives in line, so there it would only add a second copy of the
    # micro-batch program to compile (tests turn it on to check it).
    if sync_in_backward is None:
      sync_in_backward = mesh.devices.flat[0].platform in ("gpu", "cuda")
    self.sync_in_backward = sync_in_backward and self.prefetch
    # Gradient accumulator and boundary reduction: the compute dtype or fp32 (--grad-dtype).
    self.grad_dtype = jnp.float32 if grad_dtype == "fp32" else model.dtype
    # Error feedback of the gradients' quantization (core/feedback.py; None: on with int8
    # gradients where it applies). It syncs at the boundary only, once per step.
    self.error_feedback, self.feedback_note = feedback.resolve(
      strategy, wire, self.grad_dtype, error_feedback
    )
    if self.error_feedback:
      self.sync_in_backward = False
    # int8 parameter syncs send each weight's change since the last sync (core/feedback.py).
    self.param_delta, self.param_delta_note = feedback.resolve_params(strategy, wire, param_delta)
    self.reference_bytes = 0  # set with the shapes below
    # XLA's collectives in the prefetching stack: one bucket per layer on GPUs, where the
    # scheduler overlaps one gather per layer better than nine (`_make_prefetch_stack`); per
    # leaf on XLA:CPU, where unpacking a bucket is a copy of the layer's weights.
    self.bucket_layers = mesh.devices.flat[0].platform in ("gpu", "cuda")
    self.compute_dtype = model.dtype
    self.wire = wire  # inter-node wire precision (paro_jax/core/compress.py)
    self.inter, self.intra = mesh_shape(mesh)
    self.logical = model.logical_axes()
    self.shapes = jax.eval_shape(model.init, jax.random.key(0))
    self.dims = shard_dims(self.logical, rules)
    self.specs = state_specs(self.shapes, self.dims, strategy, mesh)
    # Trained leaves (all, or the LoRA adapters) and, with LoRA, the frozen ones.
    self.mask = model.trainable_mask()
    self.lora = model.lora is not None
    self.trained_shapes, self.trained_dims = (
      split_trainable(self.shapes, self.mask),
      split_trainable(self.dims, self.mask),
    )
    self.trained_specs = StateSpecs(
      *(
        split_trainable(x, self.mask) for x in (self.specs.params, self.specs.grads, self.specs.opt)
      )
    )
    self.frozen_specs = split_trainable(self.specs.params, self.mask, False) if self.lora else None
    self.tx = optim.adamw(decay_mask(split_trainable(self.logical, self.mask)))
    opt_shapes = jax.eval_shape(self.tx.init, self.trained_shapes)
    # Moments follow the master weights (OS placement); scalars (the step count) are replicated.
    self.opt_specs = optax.tree_map_params(
      self.tx,
      lambda _, spec: spec,
      opt_shapes,
      self.trained_specs.opt,
      transform_non_params=lambda _: PartitionSpec(),
      is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    self.residual_spec = PartitionSpec(MESH_AXES) if self.error_feedback else None
    self.residual_size = 0
    if self.error_feedback:
      local = tuple(
        sum(
          math.prod(local_shape(t.shape, d, p.shard_count(self.inter, self.intra)))
          for t, d in zip(jax.tree.leaves(self.trained_shapes), jax.tree.leaves(self.trained_dims))
        )
        for p in (strategy.grads, strategy.opt)
      )
      self.residual_size = feedback.residual_size(strategy, local, self.inter, self.intra)
    self.reference_specs = self.trained_specs.params if self.param_delta else None
    if self.param_delta:
      self.reference_bytes = feedback.reference_bytes(
        strategy,
        model.trainable_count(),
        self.inter,
        self.intra,
        wire,
        jnp.dtype(self.compute_dtype).itemsize,
      )
    self.state_specs = TrainState(
      PartitionSpec(),
      self.trained_specs.opt,
      self.opt_specs,
      self.frozen_specs,
      self.residual_spec,
      self.reference_specs,
    )
    self.state_shardings = named(mesh, self.state_specs)
    self.batch_spec = PartitionSpec(None, BATCH_AXES, None)
    self.batch_sharding = NamedSharding(mesh, self.batch_spec)
    self.train_step = jax.jit(self._train_step, donate_argnums=0)
    self._eval_loss = jax.jit(self._eval_loss_fn)

  # --- state -------------------------------------------------------------------------------
  def init_state(self, rng) -> TrainState:
    """Initialise the master weights and optimizer state directly into their OS shards."""

    return jax.jit(
      lambda rng: self._fresh_state(self.model.init(rng)), out_shardings=self.state_shardings
    )(rng)

  def state_from_params(self, params) -> TrainState:
    """A fresh state (step 0, zero moments) from given fp32 parameters (all of them; with LoRA
    the adapters' included)."""
    return jax.jit(self._fresh_state, out_shardings=self.state_shardings)(params)

  def _fresh_state(self, params) -> TrainState:
    master = split_trainable(params, self.mask)
    frozen = None
    if self.lora:
      frozen = jax.tree.map(
        lambda w: w.astype(self.compute_dtype), split_trainable(params, self.mask, False)
      )
    residual = None
    if self.error_feedback:  # one vector per device, laid end to end
      residual = jnp.zeros((self.inter * self.intra * self.residual_size,), jnp.float32)
    reference = None
    if self.param_delta:  # the exact weights: the first sync sends the first step's change
      reference = jax.tree.map(lambda w: w.astype(self.compute_dtype), master)
    return TrainState(
      jnp.zeros((), jnp.int32), master, self.tx.init(master), frozen, residual, reference
    )

  def params(self, state: TrainState):
    """The compute-dtype parameters at their P placement (what the step holds while it runs)."""

    def sync(master):
      return jax.tree.map(
        lambda w, d: _gather_invariant(
          w.astype(self.compute_dtype), self.strategy.param_sync_axes, d
        ),
        master,
        self.trained_dims,
      )

    fn = jax.shard_map(
      sync, mesh=self.mesh, in_specs=(self.trained_specs.opt,), out_specs=self.trained_specs.params
    )
    trained = jax.jit(fn)(state.master)
    return join_trainable(self.mask, trained, state.frozen) if self.lora else trained

  def zero_grads(self):
    """A gradient accumulator at the Gr placement, as the step holds it between micro-batches
    (trained leaves only)."""
    shardings = named(self.mesh, self.trained_specs.grads)
    return jax.jit(
      lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, self.grad_dtype), self.trained_shapes),
      out_shardings=shardings,
    )()

  def check_batch_size(self, batch_size: int) -> None:
    check_batch_divides(batch_size, self.inter, self.intra)

  def shard_batch(self, tokens_AxBxL1, any_micro_batches: bool = False) -> jax.Array:
    """Place a global (A, B, L+1) token array (identical on every process) on the mesh.
    `any_micro_batches`: A need not be the step's (an eval batch of several step batches)."""
    A, B, _ = tokens_AxBxL1.shape
    if A != self.micro_batches and not any_micro_batches:
      raise ValueError(
        f"batch has {A} micro-batches, the engine was built for {self.micro_batches}"
      )
    self.check_batch_size(B)
    return jax.make_array_from_callback(
      tokens_AxBxL1.shape, self.batch_sharding, lambda idx: tokens_AxBxL1[idx]
    )

  def shard_local_batch(self, local_tokens, global_shape, any_micro_batches=False) -> jax.Array:
    """Place this process's rows of the global (A, B, L+1) batch (`Batches.process_rows`)."""
    if global_shape[0] != self.micro_batches and not any_micro_batches:
      raise ValueError(
        f"batch has {global_shape[0]} micro-batches, the engine was built for {self.micro_batches}"
      )
    self.check_batch_size(global_shape[1])
    return jax.make_array_from_process_local_data(
      self.batch_sharding, local_tokens, tuple(global_shape)
    )

  # --- evaluation --------------------------------------------------------------------------
  def eval_loss(self, state: TrainState, tokens_AxBxL1) -> jax.Array:
    """Mean next-token loss over a placed batch of any number of micro-batches, forward only,
    with the master weights in the compute dtype (gathered as the step gathers them, at full
    precision on every level)."""
    return self._eval_loss(state, tokens_AxBxL1)

  def _eval_loss_fn(self, state, tokens_AxBxL1):
    params = self.params(state)  # compute dtype, P placement
    # The exact weights, whatever the wire precision: eval scores the model the run trains (its
    # fp32 master), so runs with and without compressed traffic are compared on equal terms.
    materialize = self._materializer(WireConfig())

    def local_loss(params, tokens_AxBxL1):
      # Forward only: no gradient reaches the sink, so the parameter itself can stand in.
      shards = jax.tree.map(lambda p, d: Shard(p, p, d), params, self.dims)

      def micro_loss(_, tokens_BxL1):
        logits = self.model.apply(shards, tokens_BxL1[:, :-1], materialize)
        return None, next_token_loss(logits, tokens_BxL1[:, 1:])

      _, losses = lax.scan(micro_loss, None, tokens_AxBxL1)
      # Every device holds the same number of rows: the mean of the local means is the mean.
      return lax.psum(jnp.mean(losses), GLOBAL_AXES) / (self.inter * self.intra)

    return jax.shard_map(
      local_loss,
      mesh=self.mesh,
      in_specs=(self.specs.params, self.batch_spec),
      out_specs=PartitionSpec(),
      check_vma=self.collectives == "xla",  # the rings' replicated results: see _train_step
    )(params, tokens_AxBxL1)

  # --- the step ----------------------------------------------------------------------------
  def _materializer(self, wire: WireConfig | None = None):
    """The model's `materialize` hook: full weights of a subtree of Shards, each gathered over
    S(P) just before use, its gradient reduce-scattered over S(Gr) into the Shard's sink.
    `wire`: the inter-node precision (default the engine's)."""
    s = self.strategy
    gather = _make_gather(
      s.param_gather_axes,
      s.grad_scatter_axes,
      self.collectives,
      self.wire if wire is None else wire,
      self.grad_dtype,
    )

    def frozen(param, dim):  # a frozen LoRA base weight: gathered, no gradient
      full = comm.all_gather(
        lax.stop_gradient(param), s.param_gather_axes, dim=dim % param.ndim, impl=self.collectives
      )
      return comm.to_varying(full, GLOBAL_AXES)

    return lambda tree: jax.tree.map(
      lambda sh: frozen(sh.param, sh.dim) if sh.sink is None else gather(sh.param, sh.sink, sh.dim),
      tree,
      is_leaf=_is_shard,
    )

  def _layer_runner(self, final: bool = False, acc=None):
    """The model's `run_layers` hook: the prefetching layer stack with full remat (see
    `_make_prefetch_stack`), or None for the model's own scan (remat "layer" or "none", or
    `prefetch=False`), where each layer gathers its weights through `_materializer` as it runs.

    `acc`: the stack's part of the accumulator (the layers' gradients of the earlier
    micro-batches, at Gr; None: none). The stack's backward adds each layer's gradient to it in
    place and hands back the sum as the sinks' gradient, so no second gradient buffer of the
    layer stack is held beside the accumulator.
    `final`: the last micro-batch's stack. Its backward also syncs each layer's sum at once
    (`_boundary_sync`); the sinks it fills are then at the OS placement."""
    if not self.prefetch:
      return None
    s = self.strategy
    stack = _make_prefetch_stack(
      s.param_gather_axes,
      s.grad_scatter_axes,
      self.collectives,
      self.wire,
      sync=self._boundary_sync if final else None,
      bucket=self.bucket_layers,
    )
    return functools.partial(stack, acc=acc)

  def _boundary_sync(self, acc, dims):
    """The gradient sync at the accumulation boundary, of a tree of accumulated gradients at Gr:
    reduce-scatter over S(OS) minus S(Gr), all-reduce over the axes OS replicates."""
    s, impl, wire = self.strategy, self.collectives, self.wire.grads_codec
    grads = buckets.tree_reduce_scatter(acc, dims, s.sync_scatter_axes, impl, wire)
    return buckets.tree_all_reduce(grads, s.sync_reduce_axes, impl, wire)

  def _train_step(self, state: TrainState, tokens_AxBxL1):
    # Hand-written ppermute rings give replicated results typed "varying"; JAX has no
    # varying->invariant cast, so the replication of their outputs cannot be checked. The lax
    # collectives keep check_vma on, and the tests check the rings against them.
    check_vma = self.collectives == "xla"
    step_fn = jax.shard_map(
      functools.partial(self._local_step, tokens_per_step=tokens_AxBxL1[..., 1:].size),
      mesh=self.mesh,
      in_specs=(
        self.trained_specs.opt,
        self.opt_specs,
        self.frozen_specs,
        self.residual_spec,
        self.reference_specs,
        self.batch_spec,
      ),
      out_specs=(
        self.trained_specs.opt,
        self.opt_specs,
        self.residual_spec,
        self.reference_specs,
        PartitionSpec(),
        PartitionSpec(),
      ),
      check_vma=check_vma,
    )
    master, opt_state, residual, reference, loss, grad_norm = step_fn(
      state.master, state.opt_state, state.frozen, state.residual, state.reference, tokens_AxBxL1
    )
    metrics = {"loss": loss, "grad_norm": grad_norm}
    new = TrainState(state.step + 1, master, opt_state, state.frozen, residual, reference)
    return new, metrics

  def _sinks(self, synced: bool = False):
    """Zero gradient sinks at the Gr placement, trained leaves only (inside the shard_map), typed
    varying over every axis. `synced`: at the OS placement, for gradients synced at the
    boundary, typed varying over the axes OS shards (the all-reduce leaves them invariant over
    the others)."""
    placement = self.strategy.opt if synced else self.strategy.grads
    ways = placement.shard_count(self.inter, self.intra)
    axes = placement.axes if synced else GLOBAL_AXES

    def sink_like(shape_struct, dim):
      zeros = jnp.zeros(local_shape(shape_struct.shape, dim, ways), self.grad_dtype)
      return comm.to_varying(zeros, axes)

    return jax.tree.map(sink_like, self.trained_shapes, self.trained_dims)

  def _micro_loss(self, params, sinks, tokens_BxL1, materialize, run_layers):
    """This device's mean next-token loss on its rows of a micro-batch, from the P-placed
    parameters; differentiated with respect to the sinks, it gives the gradients at Gr."""
    # Frozen leaves get no sink (None): they are gathered without a gradient.
    shards = jax.tree.map(
      lambda m, p, k, d: Shard(p, k if m else None, d), self.mask, params, sinks, self.dims
    )
    logits = self.model.apply(shards, tokens_BxL1[:, :-1], materialize, run_layers)
    return next_token_loss(logits, tokens_BxL1[:, 1:])

  def _local_step(
    self, master, opt_state, frozen, residual, reference, tokens_AxBxL1, *, tokens_per_step
  ):
    s, impl, compute_dtype = self.strategy, self.collectives, self.compute_dtype
    materialize = self._materializer()

    with jax.named_scope("param_sync"):
      # Each leaf gathered as its own flat bucket, with every implementation. One bucket of the
      # whole model keeps every chunk of the gathered buffer alive beside the unpacked leaves
      # (7b NGG on 2x4 H100 with HO-Ring: 33% above the plan). And XLA's all-gather of a leaf
      # along its sharded dimension returns it in a layout with that dimension major; the layer
      # loops want the default one, so XLA kept the gathered leaf for the whole step and made a
      # transposed copy for each user of it (the micro-batch loop and the last micro-batch, with
      # sync_in_backward): one more copy of the parameters (7b NGG with XLA's collectives: 44%
      # above the plan; NII, NIG: 30%). A flat bucket is unpacked by a fusion whose layout XLA
      # picks for its users, and the gathered buffer dies there. Same bytes either way.
      if self.param_delta:
        params = feedback.delta_param_sync(
          master, reference, self.trained_dims, s.param_sync_axes, impl, self.wire, compute_dtype
        )
        reference = params
      else:
        params = jax.tree.map(
          lambda w, dim: buckets.all_gather_bucket(
            [w.astype(compute_dtype)], s.param_sync_axes, [dim], impl, wire=self.wire.params_codec
          )[0],
          master,
          self.trained_dims,
        )
      if self.lora:  # the frozen base is already at P, in the compute dtype
        params = join_trainable(self.mask, params, frozen)

    sinks = self._sinks()

    def micro_grads(tokens_BxL1, sinks, run_layers, after=None):
      # Tie the parameters to this micro-batch: otherwise XLA hoists the loop-invariant gathers
      # (embedding, head) out of the micro-batch loop and keeps their full copies alive for the
      # whole step, which is not the schedule (nor the memory) the strategy promises. `after`
      # (the accumulated gradients of the earlier micro-batches) ties the last micro-batch to
      # them too: otherwise XLA may run its forward before the earlier backward, with two
      # micro-batches' activations alive at once (7b IGG on 2x4 H100: 18% above the plan).
      params_mb, _ = lax.optimization_barrier((params, (tokens_BxL1, after)))

      def loss_fn(sinks):
        # Each device's share of the step's mean loss: summed over devices and micro-batches
        # it is the mean over all tokens of the step.
        return self._micro_loss(params_mb, sinks, tokens_BxL1, materialize, run_layers) * (
          tokens_BxL1[:, 1:].size / tokens_per_step
        )

      return jax.value_and_grad(loss_fn)(sinks)

    def micro_step(acc, tokens_BxL1):
      run_layers = self._layer_runner(acc=acc["layers"])
      loss, grads = micro_grads(tokens_BxL1, sinks, run_layers)
      if run_layers is None:  # the model's own layer scan
        return jax.tree.map(jnp.add, acc, grads), loss
      # The prefetching stack adds its layers' gradients into the accumulator itself.
      rest = {k: jax.tree.map(jnp.add, acc[k], grads[k]) for k in acc if k != "layers"}
      return {**rest, "layers": grads["layers"]}, loss

    A = tokens_AxBxL1.shape[0]
    if not self.sync_in_backward:
      with jax.named_scope("micro_batches"):
        acc, losses = lax.scan(micro_step, sinks, tokens_AxBxL1)
      with jax.named_scope("grad_sync"):  # in the accumulator's dtype (compute or fp32)
        if self.error_feedback:
          grads, new_residual = feedback.boundary_sync(
            acc, self.trained_dims, residual, s, impl, self.wire
          )
        else:
          grads = self._boundary_sync(acc, self.trained_dims)
    else:
      # The layers' gradients are synced inside the last micro-batch's backward, each as soon
      # as it is final (the last layer's first), beside the backward of the layers below it;
      # only the embedding's and the head's wait for the end. Same sums in the same order.
      with jax.named_scope("micro_batches"):
        acc, losses = sinks, jnp.zeros((0,), jnp.float32)
        if A > 1:
          acc, losses = lax.scan(micro_step, sinks, tokens_AxBxL1[:-1])
        final = {**sinks, "layers": self._sinks(synced=True)["layers"]}
        last_run = self._layer_runner(final=True, acc=acc["layers"] if A > 1 else None)
        loss, last = micro_grads(tokens_AxBxL1[-1], final, last_run, acc if A > 1 else None)
        losses = jnp.concatenate([losses, loss[None]])
      with jax.named_scope("grad_sync"):
        rest = {k: v for k, v in acc.items() if k != "layers"}
        rest = jax.tree.map(jnp.add, rest, {k: last[k] for k in rest})
        grads = self._boundary_sync(rest, {k: self.trained_dims[k] for k in rest})
        grads["layers"] = last["layers"]
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    # Scalar metrics: not worth a ring; lax.psum is exact and cheap.
    loss = lax.psum(jnp.sum(losses), GLOBAL_AXES)

    with jax.named_scope("optimizer"):
      # Each OS shard is held by every device outside S(OS): sum squares over S(OS) only.
      local_sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
      grad_norm = jnp.sqrt(lax.psum(local_sq, s.opt.axes) if s.opt.axes else local_sq)
      scale = jnp.where(grad_norm < self.optim.clip_norm, 1.0, self.optim.clip_norm / grad_norm)
      updates, new_opt_state = self.tx.update(
        jax.tree.map(lambda g: g * scale, grads), opt_state, master
      )
      # A step whose loss or gradient norm is NaN/Inf changes nothing (not even Adam's count).
      # Both are the same on every device (psum results), so every shard skips alike.
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      keep = lambda new, old: jnp.where(finite, new, old)
      master = jax.tree.map(keep, optax.apply_updates(master, updates), master)
      opt_state = jax.tree.map(keep, new_opt_state, opt_state)
      if self.error_feedback:
        residual = keep(new_residual, residual)

    return master, opt_state, residual, reference, loss, grad_norm


def _gather_invariant(x, axes, dim):
  """All-gather typed as replicated over `axes` (for results that leave the shard_map)."""
  return lax.all_gather(x, axes, axis=dim % x.ndim, tiled=True, to="invarying") if axes else x


def _make_gather(gather_axes, scatter_axes, impl, wire=WireConfig(), grad_dtype=None):
  """Per-layer weight gather over S(P) whose backward reduce-scatters over S(Gr) into the sink.

  The reduce-scatter runs in the compute dtype; its result is cast to the sink's (`grad_dtype`),
  where it is accumulated. Both collectives carry `wire`'s precision on their inter level."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
  def gather(param, sink, dim):
    del sink  # only receives the gradient
    full = comm.all_gather(
      param, gather_axes, dim=dim % param.ndim, impl=impl, wire=wire.params_codec
    )
    return comm.to_varying(full, GLOBAL_AXES)

  def fwd(param, sink, dim):
    return gather(param, sink, dim), None

  def bwd(dim, _, ct):
    g = comm.reduce_scatter(ct, scatter_axes, dim=dim % ct.ndim, impl=impl, wire=wire.grads_codec)
    return None, g.astype(grad_dtype or ct.dtype)

  gather.defvjp(fwd, bwd)
  return gather


def _make_prefetch_stack(
  gather_axes, scatter_axes, impl, wire=WireConfig(), sync=None, bucket: bool = True
):
  """The layer stack as one `custom_vjp` that prefetches, as FSDP does (the model's `run_layers`).

  Per layer the traffic is today's: its weights all-gathered over S(P) in forward and again in
  backward (full remat), its gradient reduce-scattered over S(Gr) into the sink. What changes is
  *when* they are issued, so that XLA's latency-hiding scheduler can run them beside compute:

  * forward: the gather of layer i+1 is issued in the iteration that computes layer i (its result
    is only carried to the next iteration, so it does not wait for layer i and layer i does not
    wait for it);
  * backward, iteration i (layers in reverse): the re-gather of layer i-1 (prefetch) and the
    reduce-scatter of layer i+1's gradient (deferred one iteration) are issued beside the
    recompute and backward of layer i.

  The first and last iterations are peeled out of the loops, so no collective is issued twice or
  for nothing: the bytes per step are exactly the formula's. The price is memory: two layers of
  full weights alive in forward (this one and the next), and in backward two layers of weights
  plus one full layer gradient waiting for its reduce-scatter. A per-layer `custom_vjp` gather
  under `jax.checkpoint` (the model's own scan) cannot express this: its collectives are tied to
  the layer whose iteration uses them, so XLA can only run them before or after that layer's
  compute, never beside it.

  With `sync` (the last micro-batch of a step), each layer's reduce-scattered gradient is added
  to `acc` (`run_layers`' argument: the layers' gradients accumulated over the earlier
  micro-batches, at Gr; None: none) and synced at once by `sync(tree, dims)`, the accumulation
  boundary's collectives: the layer's final gradient, at the OS placement (the sinks' then),
  leaves while the layers below it still run their backward.

  Residuals are what full remat keeps: each layer's input activation, plus the P-placed shards
  (inputs anyway). Gradients: the sinks' are the reduce-scattered per-layer gradients at
  placement Gr; the P-placed parameters get none. Frozen (LoRA base) leaves, the Shards with no
  sink, are gathered but never differentiated nor reduce-scattered: backward takes the vjp with
  respect to the activation and the trained leaves only.
  """

  # A layer's leaves travel as one bucket (core/buckets.py): with the hand-written rings always,
  # one chain of ring steps per layer rather than one per leaf, so that every HO-Ring step is a
  # single intra and a single inter transfer; with XLA's collectives if `bucket` (on GPUs), one
  # gather and one reduce-scatter per layer. Per leaf, XLA kept nine collectives per layer loop
  # body apart, and its scheduler left some of the backward's re-gathers with no matmul beside
  # them (7b IIG on 2x4 H100: 89% of the per-micro-batch bytes beside compute; bucketed: 95%).
  def gather(trees, dims):
    """All-gather the leaves of several trees over S(P) (one bucket: rings, or `bucket`)."""
    full = buckets.tree_all_gather(
      trees, dims, gather_axes, impl, wire=wire.params_codec, bucket=bucket
    )
    return jax.tree.map(lambda w: comm.to_varying(w, GLOBAL_AXES), full)

  def scatter(tree, dims):
    return buckets.tree_reduce_scatter(
      tree, dims, scatter_axes, impl, wire=wire.grads_codec, bucket=bucket
    )

  def run_layers(block_fn, x, shards, acc=None):
    fields = lambda f: jax.tree.map(f, shards, is_leaf=_is_shard)
    mask = fields(lambda sh: sh.sink is not None)
    params, dims = fields(lambda sh: sh.param), fields(lambda sh: sh.dim)
    sinks = split_trainable(fields(lambda sh: sh.sink), mask)
    dims_t, dims_f = split_trainable(dims, mask), split_trainable(dims, mask, False)
    sink_types = jax.tree.map(lambda k: jax.ShapeDtypeStruct(k.shape, k.dtype), sinks)
    sink_axes = jax.tree.map(comm.varying_axes, sinks)  # how the sinks are typed (check_vma)
    n = jax.tree.leaves(params)[0].shape[0]

    def layer(tree, i):  # layer i of a stacked tree; i static or traced
      return jax.tree.map(lambda p: lax.dynamic_index_in_dim(p, i, keepdims=False), tree)

    def gather_layer(trained, frozen, i):
      return gather((layer(trained, i), layer(frozen, i)), (dims_t, dims_f))

    def block(x, w):
      return block_fn(x, join_trainable(mask, *w))

    def forward(x, trained, frozen):
      # The input of every layer, saved for backward (as full remat saves it), written in place.
      # One buffer of n rows rather than the scan's n-1 outputs and the last input apart: a
      # row of it is then picked with an index XLA cannot fold (`after` in backward).
      xs = lax.dynamic_update_index_in_dim(jnp.zeros((n, *x.shape), x.dtype), x, 0, 0)
      with jax.named_scope("layer_gather"):
        w = gather_layer(trained, frozen, 0)
      if n > 1:

        def body(carry, i):
          x, w, xs = carry
          with jax.named_scope("layer_gather"):  # prefetch: used by the next iteration
            w_next = gather_layer(trained, frozen, i + 1)
          x = block(x, w)
          return (x, w_next, lax.dynamic_update_index_in_dim(xs, x, i + 1, 0)), None

        (x, w, xs), _ = lax.scan(body, (x, w, xs), jnp.arange(n - 1))
      return block(x, w), xs

    def backward(xs, trained, frozen, acc, ct):
      def after(i, ct):
        """i, as an index XLA cannot constant-fold: it depends on the cotangent `ct` at run time
        (and is i whatever ct holds). What is indexed with it is computed after `ct`, as
        jax.checkpoint ties its recomputation to backward (with an optimization barrier, which
        XLA:CPU expands before its last CSE pass and its scheduler, so it does not hold here).

        Used for each layer's re-gather: where the index would be a constant (the peeled
        iterations; a loop of one trip, which XLA inlines), the gather would be the same
        instruction on the same operand as forward's gather of that layer, and XLA would merge
        them (CSE): one gather fewer than the schedule, the full weights alive from forward to
        backward. And for each layer's saved input: otherwise XLA may recompute a peeled layer
        beside the backward of the layer above it, with both layers' activations alive."""
        x = ct.reshape(-1)[0]
        return jnp.minimum(i, n - 1 + (x != x).astype(jnp.int32))  # x != x: only for NaN

      def regather(i, ct):
        with jax.named_scope("layer_regather"):
          return gather_layer(trained, frozen, after(i, ct))

      def saved_input(i, ct):
        return lax.dynamic_index_in_dim(xs, after(i, ct), keepdims=False)

      # The gradient buffers hold one flat row per layer ([n, size]), written row by row, so
      # they keep the default layout. Shaped [n, ...], a leaf's buffer was laid out the way the
      # layer's gradient leaves its matmul (dimensions transposed), and XLA transposed the whole
      # stack into the default layout at the end: a second copy of it (7b ING on 2x4 H100).
      def flat(tree):
        return jax.tree.map(lambda a: a.reshape(a.shape[0], -1), tree)

      def unflat(tree):
        return jax.tree.map(lambda b, t: b.reshape(t.shape), tree, sink_types)

      acc_rows = None if acc is None else flat(acc)

      def scatter_into(gbuf, i, g):
        with jax.named_scope("layer_grad_scatter"):
          g = scatter(g, dims_t)
        # Reduced in the compute dtype, accumulated in the sink's (compute or fp32).
        g = jax.tree.map(lambda b, g: g.astype(b.dtype), gbuf, g)
        if acc is not None:  # the earlier micro-batches' sum: in gbuf itself unless syncing
          rows = acc_rows if sync is not None else gbuf
          g = jax.tree.map(lambda r, g: jnp.add(layer(r, i).reshape(g.shape), g), rows, g)
        if sync is not None:
          with jax.named_scope("layer_grad_sync"):
            g = sync(g, dims_t)
        return jax.tree.map(
          lambda b, g: lax.dynamic_update_index_in_dim(b, g.reshape(-1), i, 0), gbuf, g
        )

      def layer_vjp(x, w, ct):  # recompute layer forward, then its backward
        w_t, w_f = w
        _, vjp = jax.vjp(lambda x, w_t: block(x, (w_t, w_f)), x, w_t)
        return vjp(ct)

      if acc is not None and sync is None:  # accumulate in place: gbuf is the accumulator
        gbuf = acc
      else:
        gbuf = jax.tree.map(
          lambda t, axes: comm.to_varying(jnp.zeros(t.shape, t.dtype), tuple(axes)),
          sink_types,
          sink_axes,
        )
      gbuf = flat(gbuf)
      w = regather(n - 1, ct)
      if n == 1:
        ct, g = layer_vjp(saved_input(0, ct), w, ct)
        return ct, unflat(scatter_into(gbuf, 0, g))
      w_prev = regather(n - 2, ct)
      ct, g = layer_vjp(saved_input(n - 1, ct), w, ct)
      carry = (ct, w_prev, g, gbuf)  # g: the full gradient of layer i+1, not yet scattered
      if n > 2:

        def body(carry, i):  # layer i, from n-2 down to 1
          ct, w, g_next, gbuf = carry
          w_prev = regather(i - 1, ct)
          gbuf = scatter_into(gbuf, i + 1, g_next)
          ct, g = layer_vjp(saved_input(i, ct), w, ct)
          return (ct, w_prev, g, gbuf), None

        carry, _ = lax.scan(body, carry, jnp.arange(1, n - 1), reverse=True)
      ct, w, g_next, gbuf = carry
      gbuf = scatter_into(gbuf, 1, g_next)
      ct, g = layer_vjp(saved_input(0, ct), w, ct)
      return ct, unflat(scatter_into(gbuf, 0, g))

    @jax.custom_vjp
    def stack(x, trained, frozen, sinks, acc):
      del sinks, acc  # only receive the gradients; only used by them
      return forward(x, trained, frozen)[0]

    def stack_fwd(x, trained, frozen, sinks, acc):
      y, xs = forward(x, trained, frozen)
      return y, (xs, trained, frozen, acc)

    def stack_bwd(res, ct_y):
      ct_x, grads = backward(*res, ct_y)
      return ct_x, None, None, grads, None

    stack.defvjp(stack_fwd, stack_bwd)
    trained, frozen = split_trainable(params, mask), split_trainable(params, mask, False)
    return stack(x, trained, frozen, sinks, acc)

  return run_layers
