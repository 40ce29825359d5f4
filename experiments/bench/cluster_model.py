"""The planner (paro_jax.analysis.planner) configured for the emulated cluster, and its fit.

- nodes x devices per node from the benchmark (2 x 4), the regime's tc rate as each node's link;
- a collective over both axes is "flat" where XLA:CPU runs it (`xla`; a flat `ring`): one ring
  through gloo, and tc counts every device's ring bytes on the link (GGG's wire bytes are 4x the
  per-device formula); "hierarchical" where a two-level ring runs it (`hring`, `horing` and
  their `+xla` mixes, what `--collectives auto` picks here): the intra ring, then the inter
  ring carrying 1/m of the payload, in series, as `step_model.collective_seconds` has it;
- traffic in 4-byte values (XLA:CPU widens bf16 collectives to f32; the benchmark trains fp32);
- compute: the benchmark's calibration (model FLOP/s of one virtual device while all 8 run at
  once, `effective_flop_per_s_per_device`), MFU 1.

What the calibration does not give (`Constants`: the intra-node bandwidth, the cost of one
collective of each kind, gloo's own cost per byte on the inter link and a scale on the compute
time) `fit_constants` fits by non-negative least squares on the unshaped runs only.
"""

from __future__ import annotations

import dataclasses
import math

from experiments.bench.calibration import UNSHAPED
from experiments.bench.configs import WIRE_ITEMSIZE
from experiments.bench.stats import nnls
from paro_jax.analysis.planner import inputs, planner, step_model
from paro_jax.core import names
from paro_jax.core.strategy import parse_strategy

FLAT, TWO_LEVEL = "flat", "hierarchical"


def global_model(collectives: str | None) -> str:
  """How the emulated cluster runs a collective over both axes with these `--collectives`
  (a row's `collectives`; runs from before the column had XLA's): XLA's is one flat gloo ring
  here, the others as the planner has them, a two-level ring's levels in series."""
  impl = collectives or "xla"
  return FLAT if impl == "xla" or inputs.GLOBAL_MODEL_OF[impl] == FLAT else TWO_LEVEL


@dataclasses.dataclass(frozen=True)
class Constants:
  """What the planner needs beyond the benchmark's own figures."""

  intra_s_per_byte: float  # 1 / intra bandwidth per device
  latency_s: dict  # collective kind -> seconds per collective, either level
  gloo_s_per_byte: float  # gloo's own cost per inter-node byte per device, in series with tc
  compute_scale: float  # x the calibrated compute time
  source: str


def workload(bench: dict) -> inputs.Workload:
  from models.presets import get_config

  meta = bench["meta"]
  n = meta["nodes"] * meta["devices_per_node"]
  return inputs.Workload(
    get_config(meta["model"]),
    micro_batch=max(1, meta["batch_size"] // n),
    micro_batches=1,
    seq_len=meta["seq_len"],
    itemsize=WIRE_ITEMSIZE,
    remat=meta.get("remat", "full") != "none",
  )


def cluster(bench: dict, rate_bps: float, c: Constants, model: str = FLAT) -> inputs.Cluster:
  """The planner's cluster; `model` (global_model) says how a collective over both axes runs."""
  meta = bench["meta"]
  m, g = meta["devices_per_node"], meta["nodes"]
  # Per device: m / node_rate (its share of tc's link) + gloo's cost, in series.
  inter_s = 8 * m / rate_bps + c.gloo_s_per_byte
  inter_bw = 1 / inter_s
  intra_bw = 1 / max(c.intra_s_per_byte, 1e-30)
  # Every (collective, level) as a probe profile would give it. A flat global collective runs
  # at the inter rate; a two-level one is an intra ring, then an inter ring with 1/m of the
  # payload, in series (step_model.collective_seconds): per ring byte over n devices, n/(n-1)
  # (m-1)/m at the intra rate and n/(n-1) (g-1)/(g m) at the inter rate; two latencies.
  n = m * g
  two_level_bw = (n - 1) / n / ((m - 1) / m / intra_bw + (g - 1) / (g * m) * inter_s)
  measured = {}
  for kind in names.SCHEDULE_COLLECTIVES:
    measured[(kind, "intra")] = (intra_bw, c.latency_s[kind])
    measured[(kind, "inter")] = (inter_bw, c.latency_s[kind])
    measured[(kind, "global")] = (
      (inter_bw, c.latency_s[kind]) if model == FLAT else (two_level_bw, 2 * c.latency_s[kind])
    )
  network = inputs.Links(
    inter_bandwidth=inter_bw * m,
    intra_bandwidth=intra_bw,
    global_collectives=model,
    measured=measured,
  )
  flops = bench["calibration"]["effective_flop_per_s_per_device"] / c.compute_scale
  return inputs.Cluster(meta["nodes"], m, network, flop_per_s=flops, mfu=1.0)


def features(bench: dict, name: str, a: int, model: str = FLAT) -> dict:
  """Per step: calibrated compute seconds, intra and inter bytes per device (inter: what crosses
  the link), collectives of each kind; `model` as for `cluster`."""
  w = dataclasses.replace(workload(bench), micro_batches=a)
  meta = bench["meta"]
  unit = inputs.Cluster(
    meta["nodes"],
    meta["devices_per_node"],
    inputs.Links(1.0, 1.0),
    bench["calibration"]["effective_flop_per_s_per_device"],
    mfu=1.0,
  )
  s = parse_strategy(name)
  traffic = step_model.traffic_of(s, w, unit)
  sched = step_model.phase_collectives(s, w)
  counts = {kind: 0 for kind in names.SCHEDULE_COLLECTIVES}
  for key in traffic.phases:
    kind, axes, count = sched[key]
    counts[kind] += count * (2 if model != FLAT and len(axes) == 2 else 1)  # one per level
  split = step_model.traffic_of(s, w, unit, two_level=True) if model != FLAT else traffic
  return {
    "compute": step_model.compute_seconds(w, unit),
    "intra": split.intra,
    "inter": split.inter,
    "counts": counts,
  }


def fit_constants(bench: dict, runs: list[dict]) -> Constants | None:
  """NNLS on the unshaped runs: step - inter bytes / link = s C + intra / B' + gloo E
  + sum over kinds of lat_kind K_kind (each run with its collectives' global model)."""
  meta = bench["meta"]
  m = meta["devices_per_node"]
  rate = next((g["rate_bps"] for g in bench["regimes"] if g["regime"] == UNSHAPED), None)
  ref = [r for r in runs if r["regime"] == UNSHAPED]
  if rate is None or len(ref) < 4:
    return None
  rows, ys = [], []
  for r in ref:
    f = features(bench, r["name"], r["micro_batches"], global_model(r.get("collectives")))
    rows.append(
      [f["compute"], f["intra"], f["inter"], *(f["counts"][k] for k in names.SCHEDULE_COLLECTIVES)]
    )
    ys.append(r["median_step_s"] - f["inter"] * m * 8 / rate)
  coef = nnls(rows, ys)
  scale, intra, gloo, *lat = coef
  steps = [r["median_step_s"] for r in ref]
  rel = [(sum(c * x for c, x in zip(coef, row)) - y) / t for row, y, t in zip(rows, ys, steps)]
  rms = math.sqrt(sum(e * e for e in rel) / len(rel))
  return Constants(
    intra,
    dict(zip(names.SCHEDULE_COLLECTIVES, lat)),
    gloo,
    scale or 1.0,
    f"fitted on the {len(ref)} unshaped runs by NNLS, rms error {rms:.1%} there",
  )


def predict(
  bench: dict,
  regime: dict,
  a: int,
  names: list[str],
  c: Constants,
  collectives: dict[str, str] | None = None,
) -> planner.Plan:
  """The planner's estimates of `names` and its pick among them (no memory limit on CPU);
  `collectives`: each strategy's `--collectives` as run (default xla)."""
  w = dataclasses.replace(workload(bench), micro_batches=a)
  model_of = {n: global_model((collectives or {}).get(n)) for n in names}
  clusters = {mod: cluster(bench, regime["rate_bps"], c, mod) for mod in set(model_of.values())}
  sub = [step_model.predict(parse_strategy(n), w, clusters[model_of[n]]) for n in names]
  pick = planner.tie_break(sub)
  ranking = [pick] + sorted((e for e in sub if e is not pick), key=lambda e: e.step_time_s)
  return planner.Plan(pick.strategy, "", ranking, {})
