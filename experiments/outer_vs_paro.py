"""PaRO against DiLoCo on the emulated two-level cluster: tokens/s, inter-node bytes per step and
eval loss at equal tokens.

Every configuration trains the same model on the same batches for the same steps, launched as
the strategy benchmark launches a run (paro_jax/cluster/launch.py: 2 nodes x 4 virtual CPU
devices, each node in its own network namespace behind a veth whose egress tc shapes to
`--rate`; loopback, unshaped, where this is not root). The configurations:

- IIG, the synchronous step (uncompressed, and with int8 parameters and gradients);
- DiLoCo (`--outer-sync H`, core/outer.py) with III as each node's step, H = 10 and 50, the
  pseudo-gradient in bf16 and int8;
- the bound: the same III group step with no round's end in the run (H past the last step), so
  nothing but the groups' few metrics floats crosses the link: the tokens/s no schedule of the
  outer loop can beat. Its eval loss is not a result (eval reads the outer weights, which never
  moved).

From each run: its steps' times (metrics.jsonl), the bytes each node sent over the link between
consecutive metrics lines (tc's counter, experiments/bench/runs.py WireMonitor), and the eval loss
after the last step. Timing and bytes are taken over steps 2..K-1 (step 1 compiles; step K also
evaluates); tokens/s is the tokens of those steps over their summed time (a mean, not a median:
a round's end is one step in H). Writes OUT/outer_vs_paro.json and OUT/README.md.

    python -m experiments.outer_vs_paro --out experiments/results/outer_vs_paro
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.bench.runs import WireMonitor  # noqa: E402
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402

NODES, DEVICES_PER_NODE = 2, 4
BOUND = "bound"


def configurations(steps: int, seeds: int) -> list[dict]:
  """(label, kind, H, wire, seed, train flags) of every run."""
  out = []
  for seed in range(seeds):
    out.append(
      dict(
        label=f"IIG seed{seed}" if seed else "IIG",
        kind="sync",
        h=None,
        wire="fp32",
        seed=seed,
        flags=["--strategy", "IIG"],
      )
    )
  out.append(
    dict(
      label="IIG int8",
      kind="sync",
      h=None,
      wire="int8",
      seed=0,
      flags=["--strategy", "IIG", "--inter-params", "int8", "--inter-grads", "int8"],
    )
  )
  for h in (10, 50):
    for wire in ("bf16", "int8"):
      out.append(
        dict(
          label=f"DiLoCo H={h} {wire}",
          kind="diloco",
          h=h,
          wire=wire,
          seed=0,
          flags=["--strategy", "III", "--outer-sync", str(h), "--inter-grads", wire],
        )
      )
  # no round ends in the run: the group step alone (its wire format never used)
  out.append(
    dict(
      label=BOUND,
      kind=BOUND,
      h=None,
      wire="-",
      seed=0,
      flags=["--strategy", "III", "--outer-sync", str(10 * steps)],
    )
  )
  return out


def train_argv(args, config: dict, directory: str) -> list[str]:
  return [
    "train", *config["flags"], "--model", args.model, "--steps", str(args.steps),
    "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--dtype", args.dtype,
    "--collectives", "auto", "--seed", str(config["seed"]), "--eval-every", str(args.steps),
    "--eval-batches", str(args.eval_batches), "--no-tensorboard",
    "--out", directory,
  ]  # fmt: skip


def run(args, config: dict, directory: str) -> dict:
  """Launch one configuration on the emulated cluster; its row (kept in directory/row.json)."""
  from paro_jax.cluster.launch import launch

  row_path = os.path.join(directory, "row.json")
  if args.resume and os.path.exists(row_path):
    with open(row_path) as f:
      row = json.load(f)
    if row.get("command") == train_argv(args, config, directory) and not row.get("error"):
      return {**row, **config}  # what the script derives (the planner's bytes) as it is now
  shutil.rmtree(directory, ignore_errors=True)
  os.makedirs(directory)
  argv = train_argv(args, config, directory)
  metrics_path = os.path.join(directory, "metrics.jsonl")
  monitor = WireMonitor(metrics_path, os.getpid(), NODES)
  start = time.perf_counter()
  with open(os.path.join(directory, "launch.log"), "w") as log:
    monitor.start()
    try:
      code = launch(
        argv, nodes=NODES, devices_per_node=DEVICES_PER_NODE, inter_bandwidth=args.rate,
        inter_latency="0", stdout=log, stderr=log, shaped=not args.loopback,
      )  # fmt: skip
    finally:
      monitor.stop.set()
      monitor.join()
  row = {**config, "command": argv, "exit_code": code, "wall_s": time.perf_counter() - start}
  if code:
    row["error"] = f"launch exited {code}; see {directory}/launch.log"
  else:
    with open(metrics_path) as f:
      metrics = [json.loads(line) for line in f if line.strip()]
    row.update(measured(args, metrics, monitor.samples))
  shutil.rmtree(os.path.join(directory, "checkpoints"), ignore_errors=True)
  with open(row_path, "w") as f:
    json.dump(row, f, indent=1)
  return row


def measured(args, metrics: list[dict], samples: dict) -> dict:
  """Timing, bytes and losses of one run from its metrics rows and the monitor's samples
  ({metrics lines: (time, {node: tc bytes sent})})."""
  k = len(metrics)
  window = range(2, k)  # steps 2..K-1: after the compile, before the eval
  times = [metrics[s - 1]["step_time_s"] for s in window]
  tokens = args.batch_size * args.seq_len
  # the bytes of step s: both nodes' counters between metrics lines s-1 and s
  sent = {}
  for s in window:
    if s - 1 in samples and s in samples:
      a, b = samples[s - 1][1], samples[s][1]
      if a and set(a) == set(b):
        sent[s] = sum(b[n] - a[n] for n in a)
  return {
    "steps": k,
    "window": [window.start, window.stop - 1],
    "step_times_s": times,
    "tokens_per_s": tokens * len(times) / sum(times),
    "bytes_per_step": {str(s): v for s, v in sent.items()},
    "inter_bytes_per_step": sum(sent.values()) / len(sent) if sent else None,
    "final_loss": metrics[-1]["loss"],
    "eval_loss": metrics[-1].get("eval_loss"),
  }


def planned_bytes(args, config: dict) -> float:
  """The planner's inter-node bytes per step of `config`, both nodes' egress (its per-device
  figure x the 8 devices: analysis/planner/step_model.py, the round's 1/H share for DiLoCo)."""
  from models.config import get_config
  from paro_jax.analysis.planner import inputs, step_model
  from paro_jax.core.strategy import parse_strategy
  from paro_jax.core.wire import WireConfig

  if config["kind"] == BOUND:  # no round ends in the run
    return 0.0
  flags = config["flags"]
  wire = WireConfig(
    params="int8" if "--inter-params" in flags else "same",
    grads=flags[flags.index("--inter-grads") + 1] if "--inter-grads" in flags else "same",
  )
  h = int(flags[flags.index("--outer-sync") + 1]) if "--outer-sync" in flags else None
  itemsize = 4 if args.dtype == "fp32" else 2
  devices = NODES * DEVICES_PER_NODE
  w = inputs.Workload(
    get_config(args.model), args.batch_size // devices, 1, args.seq_len, itemsize=itemsize,
    wire=wire, outer_sync=h,
  )  # fmt: skip
  cluster = inputs.Cluster(NODES, DEVICES_PER_NODE, inputs.Links(1e9, 1e9), None)
  e = step_model.predict(parse_strategy(flags[1]), w, cluster)
  return e.traffic["inter_bytes"] * devices


def table(rows: list[dict]) -> list[str]:
  """The page's table: one line per run (the test reads it back against the JSON)."""
  sync = next(r for r in rows if r["label"] == "IIG")
  bound = next(r for r in rows if r["label"] == BOUND)
  lines = [
    "| run | H | wire | tokens/s | vs bound | inter-node MB/step | planned MB/step "
    "| eval loss | vs IIG |",
    "|---|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if r.get("error"):
      lines.append(f"| {r['label']} | | | failed: {r['error']} | | | | | |")
      continue
    loss = r["eval_loss"] if r["kind"] != BOUND else None
    lines.append(
      f"| {r['label']} | {r['h'] or '-'} | {r['wire']} | {r['tokens_per_s']:.0f} | "
      f"{r['tokens_per_s'] / bound['tokens_per_s']:.3f} | {r['inter_bytes_per_step'] / 1e6:.3f} | "
      f"{r['planned_bytes_per_step'] / 1e6:.3f} | "
      + ("-" if loss is None else f"{loss:.4f}")
      + " | "
      + ("-" if loss is None else f"{loss / sync['eval_loss'] - 1:+.2%}")
      + " |"
    )
  return lines


def cut(args) -> str:
  """What the measurement leaves out of the full comparison."""
  runs = f"only {args.only.replace(',', ', ')}" if args.only else "every configuration"
  return (
    "What the measurement leaves out of the full comparison, for the time two shared cores "
    "allow (a run takes 3-4 minutes here): `tiny` (1.05M parameters) instead of `small` (25M: "
    f"about 25x the compute per step); {runs}; {args.seeds} seed(s) for IIG and one for every "
    "other run; H = 100, the 4-bit pseudo-gradient, Streaming DiLoCo, the 4 x 2 mesh and "
    "torch's configurations are not run; 101 steps, so H = 50 is two rounds."
  )


READING = (
  "Reading the table. The bytes: a DiLoCo step sends only the groups' metrics floats and the "
  "launcher's heartbeats (the bound's ~8 kB) except at a round's end, which sends the whole "
  "round (the JSON's `bytes_per_step` has every step's); measured is above planned by the "
  "reduce-scatters, which XLA:CPU through gloo runs as an all-reduce and a slice "
  "(docs/multinode.md: twice the reduce-scatter's bytes; the planner prices the collective a "
  "GPU runs), and by TCP/IP's headers (~7%). The eval loss: DiLoCo's is of the outer weights "
  "after the last round (step 100), each group having trained on half of every batch; the "
  "bound's is of the initial weights (no round ended) and is no result. The speed: the two IIG "
  "seeds do the same work, so their tokens/s apart is how much the machine's other load moves "
  "a run; differences within it are not resolved (between rounds DiLoCo's step is the bound's, "
  "so a DiLoCo run above the bound is such a difference)."
)


def goals(rows: list[dict]) -> list[str]:
  """The goals, each stated met or not by the rows: DiLoCo's tokens/s within 10% of the bound,
  its eval loss within 2% of the synchronous run's; the seed and timing scatter beside them."""
  by = {r["label"]: r for r in rows if not r.get("error")}
  bound, sync = by.get(BOUND), by.get("IIG")
  lines = []
  for r in rows:
    if r["kind"] != "diloco" or r.get("error"):
      continue
    parts = []
    if bound:
      ratio = r["tokens_per_s"] / bound["tokens_per_s"]
      parts.append(
        f"tokens/s {ratio:.2f} of the bound: {'met' if ratio >= 0.9 else 'NOT met'} (>= 0.90)"
      )
    if sync:
      gap = r["eval_loss"] / sync["eval_loss"] - 1
      parts.append(
        f"eval loss {gap:+.1%} against IIG: {'met' if abs(gap) <= 0.02 else 'NOT met'} (within 2%)"
      )
    lines.append(f"- {r['label']}: " + "; ".join(parts))
  seeds = [r for r in rows if r["label"].startswith("IIG seed") and not r.get("error")]
  if sync and seeds:
    loss = ", ".join(f"{r['eval_loss'] / sync['eval_loss'] - 1:+.1%}" for r in seeds)
    speed = ", ".join(f"{r['tokens_per_s'] / sync['tokens_per_s'] - 1:+.0%}" for r in seeds)
    lines.append(
      f"- the scatter to judge them by: IIG with another seed is {loss} in eval loss, and its "
      f"tokens/s (the same work) {speed}: the machine's other load moves a run's speed that much"
    )
  return lines


def page(args, record: dict) -> str:
  rows = record["runs"]
  link = (
    "loopback, not shaped" if args.loopback else f"each node's link shaped to {args.rate} by tc"
  )
  first, last = next((r["window"] for r in rows if "window" in r), ("?", "?"))
  return "\n".join(
    [
      "# PaRO against DiLoCo on the emulated two-level cluster",
      "",
      f"    {record['command']}",
      "",
      f"Measured {record['date']} on {record['machine']}; {NODES} nodes x {DEVICES_PER_NODE} "
      f"virtual CPU devices ({link}); `{args.model}`, batch {args.batch_size} x {args.seq_len}, "
      f"{args.dtype}, A=1, {args.steps} steps for every run (equal tokens), lr 3e-3 with 10 "
      f"warm-up steps and cosine decay, `--collectives auto`; DiLoCo with III as each node's "
      f"step, outer lr 0.7, Nesterov momentum 0.9. Eval loss after the last step over "
      f"{args.eval_batches} held-out batches (DiLoCo: of the outer weights). Timing and bytes "
      f"over steps {first}..{last} (step 1 compiles, the last also evaluates); tokens/s is "
      f"their tokens over their summed time; inter-node MB/step is both nodes' egress counted "
      f"by tc, per step; planned MB/step is the planner's per-device figure x 8 "
      f"(`analysis/planner/step_model.py`). Every run's row, with each step's time and bytes, "
      f"is in `outer_vs_paro.json` (the logs under `runs/` are not kept in git).",
      "",
      cut(args),
      "",
      *table(rows),
      "",
      READING,
      "",
      "## The goals",
      "",
      *goals(rows),
      "",
    ]
  )


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="tiny")
  ap.add_argument("--steps", type=int, default=101)
  ap.add_argument("--batch-size", type=int, default=16)
  ap.add_argument("--seq-len", type=int, default=64)
  ap.add_argument("--dtype", default="fp32")
  ap.add_argument("--eval-batches", type=int, default=8)
  ap.add_argument("--seeds", type=int, default=1, help="seeds of the synchronous IIG run")
  ap.add_argument("--rate", default="100mbit", help="tc rate of each node's link")
  ap.add_argument("--loopback", action="store_true", help="no namespaces, no shaping")
  ap.add_argument("--only", default=None, help="comma-separated labels to run")
  ap.add_argument("--resume", action="store_true", help="reuse runs whose command is unchanged")
  ap.add_argument("--out", default="experiments/results/outer_vs_paro")
  args = ap.parse_args(argv)
  if not args.loopback and os.geteuid() != 0:
    print("not root: the link cannot be shaped; running on loopback", flush=True)
    args.loopback = True
  configs = configurations(args.steps, args.seeds)
  if args.only:
    keep = set(args.only.split(","))
    configs = [c for c in configs if c["label"] in keep]
  rows = []
  for config in configs:
    config = {**config, "planned_bytes_per_step": planned_bytes(args, config)}
    directory = os.path.join(args.out, "runs", config["label"].replace(" ", "_").replace("=", ""))
    row = run(args, config, directory)
    rows.append(row)
    print(json.dumps({k: row.get(k) for k in ("label", "tokens_per_s", "inter_bytes_per_step",
                                               "eval_loss", "error")}), flush=True)  # fmt: skip
  record = {
    "command": shlex.join(["python", "-m", "experiments.outer_vs_paro", *(argv or sys.argv[1:])]),
    "date": utc_now(),
    "machine": machine_line(),
    "settings": {k: v for k, v in vars(args).items() if k not in ("out", "resume")},
    "runs": rows,
  }
  write_page(args.out, record, "outer_vs_paro.json", page(args, record), "README.md")


if __name__ == "__main__":
  main()
