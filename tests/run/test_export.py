"""`paro-jax export` (paro_jax/run/export.py) of every kind of run (bf16/fp32 x LoRA/full) reads
what training wrote, and calls a checkpoint damaged exactly when `train --resume` does (one restore
path, one verdict).

A bf16 LoRA run stores its frozen base in bf16; export (an fp32 engine) and a resume in fp32 must
verify the checksums of the bf16 bits as written, not of the fp32 values they are converted to.
"""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paro_jax.hf.weights import load_hf
from models.llama import Llama
from paro_jax import cli
from paro_jax.core.shards import join_trainable
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.run.setup import build
from paro_jax.run.train import train

RUN = {
  "model": "test",
  "strategy": "ING",
  "mesh": (2, 4),
  "batch_size": 8,
  "seq_len": 16,
  "optimizer.warmup": 1,
  "optimizer.steps": 2,
}
LORA = {"lora.rank": 4, "lora.targets": "wq,wk,wv,wo"}
KINDS = [(dtype, lora) for dtype in ("bf16", "fp32") for lora in (True, False)]


def config(dtype, lora, out, changes=()):
  """The run of this kind; `changes` by option path."""
  run = {**RUN, **(LORA if lora else {}), "dtype": dtype, "out": str(out)}
  return make_config(RunConfig, {**run, **dict(changes)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One two-step run of each kind: {(dtype, lora): run directory}."""
  root = tmp_path_factory.mktemp("runs")
  done = {}
  for dtype, lora in KINDS:
    out = root / f"{dtype}-{'lora' if lora else 'full'}"
    train(config(dtype, lora, out))
    done[dtype, lora] = out
  return done


def restore_as_trained(cfg):
  """The checkpoint read back with the run's own engine (its dtype: nothing converted)."""
  engine = build(cfg)[0]
  ckpt = Checkpointer(os.path.join(cfg.out, CHECKPOINTS))
  try:
    state, meta = ckpt.restore(engine, cfg.model)
  finally:
    ckpt.close()
  return engine, state, meta


@pytest.mark.parametrize(
  "dtype,lora", KINDS, ids=[f"{d}-{'lora' if x else 'full'}" for d, x in KINDS]
)
def test_export_writes_what_the_run_trained(runs, tmp_path, dtype, lora):
  run = runs[dtype, lora]
  # A save in flight of a run still writing there: a reader leaves it alone.
  in_flight = run / CHECKPOINTS / "3.orbax-checkpoint-tmp-1"
  in_flight.mkdir()
  try:
    cli.main(["export", "--run", str(run), "--out", str(tmp_path / "hf"), "--dtype", "fp32"])
    assert in_flight.is_dir()
  finally:
    in_flight.rmdir()
  cfg, exported = load_hf(tmp_path / "hf")
  engine, state, meta = restore_as_trained(config(dtype, lora, run))
  assert meta.step == 2 and cfg == engine.model.cfg
  frozen = jax.tree.map(lambda w: np.asarray(w, np.float32), state.frozen)
  full = jax.device_get(join_trainable(engine.mask, state.master, frozen) if lora else state.master)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab, (2, 16)), jnp.int32)
  # The exported plain LLaMA computes what the trained model computes, in fp32 (the LoRA model
  # applies its adapters unmerged: an independent path to the same function).
  np.testing.assert_allclose(
    Llama(cfg, jnp.float32).apply(jax.tree.map(jnp.asarray, exported), tokens),
    Llama(cfg, jnp.float32, lora=engine.model.lora).apply(full, tokens),
    atol=1e-5,
  )
  if not lora:  # the fp32 master weights, bit for bit
    for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(full)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_lora_run_resumes_in_the_other_dtype(runs, tmp_path, dtype, recwarn):
  out = tmp_path / "run"
  shutil.copytree(runs[dtype, True], out)
  other = "fp32" if dtype == "bf16" else "bf16"
  train(config(other, True, out, {"optimizer.steps": 3, "checkpoints.resume": True}))
  assert not any("damaged" in str(w.message) for w in recwarn)
  assert sorted(os.listdir(out / CHECKPOINTS)) == ["2", "3"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoint_is_refused_alike_by_export_and_resume(runs, tmp_path, capsys):
  """Really damaged frozen bf16 arrays: export and resume both refuse the checkpoint, with the
  same verdict; neither changes the directory, and neither advises deleting it."""
  out = tmp_path / "run"
  shutil.copytree(runs["bf16", True], out)
  for root, _, files in os.walk(out / CHECKPOINTS / "2" / "state"):
    for name in files:
      if os.sep + "d" + os.sep in root + os.sep:  # OCDBT data files
        path = os.path.join(root, name)
        with open(path, "r+b") as f:
          f.seek(os.path.getsize(path) // 2)
          f.write(np.random.default_rng(0).integers(0, 256, 256, dtype=np.uint8).tobytes())
  before = sorted(os.listdir(out / CHECKPOINTS))
  with pytest.raises(SystemExit) as e:
    cli.main(["export", "--run", str(out), "--out", str(tmp_path / "hf")])
  exported = capsys.readouterr().err.strip().splitlines()[-1]
  assert e.value.code == 2
  with pytest.raises(ValueError) as resumed:
    train(config("bf16", True, out, {"optimizer.steps": 3, "checkpoints.resume": True}))
  assert sorted(os.listdir(out / CHECKPOINTS)) == before
  assert "checkpoint step 2 is damaged" in exported and "checkpoint step 2 is damaged" in str(
    resumed.value
  )
  # The same verdict: the same kind of error and advice (which damaged array the parallel reads
  # meet first may differ from one read to the next).
  verdicts = [text.split("damaged (")[1] for text in (exported, str(resumed.value))]
  assert len({v.split(":")[0] for v in verdicts}) == 1
  assert len({v.split(". ")[-1] for v in verdicts}) == 1
  assert "elete" not in exported


def test_a_read_only_checkpointer_refuses_to_save(runs):
  ckpt = Checkpointer(os.path.join(runs["fp32", False], CHECKPOINTS), read_only=True)
  try:
    engine, state, meta = restore_as_trained(config("fp32", False, runs["fp32", False]))
    with pytest.raises(ValueError, match="opened read-only"):
      ckpt.save(state, dataclasses.replace(meta, step=int(state.step)))
  finally:
    ckpt.close()
