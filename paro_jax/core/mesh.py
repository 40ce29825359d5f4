"""The 2D device mesh (inter, intra): one row per group of fast-linked devices."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from paro_jax.core.names import MESH_AXES


def default_mesh_shape() -> tuple[int, int]:
  """One group per process (host): its local devices are the fast-linked ones."""
  return jax.process_count(), jax.local_device_count()


def make_mesh(inter: int | None = None, intra: int | None = None, devices=None) -> Mesh:
  """Build the (inter, intra) mesh so that each intra group lies on a single host.

  Devices are ordered by (process, id); each mesh row is `intra` consecutive devices. An intra
  group that would span two processes is refused: its "fast" collectives would cross the network.
  """
  devices = list(jax.devices() if devices is None else devices)
  if inter is None or intra is None:
    inter, intra = default_mesh_shape()
  if inter * intra != len(devices):
    raise ValueError(
      f"mesh {inter}x{intra} needs {inter * intra} devices but {len(devices)} are available "
      f"({jax.process_count()} process(es) x {jax.local_device_count()} local device(s), platform "
      f"{devices[0].platform}). Pass --mesh GxM with G*M == {len(devices)}, or on CPU run through "
      f"the paro-jax CLI, which creates virtual CPU devices for the mesh you ask for."
    )
  devices.sort(key=lambda d: (d.process_index, d.id))
  grid = np.array(devices, dtype=object).reshape(inter, intra)
  per_host = min(
    sum(d.process_index == p for d in devices) for p in {d.process_index for d in devices}
  )
  for row in grid:
    procs = sorted({d.process_index for d in row})
    if len(procs) > 1:
      raise ValueError(
        f"mesh {inter}x{intra}: an intra group would span processes {procs} (hosts); intra "
        f"collectives must stay on one host. Use at most {per_host} devices per group "
        f"(e.g. --mesh {len(devices) // per_host}x{per_host})."
      )
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Explicit,) * 2)


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
  return mesh.shape[MESH_AXES[0]], mesh.shape[MESH_AXES[1]]
