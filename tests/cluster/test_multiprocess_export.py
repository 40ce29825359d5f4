"""`paro-jax export` across processes (paro_jax/run/export.py): two processes of 2 devices, joined
by `paro-jax launch` (paro_jax/cluster/launch.py), each restoring its devices' shards and taking
part in every gather, write the directory one process writes, file for file and byte for byte;
only process 0 writes (paro_jax/cluster/agree.py `OneWriter`, paro_jax/run/publish.py) or
speaks. The run is a LoRA fine-tune of tests/fixtures/hf_llama/llama3_gqa (so the merge, the
tokenizer and generation_config.json travel too), exported in bf16 in several shards."""

import os

from paro_jax.cli import main
from tests.cluster.test_multiprocess import launch_on_loopback
from tests.cluster.test_multiprocess_import import FIXTURE, TEXT

# Small shards: several of them and their index (the fixture's model is ~100 KB in bf16).
EXPORT = ["--dtype", "bf16", "--max-shard-size", "40KB"]


def _files(directory):
  return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_two_processes_export_what_one_does(tmp_path):
  run = tmp_path / "run"
  main(
    ["train", "--init-from", FIXTURE, "--data", TEXT, "--lora-rank", "4", "--steps", "2"]
    + ["--warmup", "0", "--lr", "1e-3", "--batch-size", "8", "--seq-len", "16", "--dtype"]
    + ["fp32", "--mesh", "2x4", "--checkpoint-every", "2", "--out", str(run)]
  )
  one = tmp_path / "one"
  main(["export", str(run), "--out", str(one), *EXPORT])  # one process of 8 devices
  two = tmp_path / "two"
  said, _ = launch_on_loopback(["export", str(run), "--out", str(two), *EXPORT])
  assert f"[node 0] paro-jax: wrote checkpoint step 2 of {run} to {two}" in said, said
  assert "[node 1] paro-jax: wrote" not in said  # process 1 neither writes nor says it did
  reference = _files(one)
  assert "model.safetensors.index.json" in reference and "tokenizer.json" in reference
  assert sum(name.startswith("model-") for name in reference) > 1
  written = _files(two)
  assert sorted(written) == sorted(reference)
  for name, data in reference.items():
    assert written[name] == data, name
  assert sorted(os.listdir(tmp_path)) == ["one", "run", "two"]  # no partial directory left
