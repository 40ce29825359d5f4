"""Throughput of PaRO strategies on an emulated 2-node cluster, across link regimes.

Every run is a real multi-process training run: `paro_jax.cluster.launch.launch` starts one
process per "node" (2 nodes x 4 virtual CPU devices), each in its own network namespace, joined by
a veth pair whose egress is shaped with tc tbf (rate only: latency is not emulated).

  1. Calibrate: the FLOP/s of one virtual device (paro_jax's model FLOPs,
     `LlamaConfig.flops_per_token(seq_len) * tokens`, over the time of a forward+backward of the
     per-device micro-batch). Two figures: one device alone in a 1-process run, and each of 8
     devices running their own micro-batch at once (they share this machine's cores, as the 8
     devices of the emulated cluster do). The second one (`effective`) sets the link rates.
  2. Regimes: real clusters named by FLOP per inter-node byte (a device's effective FLOP/s over
     its share of the node's network). The emulated link rate of a regime is
       (effective device FLOP/s x devices per node) / (FLOP per byte)
     clamped to what tc accepts; plus fixed rates named in --regimes (e.g. 1gbit), plus an
     "unshaped" reference (100gbit, the same namespaces) that every overhead is relative to.
  3. For each (regime, strategy or baseline, A) one launch of `train --steps K`; from the run's
     metrics.jsonl (written by process 0): median step time over the steps after `--skip`
     (the first includes compilation), tokens/s, communication overhead (step time / the same
     configuration's step time on the unshaped link), inter-node bytes per optimizer step counted
     by tc on the wire (sum of both nodes' egress; per-step deltas, see `_Monitor`), beside the
     compiled-HLO figure (paro_jax.analysis.inspector.report) and the formula
     (paro_jax.analysis.costs), and the per-device model-state memory.
  4. Baselines "as most JAX users would write it": one plain `jax.jit` training step (same model,
     remat, optax AdamW with global-norm clipping) with NamedSharding annotations only, XLA
     partitioning the rest: `jit-fsdp` (every state sharded over all 8 devices) and `jit-hsdp`
     (sharded over the 4 devices of a node, replicated across nodes). They run as children of the
     launcher (`python experiments/bench_strategies.py --child baseline ...`).
  5. Outputs under --out: strategies.json (command line, machine, calibration, regimes, every
     run), strategies.md (tables), strategies.png (throughput relative to GGG per regime), and
     runs/REGIME/NAME_A*/ (metrics.jsonl and the launcher's log of each run).

Smoke test (a few minutes):
  python experiments/bench_strategies.py --model tiny --strategies IIG,GGG --baselines jit-fsdp \
      --micro-batches 1 --steps 4 --regimes 1gbit --out experiments/results/strategies_smoke
Full run (see the estimate a smoke run prints):
  python experiments/bench_strategies.py --model small --micro-batches 1,4,8 \
      --regimes infiniband,paper_cloud,commodity,1gbit

Needs root with `ip` and `tc` (else the launcher falls back to unshaped loopback and the byte
counts are missing). The hidden `--child calibrate|inspect|baseline` modes are what the
orchestrator runs in subprocesses; the orchestrator itself never imports jax.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPT = os.path.abspath(__file__)

NODES, DEVICES_PER_NODE = 2, 4
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
BASELINES = ("jit-fsdp", "jit-hsdp")
REFERENCE_STRATEGY = "GGG"
# XLA:CPU runs collectives in f32 whatever the training dtype (bf16 is widened): 4 bytes a value.
WIRE_ITEMSIZE = 4


# ------------------------------------------------------------------------------------------
# children (run in subprocesses; these import jax)
# ------------------------------------------------------------------------------------------
def _setup_jax(mesh_text: str | None, multi=(None, None, None), devices: int | None = None):
  """Devices and jax.distributed, before jax touches devices (as bench_collectives.py does)."""
  from paro_jax.cluster import distributed
  from paro_jax.core.names import parse_mesh_shape
  from paro_jax.core.xla_flags import add_xla_flags, provide_cpu_devices

  processes = distributed.process_count(*multi)
  if mesh_text:
    inter, intra = parse_mesh_shape(mesh_text)
    provide_cpu_devices(inter * intra // processes)
  elif devices:
    provide_cpu_devices(devices)
  add_xla_flags()
  distributed.maybe_initialize(*multi)


def _auto_mesh(inter: int, intra: int):
  """paro_jax's (inter, intra) device order, with Auto axes: what a plain-jit user has."""
  from jax.sharding import AxisType, Mesh

  from paro_jax.core.mesh import make_mesh

  m = make_mesh(inter, intra)
  return Mesh(m.devices, m.axis_names, axis_types=(AxisType.Auto,) * 2)


def _baseline(kind: str, model_name: str, dtype: str, micro_batches: int, steps: int, mesh):
  """(init_fn, jitted step, state shardings, batch sharding) of a plain-jit baseline."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from models.llama import Llama, get_config, next_token_loss
  from paro_jax.core.engine import DTYPES, OptimConfig, decay_mask
  from paro_jax.core.sharding import shard_dims

  model = Llama(get_config(model_name), DTYPES[dtype])
  logical = model.logical_axes()
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  dims = shard_dims(logical)  # the `embed` dimension of every leaf, as paro_jax shards it
  axes = {"jit-fsdp": ("inter", "intra"), "jit-hsdp": "intra"}[kind]

  def spec(x, d):
    s = [None] * x.ndim
    s[d % x.ndim] = axes
    return P(*s)

  param_specs = jax.tree.map(spec, shapes, dims)
  tx = OptimConfig(total_steps=steps).reference_tx(decay_mask(logical))
  opt_shapes = jax.eval_shape(tx.init, shapes)
  opt_specs = optax.tree_map_params(
    tx,
    lambda _, s: s,
    opt_shapes,
    param_specs,
    transform_non_params=lambda _: P(),
    is_leaf=lambda x: isinstance(x, P),
  )
  is_spec = lambda x: isinstance(x, P)
  state_sh = jax.tree.map(
    lambda s: NamedSharding(mesh, s), (param_specs, opt_specs), is_leaf=is_spec
  )
  batch_sh = NamedSharding(mesh, P(None, ("inter", "intra"), None))

  replicated = NamedSharding(mesh, P())

  def gather(subtree):
    # The FSDP recipe of the JAX docs and MaxText: weights stored sharded, constrained to
    # replicated where a layer uses them, so XLA all-gathers them per layer (and reduce-scatters
    # their gradients). Without it XLA:SPMD keeps the weights sharded along `embed` and shards
    # the activations instead: 18x GGG's inter-node bytes on tiny (strategies_smoke).
    return jax.tree.map(lambda w: lax.with_sharding_constraint(w, replicated), subtree)

  def init(rng):
    params = model.init(rng)
    return params, tx.init(params)

  def step(state, tokens_AxBxL1):
    params, opt_state = state

    def loss_fn(p, tokens_BxL1):
      pc = jax.tree.map(lambda w: w.astype(model.dtype), p)
      logits = model.apply(pc, tokens_BxL1[:, :-1], materialize=gather)
      return next_token_loss(logits, tokens_BxL1[:, 1:])

    def micro(acc, tokens_BxL1):
      loss, g = jax.value_and_grad(loss_fn)(params, tokens_BxL1)
      return jax.tree.map(jnp.add, acc, g), loss

    acc, losses = lax.scan(micro, jax.tree.map(jnp.zeros_like, params), tokens_AxBxL1)
    grads = jax.tree.map(lambda g: g / micro_batches, acc)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {"loss": jnp.mean(losses), "grad_norm": optax.global_norm(grads)}

  jstep = jax.jit(
    step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0
  )
  jinit = jax.jit(init, out_shardings=state_sh)
  return model, jinit, jstep, state_sh, batch_sh


def child_baseline(args) -> None:
  """One plain-jit baseline training run under the launcher; process 0 writes metrics.jsonl."""
  _setup_jax(args.mesh, (args.coordinator, args.num_processes, args.process_id))
  import jax
  import numpy as np

  from paro_jax.core.names import parse_mesh_shape
  from paro_jax.run.data import Batches, DataConfig, load_tokens, split_eval

  inter, intra = parse_mesh_shape(args.mesh)
  mesh = _auto_mesh(inter, intra)
  a = int(args.micro_batches)
  model, jinit, jstep, _, batch_sh = _baseline(
    args.kind, args.model, args.dtype, a, args.steps, mesh
  )
  tokens, _ = split_eval(load_tokens(DataConfig(), model.cfg.vocab), 0.01)
  batches = Batches(tokens, a, args.batch_size, args.seq_len, args.seed)
  shape = batches.shape
  rows = batches.process_rows(jax.process_index(), jax.process_count())

  def place(step):
    return jax.make_array_from_process_local_data(batch_sh, batches(step, rows), shape)

  state = jinit(jax.random.key(args.seed))
  main = jax.process_index() == 0
  os.makedirs(args.out, exist_ok=True)
  tokens_per_step = a * args.batch_size * args.seq_len
  last = time.perf_counter()
  with open(os.path.join(args.out, "metrics.jsonl") if main else os.devnull, "w") as log:

    def record(step, metrics):  # as paro_jax/run/train.py: read step s after s+1 is dispatched
      nonlocal last
      jax.block_until_ready(metrics)
      now = time.perf_counter()
      row = {
        "step": step,
        **{k: float(v) for k, v in metrics.items()},
        "step_time_s": now - last,
        "tokens_per_s": tokens_per_step / (now - last),
      }
      last = now
      log.write(json.dumps(row) + "\n")
      log.flush()
      if main:
        print(json.dumps(row), flush=True)

    pending = None
    for step in range(args.steps):
      state, metrics = jstep(state, place(step))
      if pending is not None:
        record(*pending)
      pending = (step + 1, metrics)
    record(*pending)
  del np


def child_calibrate(args) -> None:
  """FLOP/s of a virtual device: forward+backward of the per-device micro-batch, alone and with
  all 8 devices busy at once. Prints one JSON object."""
  _setup_jax(None, devices=args.devices)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from models.llama import Llama, get_config, next_token_loss
  from paro_jax.core.engine import DTYPES

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


def _hlo_traffic(hlo_text: str, n: int, intra: int) -> dict:
  from paro_jax.analysis import hlo

  per = {}
  for c in hlo.parse_collectives(hlo_text):
    for d, b in hlo.device_bytes(c, n).items():
      lvl = "inter" if hlo.crosses_groups(c, d, intra) else "intra"
      per.setdefault(d, {"inter": 0.0, "intra": 0.0})[lvl] += c.count * b
  return {
    "inter_bytes": max((v["inter"] for v in per.values()), default=0.0),
    "intra_bytes": max((v["intra"] for v in per.values()), default=0.0),
  }


def child_inspect(args) -> None:
  """Compile each configuration (abstract shapes, 1 process, 8 devices) and print its traffic
  and memory per device as one JSON object."""
  _setup_jax(args.mesh)
  import jax
  import jax.numpy as jnp

  from models.llama import Llama, LoraConfig, get_config
  from paro_jax.core.names import parse_mesh_shape
  from paro_jax.core.engine import DTYPES, Engine, OptimConfig
  from paro_jax.analysis.inspector import compile_step, report
  from paro_jax.core.compress import WireConfig
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.strategy import parse_strategy

  inter, intra = parse_mesh_shape(args.mesh)
  out = {}
  for name in args.names.split(","):
    for a in [int(x) for x in args.micro_batches.split(",")]:
      t = time.perf_counter()
      if name in BASELINES:
        mesh = _auto_mesh(inter, intra)
        model, jinit, jstep, state_sh, batch_sh = _baseline(
          name, args.model, args.dtype, a, 1000, mesh
        )
        shapes = jax.eval_shape(jinit, jax.random.key(0))
        state = jax.tree.map(
          lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_sh
        )
        batch = jax.ShapeDtypeStruct(
          (a, args.batch_size, args.seq_len + 1), jnp.int32, sharding=batch_sh
        )
        compiled = jstep.lower(state, batch).compile()
        mem = compiled.memory_analysis()
        state_bytes = sum(
          _shard_bytes(s, sh) for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(state_sh))
        )
        out[f"{name}/{a}"] = {
          "measured": _hlo_traffic(compiled.as_text(), inter * intra, intra),
          "expected": None,
          "model_states_bytes": state_bytes,
          "peak_bytes": (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
          ),
          "compile_s": time.perf_counter() - t,
        }
      else:
        lora = (
          LoraConfig(args.lora_rank, args.lora_alpha, args.lora_targets) if args.lora_rank else None
        )
        engine = Engine(
          Llama(get_config(args.model), DTYPES[args.dtype], lora=lora),
          parse_strategy(name),
          make_mesh(inter, intra),
          OptimConfig(),
          micro_batches=a,
          wire=WireConfig(args.inter_params, args.inter_grads, args.int8_block),
        )
        r = report(engine, compile_step(engine, args.batch_size, args.seq_len))
        out[f"{name}/{a}"] = {
          "measured": r["measured"],
          "expected": {k: r["expected"][k] for k in ("inter_bytes", "intra_bytes")},
          "model_states_bytes": r["memory"]["model_states"]["total"],
          "peak_bytes": r["memory"]["compiled"]["peak_bytes"],
          "notes": r["notes"],
          "compile_s": time.perf_counter() - t,
        }
      print(
        f"inspected {name} A={a}: {out[f'{name}/{a}']['compile_s']:.1f} s",
        file=sys.stderr,
        flush=True,
      )
  print("INSPECT " + json.dumps(out), flush=True)


def _shard_bytes(shape, sharding) -> int:
  local = sharding.shard_shape(shape.shape)
  size = 1
  for d in local:
    size *= d
  return size * shape.dtype.itemsize


# ------------------------------------------------------------------------------------------
# orchestrator (no jax here)
# ------------------------------------------------------------------------------------------
def _child_env(devices: int) -> dict:
  env = dict(os.environ)
  flags = [
    f
    for f in env.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  return env


def _run_child(argv: list[str], tag: str, log_path: str) -> dict:
  """Run `python SCRIPT --child ...` in a subprocess; parse its `TAG {json}` line."""
  t = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, SCRIPT, *argv],
    capture_output=True,
    text=True,
    env=_child_env(NODES * DEVICES_PER_NODE),
    cwd=ROOT,
  )
  with open(log_path, "a") as f:
    f.write(f"$ {shlex.join(argv)}\n{proc.stdout}\n{proc.stderr}\n")
  if proc.returncode:
    raise RuntimeError(
      f"child {argv[:2]} failed ({proc.returncode}); see {log_path}:\n{proc.stderr[-2000:]}"
    )
  line = next(line for line in proc.stdout.splitlines() if line.startswith(tag + " "))
  out = json.loads(line[len(tag) + 1 :])
  out["wall_s"] = time.perf_counter() - t
  return out


def _rate_text(bps: float) -> str:
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
      rate = _rate_text(want)
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


class _Monitor(threading.Thread):
  """Samples each node's tc byte counter whenever process 0 appends a step to metrics.jsonl.

  A line for step s appears when step s has finished (train.py reads it after dispatching s+1),
  so the counter delta between lines s-1 and s is step s's traffic (to within the 20 ms poll and
  whatever of step s+1 has started). Everything before line 1 (jax.distributed setup, state
  init, compilation, step 1) and after line K (checkpoint, shutdown) is left out.
  """

  def __init__(self, metrics_path: str, pid: int):
    super().__init__(daemon=True)
    self.path, self.pid = metrics_path, pid
    self.samples: dict[int, tuple[float, dict[int, int]]] = {}
    self.stop = threading.Event()

  def _counters(self) -> dict[int, int]:
    sent = {}
    for k in range(NODES):
      ns, dev = f"paro{self.pid}n{k}", f"pj{self.pid}v{k}"
      out = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
        capture_output=True,
        text=True,
      ).stdout
      m = re.search(r"Sent (\d+) bytes", out)
      if m:
        sent[k] = int(m.group(1))
    return sent

  def run(self) -> None:
    seen = 0
    while not self.stop.is_set():
      try:
        with open(self.path) as f:
          lines = sum(1 for line in f if line.strip())
      except OSError:
        lines = 0
      if lines > seen:
        self.samples[lines] = (time.perf_counter(), self._counters())
        seen = lines
      time.sleep(0.02)

  def per_step_bytes(self, skip: int) -> dict | None:
    """Mean bytes per step over steps skip+1..K, per node and summed."""
    steps = sorted(self.samples)
    if len(steps) < 2 or steps[-1] <= skip:
      return None
    first = max(s for s in steps if s <= max(skip, steps[0]))
    last = steps[-1]
    a, b = self.samples[first][1], self.samples[last][1]
    if not a or set(a) != set(b):
      return None
    per_node = {k: (b[k] - a[k]) / (last - first) for k in a}
    return {"per_node": per_node, "total": sum(per_node.values()), "steps": last - first}


def run_one(args, regime: dict, name: str, a: int, run_dir: str) -> dict:
  """One launch; its row is also kept in run_dir/row.json (`--resume` reuses it)."""
  row_path = os.path.join(run_dir, "row.json")
  if args.resume and os.path.exists(row_path):
    with open(row_path) as f:
      row = json.load(f)
    if not row.get("error") and row.get("rate") == regime["rate"]:
      row["resumed"] = True
      return row
  row = _launch_one(args, regime, name, a, run_dir)
  with open(row_path, "w") as f:
    json.dump(row, f, indent=2)
  return row


def _lora_flags(args) -> list[str]:
  return (
    [
      "--lora-rank",
      str(args.lora_rank),
      "--lora-alpha",
      str(args.lora_alpha),
      "--lora-targets",
      args.lora_targets,
    ]
    if args.lora_rank
    else []
  )


def _wire_flags(args) -> list[str]:
  """--inter-params/--inter-grads/--int8-block for train and the inspect child."""
  return [
    "--inter-params",
    args.inter_params,
    "--inter-grads",
    args.inter_grads,
    "--int8-block",
    str(args.int8_block),
  ]


def _launch_one(args, regime: dict, name: str, a: int, run_dir: str) -> dict:
  from paro_jax.cluster.launch import launch

  shutil.rmtree(run_dir, ignore_errors=True)
  os.makedirs(run_dir)
  common = [
    "--model",
    args.model,
    "--micro-batches",
    str(a),
    "--batch-size",
    str(args.batch_size),
    "--seq-len",
    str(args.seq_len),
    "--dtype",
    args.dtype,
    "--steps",
    str(args.steps),
    "--out",
    run_dir,
  ]
  if name in BASELINES:
    argv = ["python", SCRIPT, "--child", "baseline", "--kind", name, *common]
  else:
    argv = [
      "train",
      "--strategy",
      name,
      "--collectives",
      args.collectives,
      "--warmup",
      "1",
      *common,
      *_lora_flags(args),
      *_wire_flags(args),
    ]
  metrics_path = os.path.join(run_dir, "metrics.jsonl")
  mon = _Monitor(metrics_path, os.getpid())
  link: dict = {}
  t = time.perf_counter()
  with open(os.path.join(run_dir, "launch.log"), "w") as log:
    mon.start()
    try:
      code = launch(
        argv,
        nodes=NODES,
        devices_per_node=DEVICES_PER_NODE,
        inter_bandwidth=regime["rate"],
        inter_latency="0",
        stdout=log,
        stderr=log,
        link_bytes=link,
      )
    finally:
      mon.stop.set()
      mon.join()
  wall = time.perf_counter() - t
  # The final checkpoint train writes is not needed (small: ~300 MB a run).
  shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
  row = {
    "regime": regime["regime"],
    "rate": regime["rate"],
    "name": name,
    "micro_batches": a,
    "exit_code": code,
    "wall_s": wall,
    "command": argv,
  }
  if code:
    row["error"] = f"launch exited {code}; see {run_dir}/launch.log"
    return row
  with open(metrics_path) as f:
    metrics = [json.loads(line) for line in f if line.strip()]
  times = [m["step_time_s"] for m in metrics]
  kept = times[args.skip :] or times[-1:]
  tokens_per_step = a * args.batch_size * args.seq_len
  row.update(
    {
      "step_times_s": times,
      "first_step_s": times[0],
      "median_step_s": statistics.median(kept),
      "tokens_per_s": tokens_per_step / statistics.median(kept),
      "final_loss": metrics[-1]["loss"],
      "link_bytes_total_run": link,  # whole run per node: setup, compile, checkpoint included
      "wire_per_step": mon.per_step_bytes(args.skip),
    }
  )
  return row


def _mib(x):
  return None if x is None else x / 2**20


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def summarize(rows: list[dict], hlo: dict, regimes: list[dict]) -> list[dict]:
  """Add overhead (vs unshaped), throughput relative to GGG, HLO/formula bytes and memory."""
  ok = {(r["regime"], r["name"], r["micro_batches"]): r for r in rows if not r.get("error")}
  for r in ok.values():
    ref = ok.get((UNSHAPED, r["name"], r["micro_batches"]))
    r["comm_overhead"] = r["median_step_s"] / ref["median_step_s"] if ref else None
    g = ok.get((r["regime"], REFERENCE_STRATEGY, r["micro_batches"]))
    r["throughput_vs_ggg"] = r["tokens_per_s"] / g["tokens_per_s"] if g else None
    h = hlo.get(f"{r['name']}/{r['micro_batches']}", {})
    r["hlo_inter_bytes_per_device"] = h.get("measured", {}).get("inter_bytes")
    r["formula_inter_bytes_per_device"] = (h.get("expected") or {}).get("inter_bytes")
    r["model_states_bytes_per_device"] = h.get("model_states_bytes")
    r["compiled_peak_bytes_per_device"] = h.get("peak_bytes")
    w = r.get("wire_per_step")
    r["wire_bytes_per_step"] = w["total"] if w else None
  return rows


def markdown(rows: list[dict], regimes: list[dict], calib: dict, meta: dict) -> str:
  lines = [
    f"# PaRO strategies on an emulated {NODES}x{DEVICES_PER_NODE} cluster",
    "",
    f"`{meta['command']}`",
    "",
    f"Machine: {meta['machine']}; model {meta['model']}, batch {meta['batch_size']}x"
    f"{meta['seq_len']} per micro-batch, {meta['dtype']}, {meta['steps']} steps "
    f"(median of steps {meta['skip'] + 1}..{meta['steps']})"
    + (
      f"; LoRA mode: rank {meta['lora']['rank']} on {meta['lora']['targets']}, the base frozen"
      if meta.get("lora")
      else ""
    )
    + (
      f"; inter-node wire: params {w['params']}, grads {w['grads']} (int8 block {w['int8_block']})"
      if (w := meta.get("inter_wire")) and {w["params"], w["grads"]} != {"same"}
      else ""
    )
    + ".",
    "",
    f"Calibration: one virtual device alone "
    f"{calib['single_device']['flop_per_s'] / 1e9:.2f} GFLOP/s; with all "
    f"{NODES * DEVICES_PER_NODE} busy at once "
    f"{calib['effective_flop_per_s_per_device'] / 1e9:.2f} GFLOP/s each (used below).",
    "",
    "| regime | FLOP per inter-node byte | emulated link | stands for |",
    "|---|---:|---:|---|",
  ]
  for g in regimes:
    fpb = "-" if g["flop_per_byte"] is None else f"{g['flop_per_byte']:,.0f}"
    lines.append(f"| {g['regime']} | {fpb} | {g['rate']} | {g['what']} |")
  lines += ["", "Summary (shaped links):", "", *summary_markdown(rows)]
  lines += [
    "",
    "Per run: median step time, tokens/s, communication overhead (step time / the "
    "same run's on the unshaped link), throughput relative to GGG in the same regime "
    "and A, inter-node MiB per optimizer step on the wire (tc, both nodes' egress "
    "summed) beside the compiled HLO's and the formula's inter-node MiB per device "
    "(x4 devices = one node's share if every inter-level byte crossed the link), "
    "model states per device.",
    "",
    "| regime | strategy | A | step (s) | tokens/s | overhead | vs GGG | wire MiB/step "
    "| HLO inter MiB/dev | formula inter MiB/dev | model states MiB/dev | wall (s) |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if r.get("error"):
      lines.append(
        f"| {r['regime']} | {r['name']} | {r['micro_batches']} | failed: {r['error']} |||||||||"
      )
      continue
    lines.append(
      f"| {r['regime']} | {r['name']} | {r['micro_batches']} | {r['median_step_s']:.3f} | "
      f"{r['tokens_per_s']:.0f} | {_fmt(r['comm_overhead'], '.2f')} | "
      f"{_fmt(r['throughput_vs_ggg'], '.2f')} | {_fmt(_mib(r['wire_bytes_per_step']), '.2f')} | "
      f"{_fmt(_mib(r['hlo_inter_bytes_per_device']), '.2f')} | "
      f"{_fmt(_mib(r['formula_inter_bytes_per_device']), '.2f')} | "
      f"{_fmt(_mib(r['model_states_bytes_per_device']), '.2f')} | {r['wall_s']:.0f} |"
    )
  return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> list[dict]:
  """Per (shaped regime, A): the fastest strategy against ZeRO-3/2 and plain-jit partitioning."""
  good = [r for r in rows if not r.get("error") and r["regime"] != UNSHAPED]
  out = []
  for regime in dict.fromkeys(r["regime"] for r in good):
    for a in sorted({r["micro_batches"] for r in good if r["regime"] == regime}):
      here = {r["name"]: r for r in good if r["regime"] == regime and r["micro_batches"] == a}
      ours = {n: r for n, r in here.items() if n not in BASELINES}
      if not ours:
        continue
      best = max(ours.values(), key=lambda r: r["tokens_per_s"])
      speed = lambda name: here[name]["tokens_per_s"] if name in here else None
      ratio = lambda name: (best["tokens_per_s"] / speed(name)) if speed(name) else None
      jit = [n for n in BASELINES if n in here]
      best_jit = max(jit, key=speed) if jit else None
      out.append(
        {
          "regime": regime,
          "micro_batches": a,
          "best": best["name"],
          "best_tokens_per_s": best["tokens_per_s"],
          "vs_GGG": ratio("GGG"),
          "vs_NGG": ratio("NGG"),
          "best_jit": best_jit,
          "vs_best_jit": ratio(best_jit) if best_jit else None,
          "ranking": sorted(ours, key=lambda n: -ours[n]["tokens_per_s"]),
        }
      )
  return out


def _times(x) -> str:
  return "-" if x is None else f"{x:.2f}x"


def summary_markdown(rows: list[dict]) -> list[str]:
  lines = [
    "| regime | A | fastest strategy | tokens/s | vs GGG (ZeRO-3) | vs NGG (ZeRO-2) | vs best "
    "plain jit | order (fastest first) |",
    "|---|---:|---|---:|---:|---:|---:|---|",
  ]
  for x in summary(rows):
    jit = "-" if x["best_jit"] is None else f"{x['vs_best_jit']:.2f}x ({x['best_jit']})"
    lines.append(
      f"| {x['regime']} | {x['micro_batches']} | {x['best']} | "
      f"{x['best_tokens_per_s']:.0f} | {_times(x['vs_GGG'])} | {_times(x['vs_NGG'])} | "
      f"{jit} | {' '.join(x['ranking'])} |"
    )
  return lines


def plot(rows: list[dict], path: str) -> str | None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  good = [r for r in rows if not r.get("error") and r.get("throughput_vs_ggg") is not None]
  if not good:
    return None
  regimes = list(dict.fromkeys(r["regime"] for r in good))
  a_values = sorted({r["micro_batches"] for r in good})
  names = list(dict.fromkeys(r["name"] for r in good))
  # One row per A, one group of bars per configuration, one bar per regime.
  fig, axes = plt.subplots(
    len(a_values),
    1,
    figsize=(max(6, 0.25 * len(names) * len(regimes)), 3.6 * len(a_values)),
    squeeze=False,
  )
  width = 0.8 / len(regimes)
  for ax, a in zip(axes[:, 0], a_values):
    for i, reg in enumerate(regimes):
      ys = [
        next(
          (
            r["throughput_vs_ggg"]
            for r in good
            if r["regime"] == reg and r["name"] == n and r["micro_batches"] == a
          ),
          0.0,
        )
        for n in names
      ]
      ax.bar([j + i * width for j in range(len(names))], ys, width, label=reg)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(regimes) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=60, fontsize=8)
    ax.set_title(f"A={a}")
    ax.set_ylabel(f"throughput / {REFERENCE_STRATEGY}")
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)  # one plot per finished run: do not keep them all open
  return path


def estimate(
  args, rows: list[dict], calib: dict, calib_target: dict | None, inspect_wall: float, hlo: dict
) -> dict:
  """Wall time of the full grid (--estimate-model, 14 strategies + baselines, A in 1,4,8, every
  named regime + 1gbit + unshaped), from this run's measurements. A rough model:

    run wall = fixed x compile_scale + steps x step
    step     = A x compute + bytes per device (inter + intra) / bw_unshaped
               + one node's inter-node bytes / link rate          (no overlap)

  fixed: this run's median (wall - time of steps 2..K): launcher, jax.distributed, compile,
  teardown; compile_scale: ratio of the two models' single-device compile times; compute: the
  target model's calibrated forward+backward per micro-batch with 8 devices busy; bw_unshaped:
  fitted on this run's unshaped runs (their step minus compute, over their HLO bytes per device);
  bytes: the formula (paro_jax.analysis.costs) for strategies; for baselines this run's HLO figure
  scaled by the parameter ratio (or, absent, the formula of GGG / III).
  """
  from paro_jax.analysis.costs import step_traffic
  from paro_jax.core.strategy import VALID_NAMES, parse_strategy
  from models.llama import Llama, get_config

  good = [r for r in rows if not r.get("error")]
  ref = [r for r in good if r["regime"] == UNSHAPED]
  if not ref or calib_target is None:
    return {}
  fixed = statistics.median(r["wall_s"] - sum(r["step_times_s"][1:]) for r in good)
  per_call = calib["concurrent"]["seconds"]
  fits = []
  for r in ref:
    h = hlo.get(f"{r['name']}/{r['micro_batches']}")
    extra = r["median_step_s"] - per_call * r["micro_batches"]
    nbytes = h and h["measured"]["inter_bytes"] + h["measured"]["intra_bytes"]
    if nbytes and extra > 0:
      fits.append(nbytes / extra)
  bw = statistics.median(fits) if fits else float("inf")
  compile_scale = (
    calib_target["single_device"]["compile_and_first_s"]
    / calib["single_device"]["compile_and_first_s"]
  )
  tcfg = get_config(args.estimate_model)
  model = Llama(tcfg)
  psi, psi_here = tcfg.param_count(), calib["params"]
  itemsize = 4 if args.dtype == "fp32" else 2
  # Link rates for the target model's own calibration (rates scale with its FLOP/s).
  regs = regimes_table(
    ["infiniband", "paper_cloud", "commodity", "1gbit"],
    calib_target["effective_flop_per_s_per_device"],
    WIRE_ITEMSIZE,
  )
  names = list(VALID_NAMES) + list(BASELINES)
  steps = args.estimate_steps
  per_step = {}
  for name in names:
    for a in (1, 4, 8):
      h = hlo.get(f"{name}/{a}")
      if name in BASELINES and h:
        inter = h["measured"]["inter_bytes"] * psi / psi_here
        intra = h["measured"]["intra_bytes"] * psi / psi_here
      else:
        strat = parse_strategy({"jit-fsdp": "GGG", "jit-hsdp": "III"}.get(name, name))
        t = step_traffic(
          strat,
          psi,
          psi,
          NODES,
          DEVICES_PER_NODE,
          a,
          itemsize,
          itemsize,
          regathered=model.layer_param_count(),
        )
        inter, intra = t.inter, t.intra
      per_step[(name, a)] = (
        calib_target["concurrent"]["seconds"] * a + (inter + intra) / bw,
        inter * DEVICES_PER_NODE,
      )
  total, detail = 0.0, {}
  for g in regs:
    sub = sum(
      fixed * compile_scale + steps * (base + node_bytes / (g["rate_bps"] / 8))
      for base, node_bytes in per_step.values()
    )
    detail[g["regime"]] = {"rate": g["rate"], "hours": sub / 3600}
    total += sub
  return {
    "model": args.estimate_model,
    "steps_per_run": steps,
    "runs": len(regs) * len(per_step),
    "hours": total / 3600,
    "by_regime": detail,
    "inputs": {
      "fixed_s_per_run_measured": fixed,
      "compile_scale": compile_scale,
      "unshaped_bytes_per_s_fitted": bw,
      "target_compute_s_per_micro_batch": calib_target["concurrent"]["seconds"],
      "inspect_s_measured": inspect_wall,
      "inspect_s_per_config_measured": inspect_wall / max(1, len(hlo)),
    },
  }


def orchestrate(args) -> None:
  from paro_jax.core.strategy import VALID_NAMES

  if os.geteuid() != 0 or not shutil.which("tc"):
    print(
      "warning: not root or no tc: the launcher will run unshaped on loopback and no bytes "
      "will be counted",
      file=sys.stderr,
    )
  names = (
    [s.strip().upper() for s in args.strategies.split(",")]
    if args.strategies
    else list(VALID_NAMES)
  )
  bad = [n for n in names if n not in VALID_NAMES]
  if bad:
    raise SystemExit(f"unknown strategies {bad}; valid: {', '.join(VALID_NAMES)}")
  baselines = [b for b in args.baselines.split(",") if b] if args.baselines else []
  if bad := [b for b in baselines if b not in BASELINES]:
    raise SystemExit(f"unknown baselines {bad}; choose from {BASELINES}")
  if REFERENCE_STRATEGY not in names:
    print(
      f"note: {REFERENCE_STRATEGY} is not in --strategies: no throughput relative to it",
      file=sys.stderr,
    )
  a_values = [int(x) for x in args.micro_batches.split(",")]
  regime_names = [r for r in args.regimes.split(",") if r]
  os.makedirs(args.out, exist_ok=True)
  log_path = os.path.join(args.out, "children.log")
  if not args.resume:
    open(log_path, "w").close()
  t_start = time.perf_counter()

  import importlib.metadata as md

  meta = {
    "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, "
    f"python {platform.python_version()}, jax {md.version('jax')}",
    "nodes": NODES,
    "devices_per_node": DEVICES_PER_NODE,
    "model": args.model,
    "batch_size": args.batch_size,
    "seq_len": args.seq_len,
    "dtype": args.dtype,
    "steps": args.steps,
    "skip": args.skip,
    "collectives": args.collectives,
    "inter_wire": {
      "params": args.inter_params,
      "grads": args.inter_grads,
      "int8_block": args.int8_block,
    },
    "inter_latency": "not emulated (no netem on this kernel): rate only",
    "lora": (
      {"rank": args.lora_rank, "alpha": args.lora_alpha, "targets": args.lora_targets}
      if args.lora_rank
      else None
    ),
    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
  }

  def calibrate(model):
    return _run_child(
      [
        "--child",
        "calibrate",
        "--model",
        model,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--dtype",
        args.dtype,
        "--devices",
        str(NODES * DEVICES_PER_NODE),
      ],
      "CALIBRATION",
      log_path,
    )

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
    with open(calib_path, "w") as f:
      json.dump(calib, f, indent=2)
  else:
    print(f"calibrating {args.model} ...", flush=True)
    calib = calibrate(args.model)
    with open(calib_path, "w") as f:
      json.dump(calib, f, indent=2)
  eff = calib["effective_flop_per_s_per_device"]
  print(
    f"  one device alone {calib['single_device']['flop_per_s'] / 1e9:.2f} GFLOP/s; "
    f"{NODES * DEVICES_PER_NODE} at once {eff / 1e9:.2f} GFLOP/s each "
    f"(node {eff * DEVICES_PER_NODE / 1e9:.2f} GFLOP/s)",
    flush=True,
  )
  regimes = regimes_table(regime_names, eff, WIRE_ITEMSIZE)
  print(f"\n{'regime':14s}{'FLOP/byte':>12s}{'link rate':>12s}  stands for")
  for g in regimes:
    fpb = "-" if g["flop_per_byte"] is None else f"{g['flop_per_byte']:,.0f}"
    print(
      f"{g['regime']:14s}{fpb:>12s}{g['rate']:>12s}  {g['what']}"
      + ("  (clamped)" if g.get("clamped") else "")
    )

  print("\ncompiling every configuration for its HLO traffic ...", flush=True)
  all_names = names + baselines
  t = time.perf_counter()
  hlo_path = os.path.join(args.out, "hlo.json")
  hlo = {}
  if args.resume and os.path.exists(hlo_path):
    with open(hlo_path) as f:
      hlo = json.load(f)
  for a in a_values:
    missing = [n for n in all_names if f"{n}/{a}" not in hlo]
    if missing:
      got = _run_child(
        [
          "--child",
          "inspect",
          "--model",
          args.model,
          "--names",
          ",".join(missing),
          "--micro-batches",
          str(a),
          "--batch-size",
          str(args.batch_size),
          "--seq-len",
          str(args.seq_len),
          "--dtype",
          args.dtype,
          "--mesh",
          f"{NODES}x{DEVICES_PER_NODE}",
          *_lora_flags(args),
          *_wire_flags(args),
        ],
        "INSPECT",
        log_path,
      )
      got.pop("wall_s", None)
      hlo.update(got)
      with open(hlo_path, "w") as f:
        json.dump(hlo, f, indent=2)
  inspect_wall = time.perf_counter() - t

  def write(rows, est=None, calib_target=None):
    meta["wall_s"] = time.perf_counter() - t_start
    result = {
      "meta": meta,
      "calibration": calib,
      "estimate_calibration": calib_target,
      "regimes": regimes,
      "hlo": hlo,
      "runs": rows,
      "summary": summary(rows),
      "full_run_estimate": est or {},
    }
    with open(os.path.join(args.out, "strategies.json"), "w") as f:
      json.dump(result, f, indent=2)
    md_text = markdown(rows, regimes, calib, meta)
    with open(os.path.join(args.out, "strategies.md"), "w") as f:
      f.write(md_text)
    return md_text, plot(rows, os.path.join(args.out, "strategies.png"))

  rows = []
  for g in regimes:
    for name in all_names:
      for a in a_values:
        run_dir = os.path.join(args.out, "runs", g["regime"], f"{name}_A{a}")
        r = run_one(args, g, name, a, run_dir)
        rows.append(r)
        if r.get("error"):
          print(f"{g['regime']:12s} {name:9s} A={a}: FAILED ({r['error']})", flush=True)
        else:
          w = r["wire_per_step"]
          wire = "-" if not w else f"{w['total'] / 2**20:.2f} MiB"
          print(
            f"{g['regime']:12s} {name:9s} A={a}: step {r['median_step_s']:.3f} s, "
            f"{r['tokens_per_s']:.0f} tok/s, wire {wire}/step, "
            f"wall {r['wall_s']:.0f} s" + (" (resumed)" if r.get("resumed") else ""),
            flush=True,
          )
        write(summarize(rows, hlo, regimes))  # partial results survive an interrupted run
  summarize(rows, hlo, regimes)
  calib_target = calib
  if args.estimate_model and args.estimate_model != args.model:
    print(f"\ncalibrating {args.estimate_model} for the full-run estimate ...", flush=True)
    calib_target = calibrate(args.estimate_model)
  est = estimate(args, rows, calib, calib_target, inspect_wall, hlo) if args.estimate_model else {}
  if est:
    est["hours_inspect"] = (
      est["inputs"]["inspect_s_per_config_measured"]
      * 16
      * 3
      * calib_target["single_device"]["compile_and_first_s"]
      / calib["single_device"]["compile_and_first_s"]
    ) / 3600
  md_text, png = write(rows, est, calib_target)
  print("\n" + md_text)
  if est:
    print(
      f"full-run estimate ({est['model']}, {est['runs']} runs of {est['steps_per_run']} "
      f"steps): {est['hours']:.1f} h of runs + {est['hours_inspect']:.2f} h of HLO compiles; "
      + ", ".join(f"{k} ({v['rate']}) {v['hours']:.1f} h" for k, v in est["by_regime"].items())
    )
  print(
    f"wrote {args.out}/strategies.json, strategies.md"
    + (
      ", strategies.png" if png else " (no plot: matplotlib missing or no GGG run to compare with)"
    )
    + f" in {meta['wall_s']:.0f} s"
  )


def report_only(out: str) -> None:
  """Rewrite strategies.md and strategies.png from strategies.json (no runs)."""
  with open(os.path.join(out, "strategies.json")) as f:
    result = json.load(f)
  rows = summarize(result["runs"], result["hlo"], result["regimes"])
  result["summary"] = summary(rows)
  with open(os.path.join(out, "strategies.json"), "w") as f:
    json.dump(result, f, indent=2)
  md_text = markdown(rows, result["regimes"], result["calibration"], result["meta"])
  with open(os.path.join(out, "strategies.md"), "w") as f:
    f.write(md_text)
  plot(rows, os.path.join(out, "strategies.png"))
  print(md_text)


def main():
  from paro_jax.core.names import (  # imports no jax
    COLLECTIVE_IMPLS,
    DEFAULT_INT8_BLOCK,
    WIRE_FORMATS,
  )

  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="small")
  ap.add_argument("--strategies", default=None, help="comma-separated (default: all 14)")
  ap.add_argument(
    "--baselines",
    default=",".join(BASELINES),
    help=f"comma-separated subset of {BASELINES} ('' for none)",
  )
  ap.add_argument("--micro-batches", default="1,4,8", help="A values, comma-separated")
  ap.add_argument(
    "--regimes",
    default="infiniband,paper_cloud,commodity,1gbit",
    help=f"named ({', '.join(REGIMES)}) or fixed tc rates (e.g. 1gbit); the "
    f"unshaped reference is always run",
  )
  ap.add_argument(
    "--batch-size",
    type=int,
    default=32,
    help="global micro-batch in sequences (default 32 x 512: 2,048 tokens per device "
    "and micro-batch, as one 2,048-token sequence per GPU in the papers)",
  )
  ap.add_argument("--seq-len", type=int, default=512)
  ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
  ap.add_argument("--collectives", default="xla", choices=COLLECTIVE_IMPLS)
  ap.add_argument(
    "--inter-params",
    default="same",
    choices=WIRE_FORMATS,
    help="wire precision of the parameter gathers across nodes (strategies only)",
  )
  ap.add_argument(
    "--inter-grads",
    default="same",
    choices=WIRE_FORMATS,
    help="wire precision of the gradient reductions across nodes (strategies only)",
  )
  ap.add_argument("--int8-block", type=int, default=DEFAULT_INT8_BLOCK)
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument(
    "--skip",
    type=int,
    default=1,
    help="leading steps left out of medians and byte counts (compilation)",
  )
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="experiments/results/strategies")
  ap.add_argument(
    "--lora-rank",
    type=int,
    default=0,
    help="LoRA mode: train adapters of this rank only (baselines are full training: "
    "pass --baselines '')",
  )
  ap.add_argument("--lora-alpha", type=float, default=16.0)
  ap.add_argument("--lora-targets", default="wq,wk,wv,wo,w_gate,w_up,w_down")
  ap.add_argument(
    "--calibration",
    default=None,
    metavar="JSON",
    help="reuse another run's calibration.json (the same link rates), e.g. the "
    "full-training benchmark's for the LoRA mode",
  )
  ap.add_argument(
    "--report",
    action="store_true",
    help="only rewrite --out's strategies.md and .png from its strategies.json",
  )
  ap.add_argument(
    "--resume",
    action="store_true",
    help="reuse the runs already in --out (runs/REGIME/NAME_A*/row.json) whose link "
    "rate is unchanged; run only the missing ones",
  )
  ap.add_argument(
    "--estimate-model",
    default="small",
    help="model of the full-run time estimate printed at the end ('' for none)",
  )
  ap.add_argument("--estimate-steps", type=int, default=6)
  # hidden: subprocess modes
  ap.add_argument(
    "--child", default=None, choices=["calibrate", "inspect", "baseline"], help=argparse.SUPPRESS
  )
  ap.add_argument("--kind", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--names", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--devices", type=int, default=NODES * DEVICES_PER_NODE, help=argparse.SUPPRESS)
  ap.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
  ap.add_argument("--mesh", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--num-processes", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child == "calibrate":
    child_calibrate(args)
  elif args.child == "inspect":
    child_inspect(args)
  elif args.child == "baseline":
    child_baseline(args)
  elif args.report:
    report_only(args.out)
  else:
    if args.skip >= args.steps:
      ap.error(f"--skip {args.skip} must be below --steps {args.steps}")
    orchestrate(args)


if __name__ == "__main__":
  main()
