"""`--outer-state I` (core/outer.py `sync_at_node`): the outer weights and momentum held by every
node over its own devices, a round's only traffic across nodes the pseudo-gradient's all-reduce.

Checked against the single-device DiLoCo loops of tests/core/test_outer.py and
test_outer_stream.py (written apart from the engine), against the outer state at G, and the
compiled round's bytes across nodes against the formula, counted in the HLO.
"""

import functools
import math

import jax
import numpy as np
import pytest

from models.llama import Llama
from paro_jax.analysis.hlo.collectives import crosses_groups, device_bytes, parse_collectives
from paro_jax.core.config import OuterOptions
from paro_jax.core.groups import GroupEngine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy
from paro_jax.core.wire import Codec
from tests.core import test_outer_stream as stream
from tests.core.test_outer import (
  CFG,
  GROUPS,
  H,
  OPTIM,
  PAPER,
  PLAIN,
  REMAT,
  assert_trees_close,
  bytes_per_device,
  full,  # noqa: F401 - the module's fixture: the same reference rounds
  make_batches,
  run_groups,
)

AT_NODE = OuterOptions(sync=H, lr=PAPER.lr, momentum=PAPER.momentum, state="I")
PLAIN_AT_NODE = OuterOptions(sync=H, lr=PLAIN.lr, momentum=PLAIN.momentum, state="I")
M = 4  # devices per node (the 2x4 mesh)


@functools.cache
def rounds_of(strategy: str, state: str):
  """3 rounds of H = 2 with the pseudo-gradient in fp32, the outer state at `state`."""
  model = Llama(CFG, remat=REMAT)
  params0 = model.init(jax.random.key(1))
  outer = AT_NODE if state == "I" else PAPER
  return run_groups(model, strategy, params0, make_batches(), outer)


# OS = N (NNN: the restart gathered over intra) and OS = I (III: no collective in the node).
@pytest.mark.parametrize("strategy", ["NNN", "III"])
def test_rounds_at_node_equal_single_device_diloco(full, strategy):  # noqa: F811
  _, _, _, (ref_losses, ref_rounds) = full
  losses, rounds, engine, state = rounds_of(strategy, "I")
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  for got, want in zip(rounds, ref_rounds):
    assert_trees_close(got, want, atol=2e-5)
  master = jax.device_get(state.master)
  for k in range(GROUPS):  # every group restarted from the last round's outer weights
    assert_trees_close(jax.tree.map(lambda x: x[k], master), ref_rounds[-1], atol=2e-5)
  assert_trees_close(jax.device_get(engine.params(state)), ref_rounds[-1], atol=2e-5)
  # The outer weights and momentum are sharded over a node's devices and replicated across
  # nodes: device (0, j) and (1, j) hold the same shard.
  specs = [
    str(x.sharding.spec) for x in jax.tree.leaves((state.outer.params, state.outer.opt_state))
  ]
  assert not any("inter" in s for s in specs) and any("intra" in s for s in specs)


def test_outer_state_at_node_and_at_g_agree():
  """III with the outer state at I and at G: the same rounds (fp32), up to the float order of
  the two programs' sums."""
  _, at_node, _, _ = rounds_of("III", "I")
  _, at_g, _, _ = rounds_of("III", "G")
  for a, b in zip(at_node, at_g):
    assert_trees_close(a, b, atol=1e-6)


@pytest.fixture(scope="module")
def apart(full):  # noqa: F811
  """Each group's weights after one round's inner steps (the round not ended): [group][leaf]."""
  model, params0, batches, _ = full
  _, _, _, state = run_groups(model, "III", params0, batches[:H], outer=OuterOptions(sync=100))
  master = jax.device_get(state.master)
  return [jax.tree.map(lambda x: np.asarray(x)[k], master) for k in range(GROUPS)]


@functools.cache
def compressed_round(fmt: str, state: str = "I"):
  """One round of III with the pseudo-gradient on the wire as `fmt` (blocks of 32, error
  feedback on), outer lr 1 and no momentum; and the compiled step's HLO."""
  model = Llama(CFG, remat=REMAT)
  params0 = model.init(jax.random.key(1))
  outer = PLAIN_AT_NODE if state == "I" else PLAIN
  engine = GroupEngine(
    model,
    parse_strategy("III"),
    make_mesh(GROUPS, M),
    OPTIM,
    outer,
    Codec(fmt, 32),
    micro_batches=2,
  )
  state0 = engine.state_from_params(params0)
  batches = make_batches()[:H]
  hlo = engine.train_step.lower(state0, engine.shard_batch(batches[0])).compile().as_text()
  state = state0
  for tokens in batches:
    state, _ = engine.train_step(state, engine.shard_batch(tokens))
  return params0, jax.device_get(state.outer.params), engine, state, hlo


# As test_outer's bounds (round to nearest: bf16 2^-8 relative, int8 / int4 half a step of
# 1/127 / 1/7 of the block's largest magnitude), twice: the all-reduce quantizes each group's
# pseudo-gradient on the reduce-scatter and their sum once more on the all-gather, each within
# the bound of the sum's largest term.
@pytest.mark.parametrize("fmt,bound", [("bf16", 2.0**-8), ("int8", 0.5 / 127), ("int4", 0.5 / 7)])
def test_compressed_pseudo_gradient_at_node_within_the_format(apart, fmt, bound):
  params0, got, engine, state, _ = compressed_round(fmt)
  assert engine.outer_feedback and np.any(np.asarray(state.outer.residual) != 0)
  mean = jax.tree.map(lambda *w: sum(w) / GROUPS, *apart)
  leaves = zip(
    jax.tree_util.tree_leaves_with_path(got),
    jax.tree.leaves(mean),
    jax.tree.leaves(params0),
    *(jax.tree.leaves(w) for w in apart),
  )
  for (path, x), want, p0, *groups in leaves:
    largest = max(np.abs(np.asarray(p0) - w).max() for w in groups)  # of the pseudo-gradients
    err = np.abs(np.asarray(x) - want).max()
    assert 0 < err <= 2 * bound * largest + 1e-6, (jax.tree_util.keystr(path), err, largest)
  # The groups restarted from the same (dequantized) weights: the nodes' copies stayed equal.
  master = jax.device_get(state.master)
  for leaf in jax.tree.leaves(master):
    np.testing.assert_array_equal(leaf[0], leaf[1])


def inter_bytes(hlo: str) -> float:
  """Bytes device 0 sends across nodes in one run of the compiled step."""
  sent = 0.0
  for c in parse_collectives(hlo):
    if crosses_groups(c, 0, M):
      sent += device_bytes(c, GROUPS * M).get(0, 0.0) * c.count
  return sent


def wire_bytes(n: int, fmt: str, block: int = 32) -> float:
  """Bytes of `n` fp32 elements on the wire as `fmt` (int8 / int4: values and an fp32 scale per
  block of `block`, the last one shorter)."""
  values = {"same": 4 * n, "bf16": 2 * n, "int8": n, "int4": math.ceil(n / 2)}[fmt]
  return values + (4 * math.ceil(n / block) if fmt in ("int8", "int4") else 0)


METRICS = 64  # the groups' mean loss and gradient norm: an all-reduce of a few floats


def test_a_round_at_node_sends_two_wire_payloads_across_nodes(full):  # noqa: F811
  """Per device and round, (g-1)/g of its Ψ'/m-element I shard of the pseudo-gradient on the
  reduce-scatter and as much of the sum on the all-gather, both in the wire format: 2w bytes
  per parameter (int8: w = 1 + 4/32), no fp32 outer weights. With the state at G the two fp32
  gathers of the outer weights come on top: 8 + w."""
  _, params0, _, _ = full
  psi = sum(x.size for x in jax.tree.leaves(params0))
  g, chunk = GROUPS, psi // M // GROUPS  # this device's share of its I shard
  assert psi % (M * GROUPS) == 0
  at_node = inter_bytes(compressed_round("int8")[-1])
  at_g = inter_bytes(compressed_round("int8", "G")[-1])
  assert 0 <= at_node - 2 * (g - 1) * wire_bytes(chunk, "int8") <= METRICS
  assert (
    0 <= at_g - (g - 1) * (2 * wire_bytes(chunk, "same") + wire_bytes(chunk, "int8")) <= METRICS
  )
  print(f"tiny-test III 2x4 int8, inter bytes per device and round: G {at_g:.0f}, I {at_node:.0f}")


def test_hand_written_rings_at_node(full):  # noqa: F811
  """--collectives horing: NNN's round at I (the pseudo-gradient's all-reduce a ring over
  `inter`, the restart the two-level gather inside the node) equals the reference, and sends
  2 x 4 bytes per parameter of its share across nodes (fp32)."""
  model, params0, batches, (ref_losses, ref_rounds) = full
  losses, rounds, engine, state = run_groups(
    model, "NNN", params0, batches, AT_NODE, collectives="horing"
  )
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  for got, want in zip(rounds, ref_rounds):
    assert_trees_close(got, want, atol=2e-5)
  hlo = engine.train_step.lower(state, engine.shard_batch(batches[0])).compile().as_text()
  chunk = sum(x.size for x in jax.tree.leaves(params0)) // M // GROUPS
  assert 0 <= inter_bytes(hlo) - 2 * (GROUPS - 1) * wire_bytes(chunk, "same") <= METRICS


def test_fragments_with_delay_at_node_equal_streaming_diloco():
  """Streaming DiLoCo with the outer state at I: 2 fragments, each exchanged one step late and
  merged half and half (test_outer_stream's delayed run), against its single-device loop."""
  model = Llama(CFG, remat=REMAT)
  params0 = model.init(jax.random.key(1))
  batches = stream.make_batches(stream.STEPS)
  every, frags = stream.H, stream.F
  late = OuterOptions(sync=every, fragments=frags, delay=1, mix=0.5, state="I")
  ref_losses, ref_outers = stream.streaming_reference(
    model, params0, batches, every, frags, 0.7, 0.9, delay=1, mix=0.5
  )
  engine = GroupEngine(
    model, parse_strategy("NII"), make_mesh(GROUPS, M), OPTIM, late, micro_batches=stream.A
  )
  state = engine.state_from_params(params0)
  for t, tokens in enumerate(batches):
    state, metrics = engine.train_step(state, engine.shard_batch(tokens))
    np.testing.assert_allclose(float(metrics["loss"]), ref_losses[t], rtol=2e-6)
    assert_trees_close(jax.device_get(state.outer.params), ref_outers[t], atol=2e-5)


def test_outer_state_without_the_outer_loop_refused():
  with pytest.raises(ValueError, match="--outer-state I places the outer loop's state"):
    OuterOptions(state="I")
  with pytest.raises(ValueError, match="--outer-state must be one of G, I"):
    OuterOptions(sync=H, state="N")
  # auto is resolved by train (run/setup.py); an engine built without it (inspect) refuses it
  with pytest.raises(ValueError, match="--outer-state auto is train's choice .* pass --outer-s"):
    GroupEngine(
      Llama(CFG),
      parse_strategy("III"),
      make_mesh(GROUPS, M),
      OPTIM,
      OuterOptions(sync=H, state="auto"),
    )


@pytest.mark.parametrize("strategy,fmt", [("NNN", "int8"), ("III", "same"), ("NII", "int4")])
def test_memory_model_counts_the_outer_state_at_node(strategy, fmt):
  """The memory model's outer state at I (8 bytes per parameter over the node's m devices, and
  the pseudo-gradient's residual where its wire compresses) is what each device holds."""
  from paro_jax.analysis.planner.inputs import Workload
  from paro_jax.analysis.planner.memory import step_memory
  from paro_jax.core.wire import WireConfig

  model = Llama(CFG, remat=REMAT)
  engine = GroupEngine(
    model, parse_strategy(strategy), make_mesh(GROUPS, M), OPTIM, AT_NODE, Codec(fmt)
  )
  state = engine.state_from_params(model.init(jax.random.key(1)))
  work = Workload(
    CFG,
    micro_batch=1,
    micro_batches=2,
    seq_len=8,
    itemsize=4,
    remat=False,
    wire=WireConfig(grads=fmt),
    outer_sync=H,
    outer_state="I",
  )
  need = step_memory(parse_strategy(strategy), work, GROUPS, M, gpu=False)["model_states"]
  assert need["outer"] == bytes_per_device(state.outer) > 0
  psi = sum(x.size for x in jax.tree.leaves(state.outer.params))
  assert bytes_per_device((state.outer.params, state.outer.opt_state)) == 8 * psi // M
