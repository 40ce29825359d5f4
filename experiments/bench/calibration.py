"""FLOP/s of a virtual device, and the link rate of each regime it gives.

`child_calibrate` (run as `--child calibrate`, it imports jax) times a forward+backward of the
per-device micro-batch on one virtual device alone and on all 8 at once (they share this
machine's cores, as the 8 devices of the emulated cluster do); the second (`effective`) sets
the link rates. `regimes_table` turns real clusters' FLOP per inter-node byte into emulated tc
rates, plus fixed rates and the unshaped reference. `calibration_for` is the orchestrator's side:
run the child, or reuse a calibration.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from experiments.bench import child
from experiments.bench.child import batch_flags
from experiments.bench.configs import DEVICES_PER_NODE, NODES

# FLOP per inter-node byte of real clusters (per GPU: effective dense FLOP/s over its share of
# the node's inter-node bandwidth).
REGIMES = {
  "infiniband": {
    "flop_per_byte": 8_000,
    "what": "H100 ~400 TFLOP/s effective, 400 Gb/s (50 GB/s) InfiniBand per GPU",
  },
  "paper_cloud": {
    "flop_per_byte": 21_000,
    "what": "A100 ~150 TFLOP/s effective, ~7 GB/s per GPU (the PaRO paper's cloud)",
  },
  "commodity": {
    "flop_per_byte": 100_000,
    "what": "8 GPUs (~150 TFLOP/s each) sharing one 100 Gb/s NIC",
  },
}
UNSHAPED = "unshaped"
UNSHAPED_RATE = "100gbit"  # a tbf this fast never queues here: the reference "no network" link
MIN_RATE_BPS, MAX_RATE_BPS = 8e3, 100e9  # tc tbf takes 8kbit..100gbit here (checked by hand)


def child_calibrate(args) -> None:
  """FLOP/s of a virtual device: forward+backward of the per-device micro-batch, alone and with
  all 8 devices busy at once. Prints one JSON object."""
  child.setup_jax(None, devices=args.devices)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from models.llama import Llama
  from models.loss import next_token_loss
  from models.presets import get_config
  from paro_jax.core.state import DTYPES

  cfg = get_config(args.model)
  model = Llama(cfg, DTYPES[args.dtype])
  rows = args.batch_size // args.devices
  rng = np.random.default_rng(0)
  params = model.init(jax.random.key(0))

  def fwd_bwd(p, tokens_BxL1):
    def loss_fn(p):
      pc = jax.tree.map(lambda w: w.astype(model.dtype), p)
      return next_token_loss(model.apply(pc, tokens_BxL1[:, :-1]), tokens_BxL1[:, 1:])

    loss, g = jax.value_and_grad(loss_fn)(p)
    # One scalar that depends on every gradient: nothing can be dropped as dead code.
    return loss + sum(jnp.sum(x) for x in jax.tree.leaves(g)) * 0.0

  def timed(fn, *xs):
    t = time.perf_counter()
    jax.block_until_ready(fn(*xs))
    first = time.perf_counter() - t
    times, start = [], time.perf_counter()
    # At least `repeats` calls and 5 s of them (CPU timings here vary by 2x between calls).
    while len(times) < args.repeats or (time.perf_counter() - start < 5 and len(times) < 50):
      t = time.perf_counter()
      jax.block_until_ready(fn(*xs))
      times.append(time.perf_counter() - t)
    return statistics.median(times), first

  flops_per_call = cfg.flops_per_token(args.seq_len) * rows * args.seq_len
  tok1 = jnp.asarray(rng.integers(0, cfg.vocab, (rows, args.seq_len + 1), dtype=np.int32))
  single = jax.jit(fwd_bwd)
  t_single, first_single = timed(single, params, tok1)
  out = {
    "model": args.model,
    "params": cfg.param_count(),
    "dtype": args.dtype,
    "rows_per_device": rows,
    "seq_len": args.seq_len,
    "flops_per_call": flops_per_call,
    "single_device": {
      "seconds": t_single,
      "flop_per_s": flops_per_call / t_single,
      "compile_and_first_s": first_single,
    },
  }
  if args.devices > 1:
    mesh = jax.make_mesh((args.devices,), ("d",))
    tokens = rng.integers(0, cfg.vocab, (rows * args.devices, args.seq_len + 1), dtype=np.int32)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("d")))
    params_r = jax.device_put(params, NamedSharding(mesh, P()))
    # check_vma off: no automatic psum of the replicated parameters' gradients (no collectives).
    many = jax.jit(
      jax.shard_map(
        lambda p, t: fwd_bwd(p, t)[None],
        mesh=mesh,
        in_specs=(P(), P("d")),
        out_specs=P("d"),
        check_vma=False,
      )
    )
    t_many, first_many = timed(many, params_r, tokens)
    out["concurrent"] = {
      "devices": args.devices,
      "seconds": t_many,
      "flop_per_s_per_device": flops_per_call / t_many,
      "compile_and_first_s": first_many,
    }
  out["effective_flop_per_s_per_device"] = (
    out["concurrent"]["flop_per_s_per_device"]
    if args.devices > 1
    else out["single_device"]["flop_per_s"]
  )
  print("CALIBRATION " + json.dumps(out), flush=True)


def calibrate(args, model: str, log_path: str) -> dict:
  """Run the calibration child for `model` (the benchmark's batch, sequence and dtype)."""
  return child.run_child(
    [
      "--child",
      "calibrate",
      "--model",
      model,
      *batch_flags(args),
      "--devices",
      str(NODES * DEVICES_PER_NODE),
    ],
    "CALIBRATION",
    log_path,
  )


def calibration_for(args, log_path: str) -> dict:
  """The benchmark's calibration, kept in --out/calibration.json: --calibration's (another
  benchmark's link rates), the one being resumed (--resume), or a new one."""
  calib_path = os.path.join(args.out, "calibration.json")
  if args.calibration or (args.resume and os.path.exists(calib_path)):
    # The same link rates as the runs being resumed, or as another benchmark's (--calibration).
    with open(args.calibration or calib_path) as f:
      calib = json.load(f)
    print(f"calibration of {calib['model']} from {args.calibration or calib_path}", flush=True)
    if calib["model"] != args.model:
      raise SystemExit(
        f"--calibration {args.calibration} is for model {calib['model']}, not {args.model}"
      )
  else:
    print(f"calibrating {args.model} ...", flush=True)
    calib = calibrate(args, args.model, log_path)
  with open(calib_path, "w") as f:
    json.dump(calib, f, indent=2)
  eff = calib["effective_flop_per_s_per_device"]
  print(
    f"  one device alone {calib['single_device']['flop_per_s'] / 1e9:.2f} GFLOP/s; "
    f"{NODES * DEVICES_PER_NODE} at once {eff / 1e9:.2f} GFLOP/s each "
    f"(node {eff * DEVICES_PER_NODE / 1e9:.2f} GFLOP/s)",
    flush=True,
  )
  return calib


def rate_text(bps: float) -> str:
  bps = min(max(bps, MIN_RATE_BPS), MAX_RATE_BPS)
  return f"{bps / 1e3:.0f}kbit" if bps < 10e6 else f"{bps / 1e6:.0f}mbit"


def regimes_table(names: list[str], device_flops: float, wire_itemsize: int = 2) -> list[dict]:
  """Link rate of each regime. The FLOP-per-byte figures are for GPUs that move bf16 (2 bytes per
  value); when this emulation moves `wire_itemsize`-byte values (fp32 training, and XLA:CPU
  runs bf16 collectives in f32 anyway), the link is made that much faster, so that the FLOP per
  transferred value, and hence the ratio of communication to computation, is the regime's."""
  from paro_jax.core.units import parse_rate

  node_flops = device_flops * DEVICES_PER_NODE * wire_itemsize / 2
  out = []
  for name in names:
    if name in REGIMES:
      r = REGIMES[name]
      want = node_flops / r["flop_per_byte"] * 8
      rate = rate_text(want)
      out.append(
        {
          "regime": name,
          "rate": rate,
          "rate_bps": parse_rate(rate),
          "wanted_bps": want,
          "clamped": not MIN_RATE_BPS <= want <= MAX_RATE_BPS,
          "flop_per_byte": r["flop_per_byte"],
          "what": r["what"],
        }
      )
    else:
      bps = parse_rate(name)  # a fixed rate such as 1gbit
      out.append(
        {
          "regime": name,
          "rate": name,
          "rate_bps": bps,
          "flop_per_byte": node_flops / (bps / 8),
          "what": "fixed rate",
        }
      )
  # The reference runs last: the shaped regimes are what an interrupted run should have.
  out.append(
    {
      "regime": UNSHAPED,
      "rate": UNSHAPED_RATE,
      "rate_bps": parse_rate(UNSHAPED_RATE),
      "flop_per_byte": None,
      "what": "reference: same namespaces, link never the bottleneck",
    }
  )
  for g in out:
    g["wire_itemsize"] = wire_itemsize
  return out


def print_regimes(regimes: list[dict]) -> None:
  print(f"\n{'regime':14s}{'FLOP/byte':>12s}{'link rate':>12s}  stands for")
  for g in regimes:
    fpb = "-" if g["flop_per_byte"] is None else f"{g['flop_per_byte']:,.0f}"
    print(
      f"{g['regime']:14s}{fpb:>12s}{g['rate']:>12s}  {g['what']}"
      + ("  (clamped)" if g.get("clamped") else "")
    )
