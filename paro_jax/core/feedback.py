"""Error feedback for int8 gradients (`--inter-grads int8`; `--no-error-feedback` turns it off).

Each device keeps, in fp32, the residual of its last gradient quantization (what the int8 wire
did not carry) and adds it to the next step's gradient before quantizing, as error-feedback SGD
and 1-bit Adam do. Summed over steps, what the wire delivers then differs from the exact sum by
one step's quantization error rather than the sum of all of them (tests/core/test_feedback.py).

Where: the accumulation boundary's gradient sync, whose inter level is the one gradient
quantization of the strategies whose Gr does not shard `inter` (P and Gr at N or I). The residual
is what the device quantizes there: its accumulated gradient at Gr (one flat bucket of its
trained leaves), or with a two-level reduction its share of its node's partial sums, 1/intra of
that. It lives in the TrainState (`residual`: one fp32 vector per device, sharded over both mesh
axes), so checkpoints carry it and a resumed run continues exactly. The strategies whose Gr is G
quantize each layer's gradient in backward, once per micro-batch: error feedback does not cover
them (asking for it is an error; by default it is then off, and the run's header says so). It
also keeps the layers' sync out of the last micro-batch's backward (`StepProgram`): the
residual is applied once per step, at the boundary.

Parameters (`--inter-params int8`; `--no-param-delta` turns it off): where the step's parameter
sync (OS -> P) crosses nodes, it sends each weight's change since the last sync, quantized,
against a copy every device keeps of what it last received (the TrainState's `reference`, the
weights at P in the compute dtype); what the quantization leaves out goes into the next change.
The weights a step computes with are then the master's within one quantized change (an update
is about the learning rate: its int8 error is that of the weight's rounding to the compute dtype
or less) instead of within a quantization of the weight itself (measured in
experiments/results/compress_parity/). The per-layer gathers of
strategies whose P spans nodes (P = G) quantize the weights themselves, as before.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

from paro_jax.core import buckets
from paro_jax.core.wire import WireConfig
from paro_jax.core.names import INTER
from paro_jax.core.strategy import Strategy


def boundary_sync(acc, dims, residual, strategy: Strategy, impl: str, wire: WireConfig):
  """The boundary's gradient sync (step.boundary_sync) with error feedback on its inter
  level: (gradients at OS, new residual)."""
  scatter, reduce, codec = strategy.sync_scatter_axes, strategy.sync_reduce_axes, wire.grads_codec
  if INTER in scatter:
    grads, residual = buckets.tree_reduce_scatter_feedback(
      acc, dims, scatter, residual, impl, codec
    )
    return buckets.tree_all_reduce(grads, reduce, impl, codec), residual
  grads = buckets.tree_reduce_scatter(acc, dims, scatter, impl, codec)
  return buckets.tree_all_reduce_feedback(grads, reduce, residual, impl, codec)


# --- parameters: the step's int8 parameter sync sends each weight's change since the last one
def delta_param_sync(master, reference, dims, axes, impl: str, wire: WireConfig, dtype):
  """The parameter sync (master shards at OS -> the compute-dtype weights at P) as the change
  against `reference`, the weights every device received at the previous sync (P placement,
  compute dtype): each device sends its shard of `master - reference` in int8, and every device,
  the owner included, adds what it received. The weights a step computes with are then the
  master's within one quantization of a step's change (plus the compute dtype's rounding), not
  of the weight itself; what the quantization leaves out is in the next change. Returns the new
  weights, which are also the next reference."""
  sizes = [lax.axis_size(a) for a in axes]
  index = 0
  for a, n in zip(axes, sizes):  # this device's chunk: combined index over `axes`, major first
    index = index * n + lax.axis_index(a)

  def sync(w, ref, dim):
    dim = dim % w.ndim
    chunk = w.shape[dim]
    own = lax.dynamic_slice_in_dim(ref, index * chunk, chunk, axis=dim)
    delta = (w - own.astype(jnp.float32)).astype(dtype)
    got = buckets.all_gather_bucket([delta], axes, [dim], impl, wire=wire.params_codec)[0]
    return (ref.astype(jnp.float32) + got.astype(jnp.float32)).astype(dtype)

  return jax.tree.map(sync, master, reference, dims)
