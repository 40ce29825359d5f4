"""A plain single-device optax loop: the dense reference every strategy must match."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from models.llama import Llama, next_token_loss
from paro_jax.engine import OptimConfig, decay_mask


def reference_train(model: Llama, params, batches, optim: OptimConfig):
  """Train on `batches` (each A x B x (L+1) tokens) on one device; return (losses, params).

  The gradient of a step is the mean over its A micro-batches of each micro-batch's mean-loss
  gradient, i.e. the full-batch gradient; the optimizer is optax clip_by_global_norm + AdamW.
  """
  tx = optim.reference_tx(decay_mask(model.logical_axes()))
  opt_state = tx.init(params)

  def loss_fn(params, tokens_AxBxL1):
    def one(tokens_BxL1):
      return next_token_loss(model.apply(params, tokens_BxL1[:, :-1]), tokens_BxL1[:, 1:])
    return jnp.mean(jnp.stack([one(t) for t in tokens_AxBxL1]))

  @jax.jit
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for tokens in batches:
    params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens))
    losses.append(float(loss))
  return losses, params
