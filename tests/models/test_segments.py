"""Packed rows: several examples in one row, kept apart (models/llama.py `segments_BxL`).

An example packed beside others must be computed as if it were alone: its attention sees only
its own earlier tokens and its RoPE positions start at 0. Checked against the model on each
example alone in a right-padded row; cuDNN's packed layout (offsets and lengths of each row's
runs) against the segment ids it is built from.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig, MAX_SEGMENTS
from models.attention import segment_runs
from models.llama import Llama
from models.rope import segment_positions

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
L = 24
LENGTHS = [5, 9, 7]  # three examples, then 3 tokens of padding


@pytest.fixture(scope="module")
def model_and_params():
  model = Llama(CFG, jnp.float32)
  return model, model.init(jax.random.key(0))


def packed_row(rng):
  examples = [rng.integers(1, CFG.vocab, n).astype(np.int32) for n in LENGTHS]
  tokens = np.zeros(L, np.int32)
  segments = np.zeros(L, np.int32)
  at = 0
  for i, ex in enumerate(examples, 1):
    tokens[at : at + len(ex)], segments[at : at + len(ex)] = ex, i
    at += len(ex)
  return examples, tokens, segments


def test_positions_restart_per_segment():
  segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(
    segment_positions(segments), [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]
  )


def test_packed_logits_equal_each_example_alone(model_and_params):
  """Each example's logits in the packed row equal its logits alone in a right-padded row
  (fp32): so its per-example loss is the same packed or unpacked."""
  model, params = model_and_params
  examples, tokens, segments = packed_row(np.random.default_rng(0))
  packed = model.apply(params, tokens[None], segments_BxL=segments[None])[0]
  at = 0
  for ex in examples:
    alone = np.zeros(L, np.int32)
    alone[: len(ex)] = ex  # one example per row, padding after it: no mask needed
    want = model.apply(params, alone[None])[0, : len(ex)]
    np.testing.assert_allclose(packed[at : at + len(ex)], want, rtol=1e-5, atol=1e-5)
    at += len(ex)


def test_a_token_does_not_see_the_other_examples(model_and_params):
  """Changing another example of the same row (its tokens, or its length, which moves nothing
  else) leaves every token of this one unchanged."""
  model, params = model_and_params
  _, tokens, segments = packed_row(np.random.default_rng(1))
  apply = jax.jit(lambda t, s: model.apply(params, t[None], segments_BxL=s[None])[0])
  base = apply(tokens, segments)
  first, second = slice(0, 5), slice(5, 14)
  changed = tokens.copy()
  changed[second] = (tokens[second] + 7) % CFG.vocab
  out = apply(changed, segments)
  assert np.abs(out[second] - base[second]).max() > 1e-3  # the change is seen where it is
  np.testing.assert_array_equal(out[first], base[first])
  np.testing.assert_array_equal(out[14:21], base[14:21])  # the third example, after it
  # the same tokens as one segment: now the third example sees the others
  joined = segments.copy()
  joined[:21] = 1
  assert np.abs(apply(tokens, joined)[14:21] - base[14:21]).max() > 1e-3


def test_segment_runs_are_the_rows_runs():
  """cuDNN's packed layout, built from segment ids: each run (an example, or the padding after
  the examples) as its offset and length, -1 past the last; rebuilt into a mask it is the
  segment mask the written-out attention uses."""
  segments = np.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1] * 8, [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
  offsets, lengths = segment_runs(jnp.asarray(segments), runs=8)
  np.testing.assert_array_equal(offsets[0], [0, 3, 5, 6, -1, -1, -1, -1, -1])
  np.testing.assert_array_equal(lengths[0], [3, 2, 1, 2, -1, -1, -1, -1])
  np.testing.assert_array_equal(offsets[1], [0] + [-1] * 8)
  np.testing.assert_array_equal(lengths[1], [8] + [-1] * 7)
  np.testing.assert_array_equal(lengths[2], [1] * 8)
  for row, offs, lens in zip(segments, np.asarray(offsets), np.asarray(lengths)):
    run = np.full(8, -1)
    for k, (o, n) in enumerate(zip(offs, lens)):
      if n > 0:
        run[o : o + n] = k
    assert (run >= 0).all()  # every token in one run
    np.testing.assert_array_equal(run[:, None] == run[None, :], row[:, None] == row[None, :])


def test_the_kernel_gets_a_run_per_example_and_the_padding():
  """MAX_SEGMENTS examples and the padding after them fit the packed layout's static size."""
  segments = np.zeros((1, 2 * MAX_SEGMENTS + 2), np.int32)
  segments[0, : 2 * MAX_SEGMENTS] = np.repeat(np.arange(1, MAX_SEGMENTS + 1), 2)
  offsets, lengths = segment_runs(jnp.asarray(segments), MAX_SEGMENTS + 1)
  assert int(jnp.sum(lengths > 0)) == MAX_SEGMENTS + 1
  assert int(jnp.sum(lengths[lengths > 0])) == segments.shape[1]
