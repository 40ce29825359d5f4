"""The sharded, streaming import (paro_jax/hf/stream.py) against the whole-model read (load_hf):
bit for bit, at every placement (N, I, G) on meshes 1x1, 2x4, 1x8 and 8x1, in fp32 and in bf16,
for untied and tied heads, GQA and MHA, an odd vocabulary no mesh divides, bf16 files, and a
directory sharded over several files (an index) in fp16; the arrays are at the sharding asked,
each device holding only its block. Then the one-line errors, raised per block."""

import collections
import json
import os
import shutil
from importlib.metadata import version

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from models.config import LlamaConfig
from models.llama import Llama
from paro_jax.core.mesh import make_mesh
from paro_jax.core.sharding import named, shard_dims, tree_specs
from paro_jax.core.strategy import Placement
from paro_jax.hf import stream
from paro_jax.hf.layout import parse
from paro_jax.hf.stream import hf_shardings, import_hf
from paro_jax.hf.weights import expected_shapes, load_hf, save_hf

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
# XLA:CPU's default fusion emitters, which tests/conftest.py turns off for the suite's compile
# time (the flag exists in the pinned jaxlib only; newer ones have no other).
USERS_CPU_EMITTERS = (
  {"xla_cpu_use_fusion_emitters": True} if version("jaxlib").startswith("0.10.") else {}
)
VARIANTS = ["hf_tiny", *(f"hf_llama/{v}" for v in ("llama3_gqa", "llama32_tied", "odd_vocab"))]


def shardings(cfg, placement, mesh):
  shapes = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
    expected_shapes(cfg),
    is_leaf=lambda x: isinstance(x, tuple),
  )
  dims = shard_dims(Llama(cfg).logical_axes())
  return named(mesh, tree_specs(shapes, dims, placement, mesh))


def fp16_shards(tmp_path):
  """llama3_gqa as fp16 in two files with their index, as transformers writes a big model."""
  source = os.path.join(FIXTURES, "hf_llama", "llama3_gqa")
  out = tmp_path / "fp16"
  shutil.copytree(source, out)
  tensors = load_file(out / "model.safetensors")
  os.remove(out / "model.safetensors")
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2]}
  shards["model-00002-of-00002.safetensors"] = names[1::2]
  for shard, members in shards.items():
    save_file({n: tensors[n].astype(np.float16) for n in members}, out / shard)
  weight_map = {n: shard for shard, members in shards.items() for n in members}
  (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return str(out)


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
  return [os.path.join(FIXTURES, v) for v in VARIANTS] + [fp16_shards(tmp_path_factory.mktemp("x"))]


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4), (1, 8), (8, 1)])
def test_import_equals_the_whole_read_bit_for_bit(directories, mesh_shape):
  mesh = make_mesh(*mesh_shape, devices=jax.devices()[: mesh_shape[0] * mesh_shape[1]])
  for directory in directories:
    cfg, want = load_hf(directory)
    for placement in Placement:
      target = shardings(cfg, placement, mesh)
      for dtype in (jnp.float32, jnp.bfloat16):
        got = import_hf(directory, cfg, target, dtype)
        for keys, x in jax.tree_util.tree_leaves_with_path(got):
          where = f"{directory} {placement.name} {mesh_shape} {dtype} {jax.tree_util.keystr(keys)}"
          ref = np.asarray(jnp.asarray(_at(want, keys)).astype(dtype))  # XLA's cast, as before
          assert x.dtype == dtype and x.sharding == _at(target, keys), where
          assert np.asarray(jax.device_get(x)).tobytes() == ref.tobytes(), where
          block = x.addressable_shards[0]
          assert block.data.shape == x.sharding.shard_shape(x.shape), where


def _at(tree, keys):
  for k in keys:
    tree = tree[k.key]
  return tree


def test_a_subtree_is_imported_alone():
  """The leaves given None (a LoRA run's adapters, say) are neither read nor made."""
  directory = os.path.join(FIXTURES, "hf_tiny")
  cfg, want = load_hf(directory)
  target = shardings(cfg, Placement.G, make_mesh(2, 4))
  target["layers"]["mlp"] = jax.tree.map(lambda _: None, target["layers"]["mlp"])
  got = import_hf(directory, cfg, target, jnp.float32)
  assert got["layers"]["mlp"] == {"w_gate": None, "w_up": None, "w_down": None}
  np.testing.assert_array_equal(got["layers"]["attn"]["wq"], want["layers"]["attn"]["wq"])


@pytest.mark.parametrize("placement", [Placement.I, Placement.G])
def test_blocks_read_as_the_target_holds_them_equal_the_whole_read(directories, placement):
  """With no run too short (the tiny models' rows are short: read by rows and exchanged
  above), every block is read as the placement holds it, a run of each row, and transposed on
  its device: bit for bit the whole read."""
  mesh = make_mesh(2, 4)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(stream, "_MIN_RUN", 1)
    patch.setattr(stream, "_DEVICE_ELEMENTS", 0)
    for directory in directories[:2]:
      cfg, want = load_hf(directory)
      target = shardings(cfg, placement, mesh)
      got = import_hf(directory, cfg, target, jnp.bfloat16)
      for keys, x in jax.tree_util.tree_leaves_with_path(got):
        ref = np.asarray(jnp.asarray(_at(want, keys)).astype(jnp.bfloat16))
        assert np.asarray(x).tobytes() == ref.tobytes(), (directory, keys)


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 4), (1, 8)])
def test_a_tensor_read_in_pieces_equals_the_whole_read(directories, mesh_shape, monkeypatch):
  """Pieces of a few elements of a device's block (along our first axis: HF rows for the
  tables and k/v, HF columns for the transposed projections; a leaf outside the stack filled
  a piece a slot), bit for bit the whole read, at every placement."""
  mesh = make_mesh(*mesh_shape, devices=jax.devices()[: mesh_shape[0] * mesh_shape[1]])
  monkeypatch.setattr(stream, "_DEVICE_ELEMENTS", 0)
  monkeypatch.setattr(stream, "_PIECE_ELEMENTS", 256)
  monkeypatch.setattr(stream, "_MIN_RUN", 1)
  reads = []
  real_read = stream._read
  monkeypatch.setattr(stream, "_read", lambda *a: reads.append(a[1]) or real_read(*a))
  for directory in (directories[0], directories[-1]):  # bf16 tied and fp16 in two files
    cfg, want = load_hf(directory)
    for placement in Placement:
      reads.clear()
      got = import_hf(directory, cfg, shardings(cfg, placement, mesh), jnp.bfloat16)
      assert max(collections.Counter(reads).values()) > 1, (directory, placement)  # in pieces
      for keys, x in jax.tree_util.tree_leaves_with_path(got):
        ref = np.asarray(jnp.asarray(_at(want, keys)).astype(jnp.bfloat16))
        assert np.asarray(x).tobytes() == ref.tobytes(), (directory, placement, keys)


def test_pieces_are_whole_entries_of_our_first_axis():
  """A piece is a run of whole outer names of the HF axis that holds our first axis, alike
  (a divisor of their count); whole where a placement splits that axis or where a piece's
  runs of a row would be short."""
  mesh = make_mesh(1, 8)
  split = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
  sizes = {"d": 64, "h": 4, "k": 64, "v": 96}
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(stream, "_PIECE_ELEMENTS", 2 * 64 * 64)  # two heads of d (h k)
    pieces = stream._pieces((64, 256), parse("d (h k) -> h k d"), sizes, split(), split())
    assert (pieces.axis, pieces.step, pieces.unit) == (1, 128, 64)
    assert pieces.ranges((64, 256)) == [(0, 128), (128, 256)]
    patch.setattr(stream, "_PIECE_ELEMENTS", 40 * 64)  # 40 rows of 96: 32, the divisor below
    pieces = stream._pieces((96, 64), parse("v d -> v d"), sizes, split(), split())
    assert (pieces.axis, pieces.step) == (0, 32)
    rows = split("intra")  # the axis split: whole
    assert stream._pieces((96, 64), parse("v d -> v d"), sizes, rows, rows).step == 96
    patch.setattr(stream, "_PIECE_ELEMENTS", 96 * 8)  # runs of 8 columns of d: short, whole
    assert stream._pieces((96, 64), parse("v d -> d v"), sizes, split(), split()).step == 64


def test_where_each_tensor_is_read():
  """Rows split over the target's mesh axes when our split axis leaves short runs of a row in
  each block; else the block the target holds, in the HF layout; whole where no HF axis has
  our split axis outermost."""
  mesh = make_mesh(1, 8)
  split = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
  for d, read in ((1024, (None, "intra")), (32, (("intra",), None))):
    sizes = {"f": 64, "d": d, "h": 4, "k": 16}
    got = hf_shardings(split("intra", None), parse("f d -> d f"), sizes)
    assert (got[0].spec, got[1].spec) == (PartitionSpec(*read), PartitionSpec(None, "intra"))
  sizes = {"d": 1024, "h": 8, "k": 16}
  got = hf_shardings(split("intra"), parse("(h k) d -> h k d"), sizes)
  assert got[0].spec == got[1].spec == PartitionSpec("intra", None)  # h, the outer name
  got = hf_shardings(split(None, "intra"), parse("(h k) d -> h k d"), sizes)
  assert got[0].spec == got[1].spec == PartitionSpec(None, None)  # k, an inner one: whole


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_stack_of_layers_is_filled_in_place_and_never_copied(tmp_path, monkeypatch, dtype):
  """Each program that takes a stack of layers (donated: the import writes into it) holds less
  than one more stack of temporaries: no copy of a whole stack (a conversion at the end, from
  a stack held as integers, held two of it at once: the largest transient of a real-size
  import). Compiled as a user's run compiles them (the suite's faster emitters alias it), on
  a model wide enough to show it; the imported stacks equal the whole read."""
  cfg = LlamaConfig(vocab=96, dim=256, layers=2, heads=4, kv_heads=2, head_dim=64, mlp=1024)
  save_hf(cfg, Llama(cfg).init(jax.random.key(0)), tmp_path / "wide", dtype="bf16")
  monkeypatch.setattr(stream, "_DEVICE_ELEMENTS", 0)  # every leaf converted on the devices
  seen = []  # (the program's temporaries per device, the stack's bytes per device)
  real = stream._jit.__wrapped__

  def recording(fn, out_shardings, donate=False, **static):
    program = real(fn, out_shardings, donate, **static)
    if not donate:
      return program

    def run(stack, *rest):
      compiled = program.lower(stack, *rest).compile(compiler_options=USERS_CPU_EMITTERS)
      stats = compiled.memory_analysis()
      seen.append((stats.temp_size_in_bytes, stack.addressable_shards[0].data.nbytes))
      return program(stack, *rest)

    return run

  monkeypatch.setattr(stream, "_jit", recording)
  cfg, want = load_hf(str(tmp_path / "wide"))
  got = import_hf(str(tmp_path / "wide"), cfg, shardings(cfg, Placement.G, make_mesh(2, 4)), dtype)
  assert len(seen) >= cfg.layers * len(jax.tree.leaves(got["layers"]))
  assert all(temp < stack for temp, stack in seen), max(seen)
  for keys, x in jax.tree_util.tree_leaves_with_path(got["layers"]):
    ref = np.asarray(jnp.asarray(_at(want["layers"], keys)).astype(dtype))
    assert np.asarray(jax.device_get(x)).tobytes() == ref.tobytes(), jax.tree_util.keystr(keys)


# --- bad inputs, per block ------------------------------------------------------------------
@pytest.mark.parametrize("on_device", [False, True])
def test_non_finite_values_are_found_and_counted_in_the_tensor(tmp_path, monkeypatch, on_device):
  """Checked on the host or on the devices, the tensor (a layer's, or one outside the stack)
  is named, with its counts and first index over the whole tensor, though its values lie on
  several devices."""
  monkeypatch.setattr(stream, "_DEVICE_ELEMENTS", 0 if on_device else stream._DEVICE_ELEMENTS)
  out = tmp_path / "hf"
  shutil.copytree(os.path.join(FIXTURES, "hf_llama", "odd_vocab"), out)
  clean = load_file(out / "model.safetensors")
  cfg, _ = load_hf(os.path.join(FIXTURES, "hf_llama", "odd_vocab"))
  target = shardings(cfg, Placement.G, make_mesh(1, 8))
  tensors = {n: w.copy() for n, w in clean.items()}
  tensors["model.layers.1.self_attn.q_proj.weight"][9, 13] = np.nan
  save_file(tensors, out / "model.safetensors")
  with pytest.raises(
    ValueError, match=r"q_proj.weight holds 1 NaN and 0 Inf values \(the first at index \(9, 13\)\)"
  ):
    import_hf(str(out), cfg, target, jnp.bfloat16)
  tensors = {n: w.copy() for n, w in clean.items()}
  table = tensors["model.embed_tokens.weight"]
  table[900, 1], table[250, 14] = np.inf, np.nan  # the first and the last of 8 devices' columns
  save_file(tensors, out / "model.safetensors")
  with pytest.raises(
    ValueError,
    match=r"tensor model.embed_tokens.weight holds 1 NaN and 1 Inf values \(the first at index "
    r"\(250, 14\)\): these weights are damaged",
  ):
    import_hf(str(out), cfg, target, jnp.float32)


def test_a_tied_copy_that_differs_is_refused(tmp_path):
  out = tmp_path / "tied"
  shutil.copytree(os.path.join(FIXTURES, "hf_llama", "llama32_tied"), out)
  tensors = load_file(out / "model.safetensors")
  table = tensors["model.embed_tokens.weight"]
  save_file({**tensors, "lm_head.weight": table}, out / "model.safetensors")
  cfg, want = load_hf(out)
  target = shardings(cfg, Placement.G, make_mesh(2, 4))
  got = import_hf(str(out), cfg, target, jnp.float32)
  np.testing.assert_array_equal(got["embed"]["embedding"], want["embed"]["embedding"])
  head = table.copy()
  head[-1, -1] = (
    head[-1, -1] + ml_dtypes.bfloat16(1) if head.dtype != np.float32 else head[-1, -1] + 1
  )
  save_file({**tensors, "lm_head.weight": head}, out / "model.safetensors")
  with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
    import_hf(str(out), cfg, target, jnp.float32)


def test_shapes_names_and_files_are_checked_before_reading(tmp_path):
  out = tmp_path / "hf"
  shutil.copytree(os.path.join(FIXTURES, "hf_tiny"), out)
  cfg, _ = load_hf(out)
  target = shardings(cfg, Placement.I, make_mesh(2, 4))
  tensors = load_file(out / "model.safetensors")
  save_file(
    {**tensors, "model.layers.2.mlp.up_proj.weight": tensors["model.norm.weight"]},
    out / "model.safetensors",
  )
  with pytest.raises(ValueError, match="unexpected tensor.*model.layers.2.mlp.up_proj.weight"):
    import_hf(str(out), cfg, target, jnp.float32)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, out / "model.safetensors")
  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight is missing"):
    import_hf(str(out), cfg, target, jnp.float32)
  (out / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage" + bytes(99))
  with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
    import_hf(str(out), cfg, target, jnp.float32)
