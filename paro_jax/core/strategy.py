"""PaRO strategies: three placement letters, one per training state, and the schedule they imply.

A strategy names where each of Parameters, Gradients and Optimizer states lives:
N (replicated on every device), I (sharded over the `intra` axis, one copy per group) or
G (sharded over all devices). Everything the engine communicates is derived here from the
letters alone (see docs/design.md, "Schedule of one optimizer step").
"""

from __future__ import annotations

import dataclasses
import enum

from paro_jax.core.names import INTER, INTRA


class Placement(enum.Enum):
  """Where one training state lives. Ordered by granularity N < I < G."""

  N = 0
  I = 1
  G = 2

  @property
  def axes(self) -> tuple[str, ...]:
    """Mesh axes this placement shards over, major first (G nests inside I: ('intra', 'inter'))."""
    return ((), (INTRA,), (INTRA, INTER))[self.value]

  def shard_count(self, inter: int, intra: int) -> int:
    """f(placement): how many ways the state is split (1, m or n)."""
    return (1, intra, intra * inter)[self.value]


ALIASES = {
  "ddp": "NNN",
  "zero1": "NNG",
  "zero2": "NGG",
  "zero3": "GGG",
  "mics": "III",
  "hsdp": "III",
  "hsdp-zero2": "NII",
}

# Well-known names for the README and error messages (several aliases may map to one strategy).
KNOWN_NAMES = {
  "NNN": "DDP",
  "NNG": "ZeRO-1",
  "NGG": "ZeRO-2",
  "GGG": "ZeRO-3",
  "III": "MiCS / HSDP",
  "NII": "HSDP-ZeRO2",
}


def _rest(axes: tuple[str, ...], minus: tuple[str, ...]) -> tuple[str, ...]:
  return tuple(a for a in axes if a not in minus)


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A valid (P, Gr, OS) triple and the collectives of its step schedule."""

  params: Placement
  grads: Placement
  opt: Placement

  def __post_init__(self):
    if self.params.value > self.opt.value or self.grads.value > self.opt.value:
      raise ValueError(
        f"invalid strategy {self.name!r}: the optimizer-state placement must be at least as fine "
        f"as both the parameter and the gradient placement (P <= OS and G <= OS, with "
        f"granularity N < I < G). Valid strategies: {', '.join(VALID_NAMES)}; aliases: "
        f"{', '.join(f'{k}={v}' for k, v in ALIASES.items())}."
      )

  @property
  def name(self) -> str:
    return self.params.name + self.grads.name + self.opt.name

  def __str__(self) -> str:
    return self.name

  # --- the schedule, derived from the letters -------------------------------------------------
  @property
  def param_gather_axes(self) -> tuple[str, ...]:
    """Per layer, per micro-batch: all-gather the P shard into the full weight over S(P)."""
    return self.params.axes

  @property
  def grad_scatter_axes(self) -> tuple[str, ...]:
    """Per layer, per micro-batch (in backward): reduce-scatter the full gradient over S(Gr)."""
    return self.grads.axes

  @property
  def sync_scatter_axes(self) -> tuple[str, ...]:
    """At the accumulation boundary: reduce-scatter over S(OS) minus S(Gr), major first."""
    return _rest(self.opt.axes, self.grads.axes)

  @property
  def data_axes(self) -> tuple[str, ...]:
    """The axes a step's batch is split over and its gradients and loss summed over: all."""
    return (INTRA, INTER)

  @property
  def sync_reduce_axes(self) -> tuple[str, ...]:
    """At the accumulation boundary: all-reduce over the data axes OS is replicated across."""
    return _rest(self.data_axes, self.opt.axes)

  @property
  def param_sync_axes(self) -> tuple[str, ...]:
    """After the update: all-gather the new parameters over S(OS) minus S(P), major first."""
    return _rest(self.opt.axes, self.params.axes)

  @property
  def two_level_collectives(self) -> bool:
    """Whether some collective of the schedule spans both mesh axes (node and device)."""
    return any(
      len(axes) == 2
      for axes in (
        self.param_gather_axes,
        self.grad_scatter_axes,
        self.sync_scatter_axes,
        self.sync_reduce_axes,
        self.param_sync_axes,
      )
    )


@dataclasses.dataclass(frozen=True)
class GroupStrategy(Strategy):
  """A strategy each group (node) runs on its own, the groups independent replicas along
  `inter` (the inner step of the outer loop, core/outer.py): its placements N or I, so that no
  collective of its step crosses nodes; its batch and gradients are the group's."""

  def __post_init__(self):
    super().__post_init__()
    if Placement.G in (self.params, self.grads, self.opt):
      raise ValueError(
        f"--outer-sync runs each node's step on its own, with no collective across nodes, but "
        f"{self.name} shards a state over all devices (G): pass a strategy of N and I letters "
        f"({', '.join(GROUP_NAMES)}), or drop --outer-sync"
      )

  @classmethod
  def of(cls, strategy: Strategy) -> GroupStrategy:
    return cls(strategy.params, strategy.grads, strategy.opt)

  @property
  def data_axes(self) -> tuple[str, ...]:
    return (INTRA,)

  @property
  def outer_sync_axes(self) -> tuple[str, ...]:
    """The axes the outer loop's round runs its collectives over (core/outer.py sync_axes): from
    the groups' master placement (OS) to G, S(G) minus S(OS), major first."""
    return _rest(Placement.G.axes, self.opt.axes)

  @property
  def outer_node_axes(self) -> tuple[str, ...]:
    """With the outer state at I (--outer-state I, core/outer.py sync_at_node): the axes its
    restart weights are gathered over, S(I) minus S(OS): ('intra',) for OS = N, else ()."""
    return _rest(Placement.I.axes, self.opt.axes)


def _all_strategies() -> tuple[str, ...]:
  names = []
  for p in Placement:
    for g in Placement:
      for o in Placement:
        if p.value <= o.value and g.value <= o.value:
          names.append(p.name + g.name + o.name)
  return tuple(names)


VALID_NAMES = _all_strategies()
GROUP_NAMES = tuple(n for n in VALID_NAMES if "G" not in n)  # GroupStrategy's: N and I letters


def parse_strategy(text: str) -> Strategy:
  """Parse 'IIG', 'iig' or an alias ('zero3', 'ddp', ...) into a Strategy; refuse anything else."""
  key = text.strip()
  letters = ALIASES.get(key.lower(), key.upper())
  if len(letters) != 3 or any(c not in "NIG" for c in letters):
    raise ValueError(
      f"unknown strategy {text!r}: give three letters for Parameters, Gradients and Optimizer "
      f"states, each N (replicated), I (sharded within a group) or G (sharded globally), with "
      f"P <= OS and G <= OS in granularity N < I < G. Valid strategies: {', '.join(VALID_NAMES)}; "
      f"aliases: {', '.join(f'{k}={v}' for k, v in ALIASES.items())}."
    )
  return Strategy(*(Placement[c] for c in letters))
