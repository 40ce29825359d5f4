"""stream_hf's `check` (paro_jax/hf/stream_out.py): each of process 0's writes, config.json and
every tensor, is said to every process before the next gather, its error included, so that in a
multi-process export (cluster/agree.py `OneWriter`) no process waits in a gather the writer
left. Here in one process, with a recording check. And `_merged`: a LoRA layer merged where its
blocks are, against numpy."""

import errno
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from paro_jax.core.mesh import make_mesh

from paro_jax.hf import stream_out
from paro_jax.hf.layout import parse
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


@pytest.mark.parametrize("split", [1, 3, 2], ids=["in", "out", "inner"])
def test_a_layer_is_merged_where_its_blocks_are(split):
  """`_merged` (one layer of W + scale A @ B) against numpy, the layer (in 8 x 4, out 16) split
  over the 8 devices along its in group's leading dim, its out dim, or the in group's second
  dim (the product cannot follow that one: merged whole on each device); otherwise its result
  placed as the layer is, held once over the devices."""
  mesh = make_mesh(2, 4)
  rng = np.random.default_rng(split)
  w, a, b = (
    rng.standard_normal(s).astype(np.float32) for s in ((2, 8, 4, 16), (2, 32, 3), (2, 3, 16))
  )
  spec = [None] * 4
  spec[split] = ("intra", "inter") if split != 2 else "intra"
  layer = NamedSharding(mesh, PartitionSpec(*spec))
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, PartitionSpec(*s)))  # noqa: E731
  merged, bad = jax.jit(stream_out._merged, static_argnames=("scale", "dtype"))(
    jax.device_put(w, layer), put(a, [None, ("intra", "inter")]), put(b, []), 1,
    scale=0.5, dtype=jnp.dtype(jnp.float32),
  )  # fmt: skip
  want = w[1] + 0.5 * (a[1] @ b[1]).reshape(8, 4, 16)
  np.testing.assert_allclose(np.asarray(merged), want, rtol=1e-6, atol=1e-6)
  assert not bool(bad)
  held = sum(s.data.nbytes for s in merged.addressable_shards)
  if split == 2:  # merged whole on every device
    assert held == 8 * merged.nbytes
  else:
    assert merged.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*spec[1:])), 3)
    assert held == merged.nbytes


@pytest.mark.parametrize("dtype, refused", [(np.float16, True), (np.float32, False)])
def test_a_value_the_cast_takes_out_of_range_is_refused(dtype, refused):
  """`_gather` checks the tensor as the file will hold it: 1e5 is finite in the fp32 master and
  Inf in fp16 (its largest value is 65504). One layer of a stack split over the 8 devices, in
  HF's layout (transposed) and as ours, equal to numpy's where it is finite."""
  mesh = make_mesh(2, 4)
  w = np.random.default_rng(0).standard_normal((2, 16, 8)).astype(np.float32)
  w[1, 3, 5] = 1e5
  leaf = jax.device_put(w, NamedSharding(mesh, PartitionSpec(None, ("inter", "intra"))))
  axes = parse("f d -> d f")  # an MLP's up projection: HF (f, d), ours (d, f)
  layout = (axes, (("f", 8), ("d", 16)))
  got, bad = stream_out._gather(leaf, 1, None, 1.0, layout, dtype)
  assert bad is refused and got.dtype == dtype and got.shape == (8, 16)
  if not refused:
    np.testing.assert_array_equal(got, w[1].T)
  ours, _ = stream_out._gather(leaf, 1, None, 1.0, None, dtype)
  assert ours.shape == (16, 8)
