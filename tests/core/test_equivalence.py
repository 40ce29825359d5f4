"""Every strategy's training step equals a plain single-device optax loop on the same batches.

Each strategy on one mesh here; every strategy on every mesh, tied embeddings under every
strategy and each hand-written collective under four strategies are the page
experiments/results/equivalence_grid/ (experiments/equivalence_grid.py runs this module's cells;
tests/experiments/test_equivalence_grid.py checks the page)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import Llama
from models.loss import next_token_loss
from models.config import LlamaConfig
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.wire import WireConfig
from paro_jax.core.mesh import make_mesh
from paro_jax.core.step import StepProgram
from paro_jax.run.reference import reference_train
from paro_jax.core.strategy import VALID_NAMES, parse_strategy

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
# Adam's first steps are nearly sign(g): for a gradient element near 0, float rounding in the
# order of a reduction could flip a whole lr-sized update. An eps well above that rounding
# keeps the comparison well-conditioned without hiding real errors (which are lr-sized).
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=3, clip_norm=0.5, eps=1e-6)
A, B, L, STEPS = 2, 8, 8, 3
# Equal to the reference: each step's loss within LOSS_RTOL of its, each final parameter within
# PARAM_ATOL (fp32; the page's cells are held to the same).
LOSS_RTOL, PARAM_ATOL = 2e-6, 2e-5


def reference_setup(cfg):
  """Batches, initial parameters, and the single-device loop's losses and final parameters."""
  # Rows of arithmetic sequences (random start and stride): learnable, so the loss moves.
  rng = np.random.default_rng(0)
  start, stride = (rng.integers(0, cfg.vocab, size=(STEPS, A, B, 1)) for _ in range(2))
  batches = list(((start + stride * np.arange(L + 1)) % cfg.vocab).astype(np.int32))
  params0 = Llama(cfg).init(jax.random.key(1))
  losses, params = reference_train(Llama(cfg), params0, batches, OPTIM)
  return batches, params0, losses, params


@pytest.fixture(scope="module")
def setup():
  return reference_setup(CFG)


_RUNS = {}  # one training run per configuration: tests that check the same run share it


def run_engine(
  strategy,
  mesh_shape,
  batches,
  params0,
  dtype=jnp.float32,
  collectives="xla",
  cfg=CFG,
  **engine_args,
):
  """(losses, final master parameters, engine, state) of `strategy` trained on `batches` from
  `params0` (each config's batches and parameters are its reference_setup's)."""
  key = (strategy, mesh_shape, dtype, collectives, cfg, tuple(sorted(engine_args.items())))
  if key not in _RUNS:
    _RUNS[key] = train_engine(
      strategy, mesh_shape, batches, params0, dtype, collectives, cfg, **engine_args
    )
  return _RUNS[key]


def train_engine(strategy, mesh_shape, batches, params0, dtype, collectives, cfg, **engine_args):
  engine = Engine(
    Llama(cfg, dtype),
    parse_strategy(strategy),
    make_mesh(*mesh_shape),
    OPTIM,
    micro_batches=A,
    collectives=collectives,
    **engine_args,
  )
  state = engine.state_from_params(params0)
  losses = []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return losses, jax.device_get(state.master), engine, state


def assert_trees_close(a, b, atol, rtol=0.0):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), atol=atol, rtol=rtol, err_msg=jax.tree_util.keystr(path)
    )


def test_reference_moves_every_parameter(setup, qwen2_setup, tied_setup):
  # Otherwise "equal to the reference" could hold for a step that does nothing.
  for _, params0, _, params in (setup, qwen2_setup, tied_setup):
    assert_every_leaf_moved(params0, params)
  assert {"bq", "bk", "bv"} < set(qwen2_setup[3]["layers"]["attn"])
  assert {"q_norm", "k_norm"} < set(tied_setup[3]["layers"]["attn"])


def assert_every_leaf_moved(params0, params):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(params0)):
    assert np.abs(np.asarray(a) - np.asarray(b)).mean() > 1e-3, jax.tree_util.keystr(path)


# The Qwen2 shape: biases on q, k and v (their leaves split along `proj_out`). It takes the four
# nodes of 2 below, the Llama shape the two nodes of 4 and one node: every strategy sees each
# without a compile more.
QWEN2 = dataclasses.replace(CFG, family="qwen2")


@pytest.fixture(scope="module")
def qwen2_setup():
  return reference_setup(QWEN2)


# Every strategy on one of two nodes of 4 (the Llama shape) and four nodes of 2 (the Qwen2 shape);
# the page holds each on both. On one node of 8 (inter = 1) I and G are the same placement and
# every inter collective is empty, so the 14 collapse to a few programs: here a mix, on the page
# one state per placement and two mixes.
TWO_NODES_OF_4 = ("NNN", "NNG", "NIG", "INI", "IIG", "IGG", "GIG")
FOUR_NODES_OF_2 = ("NNI", "NII", "NGG", "ING", "III", "GNG", "GGG")
CASES = [(s, (2, 4)) for s in TWO_NODES_OF_4] + [(s, (4, 2)) for s in FOUR_NODES_OF_2]
CASES += [("NIG", (1, 8))]


def test_each_strategy_has_a_case():
  assert sorted(s for s, m in CASES if m[0] > 1) == sorted(VALID_NAMES)


@pytest.mark.parametrize("strategy,mesh_shape", CASES, ids=[f"{s}-{m[0]}x{m[1]}" for s, m in CASES])
def test_fp32_equals_single_device(setup, qwen2_setup, strategy, mesh_shape):
  cfg, (batches, params0, ref_losses, ref_params) = (
    (QWEN2, qwen2_setup) if mesh_shape == (4, 2) else (CFG, setup)
  )
  losses, params, _, _ = run_engine(strategy, mesh_shape, batches, params0, cfg=cfg)
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_trees_close(params, ref_params, atol=PARAM_ATOL)


# Tied embeddings (Llama 3.2's, the small Qwen3's): the table is also the output head, one leaf,
# its gradient the sum of both uses; with a vocabulary no mesh divides (the tables are split
# along `embed`). In the Qwen3 shape: q/k norms (split along `head_dim`) and a head_dim apart from
# dim/heads.
TIED = dataclasses.replace(CFG, vocab=61, tie_embeddings=True, family="qwen3", head_dim=16)


@pytest.fixture(scope="module")
def tied_setup():
  return reference_setup(TIED)


# One strategy per placement of the table (P: N, I, G) and of its gradient (Gr: N, I, G); every
# strategy is on the page.
@pytest.mark.parametrize("strategy", ["NNN", "NIG", "IIG", "GGG"])
def test_tied_embeddings_equal_single_device(tied_setup, strategy):
  batches, params0, ref_losses, ref_params = tied_setup
  losses, params, _, _ = run_engine(strategy, (2, 4), batches, params0, cfg=TIED)
  assert set(params["head"]) == {"norm"}
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_trees_close(params, ref_params, atol=PARAM_ATOL)


@pytest.mark.parametrize("strategy,collectives", [("IIG", "xla"), ("GGG", "horing")])
def test_tied_embeddings_with_sync_in_backward(tied_setup, strategy, collectives):
  """The GPUs' program, on XLA's collectives and on the rings: the table's gradient (both uses)
  waits for the boundary sync like an untied embedding's."""
  batches, params0, ref_losses, ref_params = tied_setup
  losses, params, engine, _ = run_engine(
    strategy,
    (2, 4),
    batches,
    params0,
    collectives=collectives,
    cfg=TIED,
    program=StepProgram.SYNC_IN_BACKWARD,
  )
  assert engine.program is StepProgram.SYNC_IN_BACKWARD
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_trees_close(params, ref_params, atol=PARAM_ATOL)


def test_tied_reference_moves_the_table(tied_setup):
  _, params0, _, params = tied_setup
  moved = np.abs(params["embed"]["embedding"] - params0["embed"]["embedding"]).mean()
  assert moved > 1e-3


@pytest.mark.parametrize("strategy", ["NNN", "IIG", "ING", "GGG"])
def test_bf16_close_to_single_device(setup, strategy):
  batches, params0, ref_losses, ref_params = setup
  losses, params, _, _ = run_engine(strategy, (2, 4), batches, params0, dtype=jnp.bfloat16)
  np.testing.assert_allclose(losses, ref_losses, atol=2e-2)
  # Adam normalises updates, so bf16 noise moves a parameter by at most ~lr per step.
  assert_trees_close(params, ref_params, atol=STEPS * OPTIM.learning_rate)
  moved = jax.tree.map(lambda a, b: np.abs(a - b).mean(), params, ref_params)
  assert max(jax.tree.leaves(moved)) < 2e-3


def test_micro_batched_gradients_equal_full_batch(setup):
  batches, params0, _, _ = setup
  model = Llama(CFG)
  tokens = jnp.asarray(batches[0])

  def loss(params, tokens_BxL1):
    return next_token_loss(model.apply(params, tokens_BxL1[:, :-1]), tokens_BxL1[:, 1:])

  grad = jax.jit(jax.grad(loss))
  micro = [grad(params0, t) for t in tokens]
  accumulated = jax.tree.map(lambda *g: sum(g) / len(g), *micro)
  full = grad(params0, tokens.reshape(A * B, L + 1))
  assert_trees_close(accumulated, full, atol=1e-7, rtol=1e-5)


# Each implementation under a strategy of its own (and in the sync-in-backward tests below under
# another); each under NNN, NIG, IIG and GGG is on the page.
@pytest.mark.parametrize(
  "strategy,collectives", [("GGG", "ring"), ("NIG", "hring"), ("IIG", "horing")]
)
def test_hand_written_collectives_equal_single_device(setup, strategy, collectives):
  batches, params0, ref_losses, ref_params = setup
  losses, params, _, _ = run_engine(strategy, (2, 4), batches, params0, collectives=collectives)
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_trees_close(params, ref_params, atol=PARAM_ATOL)


def test_mixed_collectives_equal_single_device(setup):
  """Rings over both axes, XLA's collectives over one: `--collectives auto` on CPU processes
  (which of the two each collective gets: tests/core/test_collectives.py)."""
  batches, params0, ref_losses, ref_params = setup
  losses, params, _, _ = run_engine("GGG", (2, 4), batches, params0, collectives="hring+xla")
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_trees_close(params, ref_params, atol=PARAM_ATOL)


# The layers' gradient sync inside the last micro-batch's backward (the default on GPUs): one
# strategy per shape of the boundary sync (all-reduce over both axes; reduce-scatter intra and
# all-reduce inter; reduce-scatter inter; reduce-scatter over both; nothing), on XLA's
# collectives and on the rings.
SYNC = StepProgram.SYNC_IN_BACKWARD
SYNC_IN_BACKWARD = [
  ("NNN", "xla"),
  ("INI", "xla"),
  ("IIG", "xla"),
  ("NNG", "xla"),
  ("GGG", "xla"),
  ("NIG", "hring"),
  ("IIG", "horing"),
]


@pytest.mark.parametrize("strategy,collectives", SYNC_IN_BACKWARD)
def test_sync_in_backward_equals_single_device(setup, strategy, collectives):
  batches, params0, ref_losses, ref_params = setup
  losses, params, engine, _ = run_engine(
    strategy, (2, 4), batches, params0, collectives=collectives, program=SYNC
  )
  assert engine.program is SYNC
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_trees_close(params, ref_params, atol=PARAM_ATOL)


def test_sync_in_backward_with_one_micro_batch(setup):
  """A=1: the only micro-batch is the last; the single-device loop on its batches."""
  batches, params0, _, _ = setup
  one = [b[:1] for b in batches]
  engine = Engine(Llama(CFG), parse_strategy("NIG"), make_mesh(2, 4), OPTIM, program=SYNC)
  assert_equals_reference(engine, params0, one)


def assert_equals_reference(engine, params0, batches):
  """`engine` trained on `batches` equals the single-device loop on them."""
  ref_losses, ref_params = reference_train(Llama(CFG), params0, batches, OPTIM)
  state, losses = engine.state_from_params(params0), []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_trees_close(jax.device_get(state.master), ref_params, atol=PARAM_ATOL)


def test_the_platform_picks_boundary_sync_on_cpu():
  engine = Engine(Llama(CFG), parse_strategy("IIG"), make_mesh(2, 4), OPTIM)
  # XLA:CPU runs collectives in line: nothing to overlap
  assert engine.program is StepProgram.BOUNDARY_SYNC


@pytest.mark.parametrize("program", list(StepProgram))
def test_each_step_program_equals_single_device(setup, program):
  """The two programs the platform chooses between (Engine.program), each forced on CPU: the
  same losses and parameters as the single-device loop."""
  batches, params0, ref_losses, ref_params = setup
  losses, params, engine, _ = run_engine("IIG", (2, 4), batches, params0, program=program)
  assert engine.program is program
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert_trees_close(params, ref_params, atol=PARAM_ATOL)


@pytest.mark.parametrize("engine_args", [{"prefetch": False}, {"error_feedback": True}])
def test_sync_in_backward_falls_back_to_the_boundary(engine_args):
  """It needs the prefetching stack, and error feedback syncs at the boundary only."""
  wire = WireConfig(grads="int8") if "error_feedback" in engine_args else WireConfig()
  engine = Engine(
    Llama(CFG),
    parse_strategy("IIG"),
    make_mesh(2, 4),
    OPTIM,
    program=SYNC,
    wire=wire,
    **engine_args,
  )
  assert engine.program is StepProgram.BOUNDARY_SYNC


@pytest.mark.parametrize("strategy,collectives", [("ING", "xla"), ("IGG", "horing")])
def test_sync_in_backward_with_four_micro_batches(setup, strategy, collectives):
  """A=4: the first micro-batch's gradients are the accumulator (written, not added to zeros),
  the next two add to it in place in a real loop, then the syncing stack."""
  two, params0, _, _ = setup
  # each step: its own two micro-batches and the next step's
  batches = [np.concatenate([b, two[(i + 1) % STEPS]]) for i, b in enumerate(two)]
  engine = Engine(
    Llama(CFG),
    parse_strategy(strategy),
    make_mesh(2, 4),
    OPTIM,
    micro_batches=4,
    collectives=collectives,
    program=SYNC,
  )
  assert_equals_reference(engine, params0, batches)
