"""A batch with loss weights: instruction data (prompts that are context only), packed rows,
windows padded to a whole batch.

The plain batch of a token stream is one int32 array, A x B x (L+1): every token after the first
of a row is a target. A `Batch` adds which targets count and, for packed rows, which example each
token belongs to. The step's loss is then the sum of the counted targets' losses divided by the
step's count of them (over all micro-batches and devices), so micro-batching and sharding give
the gradient of one big batch (core/step.py; the single-device loop run/reference.py does the
same).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class Batch(NamedTuple):
  tokens: Any  # int32 (..., L+1): inputs are [..., :-1], targets [..., 1:]
  weights: Any  # int32 (..., L): 1 where the target counts in the loss, else 0
  segments: Any = None  # int32 (..., L), of the inputs: the example of each token, 0 padding;
  # None: one example per row (right-padded: causal attention needs no mask)

  @property
  def shape(self):
    """The tokens' shape, (A, B, L+1) for a step's batch."""
    return self.tokens.shape

  def targets(self) -> int:
    """How many targets count (a host-side batch)."""
    return int(np.sum(self.weights))


def take(batch, index):
  """`batch[index]` of a plain batch or of every array of a Batch (index on the leading axes)."""
  import jax  # here: the data side (prepare-data) reads Batch without starting jax

  return jax.tree.map(lambda x: x[index], batch)


def inputs_of(batch):
  """(the input tokens, the targets, the weights or None, the segments or None) of a micro-batch
  (B x (L+1), or a Batch of such rows)."""
  if isinstance(batch, Batch):
    return batch.tokens[:, :-1], batch.tokens[:, 1:], batch.weights, batch.segments
  return batch[:, :-1], batch[:, 1:], None, None
