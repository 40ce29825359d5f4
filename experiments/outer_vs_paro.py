"""PaRO against DiLoCo on the emulated two-level cluster: tokens/s, inter-node bytes per step and
eval loss at equal tokens.

Every configuration trains the same model on the same batches for the same steps, launched as
the strategy benchmark launches a run (paro_jax/cluster/launch.py: 2 nodes x 4 virtual CPU
devices, each node in its own network namespace behind a veth whose egress tc shapes to
`--rate`; loopback, unshaped, where this is not root). The configurations:

- IIG, the synchronous step (uncompressed, and with int8 parameters and gradients);
- DiLoCo (`--outer-sync H`, core/outer.py) with III as each node's step, H = 10, 50 and 100, the
  pseudo-gradient in bf16, int8 and int4; with the outer state at I (`--outer-state I`: the round
  all-reduces the int8 pseudo-gradient), H = 10, 50 and 100;
- Streaming DiLoCo (`--outer-fragments 4 --outer-delay 1`, core/fragments.py), H = 20, int8, I;
- torch HSDP, the fastest torch configuration of the strategy benchmark at A = 1 on slow links
  (experiments/bench/torch_peer.py `--peer hsdp`: FSDP2 sharded within a node, gradients
  all-reduced across nodes each step), with `train`'s optimizer and schedule and the same eval;
  needs the [bench] extra (torch), else its row says so;
- the bound: the same III group step with no round's end in the run (H past the last step), so
  nothing but the groups' few metrics floats crosses the link: the tokens/s no schedule of the
  outer loop can beat. Its eval loss is not a result (eval reads the outer weights, which never
  moved).

From each run: its steps' times (metrics.jsonl), the bytes each node sent over the link between
consecutive metrics lines (tc's counter, experiments/bench/runs.py WireMonitor), and the eval loss
after the last step. Timing and bytes are taken over steps 2..K-1 (step 1 compiles; step K also
evaluates); tokens/s is the tokens of those steps over their summed time (a mean, not a median:
a round's end is one step in H). `--seeds N` runs every configuration at seeds 0..N-1 (seed k > 0
labelled `<label> seedk`); the page (experiments/outer_vs_paro_page.py) reads each configuration's
means over its seeds. Writes OUT/outer_vs_paro.json and OUT/README.md; `--only` runs the
configurations (each at every seed) or the single runs it names and keeps the other rows of OUT's
earlier JSON; `--resume` reuses a run whose command is unchanged (its runs/ folder's row, else
its row in OUT's JSON).

    python -m experiments.outer_vs_paro --out experiments/results/outer_vs_paro
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import shutil
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.bench.runs import WireMonitor  # noqa: E402
from experiments.outer_vs_paro_page import (  # noqa: E402
  BOUND,
  READING,
  configuration,
  goals,
  seeds_left_out,
  table,
)
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402

MESH = "2x4"  # nodes x devices per node, as the page's runs before --mesh were
NOT_SETTINGS = ("out", "resume", "render")  # flags of the command, not of the runs it measures


def mesh(args) -> tuple[int, int]:
  """(nodes, devices per node) of --mesh."""
  nodes, per_node = (int(x) for x in args.mesh.split("x"))
  return nodes, per_node


STREAMING = "Streaming DiLoCo"
TORCH = "torch HSDP"


def configurations(steps: int, seeds: int) -> list[dict]:
  """Every run: each configuration at seeds 0..seeds-1, seed 0 under the configuration's label,
  seed k > 0 under `<label> seedk`, the seeds of one configuration side by side."""
  return [
    {**c, "label": f"{c['label']} seed{seed}" if seed else c["label"], "seed": seed}
    for c in _configurations(steps)
    for seed in range(seeds)
  ]


def selected(configs: list[dict], only: str | None) -> list[dict]:
  """The runs `--only` names, each by its own label or by its configuration's (every seed)."""
  if not only:
    return configs
  names = set(only.split(","))
  unknown = names - {c["label"] for c in configs} - {configuration(c) for c in configs}
  if unknown:
    raise SystemExit(
      f"--only names no configuration: {', '.join(sorted(unknown))}; the labels are "
      f"{', '.join(dict.fromkeys(configuration(c) for c in configs))}"
    )
  return [c for c in configs if c["label"] in names or configuration(c) in names]


def _configurations(steps: int) -> list[dict]:
  """(label, kind, H, wire, train flags; Streaming's fragments F) of every configuration."""
  out = [
    dict(label="IIG", kind="sync", h=None, wire="fp32", flags=["--strategy", "IIG"]),
    dict(
      label="IIG int8",
      kind="sync",
      h=None,
      wire="int8",
      flags=["--strategy", "IIG", "--inter-params", "int8", "--inter-grads", "int8"],
    ),
  ]
  for h in (10, 50, 100):
    for wire in ("bf16", "int8", "int4"):
      out.append(
        dict(
          label=f"DiLoCo H={h} {wire}",
          kind="diloco",
          h=h,
          wire=wire,
          flags=["--strategy", "III", "--outer-sync", str(h), "--inter-grads", wire],
        )
      )
  # the round as an all-reduce of the pseudo-gradient (--outer-state I); Streaming DiLoCo (F = 4
  # fragments synced H/F steps apart, each exchange during the step after); H = 100
  at_i, streaming = ["--outer-state", "I"], ["--outer-fragments", "4", "--outer-delay", "1"]
  for label, h, wire, extra in (
    ("DiLoCo H=10 int8 I", 10, "int8", at_i),
    ("DiLoCo H=50 int8 I", 50, "int8", at_i),
    (f"{STREAMING} H=20 F=4 tau=1 int8 I", 20, "int8", at_i + streaming),
    ("DiLoCo H=100 int8 I", 100, "int8", at_i),
    # the outer step without momentum (the paper's Nesterov 0.9 above)
    ("DiLoCo H=10 int8 I m=0", 10, "int8", at_i + ["--outer-momentum", "0"]),
    ("DiLoCo H=50 int8 I m=0", 50, "int8", at_i + ["--outer-momentum", "0"]),
    (
      f"{STREAMING} H=20 F=4 tau=1 int8 I m=0",
      20,
      "int8",
      at_i + streaming + ["--outer-momentum", "0"],
    ),
  ):
    flags = ["--strategy", "III", "--outer-sync", str(h), "--inter-grads", wire, *extra]
    config = dict(label=label, kind="diloco", h=h, wire=wire, flags=flags)
    out.append({**config, **({"fragments": 4} if streaming[0] in extra else {})})
  # torch's best configuration at A = 1 on a slow link in the strategy benchmark
  # (experiments/results/strategies_headline/): FSDP2 sharded within a node, an all-reduce across
  # nodes each step, planned as III's synchronous step, which moves the same bytes
  out.append(dict(label=TORCH, kind="torch", h=None, wire="fp32", flags=["--peer", "hsdp"]))
  # no round ends in the run: the group step alone (its wire format never used)
  bound_flags = ["--strategy", "III", "--outer-sync", str(10 * steps)]
  out.append(dict(label=BOUND, kind=BOUND, h=None, wire="-", flags=bound_flags))
  return out


def train_argv(args, config: dict, directory: str) -> list[str]:
  return [
    "train", *config["flags"], "--model", args.model, "--steps", str(args.steps),
    "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--dtype", args.dtype,
    "--collectives", "auto", "--seed", str(config["seed"]), "--eval-every", str(args.steps),
    "--eval-batches", str(args.eval_batches), "--no-tensorboard",
    "--out", directory,
  ]  # fmt: skip


def torch_argv(args, config: dict, directory: str) -> list[str]:
  """experiments/bench/torch_peer.py with `train`'s optimizer, schedule and defaults (its lr and
  warm-up, `--remat full`) and the same eval: the same tokens, the same held-out batches."""
  from paro_jax.run.config import OptimizerOptions

  o = OptimizerOptions()
  return [
    "python", "-m", "experiments.bench.torch_peer", *config["flags"], "--model", args.model,
    "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len",
    str(args.seq_len), "--dtype", args.dtype, "--remat", "full", "--seed", str(config["seed"]),
    "--schedule", "train", "--lr", str(o.lr), "--warmup", str(o.warmup), "--eval-batches",
    str(args.eval_batches), "--out", directory,
  ]  # fmt: skip


def command(args, config: dict, directory: str) -> list[str]:
  """What the launcher runs on each node for `config`."""
  return (torch_argv if config["kind"] == "torch" else train_argv)(args, config, directory)


def run(args, config: dict, directory: str, earlier: dict | None) -> dict:
  """Launch one run on the emulated cluster; its row (kept in directory/row.json). With --resume,
  the row of directory/row.json, else `earlier` (OUT's JSON), where its command is this run's."""
  from paro_jax.cluster.launch import launch

  row_path = os.path.join(directory, "row.json")
  if args.resume:
    if os.path.exists(row_path):
      with open(row_path) as f:
        earlier = json.load(f)
    same = earlier and earlier.get("command") == command(args, config, directory)
    if same and earlier.get("mesh", MESH) == args.mesh:
      if not earlier.get("error"):
        return {**earlier, **config}  # what the script derives (the planner's bytes) as it is now
  argv = command(args, config, directory)
  if config["kind"] == "torch" and importlib.util.find_spec("torch") is None:  # its runs/ kept
    row = {**config, "command": argv, "exit_code": None, "mesh": args.mesh, "date": utc_now()}
    return {**row, "error": "torch is not installed: pip install -e '.[bench]'"}
  shutil.rmtree(directory, ignore_errors=True)
  os.makedirs(directory)
  metrics_path = os.path.join(directory, "metrics.jsonl")
  nodes, per_node = mesh(args)
  monitor = WireMonitor(metrics_path, os.getpid(), nodes)
  start = time.perf_counter()
  with open(os.path.join(directory, "launch.log"), "w") as log:
    monitor.start()
    try:
      code = launch(
        argv, nodes=nodes, devices_per_node=per_node, inter_bandwidth=args.rate,
        inter_latency="0", stdout=log, stderr=log, shaped=not args.loopback,
      )  # fmt: skip
    finally:
      monitor.stop.set()
      monitor.join()
  row = {**config, "command": argv, "exit_code": code, "wall_s": time.perf_counter() - start}
  row["mesh"] = args.mesh
  row["date"] = utc_now()  # when this run ended (a page may keep rows of earlier runs)
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
  from models.presets import get_config
  from paro_jax.analysis.planner import inputs, step_model
  from paro_jax.core.strategy import parse_strategy
  from paro_jax.core.wire import WireConfig

  if config["kind"] == BOUND:  # no round ends in the run
    return 0.0
  flags = ["--strategy", "III"] if config["kind"] == "torch" else config["flags"]
  wire = WireConfig(
    params="int8" if "--inter-params" in flags else "same",
    grads=flags[flags.index("--inter-grads") + 1] if "--inter-grads" in flags else "same",
  )
  value = lambda flag, default: flags[flags.index(flag) + 1] if flag in flags else default  # noqa: E731
  h = int(value("--outer-sync", 0)) or None
  itemsize = 4 if args.dtype == "fp32" else 2
  devices = math.prod(mesh(args))
  w = inputs.Workload(
    get_config(args.model), args.batch_size // devices, 1, args.seq_len, itemsize=itemsize,
    wire=wire, outer_sync=h, outer_state=value("--outer-state", "G"),
    outer_fragments=int(value("--outer-fragments", 1)), outer_delay=int(value("--outer-delay", 0)),
  )  # fmt: skip
  cluster = inputs.Cluster(*mesh(args), inputs.Links(1e9, 1e9), None)
  e = step_model.predict(parse_strategy(flags[1]), w, cluster)
  return e.traffic["inter_bytes"] * devices


def left_out(args, rows: list[dict]) -> str:
  """What the measurement leaves out of the full comparison: the configurations and seeds not on
  the page, and what the script never runs."""
  labels = [c["label"] for c in configurations(args.steps, 1)]
  minutes = sorted(r["wall_s"] / 60 for r in rows if "wall_s" in r) or [0.0]
  model = "" if args.model == "small" else f"`{args.model}` instead of `small`; "
  return (
    "What the measurement leaves out of the full comparison, for the time two shared cores "
    f"allow (a run took {minutes[0]:.0f}-{minutes[-1]:.0f} minutes here): {model}"
    f"{seeds_left_out(rows, labels)}; the 4-bit pseudo-gradient "
    "with the outer state at I, Streaming DiLoCo with another F or TAU or with `--outer-mix` (0 "
    "here: a synced fragment restarts from the outer weights) and torch's other configurations "
    "(full shard, HSDP with a deferred all-reduce, DDP) are not run; this page's mesh is "
    f"{args.mesh} (`--mesh` runs another, on its own page); 101 steps, so H = 50 is two rounds "
    "and H = 100 one."
  )


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
      f"Measured {record['date']} (its last run; each row's date is in the JSON) on "
      f"{record['machine']}; {mesh(args)[0]} nodes x {mesh(args)[1]} "
      f"virtual CPU devices ({link}); `{args.model}`, batch {args.batch_size} x {args.seq_len}, "
      f"{args.dtype}, A=1, {args.steps} steps for every run (equal tokens), lr 3e-3 with 10 "
      f"warm-up steps and cosine decay, `--collectives auto`; DiLoCo with III as each node's "
      f"step, outer lr 0.7, Nesterov momentum 0.9, the outer state at G unless the label says I. "
      f"Eval loss after the last step over "
      f"{args.eval_batches} held-out batches (DiLoCo: of the outer weights). Timing and bytes "
      f"over steps {first}..{last} (step 1 compiles, the last also evaluates); tokens/s is "
      f"their tokens over their summed time; inter-node MB/step is all nodes' egress counted "
      f"by tc, per step; planned MB/step is the planner's per-device figure x "
      f"{math.prod(mesh(args))} (`analysis/planner/step_model.py`). Every run's row, with "
      f"each step's time and bytes, is in `outer_vs_paro.json` (the logs under `runs/` are not "
      f"kept in git).",
      "",
      left_out(args, rows),
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


def earlier_rows(args) -> dict:
  """OUT's earlier rows by label (with --only or --resume; {} where there is none), each dated;
  an error where they were measured with other settings (the seeds are no setting of a run)."""
  path = os.path.join(args.out, "outer_vs_paro.json")
  if not (args.only or args.resume) or not os.path.exists(path):
    return {}
  with open(path) as f:
    old = json.load(f)
  ignored = (*NOT_SETTINGS, "only", "seeds")
  settings = {k: v for k, v in vars(args).items() if k not in ignored}
  before = {"mesh": MESH}  # a page written before the setting was: measured with its default
  changed = [k for k, v in settings.items() if old["settings"].get(k, before.get(k)) != v]
  if changed:
    raise SystemExit(
      f"{path} was measured with other {', '.join(changed)}: its rows cannot share a page with "
      f"these; pass another --out, or the same settings"
    )
  return {r["label"]: {"date": old["date"], **r} for r in old["runs"]}


def kept_rows(args, earlier: dict, ran: set[str]) -> tuple[dict, list[str]]:
  """With --only, the rows of `earlier` (OUT's JSON, by label) this command does not run, at any
  seed, each with the planner's bytes as this script prices them now ({} without --only); and the
  page's order: every configuration's labels at the most seeds this command or the page has."""
  seeds = max([args.seeds] + [r["seed"] + 1 for r in earlier.values()])
  known = {c["label"]: c for c in configurations(args.steps, seeds)}
  kept = {}
  for label, r in earlier.items():
    if args.only and label not in ran:
      config = known.get(label)
      planned = {"planned_bytes_per_step": planned_bytes(args, config)} if config else {}
      kept[label] = {**r, **(config or {}), **planned}
  return kept, list(known)


def render(out: str) -> None:
  """OUT's page written again from its JSON, with the settings its runs were measured with (the
  page's text changed, its measurements not)."""
  with open(os.path.join(out, "outer_vs_paro.json")) as f:
    record = json.load(f)
  args = argparse.Namespace(**{"mesh": MESH, **record["settings"], "out": out})
  write_page(out, record, "outer_vs_paro.json", page(args, record), "README.md")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="tiny")
  ap.add_argument("--steps", type=int, default=101)
  ap.add_argument("--batch-size", type=int, default=16)
  ap.add_argument("--seq-len", type=int, default=64)
  ap.add_argument("--dtype", default="fp32")
  ap.add_argument("--eval-batches", type=int, default=8)
  ap.add_argument("--seeds", type=int, default=1, help="seeds of every configuration run")
  ap.add_argument("--rate", default="100mbit", help="tc rate of each node's link")
  ap.add_argument("--loopback", action="store_true", help="no namespaces, no shaping")
  ap.add_argument("--mesh", default=MESH, help="NODESxDEVICES: the emulated cluster")
  ap.add_argument(
    "--only", default=None, help="comma-separated configurations (each at every seed) or runs"
  )
  ap.add_argument("--resume", action="store_true", help="reuse runs whose command is unchanged")
  ap.add_argument("--out", default="experiments/results/outer_vs_paro")
  ap.add_argument("--render", action="store_true", help="rewrite OUT's page from its JSON; no run")
  args = ap.parse_args(argv)
  if args.render:
    render(args.out)
    return
  if not args.loopback and os.geteuid() != 0:
    print("not root: the link cannot be shaped; running on loopback", flush=True)
    args.loopback = True
  earlier = earlier_rows(args)
  configs = selected(configurations(args.steps, args.seeds), args.only)
  kept, order = kept_rows(args, earlier, {c["label"] for c in configs})
  rows = {}
  for config in configs:
    config = {**config, "planned_bytes_per_step": planned_bytes(args, config)}
    directory = os.path.join(args.out, "runs", config["label"].replace(" ", "_").replace("=", ""))
    row = run(args, config, directory, earlier.get(config["label"]))
    rows[row["label"]] = row
    print(json.dumps({k: row.get(k) for k in ("label", "tokens_per_s", "inter_bytes_per_step",
                                               "eval_loss", "error")}), flush=True)  # fmt: skip
  rows = {**kept, **rows}
  rows = [rows[k] for k in sorted(rows, key=lambda k: order.index(k) if k in order else len(order))]
  record = {
    "command": shlex.join(["python", "-m", "experiments.outer_vs_paro", *(argv or sys.argv[1:])]),
    "date": max(r["date"] for r in rows),
    "machine": machine_line(),
    "settings": {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS},
    "runs": rows,
  }
  write_page(args.out, record, "outer_vs_paro.json", page(args, record), "README.md")


if __name__ == "__main__":
  main()
