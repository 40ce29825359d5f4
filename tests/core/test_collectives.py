"""Tests for paro_jax.core.collectives: hand-written ring collectives == lax, exactly (the rings
of core/rings.py, HO-Ring of core/horing.py, their transposes in core/stacked.py).

Inputs are small random integers (stored as float32 / bfloat16 / int32), so
every partial sum is exactly representable whatever the summation order, and
any chunk misordering shows up as a mismatch.
"""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from paro_jax.core import collectives as C
from paro_jax.core.names import MIXED_IMPLS, resolve_collectives
from paro_jax.analysis.hlo import collectives as H

MESHES = [(2, 4), (4, 2), (2, 2), (1, 8), (8, 1)]
AXES = [("intra",), ("inter",), ("intra", "inter")]
# The mixed implementations (hring+xla, horing+xla) are one of these per collective: their own
# tests below check which one each collective gets.
PLAIN = [i for i in C.IMPLS if i not in MIXED_IMPLS]
HAND = [i for i in PLAIN if i != "xla"]
COLLS = ["ag", "rs", "ar"]
DEV = P(("inter", "intra"))  # stacks per-device blocks in mesh order

# name -> (dtype, {coll: (local shape, dim)})
CONFIGS = {
  "f32": (np.float32, {"ag": ((4, 3), 1), "rs": ((3, 16), 1), "ar": ((5, 3), None)}),
  "f32_odd": (np.float32, {"ag": ((1,), 0), "rs": ((8, 1), 0), "ar": ((7,), None)}),
  "bf16": (jnp.bfloat16, {"ag": ((2, 3, 5), -1), "rs": ((3, 8), -1), "ar": ((3, 5), None)}),
  "i32": (np.int32, {"ag": ((3, 2), 0), "rs": ((2, 8), 1), "ar": ((3, 3), None)}),
}
# compile time matters on 2 cores: the full matrix on the main mesh, subsets elsewhere
MESH_CONFIGS = {
  (2, 4): ("f32", "f32_odd", "bf16", "i32"),
  (4, 2): ("f32", "f32_odd", "bf16"),
  (2, 2): ("f32", "bf16"),
  (1, 8): ("f32_odd", "bf16"),
  (8, 1): ("f32_odd", "bf16"),
}


def _mesh(shape):
  g, m = shape
  return jax.make_mesh((g, m), ("inter", "intra"), devices=jax.devices()[: g * m])


def _apply(coll, x, axes, dim, impl):
  if coll == "ag":
    return C.all_gather(x, axes, dim=dim, impl=impl)
  if coll == "rs":
    return C.reduce_scatter(x, axes, dim=dim, impl=impl)
  return C.all_reduce(x, axes, impl=impl)


def _inputs(mesh, cnames, seed=0):
  """Global arrays [ndev, *local] (device blocks in mesh order)."""
  rng = np.random.RandomState(seed)
  ndev = mesh.devices.size
  out = {}
  for cname in cnames:
    dtype, colls = CONFIGS[cname]
    for coll, (shape, _) in colls.items():
      a = rng.randint(-4, 5, size=(ndev,) + shape).astype(np.float32)
      out[(cname, coll)] = jax.device_put(jnp.asarray(a).astype(dtype), NamedSharding(mesh, DEV))
  return out


# --------------------------------------------------------------------------
# forward: one compiled program per mesh holds every collective x impl x axes
# --------------------------------------------------------------------------

_FWD_CACHE = {}


def _forward(shape):
  if shape in _FWD_CACHE:
    return _FWD_CACHE[shape]
  mesh = _mesh(shape)
  xs = _inputs(mesh, MESH_CONFIGS[shape])

  def body(xs):
    outs = {}
    for (cname, coll), x in xs.items():
      x = x[0]
      dim = CONFIGS[cname][1][coll][1]
      for axes in AXES:
        for impl in PLAIN:
          outs[(cname, coll, axes, impl)] = _apply(coll, x, axes, dim, impl)[None]
        if coll == "ag":  # `xla`'s all-gather is a leading-axis gather moved into place
          outs[(cname, coll, axes, "lax")] = jax.lax.all_gather(x, axes, axis=dim, tiled=True)[None]
    return outs

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(DEV,), out_specs=DEV))  # check_vma=True
  res = {k: np.asarray(v.astype(jnp.float32)) for k, v in f(xs).items()}
  ins = {k: np.asarray(v.astype(jnp.float32)) for k, v in xs.items()}
  _FWD_CACHE[shape] = (ins, res)
  return ins, res


@pytest.mark.parametrize("impl", HAND)
@pytest.mark.parametrize("coll", COLLS)
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"mesh{s[0]}x{s[1]}")
def test_forward_matches_lax(shape, coll, impl):
  _, res = _forward(shape)
  bad = []
  for cname in MESH_CONFIGS[shape]:
    for axes in AXES:
      got = res[(cname, coll, axes, impl)]
      ref = res[(cname, coll, axes, "xla")]
      if got.shape != ref.shape or not np.array_equal(got, ref):
        bad.append((cname, axes))
  assert not bad, f"{coll}/{impl} differs from lax on mesh {shape}: {bad}"


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"mesh{s[0]}x{s[1]}")
def test_xla_all_gather_is_lax_tiled(shape):
  _, res = _forward(shape)
  bad = [
    (cname, axes)
    for cname in MESH_CONFIGS[shape]
    for axes in AXES
    if not np.array_equal(res[(cname, "ag", axes, "xla")], res[(cname, "ag", axes, "lax")])
  ]
  assert not bad, f"all_gather (xla) differs from lax.all_gather(tiled=True) on {shape}: {bad}"


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=lambda s: f"mesh{s[0]}x{s[1]}")
def test_lax_reference_layout(shape):
  """The lax reference itself follows the documented layout (numpy check)."""
  g, m = shape
  ins, res = _forward(shape)
  for cname in MESH_CONFIGS[shape]:
    for coll, (_, dim) in CONFIGS[cname][1].items():
      x = ins[(cname, coll)]  # [ndev, *local], device d = inter * m + intra
      for axes in AXES:
        got = res[(cname, coll, axes, "xla")]
        for d in range(g * m):
          co = {"inter": d // m, "intra": d % m}
          size = {"inter": g, "intra": m}
          members = []  # devices of my group, in combined axes order
          for f in range(int(np.prod([size[a] for a in axes]))):
            c, rem = dict(co), f
            for a in reversed(axes):
              c[a], rem = rem % size[a], rem // size[a]
            members.append(c["inter"] * m + c["intra"])
          my = members.index(d)
          if coll == "ag":
            want = np.concatenate([x[e] for e in members], axis=dim)
          elif coll == "ar":
            want = sum(x[e] for e in members)
          else:
            tot = sum(x[e] for e in members)
            want = np.split(tot, len(members), axis=dim)[my]
          np.testing.assert_array_equal(got[d], want, err_msg=str((cname, coll, axes, d)))


def test_unknown_impl_raises():
  for fn, kw in [(C.all_gather, {"dim": 0}), (C.reduce_scatter, {"dim": 0}), (C.all_reduce, {})]:
    with pytest.raises(ValueError, match="horing"):
      fn(jnp.ones(4), ("intra",), impl="nccl", **kw)


def test_empty_axes_identity():
  x = jnp.arange(6.0).reshape(2, 3)
  for impl in PLAIN:
    assert C.all_gather(x, (), dim=1, impl=impl) is x
    assert C.reduce_scatter(x, (), dim=0, impl=impl) is x
    assert C.all_reduce(x, (), impl=impl) is x


# --------------------------------------------------------------------------
# gradients (check_vma=False, like the engine), one program per mesh
# --------------------------------------------------------------------------

GRAD_CFG = {"ag": ((4, 3), 1), "rs": ((3, 16), 1), "ar": ((5, 3), None)}


@pytest.fixture(scope="module", params=[(2, 4), (4, 2)], ids=lambda s: f"mesh{s[0]}x{s[1]}")
def grads(request):
  mesh = _mesh(request.param)
  ndev = mesh.devices.size
  rng = np.random.RandomState(1)
  sh = NamedSharding(mesh, DEV)
  keys = [(coll, axes, impl) for coll in COLLS for axes in AXES for impl in PLAIN]
  xs, ws = {}, {}
  for coll, (shape, dim) in GRAD_CFG.items():
    x = rng.randint(-4, 5, size=(ndev,) + shape).astype(np.float32)
    for axes in AXES:
      # cotangent weights: integer-valued, different per device/position
      k = int(np.prod([mesh.shape[a] for a in axes]))
      oshape = list(shape)
      if coll == "ag":
        oshape[dim] *= k
      elif coll == "rs":
        oshape[dim] //= k
      w = rng.randint(-3, 4, size=(ndev, *oshape)).astype(np.float32)
      for impl in PLAIN:
        xs[(coll, axes, impl)] = jax.device_put(x, sh)
        ws[(coll, axes, impl)] = jax.device_put(w, sh)

  def body(xs):
    return {
      (coll, axes, impl): _apply(coll, x[0], axes, GRAD_CFG[coll][1], impl)[None]
      for (coll, axes, impl), x in xs.items()
    }

  # check_vma off on both sides of the comparison: the hand-written rings return replicated
  # values typed "varying" (no cast back exists), and lax is compared under the same semantics.
  smap = jax.shard_map(body, mesh=mesh, in_specs=(DEV,), out_specs=DEV, check_vma=False)

  def loss(xs, ws):
    outs = smap(xs)
    return sum(jnp.sum(outs[k] * ws[k]) for k in keys)

  gs = jax.jit(jax.grad(loss))(xs, ws)
  return {k: np.asarray(v) for k, v in gs.items()}


@pytest.mark.parametrize("impl", HAND)
@pytest.mark.parametrize("coll", COLLS)
def test_grad_matches_lax(grads, coll, impl):
  for axes in AXES:
    ref = grads[(coll, axes, "xla")]
    assert np.any(ref != 0)
    np.testing.assert_array_equal(grads[(coll, axes, impl)], ref, err_msg=str(axes))


# --------------------------------------------------------------------------
# HO-Ring: intra and inter collective-permutes overlap (HLO dependency check)
# --------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}\]])([a-z][\w\-]*)\(")


def hlo_graph(hlo_text):
  """Parse HLO text: name -> (opcode, operand names, attribute text).

  Operands are the data operands plus any control-predecessors.
  """
  nodes = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m or line.rstrip().endswith("{"):
      continue
    name, rest = m.groups()
    om = _OPCODE.search(rest)
    if not om:
      continue
    opcode = om.group(1)
    i = om.end()  # just after '('
    depth, j = 1, i
    while j < len(rest) and depth:
      depth += {"(": 1, ")": -1}.get(rest[j], 0)
      j += 1
    operands = re.findall(r"%([\w.\-]+)", rest[i : j - 1])
    attrs = rest[j:]
    cm = re.search(r"control-predecessors=\{([^}]*)\}", attrs)
    if cm:
      operands += re.findall(r"%?([\w.\-]+)", cm.group(1))
    nodes[name] = (opcode, operands, attrs)
  return nodes


_COLLECTIVE_OPS = (
  "collective-permute",
  "collective-permute-start",
  "all-gather",
  "all-gather-start",
  "reduce-scatter",
)


def _device_pairs(attrs):
  """(source, target) partition pairs a collective moves data between: a permute's own pairs;
  for a collective over replica groups, every ordered pair inside a group."""
  pm = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if pm:
    return [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)", pm.group(1) + "}")]
  gm = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
  groups = [list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", gm.group(1))]
  return [(a, b) for g in groups for a in g for b in g if a != b]


def hlo_permute_dependencies(hlo_text):
  """The collectives of an HLO module (permutes, all-gathers, reduce-scatters) with their
  collective ancestors.

  Returns {name: (device pairs, frozenset of collective names it transitively depends on)}.
  """
  nodes = hlo_graph(hlo_text)
  memo = {}

  def ancestors(n):
    if n not in memo:
      memo[n] = frozenset()  # guard (HLO is a DAG)
      acc = set()
      for o in nodes.get(n, (None, (), ""))[1]:
        if o in nodes:
          acc.add(o)
          acc |= ancestors(o)
      memo[n] = frozenset(acc)
    return memo[n]

  def is_collective(n):
    return nodes[n][0] in _COLLECTIVE_OPS

  out = {}
  for n, (op, _, attrs) in nodes.items():
    if is_collective(n):
      out[n] = (_device_pairs(attrs), frozenset(a for a in ancestors(n) if is_collective(a)))
  return out


def permute_steps(hlo_text, mesh_shape):
  """Group collectives into steps = longest chain of collectives before them.

  Returns (list of steps: list of (name, kind)), deps) with kind in
  {'intra', 'inter', 'mixed'} from the partition-id pairs on a
  (inter, intra) mesh (partition = inter * m + intra).
  """
  _, m = mesh_shape
  deps = hlo_permute_dependencies(hlo_text)

  def kind(pairs):
    kinds = {
      "intra" if s // m == t // m else "inter" if s % m == t % m else "mixed" for s, t in pairs
    }
    return kinds.pop() if len(kinds) == 1 else "mixed"

  level = {}

  def lvl(n):
    if n not in level:
      level[n] = 1 + max((lvl(a) for a in deps[n][1]), default=0)
    return level[n]

  steps = {}
  for n, (pairs, _) in deps.items():
    steps.setdefault(lvl(n), []).append((n, kind(pairs)))
  return [steps[i] for i in sorted(steps)], deps


def overlap_violations(hlo_text, mesh_shape, strict=False):
  """Reasons the HO-Ring property fails (empty list: it holds).

  Every inter collective must share its step with an intra one (and vice
  versa when ``strict``), and within a step neither may transitively depend
  on the other.
  """
  steps, deps = permute_steps(hlo_text, mesh_shape)
  kinds = [k for s in steps for _, k in s]
  errs = []
  if "intra" not in kinds or "inter" not in kinds:
    errs.append(f"need both intra and inter permutes, got {kinds}")
  if "mixed" in kinds:
    errs.append("a permute mixes intra and inter pairs")
  for i, step in enumerate(steps):
    intra = [n for n, k in step if k == "intra"]
    inter = [n for n, k in step if k == "inter"]
    if inter and not intra:
      errs.append(f"step {i}: inter collective(s) {inter} with no concurrent intra one")
    if strict and intra and not inter:
      errs.append(f"step {i}: intra collective(s) {intra} with no concurrent inter one")
    for a in intra:
      for b in inter:
        if b in deps[a][1] or a in deps[b][1]:
          errs.append(f"step {i}: {a} and {b} depend on each other")
  return errs


def _compiled_hlo(mesh_shape, impl, coll="ag"):
  mesh = _mesh(mesh_shape)
  axes = ("intra", "inter")
  k = mesh.devices.size
  # local chunk [8, 6] f32 (192 bytes); reduce-scatter input: k distinct chunks
  rows = 8 if coll == "ag" else k * 8
  x = jax.device_put(jnp.zeros((k * rows, 6), jnp.float32), NamedSharding(mesh, P(axes)))

  def body(x):
    if coll == "ag":
      return C.all_gather(x, axes, dim=0, impl=impl)
    return C.reduce_scatter(x, axes, dim=0, impl=impl)

  # check_vma off, as the engine runs the hand-written rings (their replicated results are typed
  # "varying"); only the compiled schedule is read here, not the values.
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False))
  return f.lower(x).compile().as_text()


HLO_MESHES = [(2, 4), (4, 2), (2, 2)]


@pytest.fixture(scope="module")
def hlo_texts():
  return {
    (impl, coll, shape): _compiled_hlo(shape, impl, coll)
    for impl in ("horing", "hring")
    for coll in ("ag", "rs")
    for shape in HLO_MESHES
  }


def independent_partners(hlo_text, mesh_shape):
  """For each inter collective: the intra collectives neither it nor they depend on."""
  steps, deps = permute_steps(hlo_text, mesh_shape)
  kind = {n: k for step in steps for n, k in step}
  return {
    n: [a for a, k in kind.items() if k == "intra" and a not in deps[n][1] and n not in deps[a][1]]
    for n, k in kind.items()
    if k == "inter"
  }


@pytest.mark.parametrize("shape", HLO_MESHES, ids=lambda s: f"mesh{s[0]}x{s[1]}")
def test_horing_all_gather_pairs_each_inter_step_with_a_sub_round(hlo_texts, shape):
  """All-gather: g intra sub-rounds (the runtime's all-gather over the node), each tied to the
  one before so that XLA does not combine them, and g-1 inter permutes; step t holds inter step
  t+1 and sub-round t, independent of each other."""
  g, m = shape
  text = hlo_texts[("horing", "ag", shape)]
  steps, _ = permute_steps(text, shape)
  got = [sorted(k for _, k in s) for s in steps]
  assert got == [["inter", "intra"]] * (g - 1) + [["intra"]], got
  assert overlap_violations(text, shape) == [], got
  kinds = [c.kind for c in H.parse_collectives(text) for _ in range(c.count)]
  assert kinds.count("all-gather") == g and kinds.count("collective-permute") == g - 1, kinds


@pytest.mark.parametrize("shape", HLO_MESHES, ids=lambda s: f"mesh{s[0]}x{s[1]}")
def test_horing_reduce_scatter_pairs_each_inter_step_with_a_sub_round(hlo_texts, shape):
  """Reduce-scatter: g intra sub-rounds (the runtime's reduce-scatter over the node), each tied
  to the one before; step t (>= 1) holds inter step t beside sub-round g-1-t, independent."""
  g, m = shape
  text = hlo_texts[("horing", "rs", shape)]
  steps, _ = permute_steps(text, shape)
  got = [sorted(k for _, k in s) for s in steps]
  assert got == [["intra"]] + [["inter", "intra"]] * (g - 1), got
  assert overlap_violations(text, shape) == [], got
  partners = independent_partners(text, shape)
  assert len(partners) == g - 1 and all(partners.values()), partners
  kinds = [c.kind for c in H.parse_collectives(text) for _ in range(c.count)]
  assert kinds.count("reduce-scatter") == g and kinds.count("collective-permute") == g - 1, kinds


def _level_bytes(text, shape):
  """{'intra': bytes, 'inter': bytes} sent per device (summed over devices, times counts)."""
  g, m = shape
  out = {"intra": 0.0, "inter": 0.0}
  for c in H.parse_collectives(text):
    assert c.kind in ("collective-permute", "all-gather", "reduce-scatter"), c
    assert H.level_of(c, m) in ("intra", "inter"), c
    for d, b in H.device_bytes(c, g * m).items():
      out["inter" if H.crosses_groups(c, d, m) else "intra"] += b * c.count
  return out


@pytest.mark.parametrize("coll", ["ag", "rs"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=lambda s: f"mesh{s[0]}x{s[1]}")
def test_horing_sends_hring_bytes_per_level(hlo_texts, coll, shape):
  g, m = shape
  chunk = 8 * 6 * 4
  horing = _level_bytes(hlo_texts[("horing", coll, shape)], shape)
  hring = _level_bytes(hlo_texts[("hring", coll, shape)], shape)
  assert horing == hring, (horing, hring)
  # per device: inter g-1 chunks, intra g*(m-1) chunks
  assert hring == {"inter": g * m * (g - 1) * chunk, "intra": g * m * g * (m - 1) * chunk}


def test_overlap_check_rejects_hring(hlo_texts):
  """Negative control: the sequential hierarchical ring must fail the check."""
  text = hlo_texts[("hring", "ag", (2, 4))]
  steps, _ = permute_steps(text, (2, 4))
  assert [[k for _, k in s] for s in steps] == [["inter"], ["intra"], ["intra"], ["intra"]]
  assert overlap_violations(text, (2, 4)) != []
  for coll in ("ag", "rs"):  # no inter permute has an intra one it does not wait for (or feed)
    partners = independent_partners(hlo_texts[("hring", coll, (2, 4))], (2, 4))
    assert partners and not any(partners.values()), partners


def test_invariant_inputs_under_check_vma():
  """Replicated (invariant-typed) inputs are pcast to varying and still match lax."""
  mesh = _mesh((2, 4))

  def body(x):
    out = {}
    for impl in PLAIN:
      out[("ar", impl)] = C.all_reduce(x, ("intra", "inter"), impl=impl)[None]
      out[("ag", impl)] = C.all_gather(x, ("intra",), dim=0, impl=impl)[None]
    return out

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=DEV))
  res = {k: np.asarray(v) for k, v in f(jnp.arange(3.0)).items()}
  for (coll, impl), v in res.items():
    np.testing.assert_array_equal(v, res[(coll, "xla")], err_msg=str((coll, impl)))


# --------------------------------------------------------------------------
# horing+xla and --collectives auto
# --------------------------------------------------------------------------


def _one_and_two_level_hlo(impl):
  """The collectives of the compiled HLO of all-gathers over ('intra',), ('intra', 'inter') and
  ('inter',), one each."""
  mesh = _mesh((2, 4))
  x = jax.device_put(jnp.zeros((8 * 8, 6), jnp.float32), NamedSharding(mesh, DEV))

  def body(x):
    # distinct operands: HO-Ring's first intra sub-round gathers x itself, and XLA would fold
    # an identical one-level gather into it
    return (
      C.all_gather(x + 1, ("intra",), dim=0, impl=impl),
      C.all_gather(x, ("intra", "inter"), dim=0, impl=impl),
      C.all_gather(x + 2, ("inter",), dim=0, impl=impl),
    )

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=DEV, out_specs=DEV, check_vma=False))
  return [
    k for c in H.parse_collectives(f.lower(x).compile().as_text()) for k in [c.kind] * c.count
  ]


def test_mixed_impls_run_rings_over_two_axes_and_lax_over_one():
  kinds = _one_and_two_level_hlo("horing+xla")
  # the two-level gather on 2x4: HO-Ring's g = 2 intra sub-rounds (all-gathers over the node)
  # and g-1 = 1 inter permute; each one-level gather: XLA's own all-gather
  assert kinds.count("all-gather") == 2 + 2 and kinds.count("collective-permute") == 1, kinds
  # H-Ring: (g-1) inter then (m-1) intra permutes
  kinds = _one_and_two_level_hlo("hring+xla")
  assert kinds.count("all-gather") == 2 and kinds.count("collective-permute") == 1 + 3, kinds
  # horing alone: the intra gather is the runtime's collective, the inter one the ring (g-1)
  kinds = _one_and_two_level_hlo("horing")
  assert kinds.count("all-gather") == 1 + 2 and kinds.count("collective-permute") == 1 + 1, kinds


def test_auto_collectives_resolution():
  from paro_jax.core.strategy import parse_strategy

  gpu, _ = resolve_collectives("auto", "cuda", 4, parse_strategy("GGG"))
  one, _ = resolve_collectives("auto", "cpu", 1, parse_strategy("GGG"))
  cpu, why = resolve_collectives("auto", "cpu", 2, parse_strategy("GGG"))
  assert (gpu, one, cpu) == ("xla", "xla", "hring+xla")
  assert "flat ring" in why
  # only one-level collectives (III's boundary all-reduce and IIG's boundary reduce-scatter and
  # parameter gather span inter alone)
  for name in ("NNI", "INI", "III", "IIG"):
    assert not parse_strategy(name).two_level_collectives
    assert resolve_collectives("auto", "cpu", 2, parse_strategy(name))[0] == "xla"
  for name in ("NNN", "NNG", "NIG", "GGG", "NGG", "GIG"):
    assert parse_strategy(name).two_level_collectives
  # before a strategy is known (--strategy auto): the platform alone decides
  assert resolve_collectives("auto", "cpu", 2)[0] == "hring+xla"
  assert resolve_collectives("hring", "cuda", 4) == ("hring", "as asked")
  with pytest.raises(ValueError, match="horing"):
    resolve_collectives("nccl", "cpu", 2)
