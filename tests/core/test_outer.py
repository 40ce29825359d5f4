"""The outer loop (DiLoCo, core/outer.py and core/groups.py) equals a single-device DiLoCo loop.

The reference is written here, apart from the engine: two groups, each a plain optax loop
(clip + AdamW, its state kept across rounds) on its own half of every batch's rows, and every H
steps the mean pseudo-gradient (outer weights minus each group's) through Nesterov momentum
written out by hand, every group restarting from the new outer weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig, LoraConfig
from models.llama import Llama
from paro_jax.core.config import OuterOptions, StepConfig
from paro_jax.core.groups import GroupEngine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.state import OptimConfig
from paro_jax.core.step import StepProgram
from paro_jax.run.reference import reference_step
from paro_jax.core.strategy import GROUP_NAMES, parse_strategy
from paro_jax.core.wire import Codec

CFG = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
GROUPS, H, ROUNDS = 2, 2, 3
A, B, L, STEPS = 2, 8, 8, H * ROUNDS
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=STEPS, clip_norm=0.5, eps=1e-6)
PAPER = OuterOptions(sync=H, lr=0.7, momentum=0.9)
LORA = LoraConfig(rank=4, alpha=16.0, targets=("wq", "wv"))
# The layer stack is not what is tested here (tests/core/test_prefetch.py): the model's own scan,
# with nothing recomputed, compiles in about half the time.
REMAT = "none"


def make_batches():
  rng = np.random.default_rng(0)
  start, stride = (rng.integers(0, CFG.vocab, size=(STEPS, A, B, 1)) for _ in range(2))
  return list(((start + stride * np.arange(L + 1)) % CFG.vocab).astype(np.int32))


def diloco_reference(model, params0, batches, lr, momentum):
  """(per step the groups' mean loss, the outer weights after each round) on one device."""
  outer, tx, inner_step = reference_step(model, params0, OPTIM)
  velocity = jax.tree.map(jnp.zeros_like, outer)
  inner = [outer] * GROUPS
  opt = [tx.init(outer)] * GROUPS
  rows = B // GROUPS
  losses, rounds = [], []
  for t, tokens in enumerate(batches):
    step_losses = []
    for k in range(GROUPS):  # group k: rows k*B/g .. (k+1)*B/g of every micro-batch
      inner[k], opt[k], loss = inner_step(inner[k], opt[k], tokens[:, k * rows : (k + 1) * rows])
      step_losses.append(float(loss))
    losses.append(np.mean(step_losses))
    if (t + 1) % H == 0:
      # Nesterov momentum: v <- mu v + g; w <- w - lr (g + mu v)
      delta = jax.tree.map(lambda o, *w: sum(o - x for x in w) / GROUPS, outer, *inner)
      velocity = jax.tree.map(lambda v, g: momentum * v + g, velocity, delta)
      outer = jax.tree.map(lambda o, g, v: o - lr * (g + momentum * v), outer, delta, velocity)
      inner = [outer] * GROUPS
      rounds.append(outer)
  return losses, rounds


def run_groups(model, strategy, params0, batches, outer=PAPER, wire=Codec(), **kw):
  engine = GroupEngine(
    model, parse_strategy(strategy), make_mesh(GROUPS, 4), OPTIM, outer, wire, micro_batches=A, **kw
  )
  state = engine.state_from_params(params0)
  losses, rounds = [], []
  for t, batch in enumerate(batches):
    state, metrics = engine.train_step(state, engine.shard_batch(batch))
    losses.append(float(metrics["loss"]))
    if (t + 1) % H == 0:
      rounds.append(jax.device_get(state.outer.params))
  return losses, rounds, engine, state


def assert_trees_close(a, b, atol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), atol=atol, err_msg=jax.tree_util.keystr(path)
    )


@pytest.fixture(scope="module")
def full():
  model = Llama(CFG, remat=REMAT)
  params0 = model.init(jax.random.key(1))
  batches = make_batches()
  return model, params0, batches, diloco_reference(model, params0, batches, PAPER.lr, 0.9)


def test_reference_rounds_move_the_outer_weights(full):
  # Otherwise "equal to the reference" could hold for a sync that does nothing.
  _, params0, _, (_, rounds) = full
  for before, after in zip([params0, *rounds], rounds):
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).mean(), after, before)
    assert min(jax.tree.leaves(moved)) > 1e-4


@pytest.mark.parametrize("strategy", GROUP_NAMES)
def test_rounds_equal_single_device_diloco(full, strategy):
  model, params0, batches, (ref_losses, ref_rounds) = full
  losses, rounds, engine, state = run_groups(model, strategy, params0, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  for got, want in zip(rounds, ref_rounds):
    assert_trees_close(got, want, atol=2e-5)
  # Every group restarted from the outer weights at the last round's end.
  master = jax.device_get(state.master)
  for k in range(GROUPS):
    assert_trees_close(jax.tree.map(lambda x: x[k], master), ref_rounds[-1], atol=2e-5)
  # Eval reads the outer weights.
  assert_trees_close(jax.device_get(engine.params(state)), ref_rounds[-1], atol=2e-5)


@pytest.mark.parametrize("strategy", ["NNN", "III"])
def test_sync_in_backward_rounds_equal_single_device_diloco(strategy):
  """The GPUs' step program (each layer's gradient synced inside the last micro-batch's
  backward, on the prefetching stack): the synced gradient of a group varies over `inter` too,
  as its sink must be typed (it failed to trace before). OS at N (the sync all-reduces over
  `intra`) and at I (nothing all-reduced)."""
  model = Llama(CFG)  # remat full: the prefetching stack, which the program needs
  params0 = model.init(jax.random.key(1))
  batches = make_batches()
  ref_losses, ref_rounds = diloco_reference(model, params0, batches, PAPER.lr, 0.9)
  losses, rounds, engine, _ = run_groups(
    model, strategy, params0, batches, program=StepProgram.SYNC_IN_BACKWARD
  )
  assert engine.program is StepProgram.SYNC_IN_BACKWARD
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  for got, want in zip(rounds, ref_rounds):
    assert_trees_close(got, want, atol=2e-5)


def test_lora_rounds_equal_single_device_diloco():
  model = Llama(CFG, remat=REMAT, lora=LORA)
  params0 = model.init(jax.random.key(1))
  params0 = jax.tree_util.tree_map_with_path(  # adapters' B away from zero: both factors move
    lambda p, x: x + 0.05 if str(p[-1].key).endswith("_lora_b") else x, params0
  )
  batches = make_batches()
  ref_losses, ref_rounds = diloco_reference(model, params0, batches, PAPER.lr, 0.9)
  losses, rounds, _, _ = run_groups(model, "INI", params0, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  for got, want in zip(rounds, ref_rounds):
    assert_trees_close(got, want, atol=2e-5)


@pytest.fixture(scope="module")
def apart(full):
  """Each group's weights after one round's inner steps, from an engine whose round has not
  ended yet (H beyond the steps run): [group][leaf]."""
  model, params0, batches, _ = full
  _, _, _, state = run_groups(model, "III", params0, batches[:H], outer=OuterOptions(sync=100))
  master = jax.device_get(state.master)
  return [jax.tree.map(lambda x: np.asarray(x)[k], master) for k in range(GROUPS)]


PLAIN = OuterOptions(sync=H, lr=1.0, momentum=0.0)


def test_plain_mean_with_outer_lr_one(full, apart):
  """With outer lr 1 and no momentum a round's outer weights are the mean of the groups' inner
  weights."""
  model, params0, batches, _ = full
  _, rounds, _, _ = run_groups(model, "NII", params0, batches[:H], outer=PLAIN)
  mean = jax.tree.map(lambda *w: sum(w) / GROUPS, *apart)
  # Two compiled programs (with and without the round's end) order the float sums differently;
  # AdamW's normalisation carries that to ~1e-6 in a few weights: the equivalence tests' bound.
  assert_trees_close(rounds[0], mean, atol=2e-5)


# Rounding to nearest: bf16 keeps 8 significant bits (relative error <= 2^-8, the unit
# roundoff); int8 (int4) rounds each element to a 1/127 (1/7) step of its block's largest
# magnitude (error <= half a step).
@pytest.mark.parametrize("fmt,bound", [("bf16", 2.0**-8), ("int8", 0.5 / 127), ("int4", 0.5 / 7)])
def test_compressed_pseudo_gradient_within_the_format(full, apart, fmt, bound):
  """The pseudo-gradient on the wire in bf16 / int8 / int4 (error feedback on): one round's outer
  weights against the exact mean of the groups' weights (outer lr 1, no momentum), within the
  format's rounding of the groups' pseudo-gradients, and not equal to it (the format rounds)."""
  model, params0, batches, _ = full
  _, got, engine, state = run_groups(model, "III", params0, batches[:H], PLAIN, Codec(fmt, 32))
  assert engine.outer_feedback and np.any(np.asarray(state.outer.residual) != 0)
  mean = jax.tree.map(lambda *w: sum(w) / GROUPS, *apart)
  leaves = zip(
    jax.tree_util.tree_leaves_with_path(got[0]),
    jax.tree.leaves(mean),
    jax.tree.leaves(params0),
    *(jax.tree.leaves(w) for w in apart),
  )
  for (path, x), want, p0, *groups in leaves:
    largest = max(np.abs(np.asarray(p0) - w).max() for w in groups)  # of the pseudo-gradients
    err = np.abs(np.asarray(x) - want).max()
    assert 0 < err <= bound * largest + 1e-6, (jax.tree_util.keystr(path), err, largest)


def bytes_per_device(tree):
  held = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  assert len(set(held.values())) == 1 and len(held) == 8, held
  return next(iter(held.values()))


@pytest.mark.parametrize(
  "strategy,fmt,delay",
  [("NNN", "int8", 0), ("III", "same", 0), ("NII", "bf16", 0), ("III", "int8", 1)],
)
def test_memory_model_counts_the_outer_state(strategy, fmt, delay):
  """The memory model's outer state (8 bytes per parameter over all devices, and the
  pseudo-gradient's residual where its wire compresses) is what each device holds, and so is
  --outer-delay's `kept` (the weights kept for the delayed exchange, in 2 fragments of a round of
  4 steps); the groups' own states are the strategy's, as without the outer loop."""
  from paro_jax.analysis.planner.inputs import Workload
  from paro_jax.analysis.planner.memory import step_memory
  from paro_jax.core.wire import WireConfig

  outer_options = OuterOptions(sync=4, fragments=2, delay=delay) if delay else PAPER
  model = Llama(CFG, remat=REMAT)
  engine = GroupEngine(
    model, parse_strategy(strategy), make_mesh(GROUPS, 4), OPTIM, outer_options, Codec(fmt)
  )
  state = engine.state_from_params(model.init(jax.random.key(1)))
  work = Workload(CFG, micro_batch=1, micro_batches=A, seq_len=L, itemsize=4, remat=False)
  plain = step_memory(parse_strategy(strategy), work, GROUPS, 4, gpu=False)["model_states"]
  outer = Workload(
    **{**work.__dict__, "wire": WireConfig(grads=fmt), "outer_sync": H, "outer_delay": delay}
  )
  need = step_memory(parse_strategy(strategy), outer, GROUPS, 4, gpu=False)["model_states"]
  assert need["outer"] == bytes_per_device(state.outer._replace(pending=None)) > 0
  if delay:
    assert need["kept"] == bytes_per_device(state.outer.pending) > 0
  assert need["total"] == plain["total"] + need["outer"] + need.get("kept", 0)
  # Each device holds its group's entry of the master and the moments: the strategy's 12 bytes
  # per parameter at OS (the step count, one per group, aside).
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 1]
  assert bytes_per_device((state.master, moments)) == plain["opt"]


@pytest.mark.parametrize(
  "args,message",
  [
    (dict(strategy="IIG"), "shards a state over all devices"),
    (dict(strategy="III", wire=dict(inter_params="int8")), "drop --inter-params"),
  ],
)
def test_bad_combinations_refused(args, message):
  from paro_jax.core.config import WireOptions

  if "wire" in args:
    args = {**args, "wire": WireOptions(**args["wire"])}
  with pytest.raises(ValueError, match=message):
    StepConfig(outer=OuterOptions(sync=H), **args)


def test_bad_outer_options_and_one_group_refused():
  with pytest.raises(ValueError, match="--outer-sync must be >= 1"):
    OuterOptions(sync=0)
  with pytest.raises(ValueError, match="one node"):
    GroupEngine(Llama(CFG), parse_strategy("III"), make_mesh(1, 8), OPTIM, PAPER)


def test_a_groups_step_reduces_over_intra_only():
  """The letters keep their schedule inside a node; what reached across nodes does not."""
  from paro_jax.core.strategy import GroupStrategy

  for name, plain, group in [("NNN", ("intra", "inter"), ("intra",)), ("III", ("inter",), ())]:
    assert parse_strategy(name).sync_reduce_axes == plain
    assert GroupStrategy.of(parse_strategy(name)).sync_reduce_axes == group
  for name in GROUP_NAMES:
    s, g = parse_strategy(name), GroupStrategy.of(parse_strategy(name))
    axes = ("param_gather_axes", "grad_scatter_axes", "sync_scatter_axes", "param_sync_axes")
    assert all(getattr(s, a) == getattr(g, a) and "inter" not in getattr(g, a) for a in axes)
    assert "inter" not in g.sync_reduce_axes and g.data_axes == ("intra",)
