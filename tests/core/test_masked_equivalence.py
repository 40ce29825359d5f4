"""Every strategy's step on masked batches (instruction data: loss weights, packed rows) equals
the single-device loop on the same batches.

The batches are built to catch a wrong normalisation: examples of random lengths packed into
rows, prompts that are context only, so the micro-batches and the devices hold different numbers
of targets (one row holds none). The step's loss must be the sum of the counted targets' losses
over the step divided by their count over the step, as one big batch gives it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import Llama
from models.config import LlamaConfig
from paro_jax.core.batch import Batch
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.step import StepProgram
from paro_jax.core.strategy import parse_strategy
from paro_jax.run.reference import reference_train

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=3, clip_norm=0.5, eps=1e-6)
A, B, L, STEPS = 2, 8, 12, 2
LOSS_RTOL, PARAM_ATOL = 2e-6, 2e-5  # fp32 against the single-device loop


def packed_rows(rng, rows: int, pack: bool):
  """`rows` rows of examples (random length, a prompt then a completion), packed several to a
  row or one per row, right-padded: (tokens rows x L+1, weights rows x L, segments rows x L)."""
  tokens = np.zeros((rows, L + 1), np.int32)
  is_target = np.zeros((rows, L + 1), bool)  # the token is a completion token
  segment = np.zeros((rows, L + 1), np.int32)
  for r in range(rows - 1):  # the last row stays padding: a row with no target
    at, example = 0, 1
    while at < L + 1:
      n = min(int(rng.integers(3, 8)), L + 1 - at)
      if n < 2:
        break
      tokens[r, at : at + n] = rng.integers(1, CFG.vocab, n)
      prompt = int(rng.integers(1, n))
      is_target[r, at + prompt : at + n] = True
      segment[r, at : at + n] = example
      at, example = at + n, example + 1
      if not pack:
        break
  # A target counts where it is a completion token of the same example as its input.
  weights = is_target[:, 1:] & (segment[:, 1:] == segment[:, :-1]) & (segment[:, 1:] > 0)
  return tokens, weights.astype(np.int32), segment[:, :-1]


def masked_batches(pack: bool):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    t, w, s = packed_rows(rng, A * B, pack)
    shape = lambda x: x.reshape(A, B, -1)
    out.append(Batch(shape(t), shape(w), shape(s) if pack else None))
  return out


def reference_setup():
  """Packed batches, initial parameters, and the single-device loop's losses and parameters."""
  params0 = Llama(CFG).init(jax.random.key(1))
  batches = masked_batches(pack=True)
  losses, params = reference_train(Llama(CFG), params0, batches, OPTIM)
  return batches, params0, losses, params


@pytest.fixture(scope="module")
def setup():
  return reference_setup()


def run_engine(strategy, batches, params0, **engine_args):
  engine = Engine(
    Llama(CFG), parse_strategy(strategy), make_mesh(2, 4), OPTIM, micro_batches=A, **engine_args
  )
  state, losses, targets = engine.state_from_params(params0), [], []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
    targets.append(int(metrics["targets"]))
  return losses, targets, jax.device_get(state.master)


def assert_close(params, ref_params):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(x, y, atol=PARAM_ATOL, err_msg=jax.tree_util.keystr(path))


def test_the_batches_are_uneven(setup):
  """Otherwise a per-micro-batch or per-device mean would pass for the step's mean."""
  batches = setup[0]
  per_micro = [b.weights.reshape(A, -1).sum(1) for b in batches]
  per_row = [b.weights.sum(2) for b in batches]  # on 2x4, row r of each micro-batch: device r
  assert all(len(set(m)) > 1 for m in per_micro)
  assert all(len(set(r.sum(0))) > 1 and (r == 0).any() for r in per_row)
  assert all(b.segments.max() > 2 for b in batches)  # several examples in a row


def test_reference_is_the_mean_over_targets(setup):
  """The loop's first loss, by hand: each counted target's cross-entropy, averaged."""
  batches, params0, losses, _ = setup
  b = batches[0]
  rows = lambda x: x.reshape(A * B, -1)
  logits = Llama(CFG).apply(params0, rows(b.tokens)[:, :-1], segments_BxL=rows(b.segments))
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
  nll = -np.take_along_axis(np.asarray(logp), rows(b.tokens)[:, 1:, None], -1)[..., 0]
  want = nll[rows(b.weights) == 1].mean()
  np.testing.assert_allclose(losses[0], want, rtol=1e-5)


# One strategy per placement of each state (and the mixes the GPUs' program and the rings take
# below); every strategy is on the page experiments/results/equivalence_grid/ (its packed rows).
@pytest.mark.parametrize("strategy", ["NNN", "NIG", "IIG", "GGG"])
def test_packed_equals_single_device(setup, strategy):
  batches, params0, ref_losses, ref_params = setup
  losses, targets, params = run_engine(strategy, batches, params0)
  assert targets == [b.targets() for b in batches]
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_close(params, ref_params)


@pytest.mark.parametrize(
  "strategy,collectives,program",
  [
    ("IIG", "xla", StepProgram.SYNC_IN_BACKWARD),
    ("GGG", "horing", StepProgram.SYNC_IN_BACKWARD),
    ("NIG", "hring", StepProgram.BOUNDARY_SYNC),
  ],
)
def test_packed_on_the_other_programs(setup, strategy, collectives, program):
  """The GPUs' program (the last micro-batch apart) and the hand-written rings."""
  batches, params0, ref_losses, ref_params = setup
  losses, _, params = run_engine(
    strategy, batches, params0, collectives=collectives, program=program
  )
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_close(params, ref_params)


def test_unpacked_with_weights_equals_single_device():
  """One example per row, right-padded, no segments: the weights alone."""
  params0 = Llama(CFG).init(jax.random.key(1))
  batches = masked_batches(pack=False)
  ref_losses, ref_params = reference_train(Llama(CFG), params0, batches, OPTIM)
  losses, _, params = run_engine("IIG", batches, params0, prefetch=False)
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_close(params, ref_params)


def test_eval_sums_add_up_to_the_mean(setup):
  """The eval forward's sums of a Batch (core/forward.py, from the weights at P): the summed loss
  of its counted targets and their count, on any split into batches (`paro-jax eval`)."""
  batches, params0, _, _ = setup
  engine = Engine(Llama(CFG), parse_strategy("IIG"), make_mesh(2, 4), OPTIM, micro_batches=A)
  state = engine.state_from_params(params0)
  b = batches[0]
  total, count = engine.forward.sums(engine.params(state), engine.shard_batch(b))
  rows = lambda x: jnp.asarray(x.reshape(A * B, -1))
  logits = Llama(CFG).apply(params0, rows(b.tokens)[:, :-1], segments_BxL=rows(b.segments))
  ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), rows(b.tokens)[:, 1:, None], -1)[..., 0]
  assert int(count) == b.targets()
  np.testing.assert_allclose(float(total), float(jnp.sum(ce * rows(b.weights))), rtol=1e-5)
  mean = engine.eval_loss(state, engine.shard_batch(b))
  np.testing.assert_allclose(float(mean), float(total) / int(count), rtol=1e-6)
