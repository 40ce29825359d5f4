"""The planner (paro_jax/analysis/planner/planner.py), the probe and `train --strategy auto`
(analysis/planner/auto.py).

The paper's conclusions are checked on realistic clusters: 16 nodes x 8 A100-80GB, a 100 Gbit/s
link per node (a slow cloud) against 300 GB/s NVLink, A=8 micro-batches of one 2,048-token
sequence per device.
"""

import json
import os

import pytest

from models.config import vocab_passes
from models.presets import PRESETS, get_config
from models.llama import Llama
from paro_jax.analysis.gpu import hardware
from paro_jax.analysis.planner import inputs, memory, planner, step_model
from paro_jax.core import names, units
from paro_jax.cli import main
from paro_jax.analysis.planner.costs import step_traffic
from paro_jax.analysis.planner.profile import load_profile, measured_links
from paro_jax.core.strategy import VALID_NAMES, parse_strategy

PARTIAL = [n for n in VALID_NAMES if "I" in n]  # some state sharded within a node only


def paper_plan(
  model="7b", trainable_fraction=1.0, memory="80GB", global_collectives="hierarchical", nodes=16
):
  cfg = get_config(model)
  psi = cfg.param_count()
  w = inputs.Workload(
    cfg, micro_batch=1, micro_batches=8, seq_len=2048, trainable=round(trainable_fraction * psi)
  )
  net = inputs.Links(
    units.parse_bandwidth("100gbit"),
    units.parse_bandwidth("300GB/s"),
    global_collectives=global_collectives,
  )
  card = hardware.GPUS["a100-80gb"]
  return planner.plan(
    w, inputs.Cluster(nodes, 8, net, card.peak_flops, device_memory=units.parse_size(memory))
  )


@pytest.mark.parametrize("global_collectives", ["flat", "hierarchical"])
def test_slow_inter_full_training_partial_redundancy_beats_zero(global_collectives):
  """Paper: on slow inter-node links a partial-redundancy strategy beats ZeRO-2 and ZeRO-3."""
  p = paper_plan("65b", global_collectives=global_collectives)
  assert p.pick == "IIG", p.explain  # the paper's 65B pick; NGG does not fit, GGG is slower
  assert p.get("GGG").step_time_s > 2 * p.get("IIG").step_time_s
  assert not p.get("NGG").fits
  p = paper_plan("7b", global_collectives=global_collectives)  # memory to spare
  assert p.pick not in ("GGG", "NGG"), p.explain
  best_partial = min(p.get(n).step_time_s for n in PARTIAL)
  assert p.get(p.pick).step_time_s <= best_partial * (1 + inputs.TIE)
  for zero in ("GGG", "NGG"):
    assert p.get(zero).fits and p.get(zero).step_time_s > 2 * best_partial


def test_few_trainable_parameters_pick_ing():
  """Paper: with few trainable parameters (LoRA) and parameters too big to replicate, ING."""
  p = paper_plan("65b", trainable_fraction=0.003)
  assert p.pick == "ING", p.explain
  fastest = min(e.step_time_s for e in p.ranking if e.fits)
  assert p.get("ING").step_time_s <= fastest * (1 + inputs.TIE)
  # ING's gradients stay put during the micro-batches: no gradient traffic until the sync.
  assert p.get("ING").times["grad_traffic"] == 0
  assert not any(p.get(n).fits for n in VALID_NAMES if n[0] == "N")  # 130 GB of parameters


def test_tight_memory_only_fully_sharded_fit():
  p = paper_plan("65b", memory="40GB")
  fitting = {e.strategy for e in p.ranking if e.fits}
  assert fitting and all("N" not in n for n in fitting), fitting
  assert "GGG" in fitting and "IIG" not in fitting
  assert "only fully sharded strategies" in p.explain and p.pick in p.explain
  p = paper_plan("65b", memory="16GB", nodes=2)
  assert p.pick is None and p.explain.startswith("nothing fits")


def test_traffic_is_costs_step_traffic():
  """The planner times exactly costs.step_traffic's bytes, phase by phase (no second formula)."""
  cfg = get_config("7b")
  w = inputs.Workload(cfg, micro_batches=4, trainable=cfg.param_count() // 100)
  cluster = inputs.Cluster(4, 8, inputs.Links(12.5e9, 300e9), 312e12)
  regathered = Llama(cfg).stack_param_count()
  assert w.layer_params == regathered
  # 7b's vocabulary in 4 tiles; its table and head frozen here (Ψ' = Ψ/100)
  frozen_vocab = vocab_passes(cfg).beyond_stored(trained=False)
  for name in VALID_NAMES:
    s = parse_strategy(name)
    e = step_model.predict(s, w, cluster)
    t = step_traffic(
      s, w.psi, w.psi_trained, 4, 8, 4, 2, 2, regathered=regathered, vocab_extra=frozen_vocab
    )
    assert e.traffic["phases"] == t.phases and e.traffic["inter_bytes"] == t.inter
    assert set(t.phases) <= set(step_model.phase_collectives(s, w)), name
    comm = sum(
      step_model.collective_seconds(
        *step_model.phase_collectives(s, w)[k][:2],
        b,
        step_model.phase_collectives(s, w)[k][2],
        cluster,
      )
      for k, b in t.phases.items()
    )
    assert e.step_time_s == pytest.approx(e.times["compute"] + comm)


def test_global_collective_models_and_overlap():
  """Two levels send 1/m of a global collective between nodes; overlapping them is faster
  still; hiding traffic behind compute only shortens the step."""
  cfg = get_config("7b")
  w = inputs.Workload(cfg)
  times = {}
  for model in inputs.GLOBAL_MODELS:
    net = inputs.Links(12.5e9, 300e9, global_collectives=model)
    times[model] = step_model.predict(
      parse_strategy("GGG"), w, inputs.Cluster(16, 8, net, 312e12)
    ).step_time_s
  assert times["flat"] > times["hierarchical"] > times["overlapped"]
  net = inputs.Links(12.5e9, 300e9)
  plain, hidden = (
    step_model.predict(parse_strategy("IIG"), w, inputs.Cluster(16, 8, net, 312e12, overlap=o))
    for o in (0.0, 1.0)
  )
  per_mb = plain.times["param_gathers"] + plain.times["grad_traffic"]
  assert hidden.step_time_s == pytest.approx(
    plain.step_time_s - min(per_mb, plain.times["compute"])
  )


def test_layer_params_match_the_model():
  for cfg in PRESETS.values():
    assert inputs.Workload(cfg).layer_params == Llama(cfg).stack_param_count()


def test_fused_attention_keeps_no_scores():
  """The written-out attention holds fp32 scores and compute-dtype probabilities per query, key
  and head (x2 with their gradients); the fused kernel one fp32 statistic per query and head."""
  cfg = get_config("7b")
  b, s, item = 1, 2048, 2
  written, fused = (
    memory.activation_bytes(
      parse_strategy("GGG"),
      inputs.Workload(cfg, micro_batch=b, seq_len=s, itemsize=item, fused_attention=f),
      2,
      4,
    )
    for f in (False, True)
  )
  assert written["layer"] - fused["layer"] == 2 * b * cfg.heads * s * (s * (4 + item) - 4)
  assert {k: v for k, v in written.items() if k not in ("layer", "total")} == {
    k: v for k, v in fused.items() if k not in ("layer", "total")
  }


def test_plan_assumes_the_attention_gpus_run(capsys):
  """`plan` is for GPUs: in bf16 --attention auto plans cuDNN's kernel (less memory)."""
  rows = {}
  for attention in ("auto", "cudnn", "xla"):
    main([*PLAN, "--attention", attention, "--json"])
    out = json.loads(capsys.readouterr().out)
    rows[attention] = {r["strategy"]: r["memory_bytes"] for r in out["ranking"]}
  assert rows["auto"] == rows["cudnn"]
  assert all(rows["cudnn"][k] < rows["xla"][k] for k in rows["xla"])


@pytest.mark.parametrize(
  "text,expected",
  [
    ("80GB", 80e9),
    ("80GiB", 80 * 2**30),
    ("512MiB", 512 * 2**20),
    ("1.5TB", 1.5e12),
    ("4096", 4096),
    ("64KiB", 65536),
  ],
)
def test_parse_size(text, expected):
  assert units.parse_size(text) == pytest.approx(expected)


@pytest.mark.parametrize(
  "text,expected",
  [
    ("300GB/s", 300e9),
    ("100gbit", 12.5e9),
    ("100Gb/s", 12.5e9),
    ("25GiB/s", 25 * 2**30),
    ("400mbit", 50e6),
    ("10gbps", 10e9),
  ],
)  # tc's gbps is gigabytes per second
def test_parse_bandwidth(text, expected):
  assert units.parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
  "fn,text",
  [
    (units.parse_size, "80 gigs"),
    (units.parse_size, "-1GB"),
    (units.parse_size, "80GB/s"),
    (units.parse_bandwidth, "fast"),
    (units.parse_bandwidth, "300GB"),
  ],
)
def test_parsers_refuse_with_an_example(fn, text):
  with pytest.raises(ValueError, match=f"bad .*{text!r}: write .*e.g."):
    fn(text)


PLAN = [
  "plan",
  "--model",
  "7b",
  "--nodes",
  "16",
  "--devices-per-node",
  "8",
  "--device-memory",
  "80GB",
  "--inter-bandwidth",
  "100gbit",
  "--intra-bandwidth",
  "300GB/s",
  "--micro-batch",
  "1",
  "--micro-batches",
  "8",
]


def test_plan_json_schema(capsys):
  main([*PLAN, "--trainable-fraction", "0.003", "--json"])
  out = json.loads(capsys.readouterr().out)
  assert out["pick"] in VALID_NAMES and out["explain"]
  assert len(out["ranking"]) == 14 and out["ranking"][0]["strategy"] == out["pick"]
  for row in out["ranking"]:
    assert {"strategy", "fits", "memory_bytes", "step_time_s", "tokens_per_s", "times"} <= set(row)
    assert set(row["times"]) == {
      "compute",
      "param_gathers",
      "grad_traffic",
      "grad_sync",
      "param_sync",
    }
  fits = [r["fits"] for r in out["ranking"]]
  assert fits == sorted(fits, reverse=True)  # fitting ones first


@pytest.mark.parametrize("gpu,link", [("a100-80gb", 300e9), ("h100", 450e9), ("h200", 450e9)])
def test_plan_takes_the_gpus_intra_node_link(capsys, gpu, link):
  """Without --intra-bandwidth the node's link is the --gpu's NVLink (per direction: half the
  datasheet's 600 GB/s for an A100, 900 GB/s for an H100 or H200), not the A100's for every GPU;
  --intra-bandwidth overrides it."""
  base = ["plan", "--model", "7b", "--nodes", "4", "--gpu", gpu, "--json"]
  main(base)
  assert json.loads(capsys.readouterr().out)["inputs"]["intra_bandwidth_bytes_per_s"] == link
  main([*base, "--intra-bandwidth", "100GB/s"])
  assert json.loads(capsys.readouterr().out)["inputs"]["intra_bandwidth_bytes_per_s"] == 100e9


def test_plan_table_at_100000_nodes(capsys):
  """Ten-digit token rates stay apart from the column before them, and the strategies that
  cannot shard the model that many ways (fits `n/a`) are explained, not listed as not fitting."""
  main(["plan", "--model", "7b", "--nodes", "100000"])
  lines = capsys.readouterr().out.splitlines()
  header = lines.index(next(line for line in lines if line.lstrip().startswith("# strategy")))
  rows = lines[header + 1 : header + 15]
  for row in rows:
    cells = row.split()
    assert cells[-1].replace(",", "").isdigit() and cells[-2].replace(".", "").isdigit(), row
    assert row.index(cells[-1]) + len(cells[-1]) == len(lines[header]), row  # right-aligned
  assert sum(" n/a " in row for row in rows) == 9
  assert lines[header + 15] == (
    "fits n/a: the model dimension 4096 does not split 800000 ways (paro_jax shards every leaf "
    "along it): the strategy cannot run on this mesh"
  )
  assert "(NNN does not; NNG, NIG, NGG, ING, IIG, IGG, GNG, GIG, GGG cannot shard" in lines[-1]


def test_plan_table(capsys):
  main(PLAN)
  out = capsys.readouterr().out
  assert "ZeRO-3" in out and "pick " in out and out.count("\n") > 15


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--model", "70b"], "unknown model preset '70b'"),
    (["--device-memory", "80 gigs"], "bad --device-memory '80 gigs'"),
    (["--inter-bandwidth", "fast"], "bad --inter-bandwidth 'fast'"),
    (["--intra-latency", "soon"], "bad --intra-latency 'soon'"),
    (["--nodes", "0"], "--nodes and --devices-per-node must be >= 1, got 0 and 8"),
    (["--gpu", "tpu"], "unknown --gpu 'tpu'"),
    (["--trainable-fraction", "2"], "--trainable-fraction must be in (0, 1]"),
    (["--peak-tflops", "0"], "--peak-tflops must be positive, got 0.0"),
    (["--target", "h100", "--compile-top", "0"], "--compile-top must be >= 1, got 0"),
    (["--profile", "/nonexistent/probe.json"], "profile '/nonexistent/probe.json' does not exist"),
  ],
)
def test_plan_bad_input(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    main([*PLAN, *argv])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_plan_devices_that_do_not_divide_the_model(capsys):
  """tiny's dimension 128 does not split 24 ways: the globally sharded strategies are marked."""
  main(["plan", "--model", "tiny", "--nodes", "3", "--devices-per-node", "8", "--json"])
  rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["ranking"]}
  for name, row in rows.items():
    assert row["feasible"] == (name[2] != "G"), name
    if not row["feasible"]:
      assert not row["fits"] and "does not split 24 ways" in row["note"]


def test_probe_measures_every_collective_and_level(tmp_path):
  from paro_jax.core.mesh import make_mesh
  from paro_jax.analysis.planner.probe import probe, write_profile

  from paro_jax.analysis.planner.probe import fit_line

  sizes = (4096, 65536)
  profile = probe(make_mesh(2, 4), sizes=sizes, repeats=1)
  for kind in names.SCHEDULE_COLLECTIVES:
    for level, k in (("intra", 4), ("inter", 2), ("global", 8)):
      fit = profile["collectives"][kind][level]
      # Ring bytes per device, from the buffer of f32 values each size rounds to (k divides it).
      ring = (2 if kind == names.ALL_REDUCE else 1) * (k - 1) / k
      assert fit["group"] == k
      assert [b for b, _ in fit["points"]] == [ring * (size // 4 // k * k) * 4 for size in sizes]
      assert all(t > 0 for _, t in fit["points"]), (kind, level)
      assert (fit["bandwidth"], fit["latency"]) == fit_line(fit["points"])
  # A CPU device's matmul rate: GFLOP/s, not a zero or a unit error of 1e3 either way.
  assert 1e7 < profile["flop_per_s"] < 1e13
  # A CPU device's memory: its share of the host's available memory (plan --profile uses it).
  assert (
    0 < profile["device_memory"] * 8 <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  )
  path = tmp_path / "probe.json"
  write_profile(profile, str(path))
  assert len(measured_links(load_profile(str(path)))) == 9
  p = planner.plan_for_profile(get_config("tiny"), 2, 4, 1, 2, 64, 4, load_profile(str(path)))
  assert p.pick in VALID_NAMES and p.pick in p.explain


def test_fit_line():
  from paro_jax.analysis.planner.probe import fit_line

  bw, lat = fit_line([(1e6, 1e-4 + 1e6 / 2e9), (4e6, 1e-4 + 4e6 / 2e9), (8e6, 1e-4 + 8e6 / 2e9)])
  assert bw == pytest.approx(2e9) and lat == pytest.approx(1e-4)
  bw, lat = fit_line([(1e3, 2e-4), (1e4, 1e-4)])  # latency-bound noise: still positive
  assert bw == pytest.approx(1e4 / 1e-4) and lat == pytest.approx(1e-4)


def test_train_strategy_auto(tmp_path, capsys):
  out = tmp_path / "run"
  main(
    [
      "train",
      "--strategy",
      "auto",
      "--model",
      "test",
      "--mesh",
      "2x4",
      "--steps",
      "2",
      "--batch-size",
      "8",
      "--seq-len",
      "16",
      "--dtype",
      "fp32",
      "--out",
      str(out),
    ]
  )
  text = capsys.readouterr().out
  line = next(x for x in text.splitlines() if "--strategy auto picked" in x)
  pick = line.split("picked ")[1][:3]
  assert pick in VALID_NAMES and f"strategy {pick} on mesh 2x4" in text
  rows = (out / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [1, 2]


def test_compressed_inter_traffic_in_the_plan():
  """The planner's bytes are costs.step_traffic with the wire sizes; int8 shrinks IIG's inter
  bytes about 4x in fp32-gradient terms (2x against bf16 plus scales) and its predicted step."""
  from paro_jax.analysis.planner.costs import step_traffic
  from paro_jax.analysis.planner.inputs import Cluster, Links, Workload
  from paro_jax.analysis.planner.step_model import predict
  from paro_jax.core.wire import WireConfig

  cfg = get_config("7b")
  links = Links(100e9 / 8, 300e9, 50e-6, 10e-6, "hierarchical")
  cluster = Cluster(4, 8, links, 312e12, 0.4, 80 * 2**30, 0.9, 0.0)
  plain = predict(parse_strategy("IIG"), Workload(cfg), cluster)
  wire = WireConfig("int8", "int8", 256)
  w = Workload(cfg, wire=wire, grad_itemsize=4)
  packed = predict(parse_strategy("IIG"), w, cluster)
  expected = step_traffic(
    parse_strategy("IIG"), w.psi, w.psi, 4, 8, 8, 2, 2, w.layer_params, wire, 4
  )
  assert packed.traffic["inter_bytes"] == pytest.approx(expected.inter)
  assert packed.traffic["inter_bytes"] == pytest.approx(
    plain.traffic["inter_bytes"] * (1 + 4 / 256) / 2
  )
  assert packed.times["grad_sync"] < 0.6 * plain.times["grad_sync"]
  # fp32 gradients: 4 bytes per element at Gr
  assert packed.memory["model_states"]["grads"] == 2 * plain.memory["model_states"]["grads"]
  # GGG: its global collectives become two levels; every phase key has a schedule entry
  g = predict(parse_strategy("GGG"), w, cluster)
  assert g.traffic["intra_bytes"] > 0 and g.traffic["inter_bytes"] > 0


def test_rings_model_is_xlas_ring_over_all_gpus():
  """`rings` (--collectives xla): a global collective over n = g x m GPUs moves (n-1)/n of its
  payload per GPU through m NICs of a node's link (XLA's SolGPUCostModel::RingLatency:
  (n-1) chunks of payload / n per NIC, over n / g NICs), i.e. ring bytes per device / node rate."""
  g, m, payload, node_rate = 4, 8, 1e9, 25e9 / 8
  n = g * m
  ring_bytes = (n - 1) / n * payload
  xla_formula = (n - 1) * (payload / n) / (node_rate / m) / m
  links = inputs.Links(node_rate, 300e9, 0.0, 0.0, global_collectives="rings")
  cluster = inputs.Cluster(g, m, links, 989e12)
  t = step_model.collective_seconds("reduce-scatter", ("inter", "intra"), ring_bytes, 1, cluster)
  assert t == pytest.approx(xla_formula, rel=1e-9)
  two_level = inputs.Cluster(g, m, inputs.Links(node_rate, 300e9, 0.0, 0.0), 989e12)
  t2 = step_model.collective_seconds("reduce-scatter", ("inter", "intra"), ring_bytes, 1, two_level)
  assert t > t2  # hring sends only (g-1)/g of the payload's 1/m per device between nodes


def test_one_micro_batch_holds_no_layer_gradient_accumulator():
  """With A=1 each layer's gradient is synced in the only backward (sync_in_backward): the
  layer stack's accumulator at Gr is not held; with A=2 it is. The difference is the stack's
  bf16 gradients over Gr's shards, Ψ_layers x 2 / 8 for IIG on 4 x 8."""
  cfg = get_config("65b")
  net = inputs.Links(units.parse_bandwidth("100gbit"), units.parse_bandwidth("300GB/s"))
  cluster = inputs.Cluster(4, 8, net, 989e12, device_memory=80e9)
  one, two = (
    step_model.predict(parse_strategy("IIG"), inputs.Workload(cfg, micro_batches=a), cluster)
    for a in (1, 2)
  )
  stack = Llama(cfg).stack_param_count()
  assert two.memory["model_states"]["grads"] - one.memory["model_states"]["grads"] == (
    2 * stack // 8
  )
  assert two.memory["total"] - one.memory["total"] == 2 * stack // 8
