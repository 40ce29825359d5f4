"""The model's forward pass on a strategy's mesh, for evaluation: the mean loss of a placed batch,
or the summed loss of its counted targets and their count, from compute-dtype parameters at the P
placement (an engine's `params(state)`, or weights placed there directly). No gradient, no
optimizer state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from models.loss import weighted_sum
from paro_jax.core import step
from paro_jax.core.batch import Batch, inputs_of
from paro_jax.core.names import BATCH_AXES, GLOBAL_AXES
from paro_jax.core.shards import Shard
from paro_jax.core.wire import WireConfig
from paro_jax.core.xla_flags import bf16_weights_options


class Forward:
  """Forward-only programs of an engine's model, mesh and placements (`engine.forward`)."""

  def __init__(self, engine):
    self.engine = engine
    jit = functools.partial(jax.jit, compiler_options=bf16_weights_options(engine.mesh))
    self._loss = jit(self._loss_fn)
    self._sums = jit(self._sums_fn)
    self._row_scores = jit(self._row_scores_fn)

  def loss(self, params, batch_AxBxL1) -> jax.Array:
    """Mean next-token loss over a placed batch of any number of micro-batches (for a Batch,
    over its counted targets)."""
    if isinstance(batch_AxBxL1, Batch):
      total, targets = self._sums(params, batch_AxBxL1)
      return total / jnp.maximum(targets, 1)
    return self._loss(params, batch_AxBxL1)

  def sums(self, params, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """(the summed loss of the counted targets, how many) of a placed Batch: sums of several
    batches add up to the mean of all of them (`paro-jax eval`)."""
    return self._sums(params, batch)

  def row_scores(self, params, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Each row's (summed log-probability of its counted targets, fp32; whether each of them is
    the row's argmax there) of a placed Batch, (A, B) each: lm-eval's loglikelihood
    (run/lm_eval_model.py)."""
    return self._row_scores(params, batch)

  def _forward(self, params, batch_AxBxL1, micro_fn, reduce_fn, out_specs, scores=False):
    """`micro_fn(token_losses_BxL, batch_BxL1)` of each micro-batch on each device, then
    `reduce_fn` of their stack (in the shard_map). The token losses come from the head's product
    tiled over the vocabulary where it needs several tiles (models/loss.py): no fp32 logits of a
    whole micro-batch, no whole table or head on a device. `scores`: `micro_fn` takes each
    target's (log-probability, greedy flag) instead (`Llama.token_scores`, tiled alike)."""
    e = self.engine
    # The exact weights, whatever the wire precision: eval scores the model the run trains (its
    # fp32 master), so runs with and without compressed traffic are compared on equal terms.
    materialize = step.materializer(e, WireConfig())

    def local(params, batch_AxBxL1):
      # Forward only: no gradient reaches the sink, so the parameter itself can stand in.
      shards = jax.tree.map(lambda p, d: Shard(p, p, d), params, e.dims)

      def micro(_, batch_BxL1):
        inputs, targets, _, segments = inputs_of(batch_BxL1)
        if scores:
          out = e.model.token_scores(shards, inputs, targets, materialize, segments)
        else:
          out = e.model.token_losses(shards, inputs, targets, materialize, None, segments)
        return None, micro_fn(out, batch_BxL1)

      _, per_micro = lax.scan(micro, None, batch_AxBxL1)
      return reduce_fn(per_micro)

    return jax.shard_map(
      local,
      mesh=e.mesh,
      in_specs=(e.specs.params, e.batch_spec),
      out_specs=out_specs,
      check_vma=e.collectives == "xla",  # the rings' replicated results: see Engine._train_step
    )(params, batch_AxBxL1)

  def _loss_fn(self, params, tokens_AxBxL1):
    devices = self.engine.inter * self.engine.intra

    def mean(losses):
      # Every device holds the same number of rows: the mean of the local means is the mean.
      return lax.psum(jnp.mean(losses), GLOBAL_AXES) / devices

    loss = lambda ce_BxL, _: jnp.mean(ce_BxL)
    return self._forward(params, tokens_AxBxL1, loss, mean, PartitionSpec())

  def _sums_fn(self, params, batch: Batch):
    def sums(ce_BxL, batch_BxL1):
      weights = inputs_of(batch_BxL1)[2]
      return weighted_sum(ce_BxL, weights), jnp.sum(weights)

    total = lambda per_micro: jax.tree.map(lambda x: lax.psum(jnp.sum(x), GLOBAL_AXES), per_micro)
    return self._forward(params, batch, sums, total, (PartitionSpec(), PartitionSpec()))

  def _row_scores_fn(self, params, batch: Batch):
    def per_row(scores_BxL, batch_BxL1):
      target_BxL, greedy_BxL = scores_BxL
      counted_BxL = inputs_of(batch_BxL1)[2] > 0
      return (
        jnp.sum(jnp.where(counted_BxL, target_BxL, 0.0), axis=-1),
        jnp.all(greedy_BxL | ~counted_BxL, axis=-1),
      )

    rows = PartitionSpec(None, BATCH_AXES)  # each device's rows, stacked over the micro-batches
    return self._forward(params, batch, per_row, lambda x: x, (rows, rows), scores=True)
