"""stream_hf's `check` (paro_jax/hf/stream_out.py): each of process 0's writes, config.json and
every tensor, is said to every process before the next gather, its error included, so that in a
multi-process export (cluster/agree.py `OneWriter`) no process waits in a gather the writer
left. Here in one process, with a recording check."""

import errno
import os

import pytest
from safetensors.numpy import save_file

from paro_jax.hf import stream_out
from paro_jax.hf.stream_out import plan_shards, stream_hf
from paro_jax.hf.weights import load_hf, tensor_table

FIXTURE = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama", "llama3_gqa"
)
SMALL = "40KB"  # several shards of the fixture in fp32


def test_each_write_is_checked_before_the_next_gather(tmp_path, monkeypatch):
  cfg, params = load_hf(FIXTURE)
  tensors, split = plan_shards(cfg, "fp32", SMALL)
  layered = sum(path[0] == "layers" for path in tensor_table(cfg))
  assert len(tensors) == layered * cfg.layers + len(tensor_table(cfg)) - layered
  assert len(split.filename_to_tensors) > 2
  seen = []
  os.makedirs(tmp_path / "ok")
  stream_hf(cfg, params, str(tmp_path / "ok"), None, "fp32", SMALL, check=seen.append)
  assert seen == [None] * (1 + len(tensors))  # config.json, then each tensor

  real_gather = stream_out._gather
  saved, gathered, seen = [], [], []

  def full_disk(tensors, path, metadata):  # the second shard finds the disk full
    if saved:
      raise OSError(errno.ENOSPC, "No space left on device", path)
    saved.append(path)
    save_file(tensors, path, metadata=metadata)

  def check(error):
    seen.append(error)
    if error is not None:
      raise error

  monkeypatch.setattr("paro_jax.hf.stream_out.save_file", full_disk)
  monkeypatch.setattr(stream_out, "_gather", lambda *a: gathered.append(a) or real_gather(*a))
  os.makedirs(tmp_path / "full")
  with pytest.raises(OSError, match="No space left"):
    stream_hf(cfg, params, str(tmp_path / "full"), None, "fp32", SMALL, check=check)
  assert isinstance(seen[-1], OSError) and seen[:-1] == [None] * (len(seen) - 1)
  # config.json's check, then one per tensor gathered: none gathered after the failed write
  assert len(seen) == 1 + len(gathered) < 1 + len(tensors)
