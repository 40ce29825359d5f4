"""A plain single-device optax loop: the dense reference every strategy must match."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from models.llama import Llama
from models.loss import next_token_loss, weighted_token_loss
from paro_jax.core.batch import Batch, inputs_of
from paro_jax.core.state import OptimConfig, decay_mask
from paro_jax.core.shards import join_trainable, split_trainable


def reference_train(model: Llama, params, batches, optim: OptimConfig):
  """Train on `batches` (each A x B x (L+1) tokens, or a Batch: core/batch.py) on one device;
  return (losses, params).

  The gradient of a step is the mean over its A micro-batches of each micro-batch's mean-loss
  gradient, i.e. the full-batch gradient; with a Batch, the gradient of the sum of the counted
  targets' losses over the whole step divided by their count (the full batch's mean over its
  targets). The optimizer is optax clip_by_global_norm + AdamW.
  With LoRA only the adapters are trained (and returned, None in place of the frozen leaves);
  the frozen weights are used in the model's compute dtype, as the engine holds them.
  """
  trained, tx, step = reference_step(model, params, optim)
  opt_state = tx.init(trained)
  losses = []
  for tokens in batches:
    trained, opt_state, loss = step(trained, opt_state, jax.tree.map(jnp.asarray, tokens))
    losses.append(float(loss))
  return losses, trained


def reference_step(model: Llama, params, optim: OptimConfig):
  """The reference's step on one device: (the trained weights of `params`, the optimizer,
  `step(trained, opt_state, tokens)` -> (trained, opt_state, loss)); reference_train says what
  a step computes. The outer loop's references (tests/core/test_outer*.py) run it per group."""
  mask = model.trainable_mask()
  tx = optim.reference_tx(decay_mask(split_trainable(model.logical_axes(), mask)))
  frozen = jax.tree.map(lambda w: w.astype(model.dtype), split_trainable(params, mask, False))

  def loss_fn(trained, tokens_AxBxL1):
    full = join_trainable(mask, trained, frozen)

    if isinstance(tokens_AxBxL1, Batch):  # one forward over all rows of the step
      rows = jax.tree.map(lambda x: x.reshape(-1, x.shape[-1]), tokens_AxBxL1)
      inputs, targets, weights, segments = inputs_of(rows)
      logits = model.apply(full, inputs, segments_BxL=segments)
      return weighted_token_loss(logits, targets, weights) / jnp.sum(weights)

    def one(tokens_BxL1):
      return next_token_loss(model.apply(full, tokens_BxL1[:, :-1]), tokens_BxL1[:, 1:])

    return jnp.mean(jnp.stack([one(t) for t in tokens_AxBxL1]))

  @jax.jit
  def step(trained, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(trained, tokens)
    updates, opt_state = tx.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss

  return split_trainable(params, mask), tx, step
