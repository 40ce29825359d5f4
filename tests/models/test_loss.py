"""The cross-entropy tiled over the vocabulary (models/loss.py) equals the cross-entropy of the
full logits, values and gradients, and the step and the eval forward never hold fp32 logits of a
whole micro-batch.

References: optax's softmax cross-entropy of the whole einsum, differentiated by jax; the model's
own full logits (`Llama.apply`) under `token_cross_entropy`. Tiles that divide the vocabulary,
that do not (the last tile overlaps the one before), and one tile larger than the vocabulary.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from models.config import LlamaConfig
from models.llama import Llama
from models.loss import tiled_cross_entropy, token_cross_entropy, weighted_sum
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.state import OptimConfig
from paro_jax.core.strategy import parse_strategy
from tests.models.test_head import dot_generals

T, D, V = 24, 16, 37
EQUATIONS = {1: "td,dv->tv", 0: "td,vd->tv"}  # the head's kernel D x V; the tied table V x D


def _inputs(axis):
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (T, D))
  w = jax.random.normal(k[1], (D, V) if axis == 1 else (V, D))
  return x, w, jax.random.randint(k[2], (T,), 0, V), jax.random.normal(k[3], (T,))


def _full(x, w, targets, axis):
  logits = jnp.einsum(EQUATIONS[axis], x, w)
  return optax.softmax_cross_entropy(logits, jax.nn.one_hot(targets, V))


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("chunk", [1, 5, 6, 8, 36, 37, 100])
def test_tiles_equal_the_full_cross_entropy_and_its_gradients(axis, chunk):
  x, w, targets, ct = _inputs(axis)
  np.testing.assert_allclose(
    tiled_cross_entropy(x, w, targets, axis, chunk), _full(x, w, targets, axis), rtol=2e-6
  )
  tiled = jax.grad(lambda x, w: ct @ tiled_cross_entropy(x, w, targets, axis, chunk), (0, 1))
  full = jax.grad(lambda x, w: ct @ _full(x, w, targets, axis), (0, 1))
  for got, want in zip(tiled(x, w), full(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # values of order 1


@pytest.mark.parametrize("axis", [1, 0])
def test_bf16_products_take_bf16_and_the_head_gradient_is_rounded_once(axis):
  """As `head_logits`: every product of the bf16 loss and its gradient takes bf16 operands (no
  fp32/TF32 GEMM on a GPU); each column of the head's gradient is one product over all tokens,
  and the input's is summed over the tiles in fp32, each rounded once to bf16: both equal those
  of the full logits (cotangent rounded once to bf16) within one bf16 rounding."""
  x, w, targets, ct = _inputs(axis)
  x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  tiled = jax.grad(lambda x, w: jnp.sum(ct * tiled_cross_entropy(x, w, targets, axis, 5)), (0, 1))
  dots = list(dot_generals(jax.make_jaxpr(tiled)(x, w).jaxpr))
  assert len(dots) >= 3
  assert all([str(v.aval.dtype) for v in e.invars] == ["bfloat16"] * 2 for e in dots)
  # the reference: fp32 logits of the bf16 operands, their cotangent rounded once to bf16
  logits = lambda x, w: jnp.einsum(EQUATIONS[axis], x, w, preferred_element_type=jnp.float32)
  g = jax.grad(lambda lg: ct @ optax.softmax_cross_entropy(lg, jax.nn.one_hot(targets, V)))
  dlogits = g(logits(x, w)).astype(jnp.bfloat16)
  _, vjp = jax.vjp(lambda x, w: jnp.einsum(EQUATIONS[axis], x, w), x, w)
  for got, want in zip(tiled(x, w), vjp(dlogits)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)


CFG = LlamaConfig(vocab=61, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)


@pytest.mark.parametrize("tied", [False, True])
def test_model_token_losses_equal_the_full_logits_loss(tied):
  """`Llama.token_losses` (tiles of 16 of an odd vocabulary of 61) against `token_cross_entropy`
  of `Llama.apply`'s logits, packed segments and a loss mask included, gradients too."""
  cfg = LlamaConfig(**{**CFG.__dict__, "tie_embeddings": tied})
  tiled, full = Llama(cfg, vocab_chunk=16), Llama(cfg)
  params = full.init(jax.random.key(1))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab, (2, 13)), jnp.int32)
  segments = jnp.asarray([[1] * 5 + [2] * 6 + [0] * 2, [1] * 12 + [0]], jnp.int32)
  weights = jnp.asarray(rng.integers(0, 2, (2, 12)), jnp.float32) * (segments[:, 1:] > 0)
  inputs, targets, seg = tokens[:, :-1], tokens[:, 1:], segments[:, :-1]

  def tiled_loss(p):
    return weighted_sum(tiled.token_losses(p, inputs, targets, segments_BxL=seg), weights)

  def full_loss(p):
    ce = token_cross_entropy(full.apply(p, inputs, segments_BxL=seg), targets)
    return weighted_sum(ce, weights)

  np.testing.assert_allclose(
    tiled.token_losses(params, inputs, targets),
    token_cross_entropy(full.apply(params, inputs), targets),
    rtol=1e-6,
  )
  got, want = jax.value_and_grad(tiled_loss)(params), jax.value_and_grad(full_loss)(params)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


BIG_VOCAB = LlamaConfig(vocab=4096, dim=32, layers=1, heads=4, kv_heads=2, head_dim=8, mlp=64)
ROWS, SEQ = 8, 64  # 64 tokens per device on the 2x4 mesh


def _fp32_logit_buffers(hlo: str, tokens: int, vocab: int) -> list[str]:
  """fp32 shapes of `tokens` x `vocab` (whatever their layout) in compiled HLO."""
  shapes = set(re.findall(r"f32\[[0-9,]+\]", hlo))
  dims = lambda s: sorted(int(d) for d in s[4:-1].split(",") if int(d) > 1)
  return sorted(s for s in shapes if dims(s) == sorted((tokens, vocab)))


@pytest.fixture(scope="module")
def big_vocab_programs():
  """The compiled HLO of the step and of the eval forward of a model whose vocabulary dwarfs the
  rest (IGG on 2x4: the head gathered over the node), tiles of 512 columns."""
  engine = Engine(
    Llama(BIG_VOCAB, vocab_chunk=512), parse_strategy("IGG"), make_mesh(2, 4), OptimConfig()
  )
  state = jax.eval_shape(engine.init_state, jax.random.key(0))
  state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, engine.state_shardings
  )
  batch = jax.ShapeDtypeStruct((1, ROWS, SEQ + 1), jnp.int32, sharding=engine.batch_sharding)
  params = jax.tree.map(
    lambda s, spec: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=NamedSharding(engine.mesh, spec)
    ),
    jax.eval_shape(engine.params, state),
    engine.specs.params,
  )
  step = engine.train_step.lower(state, batch).compile().as_text()
  forward = engine.forward._loss.lower(params, batch).compile().as_text()
  return step, forward


def test_no_fp32_logits_of_a_whole_micro_batch(big_vocab_programs):
  step, forward = big_vocab_programs
  tokens = ROWS // 8 * SEQ
  for hlo in (step, forward):
    assert _fp32_logit_buffers(hlo, tokens, 512)  # the tile's logits: the check can see them
    assert _fp32_logit_buffers(hlo, tokens, BIG_VOCAB.vocab) == []
