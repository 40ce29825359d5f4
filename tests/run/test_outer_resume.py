"""The outer loop across checkpoints: a checkpoint holds the outer weights, their momentum and
the pseudo-gradient's error-feedback residual, and the step count is the round's position, so a
run resumed mid-round continues exactly as the uninterrupted run (streaming too: each
fragment's outer state and residual span)."""

import json
import shutil

import jax
import numpy as np
import pytest

from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.run.train import train
from tests.run.tiny_run import RUN as TINY_RUN, losses

# III on 2x4, rounds of 2 steps, the pseudo-gradient in int8 (error feedback on); a checkpoint
# every 3 steps: step 3 is in the middle of the second round.
RUN = {
  **TINY_RUN,
  "strategy": "III",
  "outer.sync": 2,
  "wire.inter_grads": "int8",
  "checkpoints.every": 3,
  "eval.every": 3,
}
pytestmark = pytest.mark.usefixtures("compilation_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  out = tmp_path_factory.mktemp("outer-straight")
  train(make_config(RunConfig, {**RUN, "out": str(out)}))
  return out


def test_resume_mid_round_equals_uninterrupted(straight, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(straight, out)
  shutil.rmtree(out / "checkpoints" / "6")
  train(make_config(RunConfig, {**RUN, "out": str(out), "checkpoints.resume": True}))
  steps, resumed = losses(out)
  assert steps == [1, 2, 3, 4, 5, 6]
  assert resumed == losses(straight)[1]  # bit for bit
  # the eval losses (of the outer weights) too
  assert eval_losses(out) == eval_losses(straight)


# Streaming: two fragments, each every 4 steps (fragment 0 kept after step 2, 1 after step 4),
# each exchanged a step late (--outer-delay 1), the pseudo-gradient in int4; a checkpoint every
# 2 steps: step 2's holds fragment 0's kept weights, whose exchange comes after step 3.
STREAM = {
  **RUN,
  "outer.sync": 4,
  "outer.fragments": 2,
  "outer.delay": 1,
  "wire.inter_grads": "int4",
  "checkpoints.every": 2,
}


def test_streaming_resume_equals_uninterrupted(tmp_path):
  """Each fragment's outer state, residual span and kept weights resumed exactly; a checkpoint
  of the fragments before they cut the vocabulary is refused (with a residual) or said."""
  import warnings

  from paro_jax.run.checkpoint import Checkpointer
  from paro_jax.run.checkpoint_content import OuterMismatch, check_outer_schedule

  straight, out = tmp_path / "straight", tmp_path / "run"
  train(make_config(RunConfig, {**STREAM, "out": str(straight)}))
  shutil.copytree(straight, out)
  for step in ("4", "6"):
    shutil.rmtree(out / "checkpoints" / step)
  train(make_config(RunConfig, {**STREAM, "out": str(out), "checkpoints.resume": True}))
  assert losses(out) == losses(straight)  # bit for bit, steps 3-6 from step 2's checkpoint
  assert eval_losses(out) == eval_losses(straight)
  # Eval and export read it as its outer weights, kept weights and all.
  ckpt = Checkpointer(str(straight / "checkpoints"), read_only=True)
  plain = {"outer.sync": None, "outer.fragments": 1, "outer.delay": 0, "wire.inter_grads": "same"}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    state, _ = ckpt.restore(engine_of((1, 8), **plain))
  own, _ = ckpt.restore(engine_of((2, 4), **{k: STREAM[k] for k in plain}))
  for a, b in zip(jax.tree.leaves(state.master), jax.tree.leaves(own.outer.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ckpt.close()
  # Written when the first fragment held the whole embedding and the last the whole head: its
  # residual spans are laid out by those fragments, so refused; without a residual, said.
  old = tmp_path / "old"
  shutil.copytree(straight / "checkpoints" / "2", old / "2")
  meta = old / "2" / "meta" / "metadata"
  written = json.loads(meta.read_text())
  del written["outer"]["cut"]
  meta.write_text(json.dumps(written))
  ckpt = Checkpointer(str(old), read_only=True)
  with pytest.raises(OuterMismatch, match="written when the first fragment held the whole emb"):
    ckpt.restore(engine_of((2, 4), **{k: STREAM[k] for k in plain}))
  with pytest.warns(UserWarning, match="from here on each fragment syncs its share of their"):
    check_outer_schedule(
      ckpt.newest_meta(), engine_of((2, 4), **{k: STREAM[k] for k in plain}).outer, "it"
    )
  ckpt.close()


def eval_losses(run_dir):
  rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  return [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def engine_of(mesh, **step):
  from models.presets import get_config
  from paro_jax.core.factory import build_engine
  from paro_jax.core.mesh import make_mesh

  config = make_config(RunConfig, {**RUN, **step})
  return build_engine(config, get_config("test"), make_mesh(*mesh))


def test_without_the_outer_loop_its_checkpoint_gives_the_outer_weights(straight):
  """Eval, export and a run without --outer-sync read the outer loop's checkpoint as its outer
  weights (said in one line); with another number of groups the outer loop refuses it."""
  from paro_jax.run.checkpoint import Checkpointer
  from paro_jax.run.checkpoint_content import OuterMismatch

  ckpt = Checkpointer(str(straight / "checkpoints"), read_only=True)
  own, _ = ckpt.restore(engine_of((2, 4)))
  with pytest.warns(UserWarning, match="holds the outer loop's state"):
    plain, _ = ckpt.restore(engine_of((1, 8), **{"outer.sync": None, "wire.inter_grads": "same"}))
  for a, b in zip(jax.tree.leaves(plain.master), jax.tree.leaves(own.outer.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(OuterMismatch, match="holds the states of 2 groups and --mesh has 4"):
    ckpt.restore(engine_of((4, 2)))
  ckpt.close()


def test_another_schedule_is_refused_in_one_line(straight, tmp_path, capsys):
  """A resume with another --outer-fragments exits 2 with one line naming both values and the
  fix, before anything is read or set aside: the checkpoints stay as they were."""
  from paro_jax import cli

  out = tmp_path / "run"
  shutil.copytree(straight, out)
  before = sorted(p.name for p in (out / "checkpoints").iterdir())
  argv = "--model test --strategy III --mesh 2x4 --micro-batches 2 --batch-size 8 --seq-len 16"
  argv += " --dtype fp32 --steps 6 --warmup 2 --outer-sync 2 --inter-grads int8 --resume"
  with pytest.raises(SystemExit) as e:
    cli.main(["train", *argv.split(), "--outer-fragments", "2", "--out", str(out)])
  err = capsys.readouterr().err
  lines = [x for x in err.splitlines() if x.startswith("paro-jax: error:")]
  assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err
  assert "was written with --outer-fragments 1, this run has --outer-fragments 2" in lines[0]
  assert "resume with --outer-fragments 1" in lines[0]
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
  assert losses(out) == losses(straight)  # nothing trained, nothing written


def test_the_checkpoint_records_the_schedule_and_old_ones_read_as_one_fragment(straight, tmp_path):
  """The metadata holds H, F, TAU and ALPHA; a checkpoint written before (no `outer`) reads as
  F = 1, TAU = 0 (H unchecked); another H or TAU is refused, another ALPHA said."""
  from paro_jax.run.checkpoint import Checkpointer
  from paro_jax.run.checkpoint_content import OuterMismatch

  ckpt = Checkpointer(str(straight / "checkpoints"), read_only=True)
  assert ckpt.newest_meta().outer == {
    "sync": 2,
    "fragments": 1,
    "delay": 0,
    "mix": 0.0,
    "state": "G",
    "cut": "vocab",
  }
  with pytest.raises(OuterMismatch, match="--outer-sync 2, this run has --outer-sync 4: "):
    ckpt.restore(engine_of((2, 4), **{"outer.sync": 4}))
  with pytest.raises(OuterMismatch, match="--outer-sync 2 --outer-delay 0, this run has --o"):
    ckpt.restore(engine_of((2, 4), **{"outer.sync": 4, "outer.delay": 1}))
  with pytest.warns(UserWarning, match="resuming with --outer-mix 0.5, but step 6's"):
    ckpt.restore(engine_of((2, 4), **{"outer.mix": 0.5}))
  ckpt.close()
  old = tmp_path / "old"
  shutil.copytree(straight / "checkpoints" / "6", old / "6")
  meta = old / "6" / "meta" / "metadata"  # the RunMeta's JSON, as written before `outer`
  written = json.loads(meta.read_text())
  del written["outer"]
  meta.write_text(json.dumps(written))
  ckpt = Checkpointer(str(old), read_only=True)
  assert ckpt.newest_meta().outer is None
  with pytest.raises(OuterMismatch, match="with --outer-fragments 1, this run has --outer-fr"):
    ckpt.restore(engine_of((2, 4), **{"outer.fragments": 2}))
  ckpt.restore(engine_of((2, 4), **{"outer.sync": 4}))  # H was not recorded: not checked
  ckpt.close()


# --outer-state I: the outer weights and momentum at I (each node's copy over its devices).
AT_NODE = {**RUN, "outer.state": "I"}


def test_resume_with_the_outer_state_at_node_equals_uninterrupted(straight, tmp_path):
  """The checkpoint holds the outer state at I and its residual; resumed mid-round, exactly.
  Another --outer-state with a residual in the checkpoint is refused in one line (its elements
  are laid out by the placement's collective)."""
  from paro_jax.run.checkpoint import Checkpointer
  from paro_jax.run.checkpoint_content import OuterMismatch

  at_node, out = tmp_path / "straight", tmp_path / "run"
  train(make_config(RunConfig, {**AT_NODE, "out": str(at_node)}))
  shutil.copytree(at_node, out)
  shutil.rmtree(out / "checkpoints" / "6")
  train(make_config(RunConfig, {**AT_NODE, "out": str(out), "checkpoints.resume": True}))
  assert losses(out) == losses(at_node)  # bit for bit
  assert eval_losses(out) == eval_losses(at_node)
  ckpt = Checkpointer(str(at_node / "checkpoints"), read_only=True)
  assert ckpt.newest_meta().outer["state"] == "I"
  ckpt.close()
  ckpt = Checkpointer(str(straight / "checkpoints"), read_only=True)
  with pytest.raises(OuterMismatch, match="--outer-state G, this run has --outer-state I, and"):
    ckpt.restore(engine_of((2, 4), **{"outer.state": "I"}))
  ckpt.close()


def test_another_outer_state_without_a_residual_reshards(tmp_path):
  """A checkpoint of the state at G without a residual (fp32 pseudo-gradient) resumed with
  --outer-state I: its outer weights and momentum read at I (said in one line), the run
  continuing as the uninterrupted one at G (up to the float order of the two programs)."""
  plain = {**RUN, "wire.inter_grads": "same"}
  straight, out = tmp_path / "straight", tmp_path / "run"
  train(make_config(RunConfig, {**plain, "out": str(straight)}))
  shutil.copytree(straight, out)
  shutil.rmtree(out / "checkpoints" / "6")
  resume = {**plain, "outer.state": "I", "out": str(out), "checkpoints.resume": True}
  with pytest.warns(UserWarning, match="holds the outer state at G: its outer weights and mom"):
    train(make_config(RunConfig, resume))
  steps, resumed = losses(out)
  assert steps == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose(resumed, losses(straight)[1], rtol=1e-5)
  assert resumed[:3] == losses(straight)[1][:3]
