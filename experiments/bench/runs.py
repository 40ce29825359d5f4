"""One configuration, one regime, one A: a real training run on the emulated cluster, as a row.

`paro_jax.cluster.launch.launch` starts one process per node (2 nodes x 4 virtual CPU devices),
each in its own network namespace, joined by a veth pair whose egress tc shapes to the regime's
rate. A PaRO strategy runs `paro-jax train`, a plain-jit baseline the `--child baseline` of
experiments/bench/baselines.py; a torch peer plugs in at `torch_row`. From the run's
metrics.jsonl (written by process 0): median step time after `--skip`, tokens/s, and the
inter-node bytes per step `WireMonitor` reads off tc while it runs.

The row format (strategies.json "runs"; experiments/bench/report.py adds the comparisons):
regime, rate, name, kind, label, collectives, micro_batches, exit_code, wall_s, command; then
either error, or step_times_s, first_step_s, median_step_s, tokens_per_s, final_loss,
link_bytes_total_run and wire_per_step. Each row is kept in runs/REGIME/LABEL_A*/row.json,
which `--resume` reuses while the link rate is unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time

from experiments.bench.child import ENTRY, batch_flags
from experiments.bench.configs import DEVICES_PER_NODE, NODES, Config, label_of


class WireMonitor(threading.Thread):
  """Samples each node's tc byte counter whenever process 0 appends a step to metrics.jsonl.

  A line for step s appears when step s has finished (train.py reads it after dispatching s+1),
  so the counter delta between lines s-1 and s is step s's traffic (to within the 20 ms poll and
  whatever of step s+1 has started). Everything before line 1 (jax.distributed setup, state
  init, compilation, step 1) and after line K (checkpoint, shutdown) is left out. `tag` is the
  launcher's PID (the launch runs in this process): the launcher names its namespaces by it.
  """

  def __init__(self, metrics_path: str, tag: int, nodes: int = NODES):
    super().__init__(daemon=True)
    self.path, self.tag, self.nodes = metrics_path, tag, nodes
    self.samples: dict[int, tuple[float, dict[int, int]]] = {}
    self.stop = threading.Event()

  def _counters(self) -> dict[int, int]:
    from paro_jax.cluster.netns import sent_bytes

    sent = {}
    for k in range(self.nodes):
      if (nbytes := sent_bytes(self.tag, k)) is not None:
        sent[k] = nbytes
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


def run_dir(out: str, regime: dict, config: Config, a: int) -> str:
  """runs/REGIME/LABEL_A{a} under --out ("/" of a label becomes "@": GGG@horing_A1)."""
  return os.path.join(out, "runs", regime["regime"], f"{config.label.replace('/', '@')}_A{a}")


def run_one(args, regime: dict, config: Config, a: int, directory: str) -> dict:
  """One run's row, also kept in directory/row.json (`--resume` reuses it)."""
  row_path = os.path.join(directory, "row.json")
  if args.resume and os.path.exists(row_path):
    with open(row_path) as f:
      row = json.load(f)
    same = (
      label_of(row) == config.label
      and row.get("collectives", config.collectives) == config.collectives
      and row.get("remat", "full") == args.remat
    )
    if not row.get("error") and row.get("rate") == regime["rate"] and same:
      row["resumed"] = True
      return row
  if config.kind == "torch":
    row = torch_row(args, regime, config, a, directory)
  else:
    row = launch_row(args, regime, config, a, directory, command(args, config, a, directory))
  row["remat"] = args.remat
  with open(row_path, "w") as f:
    json.dump(row, f, indent=2)
  return row


def torch_row(args, regime: dict, config: Config, a: int, directory: str) -> dict:
  """The row of a torch peer (kind "torch"): experiments/bench/torch_peer.py launched as the
  strategies are, with the same model, batches and steps; its ranks' model-state bytes (from
  peer.json) as the row's model states per device (the largest rank's)."""
  argv = [
    "python",
    "-m",
    "experiments.bench.torch_peer",
    "--peer",
    config.name,
    *common_flags(args, a, directory),
  ]
  row = launch_row(args, regime, config, a, directory, argv)
  peer_path = os.path.join(directory, "peer.json")
  if not row.get("error") and os.path.exists(peer_path):
    with open(peer_path) as f:
      peer = json.load(f)
    row["torch"] = peer["torch"]
    row["model_states_bytes"] = max(s["total"] for s in peer["state_bytes"])
  return row


def lora_flags(args) -> list[str]:
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


def wire_flags(args) -> list[str]:
  """--inter-params/--inter-grads/--int8-block for train and the inspect child."""
  return [
    "--inter-params",
    args.inter_params,
    "--inter-grads",
    args.inter_grads,
    "--int8-block",
    str(args.int8_block),
  ]


def command(args, config: Config, a: int, directory: str) -> list[str]:
  """The per-node command the launcher runs for a "paro" or "jit" configuration."""
  if config.kind not in ("paro", "jit"):
    raise ValueError(f"no command for a {config.kind!r} configuration here: see torch_row")
  common = common_flags(args, a, directory)
  if config.kind == "jit":
    return ["python", ENTRY, "--child", "baseline", "--kind", config.name, *common]
  return [
    "train",
    "--strategy",
    config.name,
    "--collectives",
    config.collectives,
    "--warmup",
    "1",
    *common,
    *lora_flags(args),
    *wire_flags(args),
  ]


def common_flags(args, a: int, directory: str) -> list[str]:
  """Model, batch, dtype, remat, steps and output directory: what every configuration's command
  takes (the torch peers' too)."""
  return [
    "--model",
    args.model,
    "--micro-batches",
    str(a),
    *batch_flags(args),
    "--steps",
    str(args.steps),
    "--out",
    directory,
  ]


def launch_row(args, regime: dict, config: Config, a: int, directory: str, argv: list) -> dict:
  """Launch `argv` on the emulated cluster at the regime's rate, watching the wire; its row."""
  from paro_jax.cluster.launch import launch

  shutil.rmtree(directory, ignore_errors=True)
  os.makedirs(directory)
  metrics_path = os.path.join(directory, "metrics.jsonl")
  mon = WireMonitor(metrics_path, os.getpid())
  link: dict = {}
  t = time.perf_counter()
  with open(os.path.join(directory, "launch.log"), "w") as log:
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
  shutil.rmtree(os.path.join(directory, "checkpoints"), ignore_errors=True)
  row = {
    "regime": regime["regime"],
    "rate": regime["rate"],
    "name": config.name,
    "kind": config.kind,
    "label": config.label,
    "collectives": config.collectives,
    "micro_batches": a,
    "exit_code": code,
    "wall_s": wall,
    "command": argv,
  }
  if code:
    row["error"] = f"launch exited {code}; see {directory}/launch.log"
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


def progress_line(row: dict) -> str:
  """What the orchestrator prints after each run."""
  head = f"{row['regime']:12s} {label_of(row):9s} A={row['micro_batches']}"
  if row.get("error"):
    return f"{head}: FAILED ({row['error']})"
  w = row["wire_per_step"]
  wire = "-" if not w else f"{w['total'] / 2**20:.2f} MiB"
  return (
    f"{head}: step {row['median_step_s']:.3f} s, {row['tokens_per_s']:.0f} tok/s, wire "
    f"{wire}/step, wall {row['wall_s']:.0f} s" + (" (resumed)" if row.get("resumed") else "")
  )
