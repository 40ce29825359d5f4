"""The Engine of the outer loop: the groups along `inter` as independent replicas (core/outer.py).

Each group (a node, one row of the (inter, intra) mesh) runs the step of its strategy on its own
slice of every batch, with no collective across nodes: a `GroupStrategy` (N and I letters) sums
the loss and the gradients over `intra` only. The groups' training states differ, so every leaf
that a step changes (master weights, optimizer state, the compute-dtype copy) carries a leading
axis of one entry per group, sharded over `inter`; inside the `shard_map` each device sees its
group's entry and runs core/step.py's `local_step` unchanged. The frozen LoRA base is the same in
every group and is held as the Engine holds it.

Every H steps the same compiled step ends the round (core/outer.py `sync`): the groups'
pseudo-gradients averaged over `inter`, the outer Nesterov step on the outer weights at G (or,
with `--outer-state I`, on each node's copy at I), the groups restarted from them. With
`--outer-fragments F` (core/fragments.py) each of F fragments ends its round at its own step,
H/F apart, a branch of the step each; with `--outer-delay` a fragment's exchange runs beside
the compute of a later step. The step count in the state is the round's position, so a restored
state continues the round exactly. Eval and export read the outer weights (`params`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec

from paro_jax.core import outer as outer_loop
from paro_jax.core import feedback_rules, step
from paro_jax.core.batch import Batch
from paro_jax.core.config import OuterOptions
from paro_jax.core.engine import Engine
from paro_jax.core.fragments import WHOLE, Fragments, fragment_part, with_fragment_part
from paro_jax.core.mesh import mesh_shape
from paro_jax.core.names import INTER, MESH_AXES, OUTER_STATES
from paro_jax.core.sharding import local_shape, named, state_specs
from paro_jax.core.shards import gather_invariant, join_trainable, split_trainable
from paro_jax.core.state import TrainState
from paro_jax.core.strategy import GroupStrategy, Placement, Strategy
from paro_jax.core.wire import Codec


def stacked_spec(spec: PartitionSpec) -> PartitionSpec:
  """The spec of a leaf with one entry per group in front, sharded over `inter`."""
  return PartitionSpec(INTER, *spec)


def _stack_specs(tree):
  is_spec = lambda x: isinstance(x, PartitionSpec)
  return jax.tree.map(stacked_spec, tree, is_leaf=is_spec)


class GroupEngine(Engine):
  """An Engine whose groups train independently between the outer loop's syncs."""

  def __init__(
    self,
    model,
    strategy: Strategy,
    mesh,
    optim,
    outer: OuterOptions,
    pseudo_grad_wire: Codec = Codec(),
    error_feedback: bool | None = None,
    **engine_args,
  ):
    inter, intra = mesh_shape(mesh)
    if inter < 2:
      raise ValueError(
        f"--outer-sync averages the nodes' weights every H steps, but --mesh {inter}x{intra} has "
        f"one node (group): pass a mesh of two or more groups, or drop --outer-sync"
      )
    if outer.sync is None:
      raise ValueError("GroupEngine needs the outer loop's H (--outer-sync)")
    self.outer = outer
    self.outer_tx = outer_loop.outer_tx(outer)
    self.fragments = Fragments(outer.fragments, outer.sync, model.cfg.layers)
    self.pseudo_grad_wire = pseudo_grad_wire
    # The group's step has no collective across nodes: its wire formats and int8 corrections
    # do not apply (the pseudo-gradient's wire is `pseudo_grad_wire`).
    super().__init__(model, GroupStrategy.of(strategy), mesh, optim, **engine_args)
    s = self.strategy
    # --outer-state: G (sharded over all devices) or I (each node's copy over its devices)
    if outer.state not in OUTER_STATES:
      raise ValueError(
        f"--outer-state {outer.state} is train's choice (I where the run's memory fits): pass "
        f"--outer-state G or I"
      )
    self.outer_at = Placement[outer.state]
    outer_specs = state_specs(
      self.shapes, self.dims, Strategy(s.params, s.grads, self.outer_at), mesh
    )
    self.outer_specs = split_trainable(outer_specs.opt, self.mask)
    momentum = jax.eval_shape(self.outer_tx.init, self.trained_shapes)
    self.outer_opt_specs = optax.tree_map_params(
      self.outer_tx,
      lambda _, spec: spec,
      momentum,
      self.outer_specs,
      transform_non_params=lambda _: PartitionSpec(),
      is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    # Error feedback of the pseudo-gradient's wire: on where it compresses fp32 (bf16, int8, int4).
    compresses = pseudo_grad_wire.active_for(jnp.float32)
    if error_feedback and not compresses:
      raise ValueError(
        f"error feedback corrects a compressed pseudo-gradient, but --inter-grads "
        f"{pseudo_grad_wire.fmt} sends it in fp32: pass --inter-grads bf16, int8 or int4, or drop "
        f"--error-feedback"
      )
    self.outer_feedback = compresses and error_feedback is not False
    # The banner's word on it (the Engine's own note is of the step's gradients: none here).
    self.feedback_note = "on" if self.outer_feedback else "off"
    if not compresses:
      self.feedback_note = "off (the pseudo-gradient is sent in fp32)"
    # Each fragment quantizes its own pseudo-gradient: its span of the flat residual.
    sizes = [self._fragment_residual_size(f) for f in range(self.fragments.count)]
    starts = [sum(sizes[:f]) for f in range(len(sizes))]
    self.outer_residual_spans = [(a, a + n) for a, n in zip(starts, sizes)]
    self.outer_residual_size = sum(sizes)
    self.outer_state_specs = outer_loop.OuterState(
      self.outer_specs,
      self.outer_opt_specs,
      PartitionSpec(MESH_AXES) if self.outer_feedback else None,
      _stack_specs(self.state_specs.master) if outer.delay else None,
    )
    # The groups' own leaves, one entry per group; the step count and the frozen base shared.
    self.group_specs = self.state_specs
    self.state_specs = TrainState(
      PartitionSpec(),
      _stack_specs(self.state_specs.master),
      _stack_specs(self.state_specs.opt_state),
      self.state_specs.frozen,
      None,
      None,
      _stack_specs(self.state_specs.weights) if self.weights_copy else None,
      self.outer_state_specs,
    )
    self.state_shardings = named(mesh, self.state_specs)

  def _fragment_residual_size(self, f: int) -> int:
    """Elements of one device's residual for fragment f's pseudo-gradient (0 without it)."""
    if not self.outer_feedback:
      return 0
    # The pseudo-gradient is quantized where it is computed: at OS (state G) or at I.
    s, at = self.strategy, (self.strategy.opt if self.outer_at == Placement.G else Placement.I)
    ways = at.shard_count(self.inter, self.intra)
    roles = self.fragments.roles(self.trained_shapes, self.trained_dims, f)
    local = 0
    for t, d, r in zip(
      *(jax.tree.leaves(x) for x in (self.trained_shapes, self.trained_dims, roles))
    ):
      if not isinstance(r, str):  # a Cut along an axis no placement shards, or the whole leaf
        shape = t.shape if r == WHOLE else r.shape(t.shape)
        local += math.prod(local_shape(shape, d, ways))
    return feedback_rules.outer_residual_size(s, local, self.inter, self.intra, self.outer.state)

  # --- state -------------------------------------------------------------------------------
  def _fresh_state(self, params) -> TrainState:
    one = super()._fresh_state(params)
    stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (self.inter, *x.shape)), tree)
    residual = None
    if self.outer_feedback:
      residual = jnp.zeros((self.inter * self.intra * self.outer_residual_size,), jnp.float32)
    outer = outer_loop.OuterState(
      one.master,
      self.outer_tx.init(one.master),
      residual,
      stack(one.master) if self.outer.delay else None,
    )
    return TrainState(
      one.step,
      stack(one.master),
      stack(one.opt_state),
      one.frozen,
      None,
      None,
      stack(one.weights) if self.weights_copy else None,
      outer,
    )

  def params(self, state: TrainState):
    """The outer weights in the compute dtype at the P placement (eval and export read them),
    gathered from where they live (G, or I: within a node)."""
    trained = self._outer_params(state.outer.params)
    return join_trainable(self.mask, trained, state.frozen) if self.lora else trained

  @functools.cached_property
  def _outer_params(self):
    axes = tuple(a for a in self.outer_at.axes if a not in self.strategy.params.axes)

    def gather(outer):
      return jax.tree.map(
        lambda w, d: gather_invariant(w.astype(self.compute_dtype), axes, d),
        outer,
        self.trained_dims,
      )

    return jax.jit(
      jax.shard_map(
        gather,
        mesh=self.mesh,
        in_specs=(self.outer_specs,),
        out_specs=self.trained_specs.params,
      )
    )

  # --- the step ----------------------------------------------------------------------------
  def _train_step(self, state: TrainState, batch_AxBxL1):
    check_vma = self.collectives == "xla"
    g = self.inter
    # Each group's loss is the mean over its own targets.
    if isinstance(batch_AxBxL1, Batch):
      w = batch_AxBxL1.weights
      per_group = jnp.sum(w.reshape(w.shape[0], g, -1), axis=(0, 2))
      targets = jnp.maximum(per_group, 1)
    else:
      targets = batch_AxBxL1[..., 1:].size // g
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)
    again = lambda tree: jax.tree.map(lambda x: x[None], tree)

    def body(master, opt_state, frozen, weights, batch, *group_targets):
      out = step.local_step(
        self,
        first(master),
        first(opt_state),
        frozen,
        None,
        None,
        first(weights),
        batch,
        targets_per_step=group_targets[0][0] if group_targets else targets,
      )
      master, opt_state, _, _, weights, loss, grad_norm = out
      return again(master), again(opt_state), again(weights), loss[None], grad_norm[None]

    specs = self.state_specs
    extra = (targets,) if isinstance(batch_AxBxL1, Batch) else ()
    groups = PartitionSpec(INTER)
    step_fn = jax.shard_map(
      body,
      mesh=self.mesh,
      in_specs=(
        specs.master,
        specs.opt_state,
        specs.frozen,
        specs.weights,
        self.batch_spec,
        *((groups,) if extra else ()),
      ),
      out_specs=(specs.master, specs.opt_state, specs.weights, groups, groups),
      check_vma=check_vma,
    )
    count = state.step + 1

    def inner(state):
      master, opt_state, weights, losses, norms = step_fn(
        state.master, state.opt_state, state.frozen, state.weights, batch_AxBxL1, *extra
      )
      new = TrainState(count, master, opt_state, state.frozen, None, None, weights, state.outer)
      return new, losses, norms

    # At most one fragment ends its round at this step (core/fragments.py): its branch.
    frags, delay = self.fragments, self.outer.delay
    syncs = [functools.partial(self._sync, fragment=f) for f in range(frags.count)]
    if not delay:
      new, losses, norms = inner(state)
      new = lax.switch(frags.due(count), [*syncs, lambda s: s], new)
    else:
      # The fragment whose sync step was `delay` steps ago: its exchange (of the weights kept
      # then, `pending`) in the same branch as this step's compute, which it does not depend
      # on (so a scheduler can run the two side by side), and applied after it.
      def exchange(sync):
        def branch(state):
          new, losses, norms = inner(state)
          return sync(new), losses, norms

        return branch

      branches = [*(exchange(sync) for sync in syncs), inner]
      new, losses, norms = lax.switch(frags.due(count, delay), branches, state)
      keeps = [functools.partial(self._keep, fragment=f) for f in range(frags.count)]
      new = lax.switch(frags.due(count), [*keeps, lambda s: s], new)
    # The metrics are the groups' means (a few floats across nodes, not the step's tensors).
    total = jnp.sum(targets) if extra else targets * g
    metrics = {"loss": jnp.mean(losses), "grad_norm": jnp.mean(norms), "targets": total}
    return new, metrics

  def _sync(self, state: TrainState, fragment: int = 0) -> TrainState:
    """Fragment `fragment`'s round end (core/outer.py `sync_fragment`) on the whole state: the
    fragment's part of every group's weights restarts from the new outer weights; the rest of
    them train on."""
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)
    again = lambda tree: jax.tree.map(lambda x: x[None], tree)

    def body(master, outer, weights):
      restart, roles, outer = outer_loop.sync_fragment(
        first(outer.pending if self.outer.delay else master),
        outer,
        self.trained_dims,
        self.strategy,
        self.outer_tx,
        self.collectives,
        self.pseudo_grad_wire,
        self.fragments,
        fragment,
        self.outer_residual_spans[fragment],
        self.outer_at,
      )
      if mix := self.outer.mix:  # Streaming DiLoCo's merge: some of the group's own weights
        own = fragment_part(first(master), roles)
        restart = jax.tree.map(lambda w, o: mix * w + (1 - mix) * o, own, restart)
      if weights is not None:
        copy = jax.tree.map(lambda w: w.astype(self.compute_dtype), restart)
        weights = again(with_fragment_part(first(weights), copy, roles))
      return again(with_fragment_part(first(master), restart, roles)), outer, weights

    specs = self.state_specs
    master, outer, weights = jax.shard_map(
      body,
      mesh=self.mesh,
      in_specs=(specs.master, specs.outer, specs.weights),
      out_specs=(specs.master, specs.outer, specs.weights),
      check_vma=self.collectives == "xla",
    )(state.master, state.outer, state.weights)
    return state._replace(master=master, outer=outer, weights=weights)

  def _keep(self, state: TrainState, fragment: int) -> TrainState:
    """At fragment `fragment`'s sync step with --outer-delay: every group's weights of it kept
    in `pending` for the exchange `delay` steps later (a copy on each device: no collective)."""
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)

    def body(master, pending):
      roles = self.fragments.roles(first(master), self.trained_dims, fragment)
      kept = with_fragment_part(first(pending), fragment_part(first(master), roles), roles)
      return jax.tree.map(lambda x: x[None], kept)

    spec = self.state_specs.outer.pending
    pending = jax.shard_map(
      body,
      mesh=self.mesh,
      in_specs=(self.state_specs.master, spec),
      out_specs=spec,
      check_vma=self.collectives == "xla",
    )(state.master, state.outer.pending)
    return state._replace(outer=state.outer._replace(pending=pending))
