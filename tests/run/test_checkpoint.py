"""Checkpoints: exact resume, another strategy or mesh, and the ways a checkpoint can go wrong."""

import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from models.llama import Llama
from models.presets import get_config
from paro_jax.run.checkpoint import Checkpointer
from paro_jax.run.checkpoint_content import RunMeta, cast_like
from paro_jax.run.checksums import NonFiniteStateError
from paro_jax.run.checkpoint_errors import CheckpointError
from paro_jax.data.streams import Batches, default_corpus
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy
from paro_jax import cli
from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.core.run_lock import LOCK
from paro_jax.run.stopping import NonFiniteSteps
from paro_jax.run.train import train
from tests.run.tiny_run import RUN, losses
from tests.fast_compile import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.usefixtures("compilation_cache")


CFG = make_config(RunConfig, RUN)
BATCHES = Batches(default_corpus(), CFG.micro_batches, CFG.batch_size, CFG.seq_len, CFG.seed)


def make_engine(strategy, mesh):
  """The engine train() builds for RUN (the same programs: compilation cache hits), on any mesh."""
  o = CFG.optimizer
  optim = OptimConfig(learning_rate=o.lr, warmup_steps=o.warmup, total_steps=o.steps)
  return Engine(
    Llama(get_config(CFG.model), jnp.float32),
    parse_strategy(strategy),
    mesh,
    optim,
    micro_batches=CFG.micro_batches,
  )


def batch(step):
  return BATCHES(step)


def meta_for(engine, step):
  return RunMeta(
    step=step,
    seed=0,
    model_name="test",
    model_config=dataclasses.asdict(get_config("test")),
    strategy=str(engine.strategy),
    mesh=(engine.inter, engine.intra),
    dtype="fp32",
    data={},
  )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  out = tmp_path_factory.mktemp("straight")
  train(make_config(RunConfig, {**RUN, "out": str(out), "checkpoints.every": 2}))
  return out


@pytest.fixture(scope="module")
def saved_iig(tmp_path_factory):
  """An IIG 2x4 state after 2 steps, saved as step 2, and the loss of its next step."""
  directory = str(tmp_path_factory.mktemp("iig") / "ckpt")
  engine = make_engine("IIG", make_mesh(2, 4))
  state = engine.init_state(jax.random.key(CFG.seed))
  for step in range(2):
    state, _ = engine.train_step(state, engine.shard_batch(batch(step)))
  ckpt = Checkpointer(directory, keep=3)
  ckpt.save(state, meta_for(engine, 2))
  ckpt.close()
  master = jax.device_get(state.master)
  _, metrics = engine.train_step(state, engine.shard_batch(batch(2)))
  return directory, master, float(metrics["loss"])


def test_straight_run_keeps_the_last_k(straight):
  steps, _ = losses(straight)
  assert steps == [1, 2, 3, 4, 5, 6]
  assert Checkpointer(straight / "checkpoints").steps() == [2, 4, 6]


def test_stop_and_resume_equals_uninterrupted(straight, tmp_path, monkeypatch):
  """Ctrl-C at step 3, then --resume: the same six losses as the run that was never stopped.
  The stopped run also left what a hard kill leaves: a half-written step directory and metrics
  rows past its checkpoint; resume ignores the first and rewrites the second."""
  out = tmp_path / "run"
  real_call = Batches.__call__

  def interrupt_at_3(self, step):
    if step == 3:
      raise KeyboardInterrupt
    return real_call(self, step)

  monkeypatch.setattr(Batches, "__call__", interrupt_at_3)
  with pytest.raises(KeyboardInterrupt):
    train(make_config(RunConfig, {**RUN, "out": str(out), "checkpoints.every": 2}))
  monkeypatch.setattr(Batches, "__call__", real_call)
  assert Checkpointer(out / "checkpoints").steps() == [2, 3]
  assert losses(out)[0] == [1, 2, 3]
  # A save killed halfway: orbax's temporary directory, never renamed to a step.
  os.makedirs(out / "checkpoints" / "5.orbax-checkpoint-tmp-1234" / "state")
  (out / "checkpoints" / "5.orbax-checkpoint-tmp-1234" / "state" / "junk").write_bytes(b"\0" * 9)
  with open(out / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 4, "loss": 99.0}) + "\n")

  train(
    make_config(
      RunConfig, {**RUN, "out": str(out), "checkpoints.every": 2, "checkpoints.resume": True}
    )
  )
  steps, resumed = losses(out)
  assert steps == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose(resumed, losses(straight)[1], rtol=0, atol=1e-6)
  assert Checkpointer(out / "checkpoints").steps() == [3, 4, 6]


def test_resume_needs_a_checkpoint_and_a_fresh_run_refuses_old_ones(straight, tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint in .* to resume from"):
    train(make_config(RunConfig, {**RUN, "out": str(tmp_path), "checkpoints.resume": True}))
  with pytest.raises(ValueError, match="already holds checkpoints .* pass --resume"):
    train(make_config(RunConfig, {**RUN, "out": str(straight)}))


def test_checkpoint_stores_logical_shapes(saved_iig):
  directory, master, _ = saved_iig
  stored = ocp.StandardCheckpointer().metadata(os.path.join(directory, "2", "state"))
  stored_master = stored.item_metadata.tree["master"]
  for (path, want), got in zip(
    jax.tree_util.tree_leaves_with_path(master), jax.tree.leaves(stored_master)
  ):
    assert tuple(got.shape) == want.shape, jax.tree_util.keystr(path)


@pytest.mark.parametrize("strategy,mesh_shape", [("GGG", (1, 8)), ("NNN", (1, 4))])
def test_restore_under_another_strategy_and_mesh(saved_iig, strategy, mesh_shape):
  directory, master, next_loss = saved_iig
  devices = jax.devices()[: mesh_shape[0] * mesh_shape[1]]
  engine = make_engine(strategy, make_mesh(*mesh_shape, devices=devices))
  state, meta = Checkpointer(directory).restore(engine)
  assert (meta.step, meta.strategy, meta.mesh) == (2, "IIG", (2, 4))
  assert int(state.step) == 2
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(jax.device_get(state.master)), jax.tree.leaves(master)
  ):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  leaf = jax.tree.leaves(state.opt_state)[1]
  assert leaf.sharding.mesh.devices.size == len(devices)
  _, metrics = engine.train_step(state, engine.shard_batch(batch(2)))
  np.testing.assert_allclose(float(metrics["loss"]), next_loss, rtol=1e-6)


def test_restore_writes_the_compute_copy_of_the_weights(saved_iig):
  """A checkpoint holds no compute-dtype copy of the master (`weights`, an engine's
  `weights_copy`, the GPUs' default): restoring into an engine that keeps one writes it from
  the restored master, and the next step is the one the saved state would have taken."""
  directory, master, next_loss = saved_iig
  engine = make_engine("IIG", make_mesh(2, 4))
  engine = Engine(
    engine.model, engine.strategy, engine.mesh, engine.optim, CFG.micro_batches, weights_copy=True
  )
  state, _ = Checkpointer(directory).restore(engine)
  for a, b in zip(jax.tree.leaves(jax.device_get(state.weights)), jax.tree.leaves(master)):
    np.testing.assert_array_equal(a, b.astype(a.dtype))
  _, metrics = engine.train_step(state, engine.shard_batch(batch(2)))
  np.testing.assert_allclose(float(metrics["loss"]), next_loss, rtol=1e-6)


def test_checkpoint_of_another_model_is_refused(straight, tmp_path):
  with pytest.raises(ValueError) as e:
    train(
      make_config(
        RunConfig, {**RUN, "model": "tiny", "out": str(straight), "checkpoints.resume": True}
      )
    )
  message = str(e.value)
  assert "is for model 'test'" in message and "builds model 'tiny'" in message
  assert "dim: 32 vs 128" in message and "--model test" in message


# orbax leaves an asyncio callback behind after a failed read; it is noise, not the test's subject.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_newest_checkpoint_falls_back_with_a_warning(saved_iig, tmp_path):
  directory, master = str(tmp_path / "ckpt"), saved_iig[1]
  shutil.copytree(saved_iig[0], directory)
  engine = make_engine("IIG", make_mesh(2, 4))
  ckpt = Checkpointer(directory)
  state, _ = ckpt.restore(engine)
  ckpt.save(state.__class__(state.step + 1, state.master, state.opt_state), meta_for(engine, 3))
  ckpt.close()
  manifest = os.path.join(directory, "3", "state", "manifest.ocdbt")
  with open(manifest, "r+b") as f:
    f.truncate(os.path.getsize(manifest) // 2)
  with pytest.warns(UserWarning, match=r"checkpoint step 3 is damaged .*falling back to step 2"):
    state, meta = Checkpointer(directory).restore(engine)
  assert meta.step == 2
  np.testing.assert_array_equal(
    jax.device_get(state.master)["head"]["kernel"], master["head"]["kernel"]
  )
  # Every step damaged: an error that says so, no silent fresh start.
  with open(os.path.join(directory, "2", "meta", "metadata"), "w") as f:
    f.write("{garbled")
  with pytest.raises(ValueError, match="no intact checkpoint in .*step 3.*step 2"):
    Checkpointer(directory).restore(engine)


# --- damage, full disk, locks, non-finite steps, schedule changes ------------------------------
def _data_files(step_dir):
  """The OCDBT data files of a checkpoint's state."""
  found = []
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    found += [os.path.join(root, f) for f in files if os.sep + "d" + os.sep in root + os.sep]
  return sorted(found)


def _damage(path, how):
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    if how == "truncated":
      f.truncate(size // 2)
    else:  # garbled: up to 2,000 bytes overwritten from the middle on, size unchanged
      f.seek(size // 2)
      count = min(2000, size - size // 2)
      f.write(np.random.default_rng(0).integers(0, 256, count, dtype=np.uint8).tobytes())
  return size


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["truncated", "garbled"])
def test_damaged_newest_checkpoint_is_set_aside_and_the_run_goes_on(straight, tmp_path, how):
  """The newest checkpoint's data files damaged: --resume falls back to step 4, redoes 5 and 6
  with the uninterrupted run's losses and saves step 6 again (no "already exists"); the damaged
  step is kept aside as damaged-6. The same command again resumes cleanly from 6.

  Every data file is damaged, not only the largest: OCDBT files may hold bytes no key refers to
  any more (a value written twice), so damage to one file alone need not touch what a restore
  reads."""
  out = tmp_path / "run"
  shutil.copytree(straight, out)
  files = _data_files(out / "checkpoints" / "6")
  sizes = [_damage(f, how) for f in files]
  assert files and (how == "truncated" or [os.path.getsize(f) for f in files] == sizes)
  with pytest.warns(UserWarning, match=r"step 6 is damaged .*falling back to step 4.*damaged-6"):
    train(
      make_config(
        RunConfig, {**RUN, "out": str(out), "checkpoints.every": 2, "checkpoints.resume": True}
      )
    )
  steps, resumed = losses(out)
  assert steps == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose(resumed, losses(straight)[1], rtol=0, atol=1e-6)
  assert Checkpointer(out / "checkpoints").steps() == [2, 4, 6]
  assert (out / "checkpoints" / "damaged-6").is_dir()
  engine = make_engine("IIG", make_mesh(2, 4))
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)  # step 6 is intact now: no fallback
    _, meta = Checkpointer(out / "checkpoints").restore(engine)
  assert meta.step == 6


def test_checksums_catch_any_changed_array(saved_iig, tmp_path):
  """A checkpoint whose arrays read back fine but differ from what was saved is never loaded:
  here the recorded checksum of one array is changed instead of the array."""
  directory = str(tmp_path / "ckpt")
  shutil.copytree(saved_iig[0], directory)
  meta_file = os.path.join(directory, "2", "meta", "metadata")
  with open(meta_file) as f:
    meta = json.load(f)
  key = sorted(meta["checksums"])[3]
  meta["checksums"][key][0] ^= 1
  with open(meta_file, "w") as f:
    json.dump(meta, f)
  engine = make_engine("IIG", make_mesh(2, 4))
  with pytest.raises(ValueError, match=r"step 2 is damaged .*checksum mismatch in 1 of"):
    Checkpointer(directory).restore(engine)


def test_checksum_depends_on_every_element_and_not_on_sharding():
  from paro_jax.run.checksums import state_checksums

  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  mesh = make_mesh(2, 4)
  spread = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P(("intra", "inter"))))
  base, non_finite = state_checksums({"w": jnp.asarray(x)})
  assert non_finite == [] and state_checksums({"w": spread})[0] == base
  swapped = x.copy()
  swapped[0, 0], swapped[0, 1] = x[0, 1], x[0, 0]
  assert state_checksums({"w": jnp.asarray(swapped)})[0] != base
  x[3, 3] = np.nan
  assert state_checksums({"w": jnp.asarray(x)})[1] == ["['w']"]


def _tmpfs(path, size):
  path.mkdir()
  proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
  if proc.returncode:
    pytest.skip("cannot mount a tmpfs here (needs root): the full-disk test needs a real disk")
  return path


@pytest.fixture
def small_disk(tmp_path):
  disk = _tmpfs(tmp_path / "disk", "2m")
  yield disk
  subprocess.run(["umount", str(disk)])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_full_disk_keeps_the_previous_checkpoint(saved_iig, small_disk):
  """A real full filesystem (a 2 MiB tmpfs): orbax's writer fails with a ValueError; the user
  gets the CheckpointError, and the previous checkpoint restores."""
  directory, master = str(small_disk / "ckpt"), saved_iig[1]
  engine = make_engine("IIG", make_mesh(2, 4))
  state, _ = Checkpointer(saved_iig[0]).restore(engine)
  ckpt = Checkpointer(directory)
  ckpt.save(state, meta_for(engine, 2))
  ckpt.wait()
  free = shutil.disk_usage(small_disk).free
  (small_disk / "filler").write_bytes(b"\0" * (free - 64 * 1024))
  state3 = state.__class__(state.step + 1, state.master, state.opt_state)
  with pytest.raises(CheckpointError) as e:
    ckpt.save(state3, meta_for(engine, 3))
    ckpt.wait()
  assert e.value.errno == errno.ENOSPC
  assert str(e.value).startswith("the disk is full") and os.path.join(directory, "3") in str(
    e.value
  )
  assert "previous checkpoint (step 2) is intact" in str(e.value)
  restored, meta = Checkpointer(directory).restore(engine)
  assert meta.step == 2
  np.testing.assert_array_equal(
    jax.device_get(restored.master)["head"]["kernel"], master["head"]["kernel"]
  )


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_save_failing_as_it_starts_names_its_own_step(saved_iig, tmp_path, monkeypatch):
  """A save that fails before its background write begins (orbax raising from `save` itself)
  is that step's failure, not the previous, complete one's: the message names the new step and
  the previous checkpoint as intact."""
  engine = make_engine("IIG", make_mesh(2, 4))
  state, _ = Checkpointer(saved_iig[0]).restore(engine)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(state, meta_for(engine, int(state.step)))
  ckpt.wait()
  first = int(state.step)

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(ckpt._manager, "save", full)
  later = state.__class__(state.step + 2, state.master, state.opt_state)
  with pytest.raises(CheckpointError) as e:
    ckpt.save(later, meta_for(engine, first + 2))
  where = os.path.join(ckpt.directory, str(first + 2))
  assert str(e.value).startswith(f"the disk is full: could not write checkpoint {where}; ")
  assert f"the previous checkpoint (step {first}) is intact; steps {first + 1}-{first + 2} " in (
    str(e.value)
  )


def test_full_disk_is_one_line(small_disk, capfd):
  """Through the CLI: exit 2 and one line naming the full disk and the intact step, no
  traceback (orbax logs one per writer thread)."""
  argv = ["train", "--model", "test", "--mesh", "2x4", "--micro-batches", "2", "--batch-size"]
  # Twenty checkpoints kept of a state of ~0.4 MB: the 2 MiB disk fills after the first few.
  argv += ["8", "--seq-len", "16", "--dtype", "fp32", "--steps", "40", "--warmup", "2"]
  argv += ["--checkpoint-every", "2", "--keep", "20", "--out", str(small_disk / "run")]
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  err = capfd.readouterr().err
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if "disk is full" in line]
  assert len(lines) == 1, err[-3000:]
  # The checkpoint fills the disk; its own write fails, or the metrics row written meanwhile.
  assert re.match(
    r"paro-jax: error: the disk is full: could not write (checkpoint .*/run/checkpoints/\d+; the "
    r"previous checkpoint \(step \d+\) is intact; steps \d+-\d+ are not saved|"
    r".*/run/metrics.jsonl; checkpoint step \d+ in .* is intact; the steps after it are not "
    r"saved)\. Free space",
    lines[0],
  ), lines[0]


def test_a_run_directory_is_locked(tmp_path):
  (tmp_path / LOCK).write_text("pid 4242 on elsewhere")
  fd = os.open(tmp_path / LOCK, os.O_RDWR)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    with pytest.raises(ValueError, match=r"is in use by another run \(pid 4242 on elsewhere\)"):
      train(make_config(RunConfig, {**RUN, "out": str(tmp_path)}))
  finally:
    os.close(fd)
  assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("resume", [False, True])
def test_metrics_of_a_run_that_saved_no_checkpoint_are_set_aside(tmp_path, capsys, resume):
  """Killed before its first checkpoint: the same command, with or without --resume, keeps the
  old metrics aside (saying where) and starts over."""
  old = '{"step": 1, "loss": 5.0, "grad_norm": 1.0}\n'
  (tmp_path / "metrics.jsonl").write_text(old)
  (tmp_path / "metrics.unsaved-1.jsonl").write_text("an earlier one\n")
  train(
    make_config(
      RunConfig, {**RUN, "optimizer.steps": 2, "out": str(tmp_path), "checkpoints.resume": resume}
    )
  )
  assert (tmp_path / "metrics.unsaved-2.jsonl").read_text() == old
  assert (tmp_path / "metrics.unsaved-1.jsonl").read_text() == "an earlier one\n"
  assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 2]
  assert (
    f"stopped before its first checkpoint: kept as {tmp_path}/metrics.unsaved-2.jsonl; "
    "starting from step 0" in capsys.readouterr().out
  )


MAGIC = 255  # a batch whose first token is this gets a NaN loss (and NaN gradients)


@pytest.fixture
def nan_batches(monkeypatch):
  """Steps listed in the returned set get a NaN loss and NaN gradients, inside the jitted step."""
  real_loss, real_call, poisoned = Llama.token_losses, Batches.__call__, set()

  def loss(self, params, tokens, targets, *args):
    return real_loss(self, params, tokens, targets, *args) * jnp.where(
      targets[0, 0] == MAGIC, jnp.nan, 1.0
    )

  def call(self, step, *args):
    tokens = real_call(self, step, *args)
    if step in poisoned:
      tokens = tokens.copy()
      tokens[:, :, 1] = MAGIC  # the first target of every micro-batch
    return tokens

  monkeypatch.setattr(Llama, "token_losses", loss)  # the step's loss, in either program
  monkeypatch.setattr(Batches, "__call__", call)
  return poisoned


def test_a_non_finite_step_changes_nothing(nan_batches):
  nan_batches.add(1)
  engine = make_engine("IIG", make_mesh(2, 4))
  state = engine.init_state(jax.random.key(0))
  state, _ = engine.train_step(state, engine.shard_batch(BATCHES(0)))
  before = jax.device_get((state.master, state.opt_state))
  state, metrics = engine.train_step(state, engine.shard_batch(BATCHES(1)))
  assert np.isnan(float(metrics["loss"])) and np.isnan(float(metrics["grad_norm"]))
  assert int(state.step) == 2
  after = jax.device_get((state.master, state.opt_state))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_non_finite_steps_are_skipped_logged_and_stop_the_run(nan_batches, tmp_path):
  """One NaN step is skipped (logged as null, "skipped"); the run goes on. Then
  --max-bad-steps in a row stop it naming the step, and the newest checkpoint is the last
  good one (step 4's was not written: step 4 was non-finite)."""
  nan_batches.update({2, 5, 6})  # steps 3, 6 and 7
  out = tmp_path / "run"
  with pytest.raises(NonFiniteSteps, match=r"step 7: loss nan.* 2 non-finite steps in a row"):
    run = {
      **RUN,
      "optimizer.steps": 10,
      "out": str(out),
      "checkpoints.every": 2,
      "max_bad_steps": 2,
    }
    train(make_config(RunConfig, run))

  def strict(name):
    raise ValueError(f"not strict JSON: {name}")

  rows = [json.loads(line, parse_constant=strict) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
  bad = [False, False, True, False, False, True, True]
  assert [r.get("skipped", False) for r in rows] == bad
  assert [r["loss"] is None and r["grad_norm"] is None for r in rows] == bad
  assert Checkpointer(out / "checkpoints").steps() == [2, 4]
  state, meta = Checkpointer(out / "checkpoints").restore(make_engine("IIG", make_mesh(2, 4)))
  assert meta.step == 4


def test_resume_with_another_schedule_says_so(straight, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(straight, out)
  with pytest.warns(
    UserWarning,
    match=r"resuming with --steps 7 --lr 0.001, but the checkpoint \(step 6\) was trained with "
    r"--steps 6 --lr 0.003: the learning-rate schedule changed",
  ):
    run = {**RUN, "optimizer.steps": 7, "optimizer.lr": 1e-3, "out": str(out)}
    train(make_config(RunConfig, {**run, "checkpoints.resume": True}))
  assert losses(out)[0] == [1, 2, 3, 4, 5, 6, 7]


def test_resume_with_another_wire_precision(straight, tmp_path):
  """A checkpoint does not depend on the communication precision: a run saved with full-precision
  inter-node traffic resumes with int8 on the wire (params and grads). Steps 5 and 6 then train
  with int8 traffic: close to the uncompressed run's losses, not equal to them."""
  out = tmp_path / "run"
  shutil.copytree(straight, out)
  shutil.rmtree(out / "checkpoints" / "6")
  wire = {"wire.inter_params": "int8", "wire.inter_grads": "int8"}
  run = {**RUN, **wire, "out": str(out), "checkpoints.every": 2, "checkpoints.resume": True}
  train(make_config(RunConfig, run))
  steps, resumed = losses(out)
  assert steps == [1, 2, 3, 4, 5, 6]
  expected = losses(straight)[1]
  assert resumed[:4] == expected[:4]
  np.testing.assert_allclose(resumed[4:], expected[4:], rtol=1e-2)
  assert resumed[4:] != expected[4:]


@pytest.mark.parametrize(
  "change,message",
  [
    ({"optimizer.lr": float("nan")}, "--lr must be a positive finite number, got nan"),
    ({"optimizer.lr": float("inf")}, "--lr must be a positive finite number, got inf"),
    ({"optimizer.warmup": -1}, "--warmup must be >= 0, got -1"),
    ({"max_bad_steps": 0}, "max-bad-steps must be >= 1"),
  ],
)
def test_bad_schedule_is_refused(change, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    make_config(RunConfig, {**RUN, **change})


def test_warmup_longer_than_the_run_is_said():
  with pytest.warns(UserWarning, match=r"--warmup 7 is more than --steps 6: .* all 6 steps"):
    make_config(RunConfig, {**RUN, "optimizer.warmup": 7})


@pytest.mark.parametrize("every", [0, 1])
def test_a_first_save_on_a_full_disk_is_one_line_saying_what_is_lost(small_disk, every):
  """In a real process (asyncio reports orbax's failed writes at exit): the first checkpoint,
  the final one with --checkpoint-every 0, cannot be written. One line, which says that the
  steps trained so far are not saved; no traceback, no asyncio report."""
  free = shutil.disk_usage(small_disk).free
  (small_disk / "filler").write_bytes(b"\0" * (free - 96 * 1024))  # room for metrics only
  env = {**os.environ, "XLA_FLAGS": FAST_COMPILE}  # the CLI adds its device count
  cmd = [sys.executable, "-m", "paro_jax", "train", "--model", "test", "--mesh", "2x4"]
  cmd += ["--batch-size", "8", "--seq-len", "16", "--dtype", "fp32", "--warmup", "1"]
  cmd += ["--steps", "2", "--checkpoint-every", str(every), "--out", str(small_disk / "run")]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [x for x in proc.stderr.splitlines() if x.startswith("paro-jax: error:")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "never retrieved" not in proc.stderr and "Event loop is closed" not in proc.stderr
  step = 2 if every == 0 else 1
  assert errors[0].startswith(
    f"paro-jax: error: the disk is full: could not write checkpoint {small_disk}/run/checkpoints/"
    f"{step}; no earlier checkpoint exists: the {step} steps trained are not saved. Free space"
  ), errors[0]


@pytest.mark.parametrize("name", ["exp[lr=3e-3]", "a*b", "run?", "back\\slash"])
def test_out_with_glob_characters_is_refused_before_training(tmp_path, name, capfd):
  """orbax globs a save's directory to find its per-process files: under `[...]` it finds none
  (the arrays are never merged) and under a backslash TensorStore writes elsewhere, so every
  checkpoint of such a run would be unreadable. The CLI refuses the name before any work."""
  out = tmp_path / name
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "--model", "test", "--mesh", "2x4", "--steps", "2", "--out", str(out)])
  err = capfd.readouterr().err
  assert e.value.code == 2 and not out.exists()
  lines = [line for line in err.splitlines() if "error" in line]
  assert len(lines) == 1 and "glob patterns" in lines[0] and "--out" in lines[0], err
  with pytest.raises(ValueError, match="checkpoint directory .* glob patterns"):
    Checkpointer(str(out / "checkpoints"))


def test_a_save_that_cannot_be_read_back_replaces_nothing(saved_iig, tmp_path, monkeypatch):
  """Were such a name to get through (the check in RunConfig and Checkpointer bypassed), the
  save is found unreadable when it completes: one CheckpointError, and the older checkpoint is
  not rotated away."""
  monkeypatch.setattr("paro_jax.run.checkpoint.refuse_unsafe_path", lambda *a: None)
  engine = make_engine("IIG", make_mesh(2, 4))
  state, _ = Checkpointer(saved_iig[0]).restore(engine)
  directory = str(tmp_path / "exp[a]" / "ckpt")
  ckpt = Checkpointer(directory, keep=1)
  ckpt.save(state, meta_for(engine, 2))
  with pytest.raises(CheckpointError, match="was written but cannot be read back") as e:
    ckpt.wait()
  assert "array index lists 0 of" in str(e.value) and str(directory) in str(e.value)
  # A readable save still rotates normally, and a readable one is not flagged.
  good = Checkpointer(str(tmp_path / "good"), keep=1)
  good.save(state, meta_for(engine, 2))
  good.wait()
  state3, _ = engine.train_step(state, engine.shard_batch(batch(2)))
  good.save(state3, meta_for(engine, 3))
  good.close()
  assert good.steps() == [3]


def test_a_non_finite_state_names_its_arrays_and_what_is_kept(saved_iig, tmp_path):
  """A state with NaN/Inf is never saved; the line names the arrays and says truly what the run
  keeps: it said "its newest checkpoint is kept" also when there was none."""
  engine = make_engine("IIG", make_mesh(2, 4))
  state, _ = Checkpointer(saved_iig[0]).restore(engine)
  embedding = state.master["embed"]["embedding"]
  broken = state._replace(master={**state.master, "embed": {"embedding": embedding * jnp.nan}})
  step = int(state.step)
  ckpt = Checkpointer(str(tmp_path / "none"))
  with pytest.raises(NonFiniteStateError) as e:
    ckpt.save(broken, meta_for(engine, step))
  assert f"the state of step {step} holds NaN or Inf values in 1 of " in str(e.value)
  assert "(first: .master['embed']['embedding'])" in str(e.value)
  assert str(e.value).endswith(
    f"no checkpoint was saved before it: the {step} steps trained are lost; run again with a "
    f"lower --lr"
  )
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "one"))
  ckpt.save(state, meta_for(engine, step))
  later = broken._replace(step=broken.step + 1)
  with pytest.raises(NonFiniteStateError, match=f"its newest checkpoint, step {step}, is kept"):
    ckpt.save(later, meta_for(engine, step + 1))
  ckpt.close()
  assert Checkpointer(str(tmp_path / "one")).steps() == [step]


def test_a_step_rotated_away_while_listed_is_left_out(straight, tmp_path, monkeypatch):
  """orbax reads each step's files as it lists them. A step that a run still saving there
  deletes (--keep) between orbax's `exists()` and `is_dir()` of it raised NotADirectoryError
  out of the listing (an export of such a run failed so in CI); it is listed again without it."""
  directory = tmp_path / "checkpoints"
  shutil.copytree(straight / "checkpoints", directory)
  victim = str(directory / "4")
  path_type = type(epath.Path(victim))
  is_dir = path_type.is_dir

  def rotated_while_read(self):
    if str(self) == victim and sys._getframe(1).f_code.co_name == "_sanitize_metadata_path":
      shutil.rmtree(victim)  # deleted by the saving run after orbax saw that it exists
    return is_dir(self)

  monkeypatch.setattr(path_type, "is_dir", rotated_while_read)
  assert Checkpointer(str(directory), read_only=True).steps() == [2, 6]
  assert not os.path.exists(victim)  # the deletion happened inside the listing


def test_restored_leaves_in_their_dtype_are_not_copied():
  """A restored state is cast to the engine's dtypes leaf by leaf: a leaf already in its dtype
  and at its sharding (a LoRA run's frozen base) is the restored array itself, not a copy."""
  mesh = jax.make_mesh((2,), ("intra",), devices=jax.devices()[:2])
  split, whole = NamedSharding(mesh, PartitionSpec("intra")), NamedSharding(mesh, PartitionSpec())
  base = jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), split)
  master = jax.device_put(jnp.arange(4, dtype=jnp.bfloat16), whole)
  target = {
    "base": jax.ShapeDtypeStruct((8,), jnp.bfloat16),
    "master": jax.ShapeDtypeStruct((4,), jnp.float32),
  }
  cast = cast_like(target, {"base": split, "master": split})({"base": base, "master": master})
  assert cast["base"] is base
  assert cast["master"].dtype == jnp.float32 and cast["master"].sharding == split
  np.testing.assert_array_equal(np.asarray(cast["master"]), np.arange(4))
