"""Reduce-scatters of multi-process CPU runs as an all-reduce and a slice (gloo's is racy).

jaxlib 0.10.2's XLA:CPU runs a reduce-scatter through gloo as `gloo::ReduceScatterHalvingDoubling`
(xla/backends/cpu/collectives/gloo_communicator.cc). Its `run()` sends half of the buffer
asynchronously (the TCP pair writes what the socket takes and leaves the rest to its event loop),
and on every rank but 0 copies its reduced chunk over the front of that buffer without waiting for
the send to finish: when the loop is late, the peer receives, for the tail of the message, the
sender's reduced chunk instead of its data, and sums it in. The result is wrong, and which bytes
depends on timing, so identical runs differ. `tests/cluster/gloo_rs_race.py` shows it with exact
integer data; gloo's ring all-reduce waits for its sends and is exact there.
"""

from __future__ import annotations

from paro_jax import report

NOTE = (
  "XLA:CPU's reduce-scatter through gloo can corrupt its result (docs/multinode.md): "
  "reduce-scatters run as an all-reduce and a slice"
)
_installed = False


def _all_reduce_then_slice(x, *, scatter_dimension, axis_name, axis_index_groups, axis_size, tiled):
  """`lax.psum_scatter`'s value, from `lax.psum` and this device's slice of the sum."""
  from jax import lax  # cluster.distributed imports this module before jax starts

  assert axis_index_groups is None  # register's lowering keeps XLA's own for groups

  total = lax.psum(x, axis_name)
  chunk = x.shape[scatter_dimension] // axis_size
  start = lax.axis_index(axis_name) * chunk
  out = lax.dynamic_slice_in_dim(total, start, chunk, axis=scatter_dimension)
  return out if tiled else lax.squeeze(out, (scatter_dimension,))


def register() -> None:
  """From now on, lower `reduce_scatter` on CPU as `_all_reduce_then_slice` (in this process)."""
  global _installed
  # jax 0.10.2 (pinned), imported here: cluster.distributed imports this module before jax starts
  from jax._src.interpreters import mlir  # jax 0.10.2 (pinned): the lowering registry
  from jax._src.lax import parallel

  if _installed:
    return
  generic = mlir._lowerings[parallel.reduce_scatter_p]
  fallback = mlir.lower_fun(_all_reduce_then_slice, multiple_results=False)

  def lowering(ctx, x, **params):
    if params["axis_index_groups"] is not None:  # never used here; keep XLA's
      return generic(ctx, x, **params)
    return fallback(ctx, x, **params)

  mlir.register_lowering(parallel.reduce_scatter_p, lowering, platform="cpu")
  _installed = True


def register_if_gloo() -> bool:
  """`register` where the CPU collectives are gloo's, saying so once on process 0; returns
  whether it did. After `jax.distributed.initialize`, before anything compiles."""
  import jax  # not at the top: cluster.distributed imports this module before jax starts
  from jax._src import distributed  # the process id, without touching devices

  if jax.config.jax_cpu_collectives_implementation != "gloo":
    return False
  register()
  if distributed.global_state.process_id == 0:
    report.note(NOTE)
  return True
