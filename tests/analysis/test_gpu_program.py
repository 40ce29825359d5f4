"""The GPU program: the step compiled for 2 nodes x 4 H100 without a GPU, read structurally.

A compile shows which collectives are asynchronous, what compute the scheduler put inside each
one's window and which communication stream each runs on (the thunk sequence of the dump). It
shows nothing about time: these tests assert structure only. The model is the hidden `test`
preset (2 layers), so every compile takes seconds.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from paro_jax.analysis.gpu import targets

pytestmark = pytest.mark.skipif(
  not targets.plugin_available(),
  reason=f"compiling for a GPU target needs JAX's CUDA plugin: {targets.INSTALL_HINT}",
)

from paro_jax.core.xla_flags import GPU_FLAGS  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL, MESH, A, BATCH, SEQ = "test", (2, 4), 1, 8, 32
_CACHE = {}


def gpu_report(
  strategy: str,
  impl: str,
  flags: dict = GPU_FLAGS,
  attention: str = "cudnn",
  micro_batches: int = A,
  model: str = MODEL,
  seq: int = SEQ,
  mesh: tuple = MESH,
) -> dict:
  """inspector.gpu_report (and "hlo", the program) of the step compiled for h100 on `mesh`
  (2x4 unless told; cached per configuration), one sequence per GPU, with the attention
  `--attention auto` picks there (cuDNN's kernel)."""
  key = (strategy, impl, tuple(sorted(flags.items())), attention, micro_batches, model, seq, mesh)
  if key not in _CACHE:
    import tempfile

    from models.llama import Llama
    from models.config import LlamaConfig
    from models.presets import get_config
    from paro_jax.analysis.inspect.abstract import compile_for_target
    from paro_jax.analysis.inspect.gpu_report import gpu_report as report
    from paro_jax.core.state import DTYPES, OptimConfig
    from paro_jax.core.engine import Engine
    from paro_jax.core.mesh import make_mesh
    from paro_jax.core.strategy import parse_strategy

    devices = make_mesh(*mesh, devices=targets.devices("h100", *mesh))
    engine = Engine(
      Llama(
        model if isinstance(model, LlamaConfig) else get_config(model),
        DTYPES["bf16"],
        attention=attention,
      ),
      parse_strategy(strategy),
      devices,
      OptimConfig(),
      micro_batches=micro_batches,
      collectives=impl,
    )
    with tempfile.TemporaryDirectory() as dump:
      batch = BATCH * mesh[0] * mesh[1] // (MESH[0] * MESH[1])
      compiled = compile_for_target(engine, "h100", batch, seq, flags, dump)
      _CACHE[key] = report(engine, compiled, "h100", batch, seq, dump)
      _CACHE[key]["hlo"] = compiled.as_text()
  return _CACHE[key]


# The configurations the tests below compile anyway: XLA's collectives under IIG, HO-Ring under the
# three strategies whose two-level rings they read. Every strategy with both XLA's collectives and
# HO-Ring, at 7b on 2x4 and 4x8, is on the pages experiments/results/gpu_program_7b_*/ (the same
# checks: tests/experiments/test_gpu_program_pages.py).
EVERY = [("IIG", "xla")] + [(s, "horing") for s in ("GGG", "IGG", "NGG")]


@pytest.mark.parametrize("strategy,impl", EVERY)
def test_every_strategy_compiles_for_h100(strategy, impl):
  r = gpu_report(strategy, impl)
  assert r["target"] == "h100" and r["overlap"]["streams"], "no async collective on a stream"
  if impl == "xla":
    # XLA:GPU keeps bf16 on the wire (XLA:CPU widens to f32): the compiled traffic is the formula.
    for level in ("inter_bytes", "intra_bytes"):
      assert r["measured"][level] == pytest.approx(r["expected"][level], rel=0.01, abs=1), level
  assert r["memory"]["compiled_bytes"] >= r["memory"]["model_states"]["total"]
  assert r["memory"]["fits"] and r["memory"]["device_bytes"] == 80e9


def test_attention_is_cudnns_fused_kernel():
  """--attention auto on GPUs: cuDNN's kernel forward and backward, no L x L scores; the plan
  follows (the written-out attention's plan counts the scores and is larger)."""
  fused, written = gpu_report("IIG", "xla"), gpu_report("IIG", "xla", attention="xla")
  assert fused["attention"] == "cudnn" and written["attention"] == "xla"
  assert 'custom_call_target="__cudnn$fmhaSoftmax"' in fused["hlo"]
  assert 'custom_call_target="__cudnn$fmhaSoftmaxBackward"' in fused["hlo"]
  assert "__cudnn$fmha" not in written["hlo"]
  assert fused["memory"]["planned_bytes"] < written["memory"]["planned_bytes"]
  # the kernel counts as compute when it lies inside a collective's window
  from paro_jax.analysis.hlo import overlap

  comps = overlap._computations(fused["hlo"])
  kernels = [i for c in comps.values() for i in c if "__cudnn$fmha" in i.rest]
  assert kernels and all(overlap._Compute(comps).instr(i) for i in kernels)


def test_mistrals_sliding_window_is_cudnns():
  """Mistral's sliding window (a causal window of 8 tokens in 32) reaches cuDNN's kernel as its
  sliding window, forward and backward: not the written-out attention, not a full causal mask."""
  import dataclasses
  import re

  from models.presets import get_config

  windowed = dataclasses.replace(get_config(MODEL), family="mistral", sliding_window=8)
  r = gpu_report("IIG", "xla", model=windowed)
  assert r["attention"] == "cudnn"
  calls = [x for x in r["hlo"].splitlines() if 'custom_call_target="__cudnn$fmha' in x]
  targets_ = {re.search(r'custom_call_target="([^"]+)"', x).group(1) for x in calls}
  assert targets_ == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
  assert all('"sliding_window_length": 8' in x for x in calls), calls


def _dots_with_fp32_operands(hlo_text: str) -> list[str]:
  """The dot instructions (GEMM fusions' included) that take an fp32 operand."""
  import re

  types, found = {}, []
  for line in hlo_text.splitlines():
    if m := re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ([a-z0-9]+)\[", line):
      types[m.group(1)] = m.group(2)
    if d := re.match(r"\s*(?:ROOT )?%([\w.\-]+) = \S+ dot\(%([\w.\-]+), %([\w.\-]+)\)", line):
      if "f32" in (types.get(d.group(2)), types.get(d.group(3))):
        found.append(d.group(1))
  return found


def test_no_matmul_takes_fp32_operands():
  """In bf16 every matmul of the step, the head's backward included (models/layers.py
  head_logits), takes bf16 operands: none runs as an fp32 (TF32) GEMM. Differentiated plainly
  (experiments/gpu_variants.py, the code of before), the head's two backward matmuls did."""
  from experiments.gpu_variants import undone

  hlo = gpu_report("IIG", "xla")["hlo"]
  assert " dot(" in hlo and _dots_with_fp32_operands(hlo) == []
  with undone(("head-backward",)):  # a new engine: traced with the code of before
    _CACHE.pop(("IIG", "xla", tuple(sorted(GPU_FLAGS.items())), "cudnn", A, MODEL, SEQ, MESH))
    before = gpu_report("IIG", "xla")["hlo"]
  _CACHE.pop(("IIG", "xla", tuple(sorted(GPU_FLAGS.items())), "cudnn", A, MODEL, SEQ, MESH))
  assert len(_dots_with_fp32_operands(before)) == 2


def test_packed_rows_keep_cudnns_fused_kernel():
  """Instruction data packed several examples to a row (`--pack`): attention stays inside each
  example through cuDNN's packed layout (each row's runs as offsets and lengths), still the fused
  kernel forward and backward, its mask causal inside each run."""
  from models.llama import Llama
  from models.presets import get_config
  from paro_jax.analysis.inspect.abstract import compile_for_target
  from paro_jax.core.state import DTYPES, OptimConfig
  from paro_jax.core.engine import Engine
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.strategy import parse_strategy

  engine = Engine(
    Llama(get_config(MODEL), DTYPES["bf16"], attention="cudnn"),
    parse_strategy("IIG"),
    make_mesh(*MESH, devices=targets.devices("h100", *MESH)),
    OptimConfig(),
  )
  import tempfile

  with tempfile.TemporaryDirectory() as dump:
    hlo = compile_for_target(engine, "h100", BATCH, SEQ, GPU_FLAGS, dump, packed=True).as_text()
  fwd = [line for line in hlo.splitlines() if 'custom_call_target="__cudnn$fmhaSoftmax"' in line]
  assert fwd and 'custom_call_target="__cudnn$fmhaSoftmaxBackward"' in hlo
  # causal inside the rows' runs (the token stream's kernel: CAUSAL over the whole row)
  assert all('"mask_type": "PADDING_CAUSAL"' in line for line in fwd)
  assert '"mask_type": "CAUSAL"' in gpu_report("IIG", "xla")["hlo"]


def _in_loop(rows, scope):
  """The collectives of a layer loop's body issued under `scope` (layer_gather: forward's
  prefetch of the next layer; layer_regather, layer_grad_scatter: backward's)."""
  return [c for c in rows if f"/while/body/closed_call/{scope}/" in c["op_name"]]


SCOPES = ("layer_gather", "layer_regather", "layer_grad_scatter")


def fetch_ahead_figures(strategy: str, impl: str) -> dict:
  """Per layer-loop scope of the step compiled for `tiny` (4 layers, so the layer loops have a
  body), 128 tokens: the collectives issued inside the loop body, how many of them are
  asynchronous and how many have compute in their window; and how many of the forward gathers
  are permutes (a page records these: experiments/gpu_program_grid.py)."""
  rows = gpu_report(strategy, impl, model="tiny", seq=128)["overlap"]["collectives"]
  figures = {}
  for scope in SCOPES:
    body = _in_loop(rows, scope)
    figures[scope] = {
      "issued": len(body),
      "async": sum(bool(c["async"]) for c in body),
      "with_compute": sum(c["compute_in_window"] > 0 for c in body),
    }
  gathers = _in_loop(rows, "layer_gather")
  figures["permutes_in_gather"] = sum(c["kind"] == "collective-permute" for c in gathers)
  return figures


def assert_fetched_ahead(strategy: str, impl: str, figures: dict) -> None:
  """XLA's collectives: inside the forward loop's body the next layer's gather, inside the
  backward's the re-gather of the layer below and the reduce-scatter of the layer above's
  gradient, each asynchronous with the body's matmuls inside its window. HO-Ring: the same
  collectives asynchronous (HO-Ring's permutes and sub-rounds where they span both levels,
  NCCL's collective over the node where they span one), the body's matmuls inside the windows
  of some of each chain's; GGG's chains span both levels, so its gathers are permutes."""
  for scope in SCOPES:
    f = figures[scope]
    assert f["issued"] > 0, f"{scope}: nothing issued inside the loop body"
    assert f["async"] == f["issued"], (scope, f)
    assert f["with_compute"] == f["issued"] if impl == "xla" else f["with_compute"] > 0, (scope, f)
  if impl == "horing":
    assert (figures["permutes_in_gather"] > 0) == (strategy == "GGG"), figures


# GGG on each implementation; IGG on both and IIG on XLA's are on the page
# experiments/results/gpu_program_grid/ (checked by tests/experiments/test_gpu_program_pages.py).
@pytest.mark.parametrize("impl", ["xla", "horing"])
def test_layers_are_fetched_ahead(impl):
  assert_fetched_ahead("GGG", impl, fetch_ahead_figures("GGG", impl))


@pytest.mark.parametrize("strategy", ["IIG", "NNI"])
def test_gradient_sync_runs_inside_the_last_backward(strategy):
  """On GPUs each layer's boundary sync (IIG: reduce-scatter between nodes; NNI: reduce-scatter
  in the node) is issued inside the last micro-batch's backward loop, asynchronously, with the
  backward's matmuls inside its window; the loop over the earlier micro-batches syncs nothing.
  `tiny` (4 layers): the test model's 2 layers leave no loop, and XLA combines their syncs."""
  r = gpu_report(strategy, "xla", micro_batches=2, model="tiny", seq=128)
  assert r["step_program"] == "sync-in-backward"  # the GPUs' choice (core/step.py)
  synced = [c for c in r["overlap"]["collectives"] if "layer_grad_sync" in c["op_name"]]
  in_loop = _in_loop(synced, "layer_grad_sync")
  assert in_loop and all(c["async"] and c["compute_in_window"] > 0 for c in in_loop)
  assert not any("micro_batches/while/body" in c["op_name"] for c in synced)


def test_no_inter_node_bytes_are_filed_under_other():
  """NNI's per-layer gradient all-reduces between nodes, combined by XLA:GPU into all-reduces of
  concatenated gradients without an op_name, are filed under `gradient sync`; only the loss's
  few bytes are `other`."""
  rows = gpu_report("NNI", "xla", micro_batches=2, model="tiny", seq=128)["overlap"]["collectives"]
  inter = [c for c in rows if c["level"] == "inter"]
  assert inter and all(c["phase"] == "gradient sync" for c in inter), inter
  assert sum(c["bytes_per_device"] for c in rows if c["phase"] == "other") < 64


def test_cudnn_checks_read_the_target():
  """jax asks the local GPU for its compute capability and the cuDNN library for its version;
  for a target the two answers come from the target's description (analysis/gpu/targets.py)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  with targets.cudnn_checks("h100"):
    assert fa.check_cudnn_version() == 90800
    assert fa.check_compute_capability("9.0") and not fa.check_compute_capability("10.0")
  with targets.cudnn_checks("a100-80gb"):
    assert fa.check_compute_capability("8.0") and not fa.check_compute_capability("9.0")


def test_hring_runs_one_level_after_the_other():
  """The contrast to HO-Ring: hring's inter permutes never share their window with an intra one
  on another stream."""
  o = gpu_report("GGG", "hring")["overlap"]
  assert o["horing_steps"] == 0
  inter = [
    c for c in o["collectives"] if c["kind"] == "collective-permute" and c["level"] == "inter"
  ]
  assert inter and not any(c["horing"] for c in o["collectives"])


def test_horing_permutes_run_on_two_streams():
  o = gpu_report("GGG", "horing")["overlap"]
  permutes = [c for c in o["collectives"] if c["horing"] and c["async"]]
  streams = {c["level"]: set() for c in permutes}
  for c in permutes:
    streams[c["level"]].add(c["stream"])
  assert streams["intra"] == {"communication_stream[0]"}
  assert streams["inter"] == {"communication_stream[1]"}
  assert o["horing_steps"] > 0 and o["horing_steps_concurrent"] > 0


def test_overlap_limit_flag_matters():
  """Without a second collective in flight, no HO-Ring step has both levels in flight. (With 4
  rather than 2, on 4 nodes x 8 GPUs, more of them do, and more bytes have compute in their
  window: experiments/results/gpu_program_grid/, checked by test_gpu_program_pages.py.)"""
  one = {**GPU_FLAGS, "xla_gpu_experimental_parallel_collective_overlap_limit": 1}
  o = gpu_report("GGG", "horing", one)["overlap"]
  assert o["horing_steps"] > 0 and o["horing_steps_concurrent"] == 0


@pytest.mark.parametrize("strategy", ["GGG", "IGG", "NGG"])
def test_every_horing_step_has_both_levels_in_flight(strategy):
  """Every inter permute of a two-level HO-Ring collective is in flight together with an intra
  one on the other stream, the steps outside the layer loops included; none is synchronous."""
  o = gpu_report(strategy, "horing")["overlap"]
  assert o["horing_steps"] > 0 and o["horing_steps_concurrent"] == o["horing_steps"]
  assert all(c["async"] for c in o["collectives"] if c["horing"])


def test_every_horing_step_in_flight_as_the_cli_compiles(tmp_path):
  """`paro-jax inspect --target` sets XLA's network model (gpus_per_node, analysis/estimate.py),
  whose costs change the schedule: a chain of the head's norm scale alone (a few hundred bytes
  per step) had one step whose inter permute XLA started only after its intra sub-round had
  finished (GGG, A=2: 6 of 7 steps here, 203 of 204 on 7b). A module's leaves now make one
  chain (core/shards.py make_gather), and every step has both levels in flight. The same run
  checks the CLI's report: the target's name in any case, the JSON's keys, --hlo-out."""
  hlo = tmp_path / "step.hlo"
  proc = _cli(
    "--target", "H100", "--mesh", "2x4", "--model", MODEL, "--strategy", "GGG",
    "--collectives", "horing", "--micro-batches", "2", "--batch-size", str(BATCH),
    "--seq-len", "128", "--json", "--hlo-out", str(hlo),
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout)
  o = r["overlap"]
  assert o["horing_steps"] > 0 and o["horing_steps_concurrent"] == o["horing_steps"], o
  assert r["target"] == "h100" and "collective_bytes_fraction" in o
  for key in ("compiled_bytes", "planned_bytes", "device_bytes"):
    assert r["memory"][key] > 0
  text = hlo.read_text()
  assert "ENTRY" in text and "collective-permute-start" in text  # the scheduled GPU program
  assert "kAsyncStart" in (tmp_path / "step.hlo.thunk_sequence.txt").read_text()


def test_async_to_sync_conversion_would_serialize_horing_steps():
  """The flag that keeps XLA from making collectives with no compute beside them synchronous
  matters: without it, HO-Ring steps run synchronously and some run one level after the other."""
  flags = {k: v for k, v in GPU_FLAGS.items() if k != "xla_disable_hlo_passes"}
  o = gpu_report("GGG", "horing", flags)["overlap"]
  assert any(c["horing"] and not c["async"] for c in o["collectives"])
  assert o["horing_steps_concurrent"] < o["horing_steps"]


def _cli(*args):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  return subprocess.run(
    [sys.executable, "-m", "paro_jax", "inspect", *args],
    capture_output=True,
    text=True,
    env={**env, "PYTHONPATH": REPO},
    cwd=REPO,
    timeout=600,
  )


@pytest.mark.parametrize(
  "args,message",
  [
    (["--target", "tpu-v5", "--mesh", "2x4"], "unknown --target 'tpu-v5'; choose one of h100"),
    (["--target", "h100"], "--target needs --mesh NODESxGPUS"),
  ],
)
def test_inspect_target_bad_input(args, message):
  proc = _cli(*args, "--model", MODEL)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_non_matmul_bytes_by_purpose():
  """`inspect --target`'s breakdown of the bytes of the kernels other than matmuls
  (analysis/gpu/traffic.py): the purposes sum to the total, little is left unnamed, and the
  optimizer's are AdamW's by formula: per parameter of the device's OS shard (from the engine's
  state shardings), the fp32 master, mu and nu each read and written (24 bytes), the gradient
  read (its dtype) and the compute-dtype copy of the weights written (2 bytes: Engine's
  weights_copy, on GPUs by default), or a little more where XLA splits a leaf's update around a
  transpose of its gradient's layout (the embedding's: +2.8% here)."""
  import jax
  import jax.numpy as jnp

  from models.presets import get_config
  from models.llama import Llama
  from paro_jax.core.state import DTYPES, OptimConfig
  from paro_jax.core.engine import Engine
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.strategy import parse_strategy

  r = gpu_report("IIG", "xla")
  t = r["traffic"]
  assert t["non_matmul_bytes"] > 0 and t["matmul_bytes"] > 0 and t["attention_bytes"] > 0
  assert sum(t["by_purpose"].values()) == pytest.approx(t["non_matmul_bytes"], rel=1e-12)
  assert t["by_purpose"].get("other", 0) < 0.03 * t["non_matmul_bytes"], t["by_purpose"]
  mesh = make_mesh(*MESH, devices=targets.devices("h100", *MESH))
  model = Llama(get_config(MODEL), DTYPES["bf16"], attention="cudnn")
  engine = Engine(model, parse_strategy("IIG"), mesh, OptimConfig())
  shapes = jax.eval_shape(lambda: engine.init_state(jax.random.key(0)))
  shard = sum(
    math.prod(sh.shard_shape(s.shape))
    for s, sh in zip(jax.tree.leaves(shapes.master), jax.tree.leaves(engine.state_shardings.master))
  )
  per_param = 3 * 4 * 2 + jnp.dtype(r["grad_dtype"]).itemsize + 2
  assert per_param * shard <= t["by_purpose"]["optimizer"] <= 1.05 * per_param * shard
