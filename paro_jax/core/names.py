"""Names the whole project shares: mesh axes, link levels, collectives. Imports no jax.

The mesh is `(inter, intra)`: one row per node. A state sharded globally splits one dimension
over `("intra", "inter")`, intra-major, so each device's G shard lies inside its own I shard
(docs/design.md, "Layout").
"""

from __future__ import annotations

INTRA = "intra"
INTER = "inter"
MESH_AXES = (INTER, INTRA)  # the mesh's shape is (inter, intra)
GLOBAL_AXES = (INTRA, INTER)  # a G-sharded dimension: intra-major
BATCH_AXES = (INTER, INTRA)  # process p (an inter row) reads a contiguous slice of the batch

# Link levels a collective can span, and the mesh axes of each. A level is not a mesh axis (the
# global level spans both), though the intra and inter levels are spelled like their axes.
LEVEL_INTRA, LEVEL_INTER, LEVEL_GLOBAL = "intra", "inter", "global"
LEVEL_AXES = {LEVEL_INTRA: (INTRA,), LEVEL_INTER: (INTER,), LEVEL_GLOBAL: GLOBAL_AXES}
LEVELS = tuple(LEVEL_AXES)

# Implementations of the collectives (`--collectives`); see paro_jax/core/collectives.py.
# The mixed ones: a hierarchical ring for a collective over both axes, XLA's own for one over a
# single axis (value: the ring they use).
MIXED_IMPLS = {"hring+xla": "hring", "horing+xla": "horing"}
COLLECTIVE_IMPLS = ("xla", "ring", "hring", "horing", *MIXED_IMPLS)
# `--collectives auto` picks one of the above for the platform (`resolve_collectives`).
AUTO_COLLECTIVES = "auto"
AUTO_CPU_PROCESSES = "hring+xla"  # its pick on XLA:CPU with a process per node

# Wire precision of the inter-node level (`--inter-params`, `--inter-grads`; core/compress.py),
# its default int8 block size (`--int8-block`), and the gradient dtype (`--grad-dtype`).
WIRE_FORMATS = ("same", "bf16", "int8", "int4")
# int4: only for the outer loop's pseudo-gradient (`--outer-sync`), as Streaming DiLoCo sends it.
OUTER_ONLY_FORMATS = ("int4",)
# --outer-state: the placement of the outer loop's weights and momentum (core/outer.py).
OUTER_STATES = ("G", "I")
AUTO_OUTER_STATE = "auto"  # train's choice: I where its memory fits, else G


def parse_outer_state(value: str) -> str:
  """--outer-state in any case: G, I (upper case, as the letters are written) or auto."""
  return value.upper() if value.upper() in OUTER_STATES else value.lower()


# 32 elements per fp32 scale (12.5% of the int8 payload): the smallest per-element error bound of
# the sizes tried; in single-seed loss-parity runs (tiny, IIG, 300 steps) blocks of 256 and 64
# lagged the uncompressed run's eval loss by 3.4% and 1.9% and 32 did not, differences of the
# size of the run-to-run spread measured there (experiments/results/compress_parity/).
DEFAULT_INT8_BLOCK = 32
GRAD_DTYPES = ("compute", "fp32")

# The collectives a strategy's schedule uses, as the planner and the probe name them.
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
SCHEDULE_COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)


def parse_mesh_shape(text: str) -> tuple[int, int]:
  """'2x4' -> (inter=2, intra=4)."""
  parts = text.lower().split("x")
  if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
    raise ValueError(
      f"bad --mesh {text!r}: write GROUPSxDEVICES_PER_GROUP, e.g. 2x4 "
      f"(2 groups, i.e. nodes, of 4 devices each)"
    )
  return int(parts[0]), int(parts[1])


def check_batch_divides(batch_size: int, inter: int, intra: int) -> None:
  """The one wording of a --batch-size the mesh cannot split (train, inspect, the engine)."""
  n = inter * intra
  if batch_size % n:
    raise ValueError(
      f"--batch-size {batch_size} is not divisible by the {n} devices of --mesh {inter}x{intra}: "
      f"each device holds whole sequences; use a multiple of {n}, e.g. "
      f"{max(n, batch_size // n * n)}"
    )


def resolve_collectives(
  requested: str, platform: str, processes: int, strategy=None
) -> tuple[str, str]:
  """(implementation, why) for `--collectives` `requested`; only ``auto`` is changed.

  ``auto``: where XLA's own collective over both axes is one flat ring whose every hop crosses
  the inter-node link (XLA:CPU through gloo, with a process per node), ``hring+xla``: the
  collectives over both axes as two rings, one per level, the one-level ones as XLA's. Of the
  two-level rings, ``hring`` measured the faster on that runtime, which overlaps two
  collective-permutes only partly (docs/collectives.md links the measurement and its limits).
  Elsewhere (GPUs, whose NCCL rings visit the devices node by node; or one process) ``xla``.
  A `strategy` (core/strategy.py) with no collective over both axes gets ``xla`` too.
  """
  if requested != AUTO_COLLECTIVES:
    if requested not in COLLECTIVE_IMPLS:
      raise ValueError(
        f"unknown collective impl {requested!r}; valid impls are {COLLECTIVE_IMPLS} or "
        f"{AUTO_COLLECTIVES!r}"
      )
    return requested, "as asked"
  if platform != "cpu" or processes < 2:
    where = "one process" if platform == "cpu" else f"{platform}: XLA's collectives are node-aware"
    return "xla", f"auto: {where}, XLA's own collectives"
  if strategy is not None and not strategy.two_level_collectives:
    return "xla", f"auto: {strategy} has no collective over both mesh axes, XLA's own collectives"
  return AUTO_CPU_PROCESSES, (
    f"auto: {processes} CPU processes, where XLA's collectives over both axes are one flat ring "
    "crossing the link on every hop; a ring per level for those, XLA's own for one-level ones"
  )
