"""A LoRA run from --init-from saves no frozen base: its checkpoints record the base's directory
and fingerprint, and resume, export and eval read the base again from there. The reference is the
same run with --keep-base (the checkpoints of before: the base stored in each)."""

import os
import shutil

import jax
import numpy as np
import pytest

from paro_jax.core.config import make_config
from paro_jax.data.streams import Batches
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.run.config import EvalConfig, RunConfig
from paro_jax.run.source import open_source, source_engine
from paro_jax.run.export import export_run
from paro_jax.run.frozen_base import BaseChanged, base_identity, reimport_base
from paro_jax.run.setup import build
from paro_jax.run.train import train
from tests.run.tiny_run import losses

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
HF = os.path.join(FIXTURES, "hf_llama")


def config(base, out, **changes):
  return make_config(
    RunConfig,
    {
      "init_from": str(base),
      "strategy": "IIG",
      "mesh": (2, 4),
      "batch_size": 8,
      "seq_len": 16,
      "dtype": "bf16",
      "lora.rank": 4,
      "optimizer.lr": 1e-3,
      "optimizer.steps": 4,
      "optimizer.warmup": 1,
      "checkpoints.every": 2,
      "data.paths": (os.path.join(HF, "text.txt"),),
      "out": str(out),
      **changes,
    },
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{"base": the HF directory (a copy), "whole": four steps without the base in its
  checkpoints, "kept": the same with --keep-base, "resumed": stopped at step 3 and resumed}."""
  root = tmp_path_factory.mktemp("lora_base")
  base = root / "base"
  shutil.copytree(os.path.join(HF, "odd_vocab"), base)
  train(config(base, root / "whole"))
  train(config(base, root / "kept", **{"checkpoints.keep_base": True}))
  real_call = Batches.__call__

  def interrupt_at_3(self, step):
    if step == 3:
      raise KeyboardInterrupt
    return real_call(self, step)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(Batches, "__call__", interrupt_at_3)
    with pytest.raises(KeyboardInterrupt):
      train(config(base, root / "resumed"))
  train(config(base, root / "resumed", **{"checkpoints.resume": True}))
  return {name: root / name for name in ("base", "whole", "kept", "resumed")}


def _bytes(directory):
  return sum(
    os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files
  )


def _restore(run, base, **kwargs):
  ckpt = Checkpointer(os.path.join(run, CHECKPOINTS), read_only=True)
  try:
    return ckpt.restore(build(config(base, run))[0], f"hf:{base}", **kwargs)
  finally:
    ckpt.close()


def test_checkpoints_hold_the_adapters_and_the_base_s_identity(runs):
  whole, _ = _restore(runs["whole"], runs["base"])
  kept, kept_meta = _restore(runs["kept"], runs["base"])
  ckpt = Checkpointer(os.path.join(runs["whole"], CHECKPOINTS), read_only=True)
  meta = ckpt.newest_meta()
  ckpt.close()
  assert kept_meta.base is None and meta.base["directory"] == str(runs["base"])
  assert meta.base["dtype"] == "bfloat16" and set(meta.base["files"]) == {"model.safetensors"}
  # the base read again is the base stored: every array of the two states is equal
  for a, b in zip(jax.tree.leaves(jax.device_get(whole)), jax.tree.leaves(jax.device_get(kept))):
    np.testing.assert_array_equal(a, b)
  # on disk: one step's state without the base is a fraction of the one with it
  step = lambda run: os.path.join(run, CHECKPOINTS, "4", "state")  # noqa: E731
  saved, with_base = _bytes(step(runs["whole"])), _bytes(step(runs["kept"]))
  frozen = sum(x.nbytes for x in jax.tree.leaves(jax.device_get(kept.frozen)))
  # (what the stored base adds on disk varies from run to run with the checkpoint's compression
  # and its files' layout: 0.89 to 1.3 of its bytes seen here; a base not stored adds ~nothing)
  assert with_base - saved > 0.75 * frozen
  assert saved < 0.5 * with_base, (saved, with_base)
  print(f"state bytes on disk: {saved} without the base, {with_base} with it, base {frozen}")


def test_resumed_from_a_base_less_checkpoint_equals_the_uninterrupted_run(runs):
  assert losses(runs["resumed"]) == losses(runs["whole"])
  a, _ = _restore(runs["resumed"], runs["base"])
  b, _ = _restore(runs["whole"], runs["base"])
  for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("adapter", [False, True], ids=["merged", "adapter"])
def test_export_equals_the_export_of_the_run_that_kept_its_base(runs, tmp_path, adapter):
  for name in ("whole", "kept"):
    export_run(str(runs[name]), str(tmp_path / name), adapter=adapter)
  for f in sorted(os.listdir(tmp_path / "kept")):
    if f.endswith(".safetensors"):
      assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "kept" / f).read_bytes(), f


def test_eval_weights_equal_those_of_the_run_that_kept_its_base(runs):
  got = {}
  for name in ("whole", "kept"):
    cfg = make_config(
      EvalConfig,
      {
        "source": str(runs[name]),
        "strategy": "GGG",
        "mesh": (1, 8),
        "batch_size": 8,
        "seq_len": 16,
      },
    )
    got[name] = jax.device_get(source_engine(open_source(str(runs[name])), cfg)[1])
  for a, b in zip(jax.tree.leaves(got["whole"]), jax.tree.leaves(got["kept"])):
    np.testing.assert_array_equal(a, b)


def _refused(runs, match, tmp_path):
  """Resume (its restore) and export both refuse, in the same line."""
  ckpt = Checkpointer(os.path.join(runs["whole"], CHECKPOINTS), read_only=True)
  try:
    with pytest.raises(BaseChanged, match=match):
      ckpt.restore(ENGINE[0], f"hf:{runs['base']}")
  finally:
    ckpt.close()
  with pytest.raises(BaseChanged, match=match) as refused:
    export_run(str(runs["whole"]), str(tmp_path / "export"))
  line = str(refused.value)
  assert "\n" not in line and str(runs["base"]) in line and "--keep-base" in line
  assert os.path.join(str(runs["whole"]), CHECKPOINTS) in line


ENGINE = []  # the run's engine, built while its base is there (build reads its config.json)


@pytest.fixture
def engine(runs):
  if not ENGINE:
    ENGINE.append(build(config(runs["base"], runs["whole"]))[0])
  return ENGINE[0]


def test_a_changed_base_file_is_refused_in_one_line(runs, engine, tmp_path):
  weights = runs["base"] / "model.safetensors"
  original = weights.read_bytes()
  changed = bytearray(original)
  changed[-3] ^= 0x40  # one bit of the last tensor: same size, same header
  try:
    weights.write_bytes(bytes(changed))
    _refused(runs, "changed since: 1 of its weight files differ", tmp_path)
    # an edit the sampled fingerprint does not see is seen by the checksums of the base read
    ckpt = Checkpointer(os.path.join(runs["whole"], CHECKPOINTS), read_only=True)
    meta = ckpt.newest_meta()
    ckpt.close()
    blind = {**base_identity(str(runs["base"])), "dtype": meta.base["dtype"]}
    with pytest.raises(BaseChanged, match="whose weights differ .* in 1 of"):
      reimport_base(blind, engine, engine.state_shardings.frozen, meta.checksums, "step 4")
  finally:
    weights.write_bytes(original)


def test_a_missing_base_directory_is_refused_in_one_line(runs, engine, tmp_path):
  moved = runs["base"].with_name("moved")
  os.rename(runs["base"], moved)
  try:
    _refused(runs, "which is gone", tmp_path)
  finally:
    os.rename(moved, runs["base"])
