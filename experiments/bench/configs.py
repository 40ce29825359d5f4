"""What the strategy benchmark runs: configurations, their labels, and the run list.

A configuration is (kind, name, collectives):

- kind "paro": a PaRO strategy (name: its three letters) trained by `paro-jax train` with the
  collectives implementation `collectives` (paro_jax/core/collectives.py);
- kind "jit": a plain-jit baseline of XLA's own partitioning (jit-fsdp, jit-hsdp;
  experiments/bench/baselines.py);
- kind "torch": a PyTorch peer (experiments/bench/torch_peer.py: full_shard, hsdp,
  hsdp_deferred, ddp_no_sync), labelled `torch-PEER`.

Its label names it in rows, tables, plots and hlo.json: the name, with "/IMPL" added when a PaRO
strategy runs with collectives other than the benchmark's default (--collectives), e.g. `GGG`
and `GGG/horing`. The default `auto` is resolved per strategy as `train` resolves it on this
emulated cluster (CPU, a process per node: `hring+xla` for a strategy with collectives over both
axes, else `xla`), and the row keeps the implementation that ran. Rows are keyed by (regime,
label, A). Rows written before labels existed have only a name: their label is the name, their
kind "jit" for a baseline and "paro" otherwise.

Imports no jax.
"""

from __future__ import annotations

import dataclasses

from experiments.bench.torch_peer import PEERS as TORCH_PEERS
from paro_jax.core.names import AUTO_COLLECTIVES, COLLECTIVE_IMPLS, resolve_collectives
from paro_jax.core.strategy import VALID_NAMES, parse_strategy

NODES, DEVICES_PER_NODE = 2, 4
BASELINES = ("jit-fsdp", "jit-hsdp")
KINDS = ("paro", "jit", "torch")
DEFAULT_REFERENCE = "GGG"  # the configuration label the "vs" columns compare with (--reference)
# XLA:CPU runs collectives in f32 whatever the training dtype (bf16 is widened): 4 bytes a value.
WIRE_ITEMSIZE = 4
# --remat: models/llama.py's REMAT_POLICIES (named here without importing jax).
REMAT = ("full", "layer", "none")


@dataclasses.dataclass(frozen=True)
class Config:
  """One configuration of the run list (see the module docstring)."""

  kind: str
  name: str
  collectives: str | None  # the implementation of a "paro" configuration; None otherwise
  label: str

  @classmethod
  def paro(cls, name: str, collectives: str, default: str) -> Config:
    if collectives == default:  # the default, `auto` resolved as train resolves it here
      impl = resolve_collectives(collectives, "cpu", NODES, parse_strategy(name))[0]
      return cls("paro", name, impl, name)
    return cls("paro", name, collectives, f"{name}/{collectives}")

  @classmethod
  def jit(cls, name: str) -> Config:
    return cls("jit", name, None, name)

  @classmethod
  def torch(cls, peer: str) -> Config:
    return cls("torch", peer, None, f"torch-{peer}")

  @classmethod
  def from_label(cls, label: str, default: str) -> Config:
    """The configuration a label names, `default` being the benchmark's --collectives."""
    if label in BASELINES:
      return cls.jit(label)
    if label.startswith("torch-"):
      return cls.torch(label.removeprefix("torch-"))
    name, _, impl = label.partition("/")
    return cls.paro(name, impl or default, default)


def label_of(row: dict) -> str:
  return row.get("label") or row["name"]


def kind_of(row: dict) -> str:
  return row.get("kind") or ("jit" if row["name"] in BASELINES else "paro")


def parse_torch_peers(text: str | None) -> list[str]:
  """`--torch-peers full_shard,hsdp` (or `all`, or '' for none) as a list of peers."""
  peers = [p.strip().lower() for p in (text or "").split(",") if p.strip()]
  if peers == ["all"]:
    return list(TORCH_PEERS)
  if bad := [p for p in peers if p not in TORCH_PEERS]:
    raise ValueError(f"--torch-peers: unknown peers {bad}; choose from {', '.join(TORCH_PEERS)}")
  return peers


def parse_collectives_for(specs: list[str] | None) -> dict[str, list[str]]:
  """`--collectives-for STRATEGIES=IMPLS` (repeatable) as {strategy: [implementations]}.

  `GGG,IGG=xla,horing` runs GGG and IGG once with each of xla and horing; a strategy named in
  several specs runs with every implementation they list (each once, first mention first)."""
  out: dict[str, list[str]] = {}
  for spec in specs or []:
    names, sep, impls = spec.partition("=")
    names_list = [n.strip().upper() for n in names.split(",") if n.strip()]
    impl_list = [i.strip().lower() for i in impls.split(",") if i.strip()]
    if not sep or not names_list or not impl_list:
      raise ValueError(
        f"--collectives-for {spec!r}: give STRATEGIES=IMPLEMENTATIONS, e.g. GGG,IGG=xla,horing"
      )
    if bad := [n for n in names_list if n not in VALID_NAMES]:
      raise ValueError(
        f"--collectives-for {spec!r}: unknown strategies {bad}; valid: {', '.join(VALID_NAMES)}"
      )
    if bad := [i for i in impl_list if i not in (AUTO_COLLECTIVES, *COLLECTIVE_IMPLS)]:
      raise ValueError(
        f"--collectives-for {spec!r}: unknown collectives {bad}; choose from "
        f"{', '.join((AUTO_COLLECTIVES, *COLLECTIVE_IMPLS))}"
      )
    for n in names_list:
      have = out.setdefault(n, [])
      have += [i for i in impl_list if i not in have]
  return out


def run_list(
  strategies: list[str],
  baselines: list[str],
  collectives: str,
  collectives_for: dict[str, list[str]] | None = None,
  torch_peers: list[str] | None = None,
) -> list[Config]:
  """The configurations of one regime, in run order: the strategies (those of --collectives-for
  not among them appended), each once per implementation --collectives-for gives it, else
  with the default `collectives`; then the plain-jit baselines, then the torch peers."""
  per = collectives_for or {}
  names = list(strategies) + [n for n in per if n not in strategies]
  out = [Config.paro(n, impl, collectives) for n in names for impl in per.get(n, [collectives])]
  return out + [Config.jit(b) for b in baselines] + [Config.torch(p) for p in torch_peers or []]
