import pytest

from paro_jax.core.strategy import ALIASES, VALID_NAMES, Placement, parse_strategy

# The 14 strategies of docs/design.md, written out independently of the generator in strategy.py.
PAPER_14 = "NNN NNI NII INI III NNG NIG NGG ING IIG IGG GNG GIG GGG".split()


def test_exactly_the_14_valid_strategies():
  assert sorted(VALID_NAMES) == sorted(PAPER_14)
  for name in PAPER_14:
    assert parse_strategy(name).name == name
    assert parse_strategy(name.lower()).name == name


@pytest.mark.parametrize(
  "alias,letters",
  [
    ("ddp", "NNN"),
    ("zero1", "NNG"),
    ("zero2", "NGG"),
    ("zero3", "GGG"),
    ("mics", "III"),
    ("hsdp", "III"),
    ("hsdp-zero2", "NII"),
    ("ZeRO3", "GGG"),
  ],
)
def test_aliases(alias, letters):
  assert parse_strategy(alias).name == letters
  assert alias.lower() in ALIASES


@pytest.mark.parametrize("bad", ["GNI", "IGI", "IXG", "NN", "NNNN", "", "zero4"])
def test_refused_with_rule_and_valid_names(bad):
  with pytest.raises(ValueError) as e:
    parse_strategy(bad)
  msg = str(e.value)
  assert repr(bad) in msg
  assert "P <= OS and G <= OS" in msg and "N < I < G" in msg
  for name in PAPER_14:
    assert name in msg


# Written by hand from the rules in docs/design.md ("Schedule of one optimizer step"):
# per-layer gather S(P), per-layer grad reduce-scatter S(Gr), boundary reduce-scatter
# S(OS) minus S(Gr), boundary all-reduce over the axes OS replicates, param sync S(OS) minus S(P).
SCHEDULES = [
  # name, per-layer gather, per-layer grad RS, boundary RS, boundary AR, param sync
  ("NNN", (), (), (), ("intra", "inter"), ()),
  ("NNI", (), (), ("intra",), ("inter",), ("intra",)),
  ("NII", (), ("intra",), (), ("inter",), ("intra",)),
  ("INI", ("intra",), (), ("intra",), ("inter",), ()),
  ("III", ("intra",), ("intra",), (), ("inter",), ()),
  ("NNG", (), (), ("intra", "inter"), (), ("intra", "inter")),
  ("NIG", (), ("intra",), ("inter",), (), ("intra", "inter")),
  ("NGG", (), ("intra", "inter"), (), (), ("intra", "inter")),
  ("ING", ("intra",), (), ("intra", "inter"), (), ("inter",)),
  ("IIG", ("intra",), ("intra",), ("inter",), (), ("inter",)),
  ("IGG", ("intra",), ("intra", "inter"), (), (), ("inter",)),
  ("GNG", ("intra", "inter"), (), ("intra", "inter"), (), ()),
  ("GIG", ("intra", "inter"), ("intra",), ("inter",), (), ()),
  ("GGG", ("intra", "inter"), ("intra", "inter"), (), (), ()),
]


def test_schedule_table_covers_all_14():
  assert sorted(row[0] for row in SCHEDULES) == sorted(PAPER_14)


@pytest.mark.parametrize("name,gather,scatter,sync_rs,sync_ar,param_sync", SCHEDULES)
def test_schedule_derived_from_letters(name, gather, scatter, sync_rs, sync_ar, param_sync):
  s = parse_strategy(name)
  assert s.param_gather_axes == gather
  assert s.grad_scatter_axes == scatter
  assert s.sync_scatter_axes == sync_rs
  assert s.sync_reduce_axes == sync_ar
  assert s.param_sync_axes == param_sync


def test_g_nests_inside_i():
  # The I shard axis is the major part of the G shard axes: I->G only crosses `inter`.
  assert Placement.G.axes[: len(Placement.I.axes)] == Placement.I.axes
  assert Placement.G.shard_count(2, 4) == 8 and Placement.I.shard_count(2, 4) == 4
