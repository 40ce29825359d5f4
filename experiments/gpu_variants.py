"""The step as it was before each of the GPU step's changes, to measure each on the same GPU.

Each change that made the GPU step move fewer bytes can be undone here, alone or together, for
one measurement (`experiments/gpu_measure.py --old NAMES`): the earlier code of what it
replaced, put back for the duration of a `with undone(names, ...)`. Nothing here is used by the
package; what a change replaced is in its commit.

  head-backward  the head's two backward matmuls on the logits' fp32 cotangent (fp32 GEMMs)
  loss           cross-entropy with integer labels (its backward a scatter-add, then a cast)
  one-device     all-gathers and reduce-scatters over axes of one device packed and run
  zero-fill      gradient buffers zero-filled first; the first micro-batch adds to zeros
  weights-copy   no compute-dtype copy of the master: the parameter sync casts it each step
  per-leaf       (one node of several GPUs) the layer collectives in buckets, as across nodes
"""

from __future__ import annotations

import contextlib

CHANGES = ("head-backward", "loss", "one-device", "zero-fill", "weights-copy", "per-leaf")
# changes that are made when the engine is built (its options), not by replacing code
ENGINE_OPTIONS = {"weights-copy": ("weights_copy", False)}


def parse(text: str) -> tuple[str, ...]:
  """`--old`'s value: names from CHANGES, comma-separated, or `all` / `none`."""
  if text in ("", "none"):
    return ()
  if text == "all":
    return CHANGES
  names = tuple(n.strip() for n in text.split(","))
  unknown = [n for n in names if n not in CHANGES]
  if unknown:
    raise ValueError(f"unknown change {unknown[0]!r} for --old; choose from {', '.join(CHANGES)}")
  return names


def engine_options(names) -> dict:
  """The Engine's keyword arguments that undo `names` (those made by an option)."""
  return dict(ENGINE_OPTIONS[n] for n in names if n in ENGINE_OPTIONS)


def engine_for(args, mesh, names):
  """The engine of a measured run (gpu_measure.py) and of its compile without a GPU
  (gpu_compile.py), so that both are the same program: `args`' model (and --layers), bf16,
  remat, attention, micro-batches and collectives, with the changes in `names` made by an
  option undone."""
  import dataclasses

  from models.presets import get_config
  from paro_jax.core.config import StepConfig
  from paro_jax.core.factory import build_engine

  cfg = get_config(args.model)
  if args.layers:
    cfg = dataclasses.replace(cfg, layers=args.layers)
  step = StepConfig(
    strategy=args.strategy,
    dtype="bf16",
    remat=args.remat,
    attention=args.attention,
    micro_batches=args.micro_batches,
    collectives=args.collectives,
  )
  return build_engine(step, cfg, mesh, **engine_options(names))


def _plain_head_logits(equation, x, w):
  import jax.numpy as jnp

  return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def _integer_label_cross_entropy(logits_BxLxV, targets_BxL):
  import jax.numpy as jnp
  import optax

  return optax.softmax_cross_entropy_with_integer_labels(
    logits_BxLxV.astype(jnp.float32), targets_BxL
  )


def _full_logits_token_losses(self, params, tokens_BxL, targets_BxL, *args):
  """The token losses of the whole micro-batch's fp32 logits (before the vocabulary tiles of
  models/loss.py): the path the head's and the loss's earlier code ran on."""
  from models import loss

  return loss.token_cross_entropy(self.apply(params, tokens_BxL, *args), targets_BxL)


def _only_no_axes(axes) -> bool:
  from paro_jax.core.rings import norm_axes

  return not norm_axes(axes)


def _zeros(shape, dtype):
  import jax.numpy as jnp

  return jnp.zeros(shape, dtype)


def _accumulate_from_zeros(micro_grads, micro_step, sinks, batch_MxBxL1):
  from jax import lax

  return lax.scan(micro_step, sinks, batch_MxBxL1)


@contextlib.contextmanager
def undone(names, engine=None):
  """Within: the code of before each change in `names` (module attributes put back on exit).
  `engine`: an Engine already built, for `per-leaf` (its layer buckets)."""
  from models import llama, loss
  from paro_jax.core import collectives, prefetch, step

  patches = {
    # both on the full logits, as they were (the step now takes them in vocabulary tiles);
    # `head_logits` where `Llama.apply` looks it up (models/llama.py's name for it), the cross-
    # entropy where `_full_logits_token_losses` does
    "head-backward": [
      (llama, "head_logits", _plain_head_logits),
      (llama.Llama, "token_losses", _full_logits_token_losses),
    ],
    "loss": [
      (loss, "token_cross_entropy", _integer_label_cross_entropy),
      (llama.Llama, "token_losses", _full_logits_token_losses),
    ],
    "one-device": [(collectives, "moves_nothing", _only_no_axes)],
    "zero-fill": [
      (prefetch, "uninitialised", _zeros),
      (step, "accumulate", _accumulate_from_zeros),
    ],
  }
  saved = []
  try:
    for name in names:
      for module, attr, value in patches.get(name, ()):
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)
    if "per-leaf" in names and engine is not None:
      saved.append((engine, "bucket_layers", engine.bucket_layers))
      engine.bucket_layers = engine.mesh.devices.flat[0].platform in ("gpu", "cuda")
    yield
  finally:
    for module, attr, value in reversed(saved):
      setattr(module, attr, value)
