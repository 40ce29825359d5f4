"""The configuration of `paro-jax inspect`: a step compiled, no allocation.

Its fields are flags as the step's are (paro_jax/core/config.py `option`); pure Python (no jax,
no numpy): the CLI builds its parser before jax starts.
"""

from __future__ import annotations

import dataclasses

from paro_jax.core.config import StepConfig, option


@dataclasses.dataclass(frozen=True, kw_only=True)
class InspectConfig(StepConfig):
  """`paro-jax inspect`: compile one step (no allocation) and report its communication."""

  as_json: bool = option(False, "print one JSON object", flag="--json")
  target: str | None = option(
    None,
    "compile for a cluster of these GPUs, no GPU needed: h100, h200, a100-80gb, a100-40gb "
    "(--mesh NODESxGPUS); reports async collectives, streams, overlap and memory vs the plan",
  )
  inter_bandwidth: str | None = option(
    None,
    "with --target: each node's inter-node link for XLA's network model in the step time "
    "estimate, a tc rate such as 100gbit (default: XLA's own network defaults, named in the "
    "output)",
    metavar="RATE",
  )
  prefetch: bool = option(
    True,
    "compile without the prefetching layer stack (each layer's gather waits for its use), "
    "to compare",
    flag="--no-prefetch",
    action="store_false",
  )
  hlo_out: str | None = option(None, "write the compiled (scheduled) HLO text here", metavar="FILE")
  pack: bool = option(
    False,
    "compile the step for packed instruction data (several examples per sequence, kept apart: "
    "train --pack) and say how attention runs (with --target: whether cuDNN's fused kernel "
    "does)",
  )
