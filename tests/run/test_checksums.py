"""The checkpoint checksums (run/checksums.py `state_checksums`): equal to a numpy
reference of their definition over the flat bits of every leaf, whatever the placement, and
computed without a temporary of a leaf's size (restoring a 1B LoRA base over 8 CPU devices
peaked at 5x its bytes in them)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from paro_jax.core.mesh import make_mesh
from paro_jax.core.state import TrainState
from paro_jax.run import checksums


def _reference(x: np.ndarray) -> list[int]:
  """The two sums as the checksum defines them, in numpy's wrapping uint32 arithmetic over the
  row-major flat position."""
  words = x.reshape(-1).view(f"uint{x.dtype.itemsize * 8}").astype(np.uint32)
  index = np.arange(words.size, dtype=np.uint32)
  h1 = np.sum(words * (index * np.uint32(2) + np.uint32(1)), dtype=np.uint32)
  mixed = (words ^ (words >> np.uint32(15))) * np.uint32(0x2C1B3C6D)
  h2 = np.sum(mixed ^ (index * np.uint32(0x9E3779B1)), dtype=np.uint32)
  return [int(h1), int(h2)]


@pytest.fixture(scope="module")
def leaves():
  """Leaves of each itemsize and kind, the large ones sharded over the 8 devices."""
  rng = np.random.default_rng(0)
  mesh = make_mesh(2, 4)
  split = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
  host = {
    "stack": rng.standard_normal((3, 256, 64)).astype(ml_dtypes.bfloat16),
    "table": rng.standard_normal((512, 64)).astype(np.float32),
    "half": rng.standard_normal((5, 7)).astype(np.float16),
    "count": rng.integers(-(2**31), 2**31 - 1, (4, 9), dtype=np.int32),
    "byte": rng.integers(-128, 127, (11,), dtype=np.int8),
  }
  placed = {
    "stack": jax.device_put(host["stack"], split(None, ("intra", "inter"))),
    "table": jax.device_put(host["table"], split(("intra", "inter"))),
    **{k: jnp.asarray(v) for k, v in host.items() if k not in ("stack", "table")},
  }
  return host, placed


def test_checksums_equal_their_numpy_definition(leaves):
  host, placed = leaves
  sums, non_finite = checksums.state_checksums(TrainState(None, placed, None, None))
  assert non_finite == []
  assert sums == {f".master['{k}']": _reference(v) for k, v in host.items()}


def test_a_non_finite_leaf_is_named(leaves):
  host, placed = leaves
  table = host["table"].copy()
  table[50, 3] = np.inf
  master = {**placed, "table": jax.device_put(table, placed["table"].sharding)}
  sums, non_finite = checksums.state_checksums(TrainState(None, master, None, None))
  assert non_finite == [".master['table']"]
  assert sums[".master['table']"] == _reference(table)


def test_checksums_hold_no_temporary_of_a_leafs_size(leaves):
  """The compiled program's temporaries, per device, against the smallest of the sharded
  leaves' shards: the sums and the finiteness check are reductions fused with their terms, so
  nothing the size of a leaf's shard (its 32-bit words, positions or flags) is made."""
  _, placed = leaves
  compiled = checksums._integrity.lower(TrainState(None, placed, None, None)).compile()
  shard_bytes = min(
    x.addressable_shards[0].data.nbytes for k, x in placed.items() if k in ("stack", "table")
  )
  assert compiled.memory_analysis().temp_size_in_bytes < shard_bytes // 4
