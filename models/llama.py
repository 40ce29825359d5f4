"""A Flax LLaMA: the embedding, a stack of layers (RMSNorm, grouped-query attention with RoPE,
RMSNorm, SwiGLU MLP; models/attention.py, models/layers.py, models/rope.py) and an output head of
its own or tied to the embedding table, with LoRA adapters where asked (models/lora.py). The
family's switches (models/config.py FAMILIES) make it Qwen2's (q/k/v biases), Qwen3's (per-head
q/k RMSNorm before RoPE) or Mistral's (a sliding attention window).

Every parameter is declared once, with its logical axes (`embed`, `mlp`, `heads`, ...), through
`nn.with_logical_partitioning`; the sharding layer maps those names onto the mesh. The layers are
stacked on a leading `layers` axis and run with `lax.scan`, so compile time does not grow with
depth. `Llama.apply` takes a `materialize` hook that turns each stored parameter subtree into
full weights just before use: the identity for a dense model, a per-layer all-gather for a
sharded one (see paro_jax/core/step.py).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from models.attention import Attention, KVCache
from models.config import ATTENTION_IMPLS, LAYERS, VOCAB_CHUNK, LlamaConfig, LoraConfig, vocab_tiled
from models.layers import HEAD_EQUATIONS, MLP, Embed, Head, RMSNorm, head_logits
from models.lora import is_lora_path
from models.loss import tiled_cross_entropy, tiled_lookup, tiled_scores, token_cross_entropy
from models.rope import inverse_frequencies, rope_tables, segment_rope_tables


# What each layer keeps for backward. "full": nothing (all of the layer, its weight gather
# included, is recomputed); "layer": its matmul outputs (less recompute, more activation memory;
# the weights are still gathered again); "none": no recomputation, so every layer's gathered
# weights and activations stay alive until backward.
REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "layer": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "none": None,
}


class Block(nn.Module):
  cfg: LlamaConfig
  lora: LoraConfig | None = None
  attention: str = "xla"

  @nn.compact
  def __call__(self, x_BxLxD, sin, cos, segments_BxL=None, cache=None):
    """The layer's output; with a `cache` (Attention's), (output, the layer's new keys and
    values)."""
    with jax.named_scope("attention"):
      h = RMSNorm(self.cfg.norm_eps, name="attn_norm")(x_BxLxD)
      attention = Attention(self.cfg, self.lora, self.attention, name="attn")
      attended = attention(h, sin, cos, segments_BxL, cache)
      if cache is not None:
        attended, kv = attended
      x_BxLxD = x_BxLxD + attended
    with jax.named_scope("mlp"):
      h = RMSNorm(self.cfg.norm_eps, name="mlp_norm")(x_BxLxD)
      out_BxLxD = x_BxLxD + MLP(self.cfg, self.lora, name="mlp")(h)
    return out_BxLxD if cache is None else (out_BxLxD, kv)


def _identity(tree):
  return tree


class Llama:
  """The whole model as three Flax modules (embed, a scanned block, head) and pure functions."""

  def __init__(
    self,
    cfg: LlamaConfig,
    dtype=jnp.float32,
    remat: str = "full",
    lora: LoraConfig | None = None,
    attention: str = "xla",
    vocab_chunk: int = VOCAB_CHUNK,
  ):
    if remat not in REMAT_POLICIES:
      raise ValueError(f"unknown remat policy {remat!r}; choose one of {tuple(REMAT_POLICIES)}")
    if attention not in ATTENTION_IMPLS[1:]:
      raise ValueError(f"attention must be resolved to one of {ATTENTION_IMPLS[1:]}: {attention!r}")
    self.cfg, self.dtype, self.remat, self.lora = cfg, dtype, remat, lora
    self.attention = attention
    if vocab_chunk < 1:
      raise ValueError(f"vocab_chunk must be at least 1, got {vocab_chunk}")
    # The vocabulary's tile (models/loss.py; VOCAB_CHUNK is the size meant for real
    # vocabularies; tests pass a small one) and whether the model uses tiles at all
    # (`vocab_tiled`, models/config.py: only where the vocabulary needs more than one).
    self.vocab_chunk = vocab_chunk
    self.vocab_tiled = vocab_tiled(cfg.vocab, vocab_chunk)
    self.embed, self.head = Embed(cfg, dtype), Head(cfg)
    self.block = Block(cfg, lora, attention)

  def _boxed_init(self, rng):
    k_embed, k_layers, k_head = jax.random.split(rng, 3)
    tokens = jnp.zeros((1, 2), jnp.int32)
    x = jnp.zeros((1, 2, self.cfg.dim), jnp.float32)
    sin, cos = rope_tables(2, self.cfg)
    layer_keys = jax.random.split(k_layers, self.cfg.layers)
    # The parameters do not depend on how attention is computed: initialise through the
    # written-out attention, which traces on any backend.
    block = Block(self.cfg, self.lora)
    layers = jax.vmap(lambda k: block.init(k, x, sin, cos)["params"])(layer_keys)
    return {
      "embed": self.embed.init(k_embed, tokens)["params"],
      LAYERS: layers,
      "head": self.head.init(k_head, x, jnp.zeros((self.cfg.vocab, self.cfg.dim)))["params"],
    }

  def init(self, rng) -> dict:
    """fp32 parameters; the per-layer leaves are stacked on a leading `layers` axis."""
    if not hasattr(self, "_init_fn"):
      self._init_fn = jax.jit(lambda rng: nn.meta.unbox(self._boxed_init(rng)))
    return self._init_fn(rng)

  def logical_axes(self) -> dict:
    """A tree like init()'s whose leaves are tuples of logical axis names."""
    boxed = jax.eval_shape(self._boxed_init, jax.random.key(0))
    is_box = lambda x: isinstance(x, nn.Partitioned)
    axes = jax.tree.map(lambda b: tuple(b.names), boxed, is_leaf=is_box)
    # vmap stacked the layer leaves without recording the new leading axis: add it here.
    axes[LAYERS] = jax.tree.map(
      lambda a: (LAYERS, *a), axes[LAYERS], is_leaf=lambda x: isinstance(x, tuple)
    )
    return axes

  def stack_param_count(self) -> int:
    """Parameters of the whole scanned layer stack, adapters included (the ones recomputed in
    backward); `LlamaConfig.layer_param_count` counts one layer without adapters."""
    c = self.cfg
    adapters = self.lora.layer_params(c) if self.lora else 0
    return c.layers * (c.layer_param_count() + adapters)

  def param_count(self) -> int:
    """All parameters, adapters included (Ψ)."""
    return self.cfg.param_count() + (
      self.cfg.layers * self.lora.layer_params(self.cfg) if self.lora else 0
    )

  def trainable_count(self) -> int:
    """Parameters that are trained (Ψ'): the adapters with LoRA, else all."""
    return (
      self.cfg.layers * self.lora.layer_params(self.cfg) if self.lora else self.cfg.param_count()
    )

  def trainable_mask(self) -> dict:
    """A tree like init()'s of bools: True for the trained leaves (all, or the LoRA adapters)."""
    shapes = jax.eval_shape(self._boxed_init, jax.random.key(0))
    shapes = nn.meta.unbox(shapes)
    if self.lora is None:
      return jax.tree.map(lambda _: True, shapes)
    return jax.tree_util.tree_map_with_path(lambda path, _: is_lora_path(path), shapes)

  def with_adapters(self, base, rng) -> dict:
    """Base weights (e.g. from HF) plus freshly initialised adapters: a full parameter tree."""
    if self.lora is None:
      return base

    def overlay(full, given):
      return (
        {
          k: overlay(v, given[k]) if isinstance(v, dict) else given.get(k, v)
          for k, v in full.items()
        }
        if isinstance(given, dict)
        else given
      )

    return overlay(self.init(rng), base)

  def merge_lora(self, params) -> dict:
    """The base model's parameters with every adapter folded in: W + (alpha/r) A @ B."""
    if self.lora is None:
      return params
    params = jax.tree.map(lambda x: x, params)  # a copy of the dict structure
    owners = {
      "wq": "attn",
      "wk": "attn",
      "wv": "attn",
      "wo": "attn",
      "w_gate": "mlp",
      "w_up": "mlp",
      "w_down": "mlp",
    }
    for t in self.lora.targets:
      mod = dict(params[LAYERS][owners[t]])
      a, b = mod.pop(f"{t}_lora_a"), mod.pop(f"{t}_lora_b")
      w = mod[t]  # layers x in... x out...
      delta = jnp.einsum("lir,lro->lio", a, b) * self.lora.scale
      mod[t] = w + delta.reshape(w.shape).astype(w.dtype)
      params[LAYERS] = {**params[LAYERS], owners[t]: mod}
    return params

  def apply(
    self,
    params,
    tokens_BxL,
    materialize: Callable = _identity,
    run_layers: Callable | None = None,
    segments_BxL=None,
  ):
    """Logits (fp32) for the tokens, B x L x V: for tests and references; the step and the eval
    forward take `token_losses`, which never holds them all. Arguments as `head_inputs`'."""
    h_BxLxD, w, vocab_axis = self.head_inputs(
      params, tokens_BxL, materialize, run_layers, segments_BxL
    )
    return head_logits(HEAD_EQUATIONS[vocab_axis], h_BxLxD, w)

  def token_losses(
    self,
    params,
    tokens_BxL,
    targets_BxL,
    materialize: Callable = _identity,
    run_layers: Callable | None = None,
    segments_BxL=None,
  ):
    """Each token's cross-entropy against its target (fp32, B x L): where the vocabulary needs
    several tiles (`vocab_tiled`), from the head's product tiled over the vocabulary
    (models/loss.py), equal within fp32 rounding to `token_cross_entropy(self.apply(...),
    targets_BxL)` without its B x L x V logits; else that. Arguments as `head_inputs`'."""
    if not self.vocab_tiled:  # the whole logits
      h_BxLxD, w, vocab_axis = self.head_inputs(
        params, tokens_BxL, materialize, run_layers, segments_BxL
      )
      with jax.named_scope("cross_entropy"):
        logits_BxLxV = head_logits(HEAD_EQUATIONS[vocab_axis], h_BxLxD, w)
        return token_cross_entropy(logits_BxLxV, targets_BxL)
    tiled = self._tiled_head_inputs(params, tokens_BxL, materialize, run_layers, segments_BxL)
    h_BxLxD, head, vocab_axis, head_take = tiled
    B, L, D = h_BxLxD.shape
    with jax.named_scope("cross_entropy"):
      ce_T = tiled_cross_entropy(
        h_BxLxD.reshape(B * L, D),
        head,
        targets_BxL.reshape(B * L),
        vocab_axis,
        self.vocab_chunk,
        head_take,
      )
    return ce_T.reshape(B, L)

  def token_scores(
    self, params, tokens_BxL, targets_BxL, materialize: Callable = _identity, segments_BxL=None
  ):
    """(each target's log-probability, fp32 B x L; whether it is its logits' argmax, the first
    column of the max on a tie as `jnp.argmax`, bool B x L), for evaluation (no gradient):
    where the vocabulary needs several tiles, from the head's product tiled over the vocabulary
    (models/loss.py `tiled_scores`), equal to those of `self.apply(...)`'s logits without its
    B x L x V of them; else from those logits. Arguments as `head_inputs`'."""
    if not self.vocab_tiled:  # the whole logits
      logits_BxLxV = self.apply(params, tokens_BxL, materialize, None, segments_BxL)
      logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
      target_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
      return target_BxL, jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL
    tiled = self._tiled_head_inputs(params, tokens_BxL, materialize, None, segments_BxL)
    h_BxLxD, head, vocab_axis, head_take = tiled
    B, L, D = h_BxLxD.shape
    flat = (h_BxLxD.reshape(B * L, D), head, targets_BxL.reshape(B * L), vocab_axis)
    logp_T, greedy_T = tiled_scores(*flat, self.vocab_chunk, head_take)
    return logp_T.reshape(B, L), greedy_T.reshape(B, L)

  def _tiled_head_inputs(self, params, tokens_BxL, materialize, run_layers, segments_BxL):
    """`head_inputs` in vocabulary tiles: (the final norm's output B x L x D, the head as stored
    (the table, tied), its vocabulary axis, the `take` that makes a tile of it whole in the
    compute dtype). The table is looked up one tile at a time, each made whole by `materialize`
    (models/loss.py); no device holds it or the head whole."""
    lookup_take = lambda part: materialize(part).astype(self.dtype)
    table = params["embed"]["embedding"]
    x_BxLxD = tiled_lookup(table, tokens_BxL, self.vocab_chunk, lookup_take)
    x_BxLxD = self._layer_stack(params, x_BxLxD, materialize, run_layers, segments_BxL)
    norm = {"params": materialize(params["head"]["norm"])}
    h_BxLxD = RMSNorm(self.cfg.norm_eps).apply(norm, x_BxLxD)
    head, vocab_axis = (table, 0) if self.cfg.tie_embeddings else (params["head"]["kernel"], 1)
    head_take = lambda part: materialize(part).astype(h_BxLxD.dtype)
    return h_BxLxD, head, vocab_axis, head_take

  def head_inputs(
    self,
    params,
    tokens_BxL,
    materialize: Callable = _identity,
    run_layers: Callable | None = None,
    segments_BxL=None,
  ):
    """(the final norm's output B x L x D, the head's projection, its vocabulary axis): the
    embedding, the layer stack (`_layer_stack`), then `Head.project`. `materialize(subtree)`
    returns full weights for a subtree. Tied, the table is one parameter with two uses: gathered
    once per micro-batch, it serves as the embedding and as the head, and autodiff adds the two
    uses' gradients before its one reduce-scatter into its sink. The full table is then alive
    through the layer stack, and its full gradient through backward, where an untied model
    drops each table after its use.
    """
    embed_weights = materialize(params["embed"])
    x_BxLxD = self.embed.apply({"params": embed_weights}, tokens_BxL)
    x_BxLxD = self._layer_stack(params, x_BxLxD, materialize, run_layers, segments_BxL)
    table_VxD = embed_weights["embedding"] if self.cfg.tie_embeddings else None
    head_weights = {"params": materialize(params["head"])}
    return self.head.apply(head_weights, x_BxLxD, table_VxD, method=Head.project)

  def _layer_stack(self, params, x_BxLxD, materialize, run_layers, segments_BxL):
    """The layer stack's output for its input `x_BxLxD`.

    `run_layers(block_fn, x_BxLxD, stacked_layer_params) -> x_BxLxD`, if given, runs the whole
    layer stack instead of the default scan: `block_fn(x_BxLxD, full_layer_weights)` is one
    layer whose weights are already full, and `stacked_layer_params` is `params["layers"]` as
    stored (leading `layers` axis, not materialized). The caller then owns the gathering,
    rematerialisation and gradient routing of the stack (the engine uses it to prefetch the
    next layer's weights, paro_jax/core/prefetch.py). Without it: `lax.scan` over the layers, each
    under `jax.checkpoint` with the model's remat policy, weights through `materialize`.

    `segments_BxL` (int32; None: one sequence per row): several examples packed in a row, each
    a run of equal ids (0 for padding). Each example attends only to itself and its positions
    start at 0, so its logits are those it would get alone in a row.
    """
    if segments_BxL is None:
      sin, cos = rope_tables(x_BxLxD.shape[1], self.cfg)
    else:
      sin, cos = segment_rope_tables(segments_BxL, self.cfg)

    def layer(x_BxLxD, layer_params):
      with jax.named_scope("layer"):
        weights = {"params": materialize(layer_params)}
        return self.block.apply(weights, x_BxLxD, sin, cos, segments_BxL), None

    if REMAT_POLICIES[self.remat] is not None:
      # Recompute each layer (its parameter gather included) in backward: only one layer's full
      # weights are alive at a time. The embedding and head are not recomputed: the head is the
      # last op of forward and the first of backward, and the embedding's gradient needs only
      # the token ids.
      layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat])
    if run_layers is None:
      return lax.scan(layer, x_BxLxD, params[LAYERS])[0]

    def block_fn(x_BxLxD, layer_weights):
      with jax.named_scope("layer"):
        return self.block.apply({"params": layer_weights}, x_BxLxD, sin, cos, segments_BxL)

    return run_layers(block_fn, x_BxLxD, params[LAYERS])

  def decode(self, params, tokens_BxL, cache: KVCache, materialize: Callable = _identity):
    """(the fp32 logits of each row's last token, B x V; the cache with the tokens' keys and
    values written in): the tokens fill slots length.. length+L-1 of each row and attend to
    its earlier slots (a prompt's prefill, then one token per step). A row's positions count
    from its `start_B`, so a left-padded row is rotated as it would be alone; the logits equal
    `apply`'s at the same tokens. The layers run in a scan without remat (no backward)."""
    L = tokens_BxL.shape[1]
    positions_BxL = cache.length + jnp.arange(L)[None, :] - cache.start_B[:, None]
    angles_BxLxK2 = jnp.maximum(positions_BxL, 0).astype(jnp.float32)[..., None]
    angles_BxLxK2 = angles_BxLxK2 * inverse_frequencies(self.cfg)
    sin, cos = jnp.sin(angles_BxLxK2), jnp.cos(angles_BxLxK2)

    def layer(x_BxLxD, inputs):
      layer_params, k_BxTxGxK, v_BxTxGxK = inputs
      with jax.named_scope("layer"):
        weights = {"params": materialize(layer_params)}
        layer_cache = (k_BxTxGxK, v_BxTxGxK, cache.start_B, cache.length)
        return self.block.apply(weights, x_BxLxD, sin, cos, None, layer_cache)

    embed_weights = materialize(params["embed"])
    x_BxLxD = self.embed.apply({"params": embed_weights}, tokens_BxL)
    x_BxLxD, (k, v) = lax.scan(
      layer, x_BxLxD, (params[LAYERS], cache.k_NxBxTxGxK, cache.v_NxBxTxGxK)
    )
    table_VxD = embed_weights["embedding"] if self.cfg.tie_embeddings else None
    head = {"params": materialize(params["head"])}
    logits_Bx1xV = self.head.apply(head, x_BxLxD[:, -1:], table_VxD)
    return logits_Bx1xV[:, 0], KVCache(k, v, cache.start_B, cache.length + L)
