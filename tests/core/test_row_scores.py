"""lm-eval's row scores (core/forward.py `row_scores`: each row's summed log-probability of its
counted targets, and whether each of them is the argmax) over vocabulary tiles
(models/loss.py `tiled_scores`): equal to those of the whole fp32 logits, greedy flags exactly,
ties included (the first column of the max wins, as `jnp.argmax`), with no B x L x V fp32 buffer
in the compiled program.

The function against `log_softmax` and `jnp.argmax` of the same logits, with ties placed across
tiles, inside one, and on the last tile's overlap; then the model's vocabulary of 62 in tiles of
16 on a 2x4 mesh at placements that shard the head (IIG, GGG tied), against the single-device
model's whole logits (`Llama.apply`), the head's columns 47 and 55 made equal and dominant so
that rows end on a tie.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig
from models.llama import Llama
from models.loss import tiled_scores
from paro_jax.core.batch import Batch
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy
from tests.core.test_equivalence import OPTIM

CFG = LlamaConfig(vocab=62, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
TIED = dataclasses.replace(CFG, tie_embeddings=True)
CHUNK = 16  # 62 in 4 tiles of 16: columns 0, 16, 32 and 46 on (46 and 47 overlap)
TIE = (47, 55)  # an overlap column (counted by the third tile) and one of the last tile
A, B, L = 2, 8, 16


def _reference(logits_TxV, targets_T):
  logp = jax.nn.log_softmax(logits_TxV, axis=-1)
  return (
    np.asarray(jnp.take_along_axis(logp, targets_T[:, None], axis=-1)[:, 0]),
    np.asarray(jnp.argmax(logits_TxV, axis=-1) == targets_T),
  )


@pytest.mark.parametrize("axis", [1, 0], ids=["kernel", "table"])
def test_tiled_scores_equal_log_softmax_and_argmax_ties_included(axis):
  rng = np.random.default_rng(0)
  T, D, V = 64, 8, 62
  x = rng.normal(size=(T, D)).astype(np.float32)
  x[-4:] = 0  # every logit 0: the whole vocabulary ties, column 0 is the argmax
  w = rng.normal(size=(D, V)).astype(np.float32)
  # equal, dominant columns: across tiles (3, 40), inside one (20, 21), the overlap against the
  # last tile (47, 55), and an overlap column against the tile before's own (33, 46)
  for first, second in ((3, 40), (20, 21), (47, 55), (33, 46)):
    w[:, first] = w[:, second] = 3 * w[:, first]
  logits = jnp.asarray(x) @ jnp.asarray(w)
  argmax = np.asarray(jnp.argmax(logits, axis=-1))
  ties = {3: 40, 20: 21, 47: 55, 33: 46, 0: 61}
  assert set(argmax) & set(ties) == set(ties), "every tie decides some token's argmax"
  # each token's argmax, its tie's other column, and a column at random
  for targets in (argmax, np.vectorize(lambda a: ties.get(a, a))(argmax), rng.integers(0, V, T)):
    targets = jnp.asarray(targets, jnp.int32)
    want_logp, want_greedy = _reference(logits, targets)
    head = jnp.asarray(w if axis == 1 else w.T)
    logp, greedy = tiled_scores(jnp.asarray(x), head, targets, axis, CHUNK)
    np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(greedy), want_greedy)


def _with_tie(cfg):
  """Initial parameters whose head (the table, tied) has columns TIE equal and tripled."""
  params = Llama(cfg).init(jax.random.key(1))
  if cfg.tie_embeddings:
    table = params["embed"]["embedding"]
    table = table.at[TIE, :].set(3 * table[TIE[0]])
    return {**params, "embed": {"embedding": table}}
  kernel = params["head"]["kernel"]
  kernel = kernel.at[:, TIE].set(3 * kernel[:, TIE[0], None])
  return {**params, "head": {**params["head"], "kernel": kernel}}


def _batch(cfg, params):
  """Random rows; rows 0..3 count only their last target: in rows 0 and 2 the reference's
  argmax there, in rows 1 and 3 the tie's other column where the argmax is the tie's first, else
  a column at random; rows 4..7 count random positions (their flags mostly False). The last
  target is no input: it changes no logit."""
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, cfg.vocab, size=(A, B, L + 1)).astype(np.int32)
  logits = Llama(cfg).apply(params, jnp.asarray(tokens[..., :-1].reshape(A * B, L)))
  argmax = np.asarray(jnp.argmax(logits[:, -1], axis=-1)).reshape(A, B)
  tokens[:, 0:4:2, -1] = argmax[:, 0:4:2]
  tokens[:, 1:4:2, -1] = np.where(argmax == TIE[0], TIE[1], rng.integers(0, cfg.vocab, (A, B)))[
    :, 1:4:2
  ]
  weights = np.zeros((A, B, L), np.int32)
  weights[:, :4, -1] = 1
  weights[:, 4:] = rng.integers(0, 2, size=(A, 4, L))
  return Batch(tokens, weights), argmax


def _reference_rows(cfg, params, batch: Batch):
  tokens = jnp.asarray(batch.tokens).reshape(A * B, L + 1)
  logits = Llama(cfg).apply(params, tokens[:, :-1]).reshape(A * B * L, cfg.vocab)
  logp, greedy = _reference(logits, tokens[:, 1:].reshape(-1))
  counted = np.asarray(batch.weights).reshape(A * B * L) > 0
  logp = np.where(counted, logp, 0.0).reshape(A, B, L).sum(-1)
  greedy = (greedy | ~counted).reshape(A, B, L).all(-1)
  return logp, greedy


def _engine(strategy, cfg, chunk):
  model = Llama(cfg, vocab_chunk=chunk)
  return Engine(model, parse_strategy(strategy), make_mesh(2, 4), OPTIM, micro_batches=A)


@pytest.fixture(scope="module", params=[("IIG", CFG), ("GGG", TIED)], ids=["IIG", "GGG-tied"])
def scored(request):
  """(the engine, its placed parameters and batch, the reference's argmax of each row's last
  position, the reference rows, the engine's rows)."""
  strategy, cfg = request.param
  params0 = _with_tie(cfg)
  batch, argmax = _batch(cfg, params0)
  engine = _engine(strategy, cfg, CHUNK)
  assert engine.model.vocab_tiled
  params = engine.params(engine.state_from_params(params0))
  placed = engine.shard_batch(batch)
  got = jax.device_get(engine.forward.row_scores(params, placed))
  return engine, params, placed, argmax, _reference_rows(cfg, params0, batch), got


def test_tiled_row_scores_equal_the_whole_logits_single_device(scored):
  _, _, _, argmax, (want_logp, want_greedy), (logp, greedy) = scored
  assert (argmax[:, :4] == TIE[0]).any(), "some row ends on the tie: the tie is checked"
  assert want_greedy[:, :4].any() and not want_greedy[:, :4].all()
  np.testing.assert_allclose(logp, want_logp, rtol=2e-6, atol=2e-5)
  np.testing.assert_array_equal(greedy, want_greedy)


def _logits_sized(hlo: str, tokens: int, vocab: int) -> set[tuple[int, ...]]:
  """The fp32 buffers with a vocabulary axis and at least `tokens` entries across it."""
  shapes = {tuple(int(d) for d in s.split(",") if d) for s in re.findall(r"f32\[([0-9,]*)\]", hlo)}
  return {s for s in shapes if vocab in s and math.prod(s) // vocab >= tokens}


def test_compiled_row_scores_hold_no_whole_logits(scored):
  """Each device's micro-batch is 1 row of L tokens: the untiled program holds its L x V fp32
  logits (the check sees them), the tiled one nothing of L x V (its shards of the head, 62 x 8
  or 62 x 4, are below)."""
  engine, params, placed, *_ = scored
  hlo = engine.forward._row_scores.lower(params, placed).compile().as_text()
  assert not _logits_sized(hlo, L, CFG.vocab)
  if engine.strategy.name != "GGG":  # once: the untiled program of one placement
    return
  whole = _engine("GGG", TIED, 8192)
  assert not whole.model.vocab_tiled
  hlo = whole.forward._row_scores.lower(whole.params(whole.init_state(jax.random.key(0))), placed)
  assert _logits_sized(hlo.compile().as_text(), L, CFG.vocab)
