"""The Engine: for one model, strategy and mesh, the sharded training state and the jitted step.

The step is a `shard_map` over the (inter, intra) mesh whose body is paro_jax/core/step.py, four
phases derived from the three placement letters (docs/design.md, "Schedule of one optimizer
step"): 0 parameter sync, 1 micro-batches, 2 gradient sync, 3 optimizer. The Engine holds what
they need: the strategy's shardings, the optimizer, the wire precision, and the choices made for
the platform (`program`, `bucket_layers`), which `paro-jax inspect` prints.

With LoRA (`Llama(lora=...)`) only the adapters are trained: the frozen base weights are held once,
in the compute dtype, at the P placement (TrainState.frozen), gathered like the others but with no
gradient; master weights, gradients and optimizer states exist for the adapters alone.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.llama import Llama
from paro_jax.core import collectives as comm
from paro_jax.core import feedback_rules, step
from paro_jax.core.batch import Batch
from paro_jax.core.wire import WireConfig
from paro_jax.core.forward import Forward
from paro_jax.core.mesh import mesh_shape
from paro_jax.core.names import (
  BATCH_AXES,
  GRAD_DTYPES,
  MESH_AXES,
  check_batch_divides,
)
from paro_jax.core.sharding import (
  ShardingRules,
  StateSpecs,
  local_shape,
  named,
  shard_dims,
  state_specs,
)
from paro_jax.core.shards import gather_invariant, join_trainable, split_trainable
from paro_jax.core.step import LayerStack, StepProgram
from paro_jax.core.state import OptimConfig, TrainState, decay_mask
from paro_jax.core.strategy import Strategy
from paro_jax.core.xla_flags import bf16_weights_options, cpu_gathers_as_bits


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
    program: StepProgram | None = None,
    error_feedback: bool | None = None,
    param_delta: bool | None = None,
    weights_copy: bool | None = None,
  ):
    if grad_dtype not in GRAD_DTYPES:
      raise ValueError(f"unknown grad dtype {grad_dtype!r}; choose one of {GRAD_DTYPES}")
    if micro_batches < 1:
      raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if collectives not in comm.IMPLS:
      raise ValueError(f"unknown collectives {collectives!r}; choose one of {comm.IMPLS}")
    self.model, self.strategy, self.mesh, self.optim = model, strategy, mesh, optim
    self.micro_batches, self.collectives = micro_batches, collectives
    # The prefetching layer stack (core/prefetch.py): only with full remat, the default.
    self.layer_stack = (
      LayerStack.PREFETCH if prefetch and model.remat == "full" else LayerStack.MODEL_SCAN
    )
    # Gradient accumulator and boundary reduction: the compute dtype or fp32 (--grad-dtype).
    self.grad_dtype = jnp.float32 if grad_dtype == "fp32" else model.dtype
    # Error feedback of the gradients' quantization (core/feedback.py; None: on with int8
    # gradients where it applies). It syncs at the boundary only, once per step.
    self.error_feedback, self.feedback_note = feedback_rules.resolve(
      strategy, wire, self.grad_dtype, error_feedback
    )
    # int8 parameter syncs send each weight's change since the last sync (core/feedback.py).
    self.param_delta, self.param_delta_note = feedback_rules.resolve_params(
      strategy, wire, param_delta
    )
    self.reference_bytes = 0  # set with the shapes below
    # The platform's choices, made here only. `program` (core/step.py; `paro-jax inspect` prints
    # it; the argument None: the platform's): the layers' gradient sync inside the last
    # micro-batch's backward on GPUs, which run it beside the backward's compute. XLA:CPU runs
    # collectives in line, so there it would only add a second copy of the micro-batch program
    # to compile (the tests force it to check it). It needs the prefetching stack, and error
    # feedback syncs at the boundary only.
    # `bucket_layers`: the prefetching stack's XLA collectives one bucket per layer on GPUs across
    # nodes, where the scheduler overlaps one gather per layer better than nine
    # (core/prefetch.py); per leaf on XLA:CPU, where unpacking a bucket is a copy of the layer's
    # weights, and on GPUs of one node (below).
    on_gpu = mesh.devices.flat[0].platform in ("gpu", "cuda")
    if program is None:
      program = StepProgram.SYNC_IN_BACKWARD if on_gpu else StepProgram.BOUNDARY_SYNC
    if self.layer_stack is not LayerStack.PREFETCH or self.error_feedback:
      program = StepProgram.BOUNDARY_SYNC
    self.program = program
    self.inter, self.intra = mesh_shape(mesh)
    # On one node per leaf: unpacking a layer's bucket copies the layer's weights (and packing
    # its gradient copies that), and there the scheduler overlaps the per-leaf collectives as
    # well (7b with 4 layers, IIG on 1x8 H100, A=1: 73% of the per-micro-batch bytes beside
    # compute in buckets, 81% per leaf; 26.8 GB of non-matmul traffic per GPU, 19.6 per leaf).
    # Across nodes per leaf loses overlap (7b IIG on 2x4, A=2: 95% in buckets, 89% per leaf,
    # 92% with XLA's combiners merging them), so buckets stay there.
    self.bucket_layers = on_gpu and self.inter > 1
    # `weights_copy` (None: the platform's): the optimizer also writes the updated master shard
    # in the compute dtype, kept in the state (2 bytes per parameter of the OS shard), so that
    # the next parameter sync gathers it without a cast pass of its own (which reads the fp32
    # master and writes the copy: 6 bytes per parameter, 4 more than the optimizer's extra
    # write). On GPUs, where that pass is HBM traffic (7b with 4 layers on one H100: 6.4 GB per
    # step); not with the delta sync, which sends the master's changes (core/feedback.py).
    if weights_copy is None:
      weights_copy = on_gpu
    self.weights_copy = bool(weights_copy) and not self.param_delta
    self.compute_dtype = model.dtype
    self.wire = wire  # inter-node wire precision (paro_jax/core/compress.py)
    # A LoRA step's weight gathers as their bits on XLA:CPU (core/xla_flags.py says why); not
    # where the inter wire compresses the weights (an int8 codec quantizes floats only).
    self.gather_bits = (
      model.lora is not None
      and cpu_gathers_as_bits(mesh)
      and not wire.params_codec.active_for(self.compute_dtype)
    )
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
      self.residual_size = feedback_rules.residual_size(strategy, local, self.inter, self.intra)
    self.reference_specs = self.trained_specs.params if self.param_delta else None
    if self.param_delta:
      self.reference_bytes = feedback_rules.reference_bytes(
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
      self.trained_specs.opt if self.weights_copy else None,
    )
    self.state_shardings = named(mesh, self.state_specs)
    # Every parameter at its P placement (what a forward holds: eval's weights).
    self.param_shardings = named(mesh, self.specs.params)
    self.batch_spec = PartitionSpec(None, BATCH_AXES, None)
    self.batch_sharding = NamedSharding(mesh, self.batch_spec)
    options = bf16_weights_options(mesh) if self.lora else None  # a frozen base in bf16
    self.train_step = jax.jit(self._train_step, donate_argnums=0, compiler_options=options)
    self.forward = Forward(self)

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

  def state_from_master(self, master, frozen=None) -> TrainState:
    """A fresh state around master weights already at their OS placement in fp32 and, with
    LoRA, the frozen base already at P in the compute dtype (`paro_jax/hf/stream.py` places
    them so, from an HF directory): both are donated, not copied; the rest (zero moments, the
    step) is made in place, so no device ever holds a whole parameter tree."""
    return jax.jit(self._around, out_shardings=self.state_shardings, donate_argnums=(0, 1))(
      master, frozen
    )

  def fresh_adapters(self, rng):
    """With LoRA: the adapters as `init_state(rng)` draws them, made at their OS placement (the
    base weights the same init would draw are never computed: nothing uses them)."""
    return jax.jit(
      lambda rng: split_trainable(self.model.init(rng), self.mask),
      out_shardings=self.state_shardings.master,
    )(rng)

  def _fresh_state(self, params) -> TrainState:
    master = split_trainable(params, self.mask)
    frozen = None
    if self.lora:
      frozen = jax.tree.map(
        lambda w: w.astype(self.compute_dtype), split_trainable(params, self.mask, False)
      )
    return self._around(master, frozen)

  def _around(self, master, frozen) -> TrainState:
    """Step 0's state around its master weights (and frozen base): zero moments and the buffers
    this engine's options add."""
    residual = None
    if self.error_feedback:  # one vector per device, laid end to end
      residual = jnp.zeros((self.inter * self.intra * self.residual_size,), jnp.float32)
    reference = None
    if self.param_delta:  # the exact weights: the first sync sends the first step's change
      reference = jax.tree.map(lambda w: w.astype(self.compute_dtype), master)
    return TrainState(
      jnp.zeros((), jnp.int32),
      master,
      self.tx.init(master),
      frozen,
      residual,
      reference,
      self._weights_of(master),
    )

  def _weights_of(self, master):
    """The state's compute-dtype copy of `master` (None without `weights_copy`)."""
    if not self.weights_copy:
      return None
    return jax.tree.map(lambda w: w.astype(self.compute_dtype), master)

  def with_weights(self, state: TrainState) -> TrainState:
    """`state` with its compute-dtype copy of the master written from the master (a restored
    state: checkpoints do not hold the copy)."""
    if not self.weights_copy:
      return state._replace(weights=None)
    weights = jax.jit(self._weights_of, out_shardings=self.state_shardings.weights)(state.master)
    return state._replace(weights=weights)

  def params(self, state: TrainState):
    """The compute-dtype parameters at their P placement (what the step holds while it runs)."""
    trained = self._sync_params(state.master)
    if not self.lora:
      return trained
    # A frozen base read as a checkpoint wrote it (eval of a bf16 run in fp32) is cast here.
    frozen = jax.tree.map(lambda w: w.astype(self.compute_dtype), state.frozen)
    return join_trainable(self.mask, trained, frozen)

  @functools.cached_property
  def _sync_params(self):
    """The parameter sync alone, compiled once: the master cast and gathered to P."""

    def sync(master):
      return jax.tree.map(
        lambda w, d: gather_invariant(
          w.astype(self.compute_dtype), self.strategy.param_sync_axes, d
        ),
        master,
        self.trained_dims,
      )

    return jax.jit(
      jax.shard_map(
        sync,
        mesh=self.mesh,
        in_specs=(self.trained_specs.opt,),
        out_specs=self.trained_specs.params,
      )
    )

  def check_batch_size(self, batch_size: int) -> None:
    check_batch_divides(batch_size, self.inter, self.intra)

  def shard_batch(self, batch_AxBxL1, any_micro_batches: bool = False):
    """Place a global (A, B, L+1) token array, or a Batch of such rows (identical on every
    process), on the mesh. `any_micro_batches`: A need not be the step's (an eval batch of
    several step batches)."""
    A, B, _ = batch_AxBxL1.shape
    if A != self.micro_batches and not any_micro_batches:
      raise ValueError(
        f"batch has {A} micro-batches, the engine was built for {self.micro_batches}"
      )
    self.check_batch_size(B)
    return jax.tree.map(
      lambda x: jax.make_array_from_callback(x.shape, self.batch_sharding, lambda idx: x[idx]),
      batch_AxBxL1,
    )

  def shard_local_batch(self, local_batch, global_shape, any_micro_batches=False):
    """Place this process's rows of the global (A, B, L+1) batch (`Batches.process_rows`), an
    array or a Batch; `global_shape` is the tokens'."""
    if global_shape[0] != self.micro_batches and not any_micro_batches:
      raise ValueError(
        f"batch has {global_shape[0]} micro-batches, the engine was built for {self.micro_batches}"
      )
    self.check_batch_size(global_shape[1])
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
        self.batch_sharding, x, (*global_shape[:2], x.shape[2])
      ),
      local_batch,
    )

  # --- evaluation: forward only, core/forward.py -------------------------------------------
  def eval_loss(self, state: TrainState, batch_AxBxL1) -> jax.Array:
    """Mean next-token loss over a placed batch (for a Batch, over its counted targets), with the
    master weights in the compute dtype at the P placement: `Forward.loss` of `params(state)`."""
    return self.forward.loss(self.params(state), batch_AxBxL1)

  def _train_step(self, state: TrainState, batch_AxBxL1):
    # Hand-written ppermute rings give replicated results typed "varying"; JAX has no
    # varying->invariant cast, so the replication of their outputs cannot be checked. The lax
    # collectives keep check_vma on, and the tests check the rings against them.
    check_vma = self.collectives == "xla"
    # The step's loss is the mean over its targets: all tokens but each row's first in a token
    # stream (known when tracing); for a Batch, the count of its weights over every row, the same
    # on every device.
    if isinstance(batch_AxBxL1, Batch):
      targets = jnp.maximum(jnp.sum(batch_AxBxL1.weights), 1)
      body = lambda *args: step.local_step(self, *args[:-1], targets_per_step=args[-1])
      extra, extra_specs = (targets,), (PartitionSpec(),)
    else:
      targets = batch_AxBxL1[..., 1:].size
      body = functools.partial(step.local_step, self, targets_per_step=targets)
      extra, extra_specs = (), ()
    step_fn = jax.shard_map(
      body,
      mesh=self.mesh,
      in_specs=(
        self.trained_specs.opt,
        self.opt_specs,
        self.frozen_specs,
        self.residual_spec,
        self.reference_specs,
        self.state_specs.weights,
        self.batch_spec,
        *extra_specs,
      ),
      out_specs=(
        self.trained_specs.opt,
        self.opt_specs,
        self.residual_spec,
        self.reference_specs,
        self.state_specs.weights,
        PartitionSpec(),
        PartitionSpec(),
      ),
      check_vma=check_vma,
    )
    master, opt_state, residual, reference, weights, loss, grad_norm = step_fn(
      state.master,
      state.opt_state,
      state.frozen,
      state.residual,
      state.reference,
      state.weights,
      batch_AxBxL1,
      *extra,
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "targets": targets}
    new = TrainState(state.step + 1, master, opt_state, state.frozen, residual, reference, weights)
    return new, metrics
