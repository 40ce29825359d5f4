"""XLA's estimate of a GPU step's time (paro_jax/analysis/gpu/estimate.py) and `inspect --target`'s
`estimate` section (analysis/inspect/inspection.py, analysis/inspect/gpu_report.py).

The composition is checked on programs whose answer is known by hand: a written HLO module with
nested loops, and a compiled scan of N identical bodies (N x one body plus the entry). The
compiles run in subprocesses: XLA reads its logging and network options once, at start-up.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from paro_jax.analysis.gpu import estimate, kernel_time, link, targets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_plugin = pytest.mark.skipif(
  not targets.plugin_available(),
  reason=f"compiling for a GPU target needs JAX's CUDA plugin: {targets.INSTALL_HINT}",
)

# An entry that runs the outer loop 3 times, whose body runs the inner loop 4 times, and calls
# a computation without collectives (one elementwise kernel over 3 x 4 MB) once.
NESTED_HLO = """HloModule m, is_scheduled=true

%fused_add (a: f32[1000000], b: f32[1000000]) -> f32[1000000] {
  %a = f32[1000000]{0} parameter(0)
  %b = f32[1000000]{0} parameter(1)
  ROOT %add = f32[1000000]{0} add(%a, %b)
}

%plain (x: f32[1000000]) -> f32[1000000] {
  %x = f32[1000000]{0} parameter(0)
  ROOT %add.f = f32[1000000]{0} fusion(%x, %x), kind=kLoop, calls=%fused_add
}

%cond (c: s32[]) -> pred[] {
  %c = s32[] parameter(0)
  ROOT %lt = pred[] compare(%c, %c), direction=LT
}

%inner (i: s32[]) -> s32[] {
  ROOT %i = s32[] parameter(0)
}

%outer (o: s32[]) -> s32[] {
  %o = s32[] parameter(0)
  ROOT %w.in = s32[] while(%o), condition=%cond, body=%inner, backend_config=TRIP4
}

ENTRY %main (e: s32[], v: f32[1000000]) -> s32[] {
  %e = s32[] parameter(0)
  %v = f32[1000000]{0} parameter(1)
  %called = f32[1000000]{0} call(%v), to_apply=%plain
  ROOT %w.out = s32[] while(%e), condition=%cond, body=%outer, backend_config=TRIP3
}
"""
for _n in (3, 4):
  NESTED_HLO = NESTED_HLO.replace(f"TRIP{_n}", '{"known_trip_count":{"n":"%d"}}' % _n)


def _stats_block(name: str, wasted: float, total: float) -> str:
  head = "I1125 03:00:00.000000    1 latency_hiding_scheduler.cc:4341] "
  return "".join(
    head + line + "\n"
    for line in (
      f"For computation: {name}, module m",
      f"Total wasted cycles: {wasted}",
      "Wasted cycles for all-gather: 0",
      f"Total cycles: {total}",
    )
  )


def test_nested_loops_compose_by_hand():
  """Each computation: its kernels at the efficiencies (PEAK here: the plain roofline) plus the
  waiting XLA logged for it, times its executions; the host's gap once."""
  log = (
    _stats_block("inner", 99, 999)  # before scheduling: superseded by the next block
    + _stats_block("main", 10, 100)
    + _stats_block("outer", 5, 20)
    + _stats_block("inner", 1, 7)
  )
  stats = estimate.parse_statistics(log)
  assert stats["inner"] == {"wasted_us": 1.0, "total_us": 7.0}
  bw = 2e12
  c = estimate.compose(NESTED_HLO, stats, 1e15, bw, kernel_time.PEAK)
  plain = 3 * 4e6 / bw  # two operands and a result of 4 MB, once per step
  host = estimate.HOST_GAP_S
  assert c["step_s"] == pytest.approx(host + (10 + 3 * 5 + 12 * 1) * 1e-6 + plain, rel=1e-9)
  assert c["compute_s"] == pytest.approx(host + plain, rel=1e-9)
  assert c["exposed_comm_s"] == pytest.approx((10 + 3 * 5 + 12 * 1) * 1e-6, rel=1e-9)
  assert c["unscheduled_s"] == pytest.approx(plain, rel=1e-9)
  assert c["xla_step_s"] == pytest.approx((100 + 3 * 20 + 12 * 7) * 1e-6, rel=1e-9)
  assert {r["computation"]: r["executions"] for r in c["computations"]} == {
    "main": 1,
    "outer": 3,
    "inner": 12,
    "plain": 1,
  }


def test_kernels_at_the_h100_efficiencies_not_xlas_prices():
  """The same kernel (roofline t) in the entry, in the outer loop's body and in `plain`, which
  XLA does not cost. XLA prices the entry's at 12 t (as it prices the untuned head matmul far
  above its roofline): not used. Each is t over the H100's memory-bound efficiency."""
  kernel = "f32[1000000]{0} fusion(%v, %v), kind=kLoop, calls=%fused_add"
  text = NESTED_HLO.replace(
    "%outer (o: s32[]) -> s32[] {\n  %o = s32[] parameter(0)",
    "%outer (o: s32[]) -> s32[] {\n  %o = s32[] parameter(0)\n  %v = f32[1000000]{0} "
    f"parameter(1)\n  %k.outer = {kernel}",
  ).replace("%called =", f"%k.main = {kernel}\n  %called =")
  bw = 1.6e12
  t = 3 * 4e6 / bw / kernel_time.H100.memory
  stats = {
    "main": {"total_us": 100.0, "wasted_us": 10.0},  # 90 us of compute: 12 t
    "outer": {"total_us": 20.0, "wasted_us": 5.0},  # 15 us of compute: 2 t
  }
  c = estimate.compose(text, stats, 1e15, bw)  # kernel_time.H100 unless told
  assert c["unscheduled_s"] == pytest.approx(t, rel=1e-9)
  assert c["compute_s"] == pytest.approx(estimate.HOST_GAP_S + (1 + 3 + 1) * t, rel=1e-9)
  assert c["step_s"] == pytest.approx(c["compute_s"] + (10 + 3 * 5) * 1e-6, rel=1e-9)


_ESTIMATE_ARGS = dict(
  compute_capability=(9, 0),
  peak_flops=1e15,
  memory_bandwidth=2e12,
  devices=1,
  tokens_per_step=1,
  flops_per_step=1.0,
  inter_bits_per_s=None,
  gpus_per_node=1,
)


def test_one_device_program_is_charged_its_roofline():
  # No async collective (one GPU): XLA's scheduler orders nothing and logs nothing, by design.
  e = estimate.estimate(NESTED_HLO, "", **_ESTIMATE_ARGS)
  assert e["source"] == estimate.ROOFLINE_SOURCE
  plain = 3 * 4e6 / 2e12 / kernel_time.H100.memory  # `plain`, once; the loops hold no kernel
  assert e["step_s"] == pytest.approx(estimate.HOST_GAP_S + plain, rel=1e-9)
  assert e["exposed_comm_s"] == 0 and e["xla_step_s"] is None
  assert "nothing to wait on" in estimate.format_estimate(e)


def test_silent_log_with_collectives_fails_loudly():
  # A program with an async collective that XLA logged nothing for: the log path has changed.
  text = NESTED_HLO.replace(
    "%called =",
    "%ags = (f32[1000000]{0}, f32[1000000]{0}) all-gather-start(%v), dimensions={0}\n  %called =",
  )
  with pytest.raises(RuntimeError, match="no latency-hiding scheduler statistics"):
    estimate.estimate(text, "", **_ESTIMATE_ARGS)


def test_network_options_are_gigabytes_per_gpu():
  # 25 Gbit/s shared by 8 GPUs: 25e9 / 8 bits -> bytes, / 8 GPUs, in units of 1e9 bytes/s.
  assert estimate.network_options(25e9, 8) == "nic_speed_gbps=0.390625,gpus_per_node=8"
  assert estimate.network_options(None, 4) == "gpus_per_node=4"


def test_a100_has_no_time_estimate():
  line = estimate.unavailable_reason("", targets.compute_capability("a100-80gb"))
  assert line is not None and "8.0" in line
  assert estimate.unavailable_reason("", targets.compute_capability("h100")) is None


def _run(args: list[str]) -> dict:
  env = {**os.environ, "PYTHONPATH": REPO}
  p = subprocess.run(
    [sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=900
  )
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout)


@pytest.fixture(scope="module")
def scans():
  script = os.path.join("tests", "analysis", "scan_program.py")
  return {n: _run([script, str(n)]) for n in (3, 6)}


@needs_plugin
def test_scan_is_n_bodies_plus_the_entry(scans):
  """A scan of N bodies costs N times one body (its kernels and XLA's waiting) plus the entry;
  XLA's own figure composes the same way."""
  bodies = {}
  for n, r in scans.items():
    entry = re.search(r"^ENTRY %?([\w.\-]+)", r["hlo"], re.M).group(1)
    (body,) = set(r["stats"]) - {entry}  # the scan's body: the other logged computation
    rows = {c["computation"]: c for c in r["compose"]["computations"]}
    assert rows[body]["executions"] == n and rows[body]["wait_s"] > 0
    bodies[n] = rows[body]["time_s"]
    expected = estimate.HOST_GAP_S + rows[entry]["time_s"] + n * bodies[n]
    assert r["compose"]["step_s"] == pytest.approx(expected, rel=0.01)
    xla = r["stats"][entry]["total_us"] + n * r["stats"][body]["total_us"]
    assert r["compose"]["xla_step_s"] * 1e6 == pytest.approx(xla, rel=0.01)
    assert r["compose"]["unscheduled_s"] == 0
  assert bodies[3] == pytest.approx(bodies[6], rel=1e-6)
  step = {n: r["compose"]["step_s"] for n, r in scans.items()}
  assert step[6] - step[3] == pytest.approx(3 * bodies[3], rel=0.01)


def _inspect(strategy: str, *extra: str, target: str = "h100") -> dict:
  return _run(
    [
      "-m",
      "paro_jax",
      "inspect",
      "--target",
      target,
      "--model",
      "test",
      "--mesh",
      "2x4",
      "--strategy",
      strategy,
      "--collectives",
      "xla",
      "--micro-batches",
      "2",
      "--batch-size",
      "8",
      "--seq-len",
      "64",
      "--json",
      *extra,
    ]
  )


@pytest.fixture(scope="module")
def reports():
  return {
    "IIG@100": _inspect("IIG", "--inter-bandwidth", "100gbit"),
    "GGG@25": _inspect("GGG", "--inter-bandwidth", "25gbit"),
    "GGG@400": _inspect("GGG", "--inter-bandwidth", "400gbit"),
    "IIG@defaults": _inspect("IIG"),
    "NNI@0.1": _inspect("NNI", "--inter-bandwidth", "0.1gbit"),
  }


@needs_plugin
def test_inspect_reports_xla_estimate(reports):
  """Fails loudly when the pinned XLA stops logging the scheduler's figures."""
  e = reports["IIG@100"]["estimate"]
  for key in ("step_s", "compute_s", "exposed_comm_s", "tokens_per_s", "mfu"):
    assert e[key] is not None and e[key] >= 0, key
  assert e["source"] == estimate.SOURCE and e["inter_bandwidth_gbps"] == 100
  assert 0 < e["mfu"] < 1 and 0 < e["compute_s"] <= e["step_s"]
  assert e["tokens_per_s"] == pytest.approx(2 * 8 * 64 / e["step_s"])
  assert any(r["source"] == "kernels + XLA's waiting" for r in e["computations"])
  d = reports["IIG@defaults"]["estimate"]
  assert d["inter_bandwidth_gbps"] is None and "XLA's defaults" in d["network"]


@needs_plugin
def test_inspect_reads_what_xla_charged_each_matmul(reports):
  """Fails loudly when the pinned XLA stops dumping its schedule (xla_dump_latency_hiding_schedule):
  the median price of the program's matmuls comes from what XLA charged each of them."""
  e = reports["IIG@100"]["estimate"]
  over = e["overpriced"]
  assert over["median_over_roofline"] is not None and over["median_over_roofline"] > 0
  assert e["step_s_repriced"] == pytest.approx(e["xla_step_s"] - over["overcharge_s"])
  assert 0 < e["step_s_repriced"] <= e["xla_step_s"]


@needs_plugin
def test_slower_link_gives_longer_step(reports):
  slow, fast = reports["GGG@25"]["estimate"], reports["GGG@400"]["estimate"]
  assert slow["step_s"] > fast["step_s"]
  assert slow["compute_s"] == pytest.approx(fast["compute_s"], rel=0.05)


@needs_plugin
def test_link_floor_is_the_compiled_inter_bytes_on_the_gpus_share(reports):
  """The compiled program's bytes per GPU that cross nodes (collectives across nodes whole, those
  over all 8 GPUs by (2 - 1) / (8 - 1) of their ring bytes) over its share of the node's link (8
  bits a byte, 4 GPUs a node); none without --inter-bandwidth."""
  for name, gbit in (("IIG@100", 100), ("GGG@25", 25), ("GGG@400", 400)):
    r = reports[name]
    e = r["estimate"]
    level = lambda lvl: sum(
      c["bytes_per_device"] for c in r["overlap"]["collectives"] if c["level"] == lvl
    )
    crossing = level("inter") + level("global") / 7
    assert e["inter_bytes_per_device"] == pytest.approx(crossing) and crossing > 0
    assert e["inter_link_s"] == pytest.approx(crossing / (gbit * 1e9 / 8 / 4))
  ggg = reports["GGG@25"]  # its collectives span all 8 GPUs: a seventh of their bytes cross
  assert ggg["estimate"]["inter_bytes_per_device"] < ggg["measured"]["inter_bytes"] / 6
  assert "inter_link_s" not in reports["IIG@defaults"]["estimate"]


@needs_plugin
def test_step_is_never_below_the_link_floor(reports):
  """inspect's step is link_shared's: at 0.1 Gbit/s (the link floor 10x the kernels) at least the
  floor; where the link does not bind (400 Gbit/s, XLA's default network) the scheduled step."""
  slow = reports["NNI@0.1"]["estimate"]
  # the link's time far past the kernels' (the host's gap aside)
  assert slow["inter_link_s"] > 10 * (slow["compute_s"] - slow["host_s"])
  assert slow["step_s"] >= slow["inter_link_s"]
  split = slow["link_s_by_computation"]  # the floor's bytes, by the computation issuing them
  assert sum(split.values()) == pytest.approx(slow["inter_link_s"])
  rows = {r["computation"]: r["executions"] * r["time_s"] for r in slow["computations"]}
  by_hand = sum(max(t, split.get(c, 0.0)) for c, t in rows.items())
  assert slow["step_s"] == pytest.approx(max(slow["schedule_step_s"], by_hand))
  assert slow["exposed_comm_s"] == pytest.approx(slow["step_s"] - slow["compute_s"])
  for name in ("GGG@400", "IIG@defaults"):
    e = reports[name]["estimate"]
    assert e["step_s"] == e["schedule_step_s"] and e["step_bound"] == link.BOUND_SCHEDULE, name
  fast = reports["GGG@400"]["estimate"]
  assert fast["inter_link_s"] < 0.1 * fast["step_s"]


def test_link_shared_step_by_hand():
  """A hand-written schedule: its step 4 ms (compute 3 ms, waiting 1 ms) of a program that
  sends 1.25 MB per GPU across 2 nodes of 4 GPUs. At 8 Gbit/s per node a GPU's share is
  8e9 / 8 / 4 = 250 MB/s, so the link is busy 5 ms: the step is 5 ms, 2 ms of it exposed, and
  tokens/s and MFU fall by 4/5. At 80 Gbit/s the link takes 0.5 ms: the scheduled 4 ms stands."""
  e = {
    "step_s": 4e-3,
    "compute_s": 3e-3,
    "exposed_comm_s": 1e-3,
    "tokens_per_s": 1000.0,
    "mfu": 0.5,
    "step_s_repriced": 3.5e-3,
  }
  slow = estimate.link_floor(1.25e6, 0.0, 2, 4, 8e9)
  assert slow["inter_link_s"] == pytest.approx(5e-3)
  s = link.link_shared(e, slow["inter_link_s"])
  assert s["step_s"] == pytest.approx(5e-3) and s["schedule_step_s"] == 4e-3
  assert s["exposed_comm_s"] == pytest.approx(2e-3) and s["compute_s"] == 3e-3
  assert (s["tokens_per_s"], s["mfu"]) == pytest.approx((800.0, 0.4))
  assert s["step_s_repriced"] == pytest.approx(5e-3)
  assert s["step_bound"] == link.BOUND_LINK
  assert link.link_shared(s, slow["inter_link_s"]) == s  # applied twice: the same
  fast = link.link_shared(e, estimate.link_floor(1.25e6, 0.0, 2, 4, 80e9)["inter_link_s"])
  assert fast.pop("step_bound") == link.BOUND_SCHEDULE
  assert fast == pytest.approx({**e, "schedule_step_s": 4e-3})
  assert link.link_shared(e, None)["step_s"] == 4e-3  # no --inter-bandwidth: no floor
  assert link.link_shared({"source": None}, 1.0) == {"source": None}  # no estimate


def test_link_shared_by_computation_by_hand():
  """Two computations run one after the other: the entry (once, 2 ms in XLA's schedule) and a
  loop body (10 times 0.5 ms). The entry's collectives keep the link busy 3 ms, the body's 1 ms
  in all (the floor: 4 ms). XLA's step, 7 ms, is above the floor, yet the entry cannot finish
  before its 3 ms on the link while the body's compute hides its own: 3 + 5 = 8 ms."""
  rows = [
    {"computation": "main", "executions": 1, "time_s": 2e-3},
    {"computation": "body", "executions": 10, "time_s": 0.5e-3},
  ]
  e = {"step_s": 7e-3, "compute_s": 6e-3, "tokens_per_s": 800.0, "mfu": 0.4, "computations": rows}
  split = {"main": 3e-3, "body": 1e-3}
  s = link.link_shared(e, 4e-3, split)
  assert s["step_s"] == pytest.approx(8e-3) and s["step_bound"] == link.BOUND_LINK
  assert (s["exposed_comm_s"], s["tokens_per_s"]) == pytest.approx((2e-3, 700.0))
  assert link.link_shared(s, 4e-3)["step_s"] == pytest.approx(8e-3)  # the split is kept
  # a collective in flight across the loop (no split), or one issued where compose has no row:
  # only the step as a whole bounds the link, and XLA's 7 ms stands
  assert link.link_shared(e, 4e-3, None)["step_s"] == 7e-3
  assert link.link_shared(e, 4e-3, {"elsewhere": 4e-3})["step_s"] == 7e-3


def test_estimate_set_by_the_link_floor_says_so():
  e = {
    "source": estimate.SOURCE,
    "inter_bandwidth_gbps": 100.0,
    "network": "nic_speed_gbps=1.5625,gpus_per_node=8",
    "step_s": 7.95,
    "compute_s": 1.88,
    "exposed_comm_s": 6.07,
    "tokens_per_s": 8240.0,
    "mfu": 0.106,
    "unscheduled_s": 0.0,
    "attention_s": 0.0,
    "host_s": 2.06e-3,
  }
  # 65b IIG on 4 x 8 H100 at 100 Gbit/s per node: its syncs cross nodes on the inter axis
  floor = estimate.link_floor(24.48e9, 0.0, 4, 8, 100e9)
  assert floor["inter_link_s"] == pytest.approx(24.48e9 / 1.5625e9)
  text = estimate.format_estimate(link.link_shared({**e, **floor}, floor["inter_link_s"]))
  assert "the inter-node link alone: 15667.20 ms per step (24.5 GB per GPU" in text
  assert "step 15667.20 ms = compute 1880.00 ms + exposed communication 13787.20 ms" in text
  assert "set by the inter-node link: the schedule alone gives 7950.00 ms" in text
  low = estimate.link_floor(0.0, 31e9 / 3, 4, 8, 100e9)  # 3/31 of the bytes cross
  fast = estimate.format_estimate(link.link_shared({**e, **low}, low["inter_link_s"]))
  assert "the inter-node link alone: 640.00 ms" in fast and "step 7950.00 ms" in fast
  assert "set by the schedule (the link does not bind)" in fast


@needs_plugin
def test_a100_inspect_says_why_no_number():
  e = _inspect("IIG", "--inter-bandwidth", "100gbit", target="a100-80gb")["estimate"]
  assert e["source"] is None and "step_s" not in e
  assert estimate.format_estimate(e).count("\n") == 0
