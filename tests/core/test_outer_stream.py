"""Streaming DiLoCo (`--outer-fragments F`: core/fragments.py) equals a single-device streaming
loop, and its compiled step exchanges one fragment's bytes at that fragment's sync steps.

The reference is written apart from the engine: two groups, each the plain single-device
optax step (run/reference.py reference_step) on its own half of every batch's rows; fragment f
(layers split into F contiguous ranges, the embedding's rows and the head's columns split by
vocabulary index the same way, the final norm with the last) is averaged into its outer
weights through Nesterov momentum every H steps at its own offset, (f+1) H/F, selected by masks
(the engine slices); every group restarts that fragment only.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import Llama
from paro_jax.analysis.hlo.collectives import (
  crosses_groups,
  device_bytes,
  parse_collectives,
  phase_of,
)
from paro_jax.core.config import OuterOptions
from models.presets import get_config
from paro_jax.core.fragments import SKIP, WHOLE, Fragments
from paro_jax.core.sharding import shard_dims
from paro_jax.core.groups import GroupEngine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy
from paro_jax.run.reference import reference_step
from tests.core.test_outer import CFG, GROUPS, LORA, OPTIM, REMAT, assert_trees_close
from tests.core import test_outer
from tests.core.test_collectives import hlo_graph

H, F, A, B, L, STEPS = 4, 2, 2, 8, 8, 8  # each fragment synced twice: steps 2, 6 and 4, 8
STREAM = OuterOptions(sync=H, lr=0.7, momentum=0.9, fragments=F)


def make_batches(steps):
  rng = np.random.default_rng(3)
  start, stride = (rng.integers(0, CFG.vocab, size=(steps, A, B, 1)) for _ in range(2))
  return list(((start + stride * np.arange(L + 1)) % CFG.vocab).astype(np.int32))


def fragment_masks(params, fragments):
  """Per fragment, a tree of 0/1 arrays broadcastable to each leaf: which of its entries the
  fragment holds. Layer leaves by their leading layer index; the embedding's and the head's
  entries by their vocabulary index (its rows, its columns), cut like the layers; the final
  norm whole with the last fragment."""
  layer_sets = np.array_split(np.arange(CFG.layers), fragments)
  vocab_sets = np.array_split(np.arange(CFG.vocab), fragments)
  masks = []
  for f, layers in enumerate(layer_sets):
    words = np.isin(np.arange(CFG.vocab), vocab_sets[f])
    outside = {"embedding": words[:, None], "kernel": words[None, :], "scale": f == fragments - 1}

    def mask(path, x):
      if path[0].key == "layers":
        return np.isin(np.arange(x.shape[0]), layers).reshape((-1,) + (1,) * (x.ndim - 1))
      return np.asarray(outside[path[-1].key])

    masks.append(jax.tree_util.tree_map_with_path(mask, params))  # None (frozen) stays None
  return masks


def streaming_reference(model, params0, batches, every, fragments, lr, momentum, delay=0, mix=0.0):
  """(per step the groups' mean loss, per step the outer weights) on one device. With `delay`,
  a fragment's pseudo-gradient is of the groups' weights at its sync step, and the outer step
  and the groups' restart happen `delay` steps later; with `mix`, a group restarts from
  mix x its own weights + (1 - mix) x the outer weights."""
  outer, tx, inner_step = reference_step(model, params0, OPTIM)
  velocity = jax.tree.map(jnp.zeros_like, outer)
  inner, opt = [outer] * GROUPS, [tx.init(outer)] * GROUPS
  masks = fragment_masks(outer, fragments)
  kept = {}  # fragment -> the groups' weights at its last sync step
  rows = B // GROUPS
  losses, outers = [], []
  for t, tokens in enumerate(batches):
    step_losses = []
    for k in range(GROUPS):
      inner[k], opt[k], loss = inner_step(inner[k], opt[k], tokens[:, k * rows : (k + 1) * rows])
      step_losses.append(float(loss))
    losses.append(np.mean(step_losses))
    offset = lambda f: (f + 1) * (every // fragments) % every
    for f in range(fragments):
      if (t + 1) % every == offset(f):
        kept[f] = list(inner)
    for f, m in enumerate(masks):
      if t + 1 <= delay or (t + 1 - delay) % every != offset(f):
        continue
      sel = lambda new, old: jax.tree.map(jnp.where, m, new, old)
      delta = jax.tree.map(lambda o, *w: sum(o - x for x in w) / GROUPS, outer, *kept[f])
      velocity = sel(jax.tree.map(lambda v, g: momentum * v + g, velocity, delta), velocity)
      step = jax.tree.map(lambda o, g, v: o - lr * (g + momentum * v), outer, delta, velocity)
      outer = sel(step, outer)
      inner = [sel(jax.tree.map(lambda o, x: mix * x + (1 - mix) * o, outer, w), w) for w in inner]
    outers.append(outer)
  return losses, outers


def test_one_fragment_is_the_diloco_reference():
  """The streaming reference with F = 1 is test_outer's DiLoCo reference, bit for bit (so the
  F = 2 comparison below checks the staggering, not another loop)."""
  model = Llama(CFG, remat=REMAT)
  params0 = model.init(jax.random.key(1))
  batches = test_outer.make_batches()
  want_losses, want_rounds = test_outer.diloco_reference(model, params0, batches, 0.7, 0.9)
  losses, outers = streaming_reference(model, params0, batches, test_outer.H, 1, 0.7, 0.9)
  assert losses == want_losses
  for got, want in zip(outers[test_outer.H - 1 :: test_outer.H], want_rounds):
    assert_trees_close(got, want, atol=0)


@pytest.fixture(scope="module")
def streamed():
  model = Llama(CFG, remat=REMAT)
  params0 = model.init(jax.random.key(1))
  batches = make_batches(STEPS)
  reference = streaming_reference(model, params0, batches, H, F, STREAM.lr, STREAM.momentum)
  engine = GroupEngine(
    model, parse_strategy("III"), make_mesh(GROUPS, 4), OPTIM, STREAM, micro_batches=A
  )
  state = engine.state_from_params(params0)
  batch = engine.shard_batch(batches[0])
  hlo = engine.train_step.lower(state, batch).compile().as_text()
  losses, outers = [], []
  for tokens in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(tokens))
    losses.append(float(metrics["loss"]))
    outers.append(jax.device_get(state.outer.params))
  return reference, (losses, outers, state), engine, hlo


def test_lora_fragments_equal_single_device_streaming_diloco():
  """The adapters of each fragment's layers synced at its steps (the frozen base is no part of
  any fragment); INI, the pseudo-gradient in fp32."""
  model = Llama(CFG, remat=REMAT, lora=LORA)
  params0 = model.init(jax.random.key(1))
  params0 = jax.tree_util.tree_map_with_path(  # adapters' B away from zero: both factors move
    lambda p, x: x + 0.05 if str(p[-1].key).endswith("_lora_b") else x, params0
  )
  batches = make_batches(STEPS)
  ref_losses, ref_outers = streaming_reference(model, params0, batches, H, F, 0.7, 0.9)
  engine = GroupEngine(
    model, parse_strategy("INI"), make_mesh(GROUPS, 4), OPTIM, STREAM, micro_batches=A
  )
  state = engine.state_from_params(params0)
  for t, tokens in enumerate(batches):
    state, metrics = engine.train_step(state, engine.shard_batch(tokens))
    np.testing.assert_allclose(float(metrics["loss"]), ref_losses[t], rtol=2e-6)
    assert_trees_close(jax.device_get(state.outer.params), ref_outers[t], atol=2e-5)


def test_fragments_equal_single_device_streaming_diloco(streamed):
  (ref_losses, ref_outers), (losses, outers, state), _, _ = streamed
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  for t, (got, want) in enumerate(zip(outers, ref_outers)):
    assert_trees_close(got, want, atol=2e-5)
  # The fragments moved at their own steps: after step 2 fragment 0's half of the vocabulary
  # (the embedding's first rows, the head's first columns) has, fragment 1's half has not.
  first, params0, half = ref_outers[1], ref_outers[0], CFG.vocab // F
  assert not np.allclose(first["embed"]["embedding"][:half], params0["embed"]["embedding"][:half])
  np.testing.assert_array_equal(
    first["embed"]["embedding"][half:], params0["embed"]["embedding"][half:]
  )
  assert not np.allclose(first["head"]["kernel"][:, :half], params0["head"]["kernel"][:, :half])
  np.testing.assert_array_equal(
    first["head"]["kernel"][:, half:], params0["head"]["kernel"][:, half:]
  )
  # At the last step (fragment 1's sync) the groups hold the outer weights of fragment 1 only.
  master = jax.device_get(state.master)
  head = [np.asarray(master["head"]["kernel"][k]) for k in range(GROUPS)]
  np.testing.assert_allclose(
    head[0][:, half:], np.asarray(outers[-1]["head"]["kernel"])[:, half:], atol=2e-5
  )
  assert not np.allclose(head[0][:, :half], head[1][:, :half])  # fragment 0's: apart since step 6
  embed = [np.asarray(master["embed"]["embedding"][k]) for k in range(GROUPS)]
  assert not np.allclose(embed[0][:half], embed[1][:half])


def fragment_param_counts(params, fragments):
  counts = [0] * fragments
  for f, m in enumerate(fragment_masks(params, fragments)):
    for x, sel in zip(jax.tree.leaves(params), jax.tree.leaves(m)):
      counts[f] += int(np.broadcast_to(sel, x.shape).sum())
  return counts


def test_a_fragments_sync_moves_only_its_bytes_across_nodes(streamed):
  """Per step kind of the compiled step (the switch's branches): fragment f's branch sends
  across `inter` its fragment's share of a round, and the steps without a sync only the metrics.
  III on 2x4 (OS = I: the outer weights' G shard inside it): per device, the old and the new
  outer weights gathered (4 bytes each) and the fp32 pseudo-gradient reduce-scattered (4 bytes),
  each (g-1)/g of the fragment's Ψ_f/m parameters."""
  (_, ref_outers), _, engine, hlo = streamed
  per_fragment, elsewhere = [0.0] * F, 0.0
  for c in parse_collectives(hlo):
    if not crosses_groups(c, 0, 4):
      continue
    sent = device_bytes(c, 8).get(0, 0.0) * c.count
    owner = [f for f in range(F) if f"fragment_{f}/" in c.op_name]
    if owner:
      per_fragment[owner[0]] += sent
    else:
      elsewhere += sent
  counts = fragment_param_counts(ref_outers[0], F)
  g, m = GROUPS, 4
  assert per_fragment == [12 * (g - 1) / g * n / m for n in counts]
  assert 0 < min(counts) and max(counts) < sum(counts)  # each a part of the round's bytes
  assert elsewhere <= 64  # the groups' mean loss and gradient norm


@pytest.fixture(scope="module")
def delayed():
  """III with each fragment's exchange one step late, merged half and half with the groups'
  own weights (the paper's): the engine's losses and outer weights per
  step, the reference's, and the compiled step."""
  model = Llama(CFG, remat=REMAT)
  params0 = model.init(jax.random.key(1))
  batches = make_batches(STEPS)
  late = OuterOptions(sync=H, lr=0.7, momentum=0.9, fragments=F, delay=1, mix=0.5)
  reference = streaming_reference(model, params0, batches, H, F, 0.7, 0.9, delay=1, mix=0.5)
  engine = GroupEngine(
    model, parse_strategy("III"), make_mesh(GROUPS, 4), OPTIM, late, micro_batches=A
  )
  state = engine.state_from_params(params0)
  hlo = engine.train_step.lower(state, engine.shard_batch(batches[0])).compile().as_text()
  losses, outers = [], []
  for tokens in batches:
    state, metrics = engine.train_step(state, engine.shard_batch(tokens))
    losses.append(float(metrics["loss"]))
    outers.append(jax.device_get(state.outer.params))
  return reference, (losses, outers), hlo


def test_delayed_exchange_equals_the_reference(delayed):
  """Fragment 0 kept after steps 2 and 6, exchanged and applied after 3 and 7; fragment 1 kept
  after 4 (applied after 5) and 8 (its exchange would come after step 9)."""
  (ref_losses, ref_outers), (losses, outers), _ = delayed
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  for got, want in zip(outers, ref_outers):
    assert_trees_close(got, want, atol=2e-5)
  # Not the undelayed run: the outer weights first move after step 3, not 2.
  assert_trees_close(outers[1], outers[0], atol=0)
  assert not np.allclose(outers[2]["embed"]["embedding"], outers[1]["embed"]["embedding"])


def test_delayed_exchange_does_not_wait_for_the_step(delayed, streamed):
  """In the compiled step, each fragment's exchange across nodes sits in the branch that runs
  the step's compute and depends on none of it (its operands are the weights kept steps
  before and the outer state): a scheduler is free to run the two side by side. Without the
  delay the exchange needs the step's result, and the check says so."""
  assert exchange_beside_the_step(delayed[2])
  assert not exchange_beside_the_step(streamed[3])


def exchange_beside_the_step(hlo) -> bool:
  nodes = hlo_graph(hlo)
  step_ops = {
    n
    for n, (_, _, attrs) in nodes.items()
    if re.search(r'op_name="[^"]*(micro_batches|grad_sync|optimizer)', attrs)
  }
  collectives = parse_collectives(hlo)
  exchange = [c for c in collectives if "fragment_" in c.op_name and crosses_groups(c, 0, 4)]
  assert {c.op_name.split("fragment_")[1][0] for c in exchange} == {"0", "1"}
  memo = {}

  def ancestors(n):
    if n not in memo:
      memo[n] = set()
      for o in nodes.get(n, (None, (), ""))[1]:
        memo[n] |= {o} | ancestors(o)
    return memo[n]

  step_computations = {
    c.computation for c in collectives if phase_of(c.op_name) in ("gradient sync", "optimizer")
  }
  assert step_ops and step_computations
  return all(
    not ancestors(c.name) & step_ops and c.computation in step_computations for c in exchange
  )


def test_schedule_and_split():
  frags = Fragments(2, 4, 2)
  assert [int(frags.due(t)) for t in range(1, 9)] == [2, 0, 2, 1, 2, 0, 2, 1]  # 2: none
  assert [int(Fragments(1, 3, 2).due(t)) for t in range(1, 7)] == [1, 1, 0, 1, 1, 0]
  assert [int(frags.due(t, 1)) for t in range(1, 9)] == [2, 2, 0, 2, 1, 2, 0, 2]  # a step late
  five = Fragments(2, 2, 5)
  assert [five.layer_range(f) for f in range(2)] == [(0, 3), (3, 5)]
  assert [five.offset(f) for f in range(2)] == [1, 0]


@pytest.mark.parametrize("name, count", [("llama3.1-8b", 4), ("llama3.2-1b", 4), ("tiny", 3)])
def test_no_fragment_holds_more_than_its_share(name, count):
  """Real shapes: whatever F, no fragment holds more than 1/F of the parameters, but for the
  final norm (its one axis is the sharded one: it goes whole with the last fragment) and the
  rounding of F parts; a 128k vocabulary whole in the first fragment would hold 0.28 of 8B."""
  model = Llama(get_config(name))
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  frags = Fragments(count, count, model.cfg.layers)
  dims = shard_dims(model.logical_axes())
  sizes = []
  for f in range(count):
    roles = frags.roles(shapes, dims, f)
    size = 0
    for x, r in zip(jax.tree.leaves(shapes), jax.tree.leaves(roles)):
      size += 0 if r == SKIP else int(np.prod(x.shape if r == WHOLE else r.shape(x.shape)))
    sizes.append(size)
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert sum(sizes) == total  # a partition
  c = model.cfg
  tables = 1 if c.tie_embeddings else 2  # the embedding, and the head where it is its own
  layer = (total - tables * c.vocab * c.dim - c.dim) // c.layers
  layers, words = (np.array_split(np.arange(n), count) for n in (c.layers, c.vocab))
  want = [len(layers[f]) * layer + tables * len(words[f]) * c.dim for f in range(count)]
  want[-1] += c.dim  # the final norm
  assert sizes == want
  over = c.dim + layer * (c.layers % count > 0) + tables * c.dim * (c.vocab % count > 0)
  assert max(sizes) <= total / count + over


def test_bad_fragments_refused():
  with pytest.raises(ValueError, match=r"--outer-delay must be in \[0, H/F\) = \[0, 2\)"):
    OuterOptions(sync=4, fragments=2, delay=2)
  with pytest.raises(ValueError, match="--outer-delay 1 delays the outer loop's syncs"):
    OuterOptions(delay=1)
  with pytest.raises(ValueError, match=r"--outer-mix must be in \[0, 1\)"):
    OuterOptions(sync=4, mix=1.0)
  with pytest.raises(ValueError, match="--outer-fragments 3 must divide --outer-sync 4"):
    OuterOptions(sync=4, fragments=3)
  with pytest.raises(ValueError, match="pass --outer-sync H too"):
    OuterOptions(fragments=2)
  with pytest.raises(ValueError, match="the model has 2 layers: pass at most 2"):
    GroupEngine(
      Llama(CFG), parse_strategy("III"), make_mesh(2, 4), OPTIM, OuterOptions(sync=4, fragments=4)
    )
