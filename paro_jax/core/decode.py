"""Decoding on a strategy's mesh (`paro-jax generate`): a prompt's prefill, then one token per
step, each reusing the keys and values the earlier ones cached (models/llama.py `Llama.decode`),
from compute-dtype weights at the P placement, each layer's gathered just before use as the
training forward gathers it; and the choice of each next token: greedy, or sampled with a
temperature, top-k and top-p.

The rows are split over all the mesh's devices (padded with rows of no prompt to a multiple of
them), each device decoding its rows with its own part of the cache: the weight gathers every
device needs anyway serve rows that differ, not copies of the same ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from models.attention import KVCache
from paro_jax.core import step
from paro_jax.core.names import BATCH_AXES
from paro_jax.core.shards import Shard
from paro_jax.core.wire import WireConfig


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen: greedy at temperature 0, else sampled from the softmax of
  logits / temperature over the top_k likeliest tokens (0: all) whose probabilities, likeliest
  first, reach top_p before them (transformers' TopKLogitsWarper, then TopPLogitsWarper). The
  command checks the values (run/generate_config.py)."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0


def next_token(logits_BxV, key, sampling: Sampling):
  """Each row's next token (int32, B) from its fp32 logits."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits = logits_BxV.astype(jnp.float32) / sampling.temperature
  lowest = jnp.finfo(jnp.float32).min
  if sampling.top_k:
    kth_Bx1 = lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth_Bx1, lowest, logits)
  if sampling.top_p < 1:
    sorted_BxV = -jnp.sort(-logits, axis=-1)  # likeliest first
    probs = jax.nn.softmax(sorted_BxV, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
    kept = jnp.sum(before < sampling.top_p, axis=-1, keepdims=True)  # >= 1: the first is kept
    floor_Bx1 = jnp.take_along_axis(sorted_BxV, kept - 1, axis=-1)
    logits = jnp.where(logits < floor_Bx1, lowest, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Decoder:
  """The decode program of an engine's model, mesh and placements, for one `Sampling`."""

  def __init__(self, engine, sampling: Sampling):
    self.engine, self.sampling = engine, sampling
    self.devices = engine.inter * engine.intra
    rows = PartitionSpec(BATCH_AXES)
    self.cache_spec = KVCache(
      PartitionSpec(None, BATCH_AXES), PartitionSpec(None, BATCH_AXES), rows, PartitionSpec()
    )
    # One program per shape (the prefill's, then the step's), the cache updated in place.
    self._step = jax.jit(self._step_fn, donate_argnums=1)

  def rows(self, prompts: int) -> int:
    """The rows decoded for `prompts` prompts: a multiple of the devices."""
    return -(-prompts // self.devices) * self.devices

  def empty_cache(self, start_B, slots: int) -> KVCache:
    """A cache of `slots` slots per row, each row's tokens from slot start_B, on the mesh."""
    e = self.engine
    shardings = jax.tree.map(lambda s: NamedSharding(e.mesh, s), self.cache_spec)
    make = lambda: KVCache.empty(e.model.cfg, jnp.asarray(start_B), slots, e.compute_dtype)
    return jax.jit(make, out_shardings=shardings)()

  def step(self, params, cache: KVCache, tokens_BxL, key, index: int):
    """(each row's next token, B int32; the cache with `tokens_BxL` written in). The sample's
    randomness is `key` folded with `index`, so a seed gives the same tokens on any mesh."""
    tokens = jax.device_put(
      jnp.asarray(tokens_BxL, jnp.int32), NamedSharding(self.engine.mesh, PartitionSpec(BATCH_AXES))
    )
    return self._step(params, cache, tokens, key, jnp.int32(index))

  def _step_fn(self, params, cache, tokens_BxL, key, index):
    e = self.engine
    materialize = step.materializer(e, WireConfig())  # the exact weights, as eval's forward

    def local(params, cache, tokens_BxL):
      # Forward only: no gradient reaches the sink, so the parameter itself can stand in.
      shards = jax.tree.map(lambda p, d: Shard(p, p, d), params, e.dims)
      return e.model.decode(shards, tokens_BxL, cache, materialize)

    logits_BxV, cache = jax.shard_map(
      local,
      mesh=e.mesh,
      in_specs=(e.specs.params, self.cache_spec, PartitionSpec(BATCH_AXES)),
      out_specs=(PartitionSpec(BATCH_AXES), self.cache_spec),
      check_vma=e.collectives == "xla",  # the rings' replicated results: see Engine._train_step
    )(params, cache, tokens_BxL)
    # On the whole batch, outside the shard_map: the random bits do not depend on the mesh.
    return next_token(logits_BxV, jax.random.fold_in(key, index), self.sampling), cache


def generate_ids(
  decoder: Decoder,
  params,
  prompts: list[np.ndarray],
  max_new_tokens: int,
  stops: set[int],
  seed: int = 0,
) -> list[list[int]]:
  """Each prompt's new tokens: `max_new_tokens`, or fewer, up to and with the first of `stops`.
  The prompts are left-padded to the longest into one batch.

  A Python loop over the jitted step, not a lax.while_loop: the host reads each step's tokens,
  so it stops once every row has met a stop token; the next step is dispatched before the host
  reads this one's, so the device does not wait on the host (at most one step is wasted)."""
  longest = max(len(p) for p in prompts)
  rows = decoder.rows(len(prompts))
  tokens_BxL = np.zeros((rows, longest), np.int32)
  start_B = np.zeros(rows, np.int32)  # a padding row: token 0 at every slot, never read
  for b, prompt in enumerate(prompts):
    start_B[b] = longest - len(prompt)
    tokens_BxL[b, start_B[b] :] = prompt
  cache = decoder.empty_cache(start_B, longest + max_new_tokens)
  key = jax.random.key(seed)
  new, cache = decoder.step(params, cache, tokens_BxL, key, 0)
  out = [[] for _ in prompts]
  done = np.zeros(len(prompts), bool)
  for index in range(1, max_new_tokens + 1):
    ahead = None
    if index < max_new_tokens:
      ahead, cache = decoder.step(params, cache, new[:, None], key, index)
    for b, token in enumerate(np.asarray(jax.device_get(new))[: len(prompts)]):
      if not done[b]:
        out[b].append(int(token))
        done[b] = int(token) in stops
    if done.all():
      break
    new = ahead
  return out
