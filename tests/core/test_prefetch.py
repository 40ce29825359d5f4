"""The prefetching layer stack (core/prefetch.py) gives the gradients of the plain
layer scan: the same Gr shards on every device, for stacks of 1, 2 and 3 layers (the peeled
iterations and the loops of the backward are all exercised), with and without LoRA.

Here ZeRO-3 (GGG) on each stack and the other strategies on 3 layers; every strategy on every
stack is the page experiments/results/prefetch_grid/ (experiments/prefetch_grid.py runs this
module's cells; tests/experiments/test_prefetch_grid.py checks the page)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models.llama import Llama
from models.config import LlamaConfig, LoraConfig
from paro_jax.core import step
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.names import BATCH_AXES, GLOBAL_AXES
from paro_jax.core.sharding import named
from paro_jax.core.strategy import parse_strategy

B, L = 8, 8
RTOL, ATOL = 1e-5, 1e-7  # the prefetched gradients against the plain scan's
LORA = LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "wo", "w_up", "w_down"))


def cfg(layers):
  return LlamaConfig(vocab=64, dim=32, layers=layers, heads=4, kv_heads=2, head_dim=8, mlp=64)


def local_grads(engine, params, tokens_BxL1, collectives_check=True):
  """Each device's gradients at Gr for one micro-batch, stacked on a leading device axis."""
  batch_spec = PartitionSpec(BATCH_AXES, None)

  def local(params, tokens_BxL1):
    loss_fn = lambda sinks: step.micro_loss(
      engine, params, sinks, tokens_BxL1, step.materializer(engine)
    )
    grads = jax.grad(loss_fn)(step.make_sinks(engine))
    return jax.tree.map(lambda g: g[None], grads)

  fn = jax.shard_map(
    local,
    mesh=engine.mesh,
    in_specs=(engine.specs.params, batch_spec),
    out_specs=PartitionSpec(GLOBAL_AXES),
    check_vma=collectives_check,
  )
  tokens_BxL1 = jax.device_put(tokens_BxL1, NamedSharding(engine.mesh, batch_spec))
  return jax.device_get(jax.jit(fn)(params, tokens_BxL1))


def both_grads(strategy, layers, lora=None, collectives="xla", bucket_layers=False):
  model = Llama(cfg(layers), jnp.float32, lora=lora)
  mesh = make_mesh(2, 4)
  engines = [
    Engine(
      model, parse_strategy(strategy), mesh, OptimConfig(), collectives=collectives, prefetch=pf
    )
    for pf in (False, True)
  ]
  assert [e.layer_stack for e in engines] == [step.LayerStack.MODEL_SCAN, step.LayerStack.PREFETCH]
  engines[1].bucket_layers = bucket_layers  # XLA's collectives one bucket per layer (GPUs)
  params0 = model.init(jax.random.key(0))
  if lora:  # non-zero B, so that every adapter has a gradient
    params0 = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.05 if str(p[-1].key).endswith("_lora_b") else x, params0
    )
  # At the P placement, as the step holds them (frozen base included).
  params = jax.device_put(params0, named(mesh, engines[0].specs.params))
  tokens = np.random.default_rng(layers).integers(0, 64, (B, L + 1)).astype(np.int32)
  return [local_grads(e, params, tokens, collectives == "xla") for e in engines]


def assert_close(plain, prefetched):
  leaves = jax.tree_util.tree_leaves_with_path(plain)
  assert leaves and len(leaves) == len(jax.tree.leaves(prefetched))
  for (path, a), b in zip(leaves, jax.tree.leaves(prefetched)):
    assert np.abs(a).max() > 0, jax.tree_util.keystr(path)  # a gradient that is there
    np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


CASES = [("GGG", 1), ("GGG", 2)] + [(s, 3) for s in ("ING", "IIG", "IGG", "GNG", "GIG", "GGG")]


@pytest.mark.parametrize("strategy,layers", CASES)
def test_prefetch_grads_equal_plain_scan(strategy, layers):
  assert_close(*both_grads(strategy, layers))


@pytest.mark.parametrize("strategy,layers", [("ING", 1), ("GGG", 3)])
def test_prefetch_grads_equal_plain_scan_lora(strategy, layers):
  plain, prefetched = both_grads(strategy, layers, LORA)
  # Only the adapters are trained: no gradient for the frozen base weights.
  assert all(
    str(path[-1].key).endswith(("_lora_a", "_lora_b"))
    for path, _ in jax.tree_util.tree_leaves_with_path(plain)
  )
  assert_close(plain, prefetched)


def test_prefetch_grads_equal_plain_scan_horing():
  assert_close(*both_grads("IIG", 3, collectives="horing"))


@pytest.mark.parametrize("strategy", ["IIG", "GGG"])
def test_prefetch_grads_equal_plain_scan_bucketed_xla(strategy):
  """The stack as it runs on GPUs: XLA's collectives on one bucket per layer."""
  assert_close(*both_grads(strategy, 3, bucket_layers=True))
