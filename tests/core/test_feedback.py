"""Error feedback of int8 gradients (core/feedback.py): its arithmetic against a numpy quantizer
written here from the format's definition, the collectives that carry it, where it applies, and
the residual's placement in the state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models.llama import Llama
from models.presets import get_config
from paro_jax.core import collectives as comm
from paro_jax.core import feedback_rules
from paro_jax.core.wire import Codec, WireConfig
from paro_jax.core.compress import with_feedback
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.names import INTER, INTRA
from paro_jax.core.strategy import parse_strategy

BLOCK = 32
CODEC = Codec("int8", BLOCK)
INT8 = WireConfig("same", "int8")


def np_roundtrip(x):
  """int8 with one scale per `BLOCK` consecutive elements (the last block may be shorter):
  scale = max|block| / 127, values rounded to nearest, even on ties (as jnp.round)."""
  x = np.asarray(x, np.float32).reshape(-1)
  out = np.empty_like(x)
  for i in range(0, x.size, BLOCK):
    b = x[i : i + BLOCK]
    scale = np.float32(np.abs(b).max() / np.float32(127))
    safe = scale if scale > 0 else np.float32(1)
    out[i : i + BLOCK] = np.clip(np.round(b / safe), -127, 127) * scale
  return out


def test_error_feedback_sum_tracks_the_exact_sum():
  """Over k steps the int8 wire with error feedback delivers the exact sum less the last
  residual, each of whose elements is at most max|block| / 254 (half a quantization step); the
  wire without it accumulates every step's rounding error. The gradient is nearly the same each
  step (a steady slope plus noise), where plain rounding errs the same way every time."""
  rng = np.random.default_rng(0)
  base = rng.normal(size=(4, 96)).astype(np.float32)
  steps = [base + 0.05 * rng.normal(size=base.shape).astype(np.float32) for _ in range(40)]
  exact = np.sum(steps, axis=0)
  residual = jnp.zeros(base.size, jnp.float32)
  sent_ef, sent_plain = np.zeros_like(exact), np.zeros_like(exact)
  for g in steps:
    corrected, new = with_feedback(jnp.asarray(g), residual, CODEC)
    sent = np.asarray(corrected) - np.asarray(new).reshape(g.shape)
    # what the wire carried is the numpy quantizer's reading of the corrected chunks
    want = np.stack(
      [np_roundtrip(c) for c in np.asarray(g) + np.asarray(residual).reshape(g.shape)]
    )
    np.testing.assert_allclose(sent, want.reshape(g.shape), rtol=0, atol=1e-6)
    sent_ef += sent
    sent_plain += np.stack([np_roundtrip(c) for c in g]).reshape(g.shape)
    bound = np.repeat(np.abs(np.asarray(corrected)).reshape(-1, BLOCK).max(axis=1) / 254, BLOCK)
    assert np.all(np.abs(np.asarray(new)) <= bound * (1 + 1e-5) + 1e-7)
    residual = new
  err_ef, err_plain = np.abs(sent_ef - exact), np.abs(sent_plain - exact)
  last_bound = np.repeat(np.abs(np.asarray(corrected)).reshape(-1, BLOCK).max(axis=1) / 254, BLOCK)
  assert np.all(err_ef.reshape(-1) <= last_bound * (1 + 1e-4) + 1e-5)
  # without feedback the error of the sum is many steps' worth
  assert np.sqrt(np.mean(err_plain**2)) > 5 * np.sqrt(np.mean(err_ef**2))


@pytest.mark.parametrize("axes", [(INTER,), (INTER, INTRA)])
def test_reduce_scatter_with_feedback_matches_numpy(axes):
  """The collective's sum and each device's new residual, against numpy: for one level, each
  device quantizes its own corrected chunks; for two, the node's partial sums (reduced over
  `intra` first, exactly), each device the share it scatters across nodes."""
  mesh = make_mesh(2, 4)
  g, d = 2, 4
  k = g * (d if INTRA in axes else 1)
  n = k * 3 * BLOCK + k * 8  # a short last block in every chunk
  rng = np.random.default_rng(1)
  x = rng.normal(size=(g, d, n)).astype(np.float32)
  size = feedback_rules.feedback_size(n, k, g)
  e = (0.01 * rng.normal(size=(g, d, size))).astype(np.float32)

  def local(x, e):
    y, r = comm.reduce_scatter_feedback(x[0, 0], e[0, 0], axes, impl="xla", wire=CODEC)
    return y[None, None], r[None, None]

  spec = P(INTER, INTRA)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))
  placed = [jax.device_put(a, jax.NamedSharding(mesh, spec)) for a in (x, e)]
  y, r = (np.asarray(a) for a in jax.jit(fn)(*placed))

  # numpy: what each device (i, j) quantizes, [g, n/k], chunk m of it for node m
  if axes == (INTER,):
    ops = {
      (i, j): x[i, j].reshape(g, -1) + e[i, j].reshape(g, -1) for i in range(g) for j in range(d)
    }
  else:  # chunk index = node * d + device; device j of node i gets the node's sum of chunks (., j)
    parts = x.reshape(g, d, g, d, -1).sum(axis=1)  # [node, dest node, dest device, n/k]
    ops = {(i, j): parts[i, :, j] + e[i, j].reshape(g, -1) for i in range(g) for j in range(d)}
  sent = {key: np.stack([np_roundtrip(c) for c in op]) for key, op in ops.items()}
  for i in range(g):
    for j in range(d):
      np.testing.assert_allclose(r[i, j], (ops[(i, j)] - sent[(i, j)]).reshape(-1), atol=1e-5)
      want = sum(sent[(m, j)][i] for m in range(g))
      np.testing.assert_allclose(y[i, j], want, rtol=1e-5, atol=1e-5)


def test_where_error_feedback_applies():
  s = parse_strategy
  assert feedback_rules.resolve(s("IIG"), INT8, jnp.bfloat16, None) == (True, "on")
  assert feedback_rules.resolve(s("IIG"), INT8, jnp.bfloat16, False)[0] is False
  assert feedback_rules.resolve(s("IIG"), WireConfig("int8", "bf16"), jnp.float32, None)[0] is False
  assert feedback_rules.resolve(s("IIG"), WireConfig("int8", "bf16"), jnp.float32, True)[0] is True
  # GGG quantizes per layer in backward: off by default, said so; asked for, an error
  on, why = feedback_rules.resolve(s("GGG"), INT8, jnp.bfloat16, None)
  assert not on and "GGG" in why
  with pytest.raises(ValueError, match="pass --no-error-feedback"):
    feedback_rules.resolve(s("GGG"), INT8, jnp.bfloat16, True)
  with pytest.raises(ValueError, match="pass --inter-grads int8"):
    feedback_rules.resolve(s("IIG"), WireConfig(), jnp.bfloat16, True)


def _engine(strategy, wire=INT8, error_feedback=None, param_delta=None):
  optim = OptimConfig(learning_rate=1e-3, warmup_steps=1, total_steps=4)
  model = Llama(get_config("test"), jnp.float32)
  mesh = make_mesh(2, 4)
  return Engine(
    model,
    parse_strategy(strategy),
    mesh,
    optim,
    2,
    wire=wire,
    error_feedback=error_feedback,
    param_delta=param_delta,
  )


@pytest.mark.parametrize("strategy,ways", [("IIG", 4), ("NNN", 4), ("NNG", 4), ("NII", 4)])
def test_residual_is_one_vector_per_device_sized_as_stated(strategy, ways):
  """One fp32 vector per device (sharded over both mesh axes): IIG's is its gradient at Gr (1/4
  of the parameters); NNN and NII reduce across nodes after the node, NNG in a two-level
  reduce-scatter: each device quantizes 1/intra of the partial sums (padded to the 8 devices).
  The memory models count the same bytes."""
  engine = _engine(strategy)
  psi = engine.model.param_count()
  assert engine.residual_size == -(-psi // 8) * 8 // ways
  state = jax.eval_shape(engine.init_state, jax.random.key(0))
  assert state.residual.shape == (8 * engine.residual_size,)
  assert state.residual.dtype == jnp.float32
  assert engine.state_specs.residual == P((INTER, INTRA))
  assert (
    feedback_rules.residual_bytes(engine.strategy, psi, 2, 4, INT8, 4) == 4 * engine.residual_size
  )


def test_no_error_feedback_keeps_no_residual():
  engine = _engine("IIG", error_feedback=False)
  assert engine.residual_size == 0
  assert jax.eval_shape(engine.init_state, jax.random.key(0)).residual is None
  assert feedback_rules.residual_bytes(parse_strategy("GGG"), 1000, 2, 4, INT8, 4) == 0


def test_step_updates_each_devices_residual():
  """After one step every device holds its own, nonzero residual (each quantized its own
  gradient), and a step with feedback differs from one without."""
  engine = _engine("IIG")
  state = engine.init_state(jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, engine.model.cfg.vocab, size=(2, 8, 9)).astype(np.int32)
  state, _ = engine.train_step(state, engine.shard_batch(tokens))
  shards = [np.asarray(s.data) for s in state.residual.addressable_shards]
  assert len(shards) == 8 and all(s.shape == (engine.residual_size,) for s in shards)
  assert all(np.abs(s).max() > 0 for s in shards)
  assert len({s.tobytes() for s in shards}) == 8


def test_param_delta_weights_track_the_master():
  """With the delta parameter sync the weights a step computes with (the state's reference, at
  P) are the master's within a quantized change: far closer than int8 of the weight itself
  (the numpy quantizer's error on the master), though not equal (int8 did cross the wire)."""
  engine = _engine("IIG", wire=WireConfig("int8", "same"))
  assert engine.param_delta and engine.state_specs.reference == engine.trained_specs.params
  state = engine.init_state(jax.random.key(0))
  rng = np.random.default_rng(0)
  for _ in range(3):  # the reference is the weights the last step used: its master before it
    before = jax.device_get(state.master)
    tokens = rng.integers(0, engine.model.cfg.vocab, size=(2, 8, 9)).astype(np.int32)
    state, _ = engine.train_step(state, engine.shard_batch(tokens))
  master = np.concatenate([np.ravel(a) for a in jax.tree.leaves(before)])
  ref = np.concatenate([np.ravel(a) for a in jax.tree.leaves(jax.device_get(state.reference))])
  rms = lambda a: float(np.sqrt(np.mean(np.square(a))))
  int8_error = rms(np_roundtrip(master) - master)
  assert 0 < rms(ref - master) < 0.05 * int8_error


def test_where_param_delta_applies():
  s = parse_strategy
  int8_params = WireConfig("int8", "same")
  assert feedback_rules.resolve_params(s("IIG"), int8_params, None) == (True, "on")
  assert feedback_rules.resolve_params(s("IIG"), int8_params, False)[0] is False
  assert feedback_rules.resolve_params(s("IIG"), WireConfig("bf16", "same"), None)[0] is False
  assert (
    feedback_rules.resolve_params(s("GGG"), int8_params, None)[0] is False
  )  # no sync across nodes
  with pytest.raises(ValueError, match="drop --param-delta"):
    feedback_rules.resolve_params(s("GGG"), int8_params, True)
  assert _engine("IIG", wire=int8_params, param_delta=False).state_specs.reference is None


def test_planner_counts_the_residual_and_the_reference():
  """The planner's model states hold the fp32 residual (IIG on 4x8: Ψ/8 values per device, its
  gradient at Gr) and the compute-dtype weights at P (Ψ/8 x 2 bytes) with int8 on both paths,
  and neither without it."""
  from paro_jax.analysis.planner.inputs import Cluster, Links, Workload
  from paro_jax.analysis.planner.step_model import predict

  cfg = get_config("7b")
  links = Links(100e9 / 8, 300e9, 50e-6, 10e-6, "hierarchical")
  cluster = Cluster(4, 8, links, 312e12, 0.4, 80 * 2**30, 0.9, 0.0)
  iig = parse_strategy("IIG")
  plain = predict(iig, Workload(cfg), cluster).memory["model_states"]
  states = predict(iig, Workload(cfg, wire=WireConfig("int8", "int8")), cluster).memory
  states = states["model_states"]
  psi = cfg.param_count()
  assert states["residual"] == 4 * (psi // 8) and states["reference"] == 2 * (psi // 8)
  assert states["total"] == plain["total"] + states["residual"] + states["reference"]
  assert "residual" not in plain and "reference" not in plain
