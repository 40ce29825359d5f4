"""The engine with compressed inter-node traffic (--inter-params/--inter-grads) and fp32 gradients
(--grad-dtype fp32), against the single-device fp32 reference of test_equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import Llama
from paro_jax.analysis.inspect.abstract import abstract_inputs
from paro_jax.core.wire import WireConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy
from tests.core.test_equivalence import A, CFG, OPTIM, STEPS, assert_trees_close, setup  # noqa: F401

INT8 = WireConfig("int8", "int8", block=64)


def run(strategy, batches, params0, wire, collectives="xla", dtype=jnp.float32, grad="compute"):
  engine = Engine(
    Llama(CFG, dtype),
    parse_strategy(strategy),
    make_mesh(2, 4),
    OPTIM,
    micro_batches=A,
    collectives=collectives,
    wire=wire,
    grad_dtype=grad,
  )
  state = engine.state_from_params(params0)
  losses = []
  for batch in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return losses, state


def replicas_agree(tree) -> bool:
  """Every device holding the same slice of a master weight holds the same values: a compressed
  all-reduce that handed replicas different gradients would split them apart."""
  for leaf in jax.tree.leaves(tree):
    by_index = {}
    for shard in leaf.addressable_shards:
      key = tuple((s.start, s.stop) for s in shard.index)
      by_index.setdefault(key, []).append(np.asarray(shard.data))
    if any(not np.array_equal(c, copies[0]) for copies in by_index.values() for c in copies[1:]):
      return False
  return True


def close_not_equal(losses, state, ref_losses, ref_params) -> dict:
  """The figures assert_close_not_equal holds to its bounds (a results page records them)."""
  params = jax.device_get(state.master)
  pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)))
  return {
    # assert_allclose's: |a - b| <= atol + rtol |b|, its default rtol 1e-7
    "loss_excess": float(max(abs(a - b) - 1e-7 * abs(b) for a, b in zip(losses, ref_losses))),
    "param_abs_diff": max(float(np.abs(a - b).max()) for a, b in pairs),
    "param_mean_diff": max(float(np.abs(a - b).mean()) for a, b in pairs),
    "replicas_agree": replicas_agree(state.master),
  }


def assert_close_not_equal(figures):
  assert figures["loss_excess"] <= 1e-2, figures
  # int8 noise can flip Adam's early, sign-like updates of near-zero gradients: at most 2 lr each.
  assert figures["param_abs_diff"] <= 2 * STEPS * OPTIM.learning_rate, figures
  assert figures["param_mean_diff"] < 3e-3, figures
  # Every strategy sends something across nodes: compression must have changed the result.
  assert figures["param_abs_diff"] > 1e-5, figures
  assert figures["replicas_agree"], figures


# One strategy per placement of each state; every strategy is on the page
# experiments/results/equivalence_grid/ (its int8 cells).
@pytest.mark.parametrize("strategy", ["NNN", "NIG", "IIG", "GGG"])
def test_int8_inter_traffic(setup, strategy):  # noqa: F811
  batches, params0, ref_losses, ref_params = setup
  losses, state = run(strategy, batches, params0, INT8)
  assert_close_not_equal(close_not_equal(losses, state, ref_losses, ref_params))


@pytest.mark.parametrize(
  "strategy,collectives", [("IIG", "horing"), ("GGG", "horing"), ("NNN", "ring"), ("III", "hring")]
)
def test_int8_hand_written_collectives(setup, strategy, collectives):  # noqa: F811
  batches, params0, ref_losses, ref_params = setup
  losses, state = run(strategy, batches, params0, INT8, collectives)
  assert_close_not_equal(close_not_equal(losses, state, ref_losses, ref_params))


def test_bf16_wire_and_fp32_grads(setup):  # noqa: F811
  batches, params0, ref_losses, ref_params = setup
  losses, state = run("NIG", batches, params0, WireConfig("bf16", "bf16"), grad="fp32")
  assert_close_not_equal(close_not_equal(losses, state, ref_losses, ref_params))


def test_fp32_grads_in_fp32_compute_equal_reference(setup):  # noqa: F811
  batches, params0, ref_losses, ref_params = setup
  losses, state = run("IIG", batches, params0, WireConfig(), grad="fp32")
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  assert_trees_close(jax.device_get(state.master), ref_params, atol=2e-5)


def _micro_batch_carry_dtypes(engine):
  """dtypes of the accumulator the step carries through its micro-batch scan (from the jaxpr)."""
  state, batch = abstract_inputs(engine, batch_size=8, seq_len=8)
  jaxpr = jax.make_jaxpr(engine._train_step)(state, batch)

  def scans(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name == "scan" and eqn.params["length"] == A:
        yield eqn
      for p in eqn.params.values():
        inner = getattr(p, "jaxpr", p)
        if hasattr(inner, "eqns"):
          yield from scans(inner)

  eqn = next(scans(jaxpr.jaxpr))
  nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
  return {str(a.dtype) for a in eqn.params["jaxpr"].in_avals[nc : nc + ncarry]}


@pytest.mark.parametrize("grad,want", [("compute", "bfloat16"), ("fp32", "float32")])
def test_step_accumulates_in_grad_dtype(grad, want):
  engine = Engine(
    Llama(CFG, jnp.bfloat16), parse_strategy("IIG"), make_mesh(2, 4), OPTIM, A, grad_dtype=grad
  )
  assert _micro_batch_carry_dtypes(engine) == {want}


def test_bad_grad_dtype_refused():
  with pytest.raises(ValueError, match="grad dtype"):
    Engine(Llama(CFG), parse_strategy("IIG"), make_mesh(2, 4), OPTIM, grad_dtype="fp16")


def test_eval_scores_the_exact_weights_whatever_the_wire(setup):  # noqa: F811
  """GGG gathers its weights per layer, across nodes: with int8 on the wire the training step sees
  quantized weights, but the eval loss is the uncompressed engine's, to the last bit."""
  batches, params0, _, _ = setup

  def eval_loss(wire):
    engine = Engine(Llama(CFG), parse_strategy("GGG"), make_mesh(2, 4), OPTIM, A, wire=wire)
    state = engine.state_from_params(params0)
    return float(engine.eval_loss(state, engine.shard_batch(batches[0])))

  assert eval_loss(INT8) == eval_loss(WireConfig())


def test_eval_over_several_batches_is_their_mean(setup):  # noqa: F811
  """`--eval-batches K` scores one batch of K step batches in one program: the same as the mean
  of the K batches scored one at a time."""
  batches, params0, _, _ = setup
  engine = Engine(Llama(CFG), parse_strategy("IIG"), make_mesh(2, 4), OPTIM, A)
  state = engine.state_from_params(params0)
  one = [float(engine.eval_loss(state, engine.shard_batch(b))) for b in batches[:2]]
  both = engine.shard_batch(np.concatenate(batches[:2]), any_micro_batches=True)
  assert float(engine.eval_loss(state, both)) == pytest.approx(np.mean(one), rel=1e-6)
  with pytest.raises(ValueError, match="micro-batches"):
    engine.shard_batch(np.concatenate(batches[:2]))
