"""The words of a plan (planner.py): its tables and the explanation of its pick.

Pure Python (no jax), as the planner.
"""

from __future__ import annotations

from paro_jax.analysis.planner.inputs import TIE, Cluster
from paro_jax.analysis.planner.step_model import Prediction
from paro_jax.core.strategy import KNOWN_NAMES
from paro_jax.core.units import human_bytes


def strategy_named(name: str) -> str:
  return f"{name} ({KNOWN_NAMES[name]})" if name in KNOWN_NAMES else name


# (header, width): each numeric column right-aligned, widened where a value needs it
COLUMNS = (
  ("fits", 5),
  ("memory", 11),
  ("states", 11),
  ("step s", 9),
  ("compute", 9),
  ("gathers", 9),
  ("grads", 9),
  ("grad sync", 10),
  ("par sync", 9),
  ("tokens/s", 11),
)


def format_plan(
  ranking: list[Prediction], synchronous: list[Prediction] | None, explain: str
) -> str:
  """The plan as `paro-jax plan` prints it: the ranking's table, with the outer loop (DiLoCo)
  its `outer sync` column and the synchronous strategies' table beside it, then the
  explanation."""
  if synchronous is None:
    return "\n".join(_table(ranking, COLUMNS) + ["", explain])
  h = ranking[0].outer_sync if ranking else None
  columns = COLUMNS[:-1] + (("outer sync", 11), COLUMNS[-1])
  return "\n".join(
    [f"DiLoCo: each group's step, the outer sync every {h} steps (its share per step)"]
    + _table(ranking, columns)
    + ["", "beside it, the synchronous strategies (a step syncs every step)"]
    + _table(synchronous, COLUMNS)
    + ["", explain]
  )


def _table(predictions: list[Prediction], columns) -> list[str]:
  """The plan's table of `predictions`, one row each, in `columns` (COLUMNS; with the outer loop
  its `outer sync` column too)."""
  rows = []
  for e in predictions:
    t = e.times
    fits = "yes" if e.fits else ("n/a" if not e.feasible else "no")
    outer = [f"{t['outer_sync']:.3f}"] if len(columns) > len(COLUMNS) else []
    rows.append(
      [fits, human_bytes(e.memory_bytes), human_bytes(e.memory["model_states"]["total"])]
      + [f"{v:.3f}" for v in (e.step_time_s, t["compute"], t["param_gathers"])]
      + [f"{v:.3f}" for v in (t["grad_traffic"], t["grad_sync"], t["param_sync"])]
      + outer
      + [f"{e.tokens_per_s:,.0f}"]
    )
  widths = [max([w] + [len(r[k]) + 1 for r in rows]) for k, (_, w) in enumerate(columns)]
  cells = lambda values: "".join(f"{v:>{w}s}" for v, w in zip(values, widths))  # noqa: E731
  lines = [f"{'#':>3s} {'strategy':9s}{'known as':13s}" + cells(h for h, _ in columns)]
  for i, (e, row) in enumerate(zip(predictions, rows), 1):
    lines.append(f"{i:3d} {e.strategy:9s}{KNOWN_NAMES.get(e.strategy, ''):13s}" + cells(row))
  notes = sorted({e.note for e in predictions if not e.feasible})
  if notes:  # what n/a means, once per reason
    lines.append(f"fits n/a: {'; '.join(notes)}: the strategy cannot run on this mesh")
  return lines


def explain_pick(
  pick: Prediction | None,
  fastest: Prediction | None,
  fitting: list[Prediction],
  all_: list[Prediction],
  cluster: Cluster,
) -> str:
  usable = cluster.usable_bytes
  room = (
    ""
    if usable is None
    else f" in {human_bytes(usable)} usable per device "
    f"({cluster.usable_memory:.0%} of {human_bytes(cluster.device_memory)})"
  )
  if pick is None:
    lean = min((e for e in all_ if e.feasible), key=lambda e: e.memory_bytes, default=None)
    if lean is None:
      return "nothing fits: no strategy can shard this model on this mesh"
    return (
      f"nothing fits{room}: the leanest, {strategy_named(lean.strategy)}, needs "
      f"{human_bytes(lean.memory_bytes)} per device; use more devices, a smaller "
      f"micro-batch or sequence, or train fewer parameters (LoRA)"
    )
  if len(fitting) == len(all_):
    head = f"all {len(all_)} strategies fit{room}"
  elif all("N" not in e.strategy for e in fitting):
    head = (
      f"memory is tight: only fully sharded strategies (no replicated state) fit{room}: "
      f"{', '.join(e.strategy for e in fitting)}"
    )
  else:
    out = [e.strategy for e in all_ if not e.fits and e.feasible]
    cannot = [e.strategy for e in all_ if not e.feasible]
    said = [f"{', '.join(out)} {'does' if len(out) == 1 else 'do'} not"] if out else []
    said += [f"{', '.join(cannot)} cannot shard the model that many ways"] if cannot else []
    head = f"{len(fitting)} of {len(all_)} strategies fit{room} ({'; '.join(said)})"
  why = (
    f"pick {strategy_named(pick.strategy)}: {pick.step_time_s:.3f} s/step, "
    f"{pick.tokens_per_s:,.0f} tokens/s, {human_bytes(pick.memory_bytes)} per device"
  )
  if fastest is not pick:
    fewer = fastest.collectives - pick.collectives
    why += f" (within {TIE:.0%} of {fastest.strategy}'s {fastest.step_time_s:.3f} s, with " + (
      f"{fewer:,} fewer collectives per step)" if fewer > 0 else "less memory)"
    )
  tail = []
  rest = [e for e in fitting if e is not pick and e is not fastest]
  if rest:
    tail.append(f"next {rest[0].strategy} {rest[0].step_time_s / pick.step_time_s - 1:+.1%}")
  for ref in ("GGG", "NGG"):
    e = next((x for x in all_ if x.strategy == ref), None)  # none with the outer loop
    if e is not None and e is not pick and e.fits:
      tail.append(f"{e.step_time_s / pick.step_time_s:.2f}x the speed of {strategy_named(ref)}")
  costs = {k: v for k, v in pick.times.items() if k != "compute"}
  top = max(costs, key=costs.get)
  if costs[top] > 0:
    tail.append(f"its largest cost after compute is {top.replace('_', ' ')} ({costs[top]:.3f} s)")
  return f"{head}; {why}" + ("; " + "; ".join(tail) if tail else "")
