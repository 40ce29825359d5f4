import dataclasses

import jax
import numpy as np
import pytest

from paro_jax.core.names import parse_mesh_shape
from paro_jax.core.mesh import make_mesh, mesh_shape


def test_mesh_axes_and_order():
  mesh = make_mesh(2, 4)
  assert mesh.axis_names == ("inter", "intra")
  assert mesh_shape(mesh) == (2, 4)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_default_mesh_is_one_group_per_process():
  assert mesh_shape(make_mesh()) == (jax.process_count(), jax.local_device_count())


@pytest.mark.parametrize("shape", [(3, 3), (2, 2), (1, 16)])
def test_mesh_device_count_mismatch(shape):
  with pytest.raises(
    ValueError,
    match=rf"mesh {shape[0]}x{shape[1]} needs {shape[0] * shape[1]} "
    r"devices but 8 are available.*--mesh GxM",
  ):
    make_mesh(*shape)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int
  platform: str = "gpu"


def test_intra_group_spanning_hosts_is_refused():
  # Two hosts with 4 devices each: a group of 8 would put "fast" collectives on the network.
  devices = [FakeDevice(i, i // 4) for i in range(8)]
  with pytest.raises(ValueError, match=r"intra group would span processes \[0, 1\].*--mesh 2x4"):
    make_mesh(1, 8, devices=devices)


@pytest.mark.parametrize("text,shape", [("2x4", (2, 4)), ("1X8", (1, 8))])
def test_parse_mesh_shape(text, shape):
  assert parse_mesh_shape(text) == shape


@pytest.mark.parametrize("text", ["8", "2x", "0x8", "axb", "2x4x1"])
def test_parse_mesh_shape_refuses(text):
  with pytest.raises(ValueError, match="write GROUPSxDEVICES_PER_GROUP"):
    parse_mesh_shape(text)
