"""The one way an Engine is built from a step's configuration (core/config.py StepConfig): the
model in the step's dtype, remat, adapters and attention, the strategy, and the Engine with the
step's micro-batches, collectives, wire formats and int8 corrections. `paro-jax train`, `inspect`
and `export` and the experiments call it; what a command resolves itself (train's
`--strategy auto`, the collectives for its processes) it passes in.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from models.config import LlamaConfig, resolve_attention
from models.llama import Llama
from paro_jax.core.config import StepConfig
from paro_jax.core.state import DTYPES, OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.groups import GroupEngine
from paro_jax.core.wire import Codec
from paro_jax.core.names import resolve_collectives
from paro_jax.core.strategy import Strategy, parse_strategy


def platform_of(mesh: Mesh) -> str:
  """The platform of the mesh's devices ("cpu", "gpu", "cuda"; a compile-only GPU topology's
  too)."""
  return mesh.devices.flat[0].platform


def build_model(step: StepConfig, model_cfg: LlamaConfig, attention: str) -> Llama:
  """The model the step trains: `model_cfg`'s shapes in the step's dtype, remat and adapters,
  with `attention` resolved (models/config.py resolve_attention)."""
  return Llama(model_cfg, DTYPES[step.dtype], step.remat, step.lora.adapters(), attention)


def build_engine(
  step: StepConfig,
  model_cfg: LlamaConfig,
  mesh: Mesh,
  optim: OptimConfig = OptimConfig(),
  *,
  strategy: Strategy | None = None,
  attention: str | None = None,
  collectives: str | None = None,
  prefetch: bool = True,
  weights_copy: bool | None = None,
) -> Engine:
  """The Engine of `step` for the model `model_cfg` (a preset's, an HF config's or a
  checkpoint's) on `mesh`. `strategy` (default: step.strategy's letters), `attention` and
  `collectives` (default: step's, resolved for the mesh's platform and this run's processes)
  are given where the caller resolved them already; `prefetch=False` compiles without the
  prefetching layer stack (`inspect --no-prefetch`); `weights_copy`: the Engine's (None: the
  platform's choice)."""
  platform = platform_of(mesh)
  strategy = strategy or parse_strategy(step.strategy)
  if attention is None:
    attention, _ = resolve_attention(
      step.attention, platform, DTYPES[step.dtype], model_cfg.head_dim
    )
  if collectives is None:
    collectives, _ = resolve_collectives(step.collectives, platform, jax.process_count(), strategy)
  model = build_model(step, model_cfg, attention)
  if step.outer.sync is not None:  # the groups train on their own (core/groups.py)
    return GroupEngine(
      model,
      strategy,
      mesh,
      optim,
      step.outer,
      Codec(step.wire.inter_grads, step.wire.int8_block),
      step.error_feedback,
      micro_batches=step.micro_batches,
      collectives=collectives,
      grad_dtype=step.wire.grad_dtype,
      prefetch=prefetch,
      weights_copy=weights_copy,
    )
  return Engine(
    model,
    strategy,
    mesh,
    optim,
    micro_batches=step.micro_batches,
    collectives=collectives,
    wire=step.wire.formats(),
    grad_dtype=step.wire.grad_dtype,
    prefetch=prefetch,
    error_feedback=step.error_feedback,
    param_delta=step.param_delta,
    weights_copy=weights_copy,
  )
