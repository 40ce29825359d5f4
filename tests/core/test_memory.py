"""Bytes each device really holds for each state == the formula of docs/design.md."""

import collections

import jax
import jax.numpy as jnp
import pytest

from models.llama import Llama
from models.config import LlamaConfig
from paro_jax.analysis.planner.costs import model_state_bytes
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.step import make_sinks
from paro_jax.core.strategy import VALID_NAMES, parse_strategy

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)


def bytes_per_device(tree):
  """Sum of the addressable shards' sizes on each device (scalars such as Adam's count aside)."""
  held = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    if leaf.ndim == 0:
      continue
    for shard in leaf.addressable_shards:
      held[shard.device] += shard.data.nbytes
  assert len(set(held.values())) == 1, f"devices hold different amounts: {held}"
  assert len(held) == 8
  return next(iter(held.values()))


def gradient_sinks(engine):
  """The step's gradient accumulator, as it holds it between micro-batches (core/step.py
  make_sinks: zeros at the Gr placement, trained leaves only), each device's as its shards."""
  # check_vma off: the sinks are typed varying over every axis, and only out_specs places them
  fn = jax.shard_map(
    lambda: make_sinks(engine),
    mesh=engine.mesh,
    in_specs=(),
    out_specs=engine.trained_specs.grads,
    check_vma=False,
  )
  return jax.jit(fn)()


@pytest.fixture(scope="module")
def params0():
  return Llama(CFG).init(jax.random.key(0))


@pytest.mark.parametrize("strategy", VALID_NAMES)
def test_state_bytes_match_formula(params0, strategy):
  s = parse_strategy(strategy)
  engine = Engine(Llama(CFG, jnp.bfloat16), s, make_mesh(2, 4), OptimConfig())
  state = engine.state_from_params(params0)
  psi = sum(x.size for x in jax.tree.leaves(params0))
  assert psi == CFG.param_count()
  expected = model_state_bytes(s, psi, psi, inter=2, intra=4, param_bytes=2, grad_bytes=2)
  assert bytes_per_device(engine.params(state)) == expected["params"]
  assert bytes_per_device(gradient_sinks(engine)) == expected["grads"]
  # fp32 master weights + Adam's two fp32 moments.
  assert bytes_per_device((state.master, state.opt_state)) == expected["opt"]


@pytest.mark.parametrize("strategy", VALID_NAMES)
def test_fp32_grads_bytes_match_formula(strategy):
  """--grad-dtype fp32: 4 bytes per gradient element at its Gr placement (the step's accumulator
  is this one: tests/core/test_engine_compress.py reads its dtype from the step)."""
  s = parse_strategy(strategy)
  engine = Engine(Llama(CFG, jnp.bfloat16), s, make_mesh(2, 4), OptimConfig(), grad_dtype="fp32")
  psi = CFG.param_count()
  expected = model_state_bytes(s, psi, psi, inter=2, intra=4, param_bytes=2, grad_bytes=4)
  assert bytes_per_device(gradient_sinks(engine)) == expected["grads"]
  assert expected["grads"] == 2 * model_state_bytes(s, psi, psi, 2, 4)["grads"]


def test_params_view_is_the_master_weights_in_compute_dtype(params0):
  engine = Engine(Llama(CFG, jnp.bfloat16), parse_strategy("IIG"), make_mesh(2, 4), OptimConfig())
  view = jax.device_get(engine.params(engine.state_from_params(params0)))
  for a, b in zip(jax.tree.leaves(view), jax.tree.leaves(params0)):
    assert a.dtype == jnp.bfloat16
    assert (a == b.astype(jnp.bfloat16)).all()
