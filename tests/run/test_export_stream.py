"""The streaming, sharded export (paro_jax/hf/stream_out.py through `paro-jax export`) writes the
files the whole-tree export wrote, byte for byte: the reference here is that path, kept in the
test (the checkpoint restored whole onto one device, merged with `merge_lora`, written by
`save_hf` or `save_adapter`), for a full run and a LoRA run (merged and --adapter), in one file
and in shards."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig, LoraConfig
from paro_jax import cli
from paro_jax.core.config import LoraOptions, StepConfig, make_config
from paro_jax.core.factory import build_engine
from paro_jax.core.mesh import make_mesh
from paro_jax.core.shards import join_trainable
from paro_jax.hf.peft import save_adapter
from paro_jax.hf.weights import WEIGHT_DTYPES, save_hf
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.run.config import RunConfig
from paro_jax.run.export import _base_config, _source_dir
from paro_jax.run.train import train

RUN = {
  "model": "test",
  "strategy": "ING",
  "mesh": (2, 4),
  "batch_size": 8,
  "seq_len": 16,
  "optimizer.warmup": 1,
  "optimizer.steps": 1,
  "dtype": "bf16",
}
LORA = {"lora.rank": 4, "lora.targets": "wq,wv,w_down"}
SMALL = "20KB"  # several shards of the test model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("runs")
  done = {}
  for kind, extra in (("full", {}), ("lora", LORA)):
    out = root / kind
    train(make_config(RunConfig, {**RUN, **extra, "out": str(out)}))
    done[kind] = out
  return done


def reference(run, out, dtype, max_shard_size, adapter=False):
  """The whole-tree export: restored whole on one device, merged, then save_hf/save_adapter."""
  ckpt = Checkpointer(os.path.join(run, CHECKPOINTS), read_only=True)
  try:
    meta = ckpt.newest_meta()
    cfg = LlamaConfig(**meta.model_config)
    lora = LoraConfig(**meta.lora) if meta.lora else None
    one = StepConfig(strategy="NNN", dtype="fp32", lora=LoraOptions.of(lora))
    engine = build_engine(one, cfg, make_mesh(1, 1, jax.devices()[:1]))
    state, meta = ckpt.restore(engine, meta.model_name)
  finally:
    ckpt.close()
  params = state.master
  if lora:
    full = join_trainable(
      engine.mask, state.master, jax.tree.map(lambda w: w.astype(jnp.float32), state.frozen)
    )
    params = full if adapter else engine.model.merge_lora(full)
  params = jax.tree.map(np.asarray, params)
  if adapter:
    save_adapter(cfg, lora, params, out, None, WEIGHT_DTYPES[dtype][0])
  else:
    base = _base_config(meta, _source_dir(meta))
    save_hf(cfg, params, out, base, dtype, max_shard_size)


def weight_files(directory):
  return sorted(
    f for f in os.listdir(directory) if f.endswith((".safetensors", ".json")) and "token" not in f
  )


CASES = [
  ("full", "fp32", None),
  ("full", "bf16", SMALL),
  ("lora", "bf16", None),
  ("lora", "fp32", SMALL),
]


@pytest.mark.parametrize("kind,dtype,shard", CASES, ids=[f"{k}-{d}-{s}" for k, d, s in CASES])
def test_streaming_export_writes_the_whole_tree_files(runs, tmp_path, kind, dtype, shard):
  out, ref = tmp_path / "out", tmp_path / "ref"
  flags = ["--dtype", dtype] + (["--max-shard-size", shard] if shard else [])
  cli.main(["export", "--run", str(runs[kind]), "--out", str(out), *flags])
  reference(runs[kind], ref, dtype, shard or "5GB")
  files = weight_files(ref)
  assert weight_files(out) == files
  assert any(f.startswith("model-0000") for f in files) == bool(shard)
  for f in files:
    assert (out / f).read_bytes() == (ref / f).read_bytes(), f


def test_adapter_export_reads_only_the_adapters(runs, tmp_path, monkeypatch):
  """--adapter writes save_adapter's file of the whole-tree restore, reading the master alone
  (the frozen base is not read). The run trained from scratch, where --adapter is refused: its
  source directory is pretended."""
  from paro_jax.run import export

  read, real = [], Checkpointer._read_weights

  def spy(self, step, written, target, parts):
    read.append(parts)
    return real(self, step, written, target, parts)

  monkeypatch.setattr(Checkpointer, "_read_weights", spy)

  run = runs["lora"]
  ckpt = Checkpointer(os.path.join(run, CHECKPOINTS), read_only=True)
  meta = ckpt.newest_meta()
  ckpt.close()
  # the run was trained from scratch: pretend it started from an HF directory
  reference(run, tmp_path / "ref", "bf16", "5GB", adapter=True)
  monkeypatch.setattr(export, "_source_dir", lambda m: str(tmp_path / "base"))
  export.export_run(str(run), str(tmp_path / "out"), dtype="bf16", adapter=True)
  assert read == [("master",)]
  f = "adapter_model.safetensors"
  assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes()
  assert meta.lora
  assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["r"] == 4


def test_each_tensor_is_held_once_over_the_devices(runs, tmp_path, monkeypatch):
  """On one process every output tensor, a merged LoRA layer included, is made where its blocks
  are and assembled on the host: its shards on the devices, counted at the hand-over to the
  host, add up to the tensor once (a layer merged whole on each of the 8 devices held it 8
  times)."""
  from paro_jax.hf import stream_out

  held, real = [], stream_out._host

  def spy(x):
    held.append((sum(s.data.nbytes for s in x.addressable_shards), x.nbytes))
    return real(x)

  monkeypatch.setattr(stream_out, "_host", spy)
  cli.main(["export", "--run", str(runs["lora"]), "--out", str(tmp_path / "out")])
  ckpt = Checkpointer(os.path.join(runs["lora"], CHECKPOINTS), read_only=True)
  cfg = LlamaConfig(**ckpt.newest_meta().model_config)
  ckpt.close()
  merged = cfg.layers * len(LORA["lora.targets"].split(","))
  assert len(held) >= merged and jax.device_count() == 8
  assert [on_devices for on_devices, _ in held] == [nbytes for _, nbytes in held]
