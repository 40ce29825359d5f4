"""paro_jax: PaRO partial-redundancy sharding strategies and HO-Ring collectives in JAX.

What a training script needs, importable from the top level:

  from paro_jax import Engine, Llama, OptimConfig, get_config, make_mesh, parse_strategy

Names resolve on first use, so `import paro_jax` alone does not start jax: a script (or the CLI)
can still set XLA flags, e.g. `provide_cpu_devices(8)`, before touching a device.
"""

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
  # strategies and the mesh
  "Strategy": "paro_jax.core.strategy",
  "Placement": "paro_jax.core.strategy",
  "parse_strategy": "paro_jax.core.strategy",
  "VALID_NAMES": "paro_jax.core.strategy",
  "make_mesh": "paro_jax.core.mesh",
  "provide_cpu_devices": "paro_jax.core.xla_flags",
  # the training step
  "Engine": "paro_jax.core.engine",
  "OptimConfig": "paro_jax.core.state",
  "TrainState": "paro_jax.core.state",
  # the model
  "Llama": "models.llama",
  "LlamaConfig": "models.config",
  "LoraConfig": "models.config",
  "get_config": "models.presets",
  # data and checkpoints
  "Batches": "paro_jax.data.streams",
  "DataConfig": "paro_jax.data.config",
  "load_tokens": "paro_jax.data.streams",
  "default_corpus": "paro_jax.data.streams",
  "Checkpointer": "paro_jax.run.checkpoint",
  "RunMeta": "paro_jax.run.checkpoint_content",
  # the whole run, as `paro-jax train` does it
  "RunConfig": "paro_jax.run.config",
  "train": "paro_jax.run.train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'paro_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # resolve once
  return value


def __dir__():
  return sorted([*globals(), *_EXPORTS])
