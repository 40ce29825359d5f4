"""What the outer loop's compiled step copies on a step that ends no round: the bytes of XLA's
`copy` instructions per device, and the compiled memory, for the synchronous step beside DiLoCo's
and Streaming DiLoCo's (with and without `--outer-delay`).

  python experiments/step_copies.py --out experiments/results/step_copies

Each configuration is compiled by `paro-jax inspect --json --hlo-out` (nothing runs). A copy
executes once per execution of its computation: the entry once, a while loop's body its trip
count times, a conditional's branch once where the step takes it. A step that ends no round
takes the last branch of every conditional (the outer loop's switches put "nothing due" last:
core/groups.py), so the quiet step's copies are summed over the entry and, recursively, the
bodies of its loops and the last branch of its conditionals; a copy inside a fusion is part of
that fusion's kernel and is left out. Writes OUT/step_copies.json and OUT/README.md;
tests/experiments/test_step_copies.py reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.families_grid import git_commit  # noqa: E402
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402
from paro_jax.analysis.gpu.roofline import parse_computations  # noqa: E402
from paro_jax.analysis.hlo.collectives import (  # noqa: E402
  _BRANCHES_RE,
  _CALLEE_RE,
  _TRIP_RE,
  _array_bytes,
)

# (label, inspect flags beyond the common ones): the step each page of outer_vs_paro runs
CONFIGS = [
  ("III, synchronous", []),
  ("DiLoCo, no round in the run (the bound)", ["--outer-sync", "1010"]),
  ("DiLoCo H=10 int8 I", ["--outer-sync", "10", "--inter-grads", "int8", "--outer-state", "I"]),
  (
    "Streaming H=20 F=4 int8 I, no delay",
    ["--outer-sync", "20", "--outer-fragments", "4", "--inter-grads", "int8", "--outer-state", "I"],
  ),
  (
    "Streaming H=20 F=4 tau=1 int8 I",
    ["--outer-sync", "20", "--outer-fragments", "4", "--outer-delay", "1", "--inter-grads", "int8"]
    + ["--outer-state", "I"],
  ),
]


def _callee(attrs: str, role: str) -> str:
  """The computation an instruction's attributes name for `role` (body, to_apply, ...)."""
  return dict(_CALLEE_RE.findall(attrs))[role]


def quiet_copies(hlo_text: str) -> int:
  """Bytes of the `copy` instructions a step runs when it takes every conditional's last branch:
  the entry's, its loops' bodies' times their trip counts, and its conditionals' last branches'
  (fused computations are called by `fusion` ops and never visited)."""
  comps, entry = parse_computations(hlo_text)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")

  def visit(comp: str) -> int:
    total = 0
    for instr in comps[comp]:
      op, rest = instr.op, instr.attrs
      if op == "copy":
        total += _array_bytes(instr.type_text)[0]
      elif op == "while":
        trip = _TRIP_RE.search(rest)
        if not trip:
          raise ValueError(f"a while loop of {comp} has no known trip count")
        total += int(trip.group(1)) * visit(_callee(rest, "body"))
      elif op == "conditional":
        branches = _BRANCHES_RE.search(rest)
        # a predicate's (true, false) pair: the false one is index 1, the last
        last = (
          re.findall(r"%?([\w.\-]+)", branches.group(1))[-1]
          if branches
          else _callee(rest, "false_computation")
        )
        total += visit(last)
      elif op == "call":
        total += visit(_callee(rest, "to_apply"))
    return total

  return visit(entry)


def measure(label: str, flags: list[str], args) -> dict:
  """One configuration compiled by inspect: its quiet step's copies, memory and program size."""
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    hlo = os.path.join(tmp, "step.hlo")
    cli = [sys.executable, "-c", "from paro_jax.cli import main; main()"]
    argv = [*cli, "inspect", "--model", args.model]
    argv += ["--strategy", "III", "--mesh", args.mesh, "--dtype", "fp32", "--json"]
    argv += ["--hlo-out", hlo, *flags, *(["--target", args.target] if args.target else [])]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
      raise SystemExit(f"{label}: inspect exited {out.returncode}:\n{out.stderr[-3000:]}")
    report = json.loads(out.stdout[out.stdout.index("{") :])
    with open(hlo) as f:
      text = f.read()
  compiled = report["memory"]["compiled"]
  return {
    "label": label,
    "flags": flags,
    "quiet_copy_bytes": quiet_copies(text),
    "master_bytes": 4 * report["params"] / report["mesh"]["intra"],  # III's fp32 master at I
    "argument_bytes": compiled["argument_bytes"],
    "temp_bytes": compiled["temp_bytes"],
    "hlo_chars": len(text),
    "compile_s": round(time.perf_counter() - start, 1),
    **({"quiet_step_s": quiet_step_s(flags, args)} if args.time_steps else {}),
  }


def quiet_step_s(flags: list[str], args) -> float:
  """The median step time of `--time-steps` steps of `--time-model` with `flags` (steps 2..N-1:
  after the compile), in one process on the mesh's virtual devices: a run whose H (10,000) ends
  no round and is due no fragment, so every step is the configuration's quiet step."""
  flags = list(flags)
  if "--outer-sync" in flags:
    flags[flags.index("--outer-sync") + 1] = "10000"
  with tempfile.TemporaryDirectory() as tmp:
    cli = [sys.executable, "-c", "from paro_jax.cli import main; main()"]
    argv = [*cli, "train", "--model", args.time_model, "--strategy", "III", "--mesh", args.mesh]
    argv += ["--dtype", "fp32", "--batch-size", "16", "--seq-len", "64", "--steps"]
    argv += [str(args.time_steps), "--no-tensorboard", "--out", tmp, *flags]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
      raise SystemExit(f"train {flags} exited {out.returncode}:\n{out.stderr[-3000:]}")
    with open(os.path.join(tmp, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  return statistics.median(r["step_time_s"] for r in rows[1:-1])


def page(record: dict) -> str:
  rows, mib = record["rows"], 2**20
  sync = rows[0]
  timed = all("quiet_step_s" in r for r in rows)
  target = record.get("target")
  devices = f"{target.upper()}s (compiled for, without one)" if target else "virtual CPU devices"
  lines = [
    "# What the outer loop's step copies on a step that ends no round",
    "",
    f"    {record['command']}",
    "",
    f"{record['date']}, commit `{record['commit']}`; {record['machine']}; `{record['model']}`, "
    f"III on {record['mesh']} {devices}, fp32, batch 16 x 64, A=1; each row compiled "
    "by `paro-jax inspect --json --hlo-out` (nothing ran). Per device: the bytes of the `copy` "
    "instructions a step runs when it ends no round and exchanges nothing (the entry's, each loop "
    "body's times its trip count, each conditional's last branch: the outer loop's switches put "
    "\"nothing due\" last), against the master weights' bytes on a device; XLA's compiled "
    "arguments and temporaries; the size of the compiled program's text.",
    "",
    "| step | copies on a quiet step (MiB) | x master | arguments (MiB) | temporaries (MiB) "
    "| HLO (MB of text) |" + (" quiet step (s) | x the bound's |" if timed else ""),
    "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if timed else ""),
  ]
  for r in rows:
    lines.append(
      f"| {r['label']} | {r['quiet_copy_bytes'] / mib:.2f} | "
      f"{r['quiet_copy_bytes'] / r['master_bytes']:.2f} | {r['argument_bytes'] / mib:.2f} | "
      f"{r['temp_bytes'] / mib:.2f} | {r['hlo_chars'] / 1e6:.1f} |"
      + (
        f" {r['quiet_step_s']:.3f} | {r['quiet_step_s'] / rows[1]['quiet_step_s']:.3f} |"
        if timed
        else ""
      )
    )
  sync, bound, at_i, plain, delay = rows
  x = lambda a, b, key: (a[key] - b[key]) / a["master_bytes"]  # noqa: E731
  lines += [
    "",
    "In master-sized units: the bound's quiet step copies "
    f"{x(bound, sync, 'quiet_copy_bytes'):+.2f} against the synchronous step's; with the outer "
    "state at I, "
    f"{x(at_i, bound, 'quiet_copy_bytes'):+.1f} against the bound's (at G): the round's switch "
    "passes each node's outer weights, momentum and residual (each the master's size at I) "
    "through its branch that ends no round, and a conditional's output is a buffer of its own, "
    "so a value passed through is copied into it. Streaming without the delay copies what DiLoCo "
    f"at I copies ({x(plain, at_i, 'quiet_copy_bytes'):+.2f}); with `--outer-delay` "
    f"{x(delay, plain, 'quiet_copy_bytes'):+.1f} more, and its temporaries are "
    f"{x(delay, plain, 'temp_bytes'):+.1f} larger (its arguments hold the kept weights, "
    f"{x(delay, plain, 'argument_bytes'):+.1f}): the step's compute sits in every branch of its "
    "switch, so that a fragment's exchange may run beside it, and the program's text is "
    f"{delay['hlo_chars'] / plain['hlo_chars']:.1f}x as long.",
    "",
  ]
  if timed:
    times = [r["quiet_step_s"] for r in rows]
    lines += [
      f"Timed: `{record['time_model']}` on the same mesh in one process (its virtual devices on "
      "this machine's cores), each configuration's median step over steps "
      f"2..{record['time_steps'] - 1} of a run with H = 10,000, so that no round ends and no "
      "fragment is due (every step the quiet one), one configuration after another: a single short "
      f"run of each, so their medians ({min(times):.2f}-{max(times):.2f} s) differ by the "
      "machine's drift between runs as well as by their programs.",
      "",
    ]
  return "\n".join(lines)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="tiny")
  ap.add_argument("--mesh", default="2x4")
  ap.add_argument("--out", default="experiments/results/step_copies")
  ap.add_argument("--target", default=None, help="compile for this GPU (h100, h200) without one")
  ap.add_argument("--time-steps", type=int, default=0, help="also time N steps of each (0: no)")
  ap.add_argument("--time-model", default="small", help="the model those steps train")
  ap.add_argument("--render", action="store_true", help="rewrite OUT's page from its JSON; no run")
  args = ap.parse_args(argv)
  if args.render:
    with open(os.path.join(args.out, "step_copies.json")) as f:
      record = json.load(f)
    write_page(args.out, record, "step_copies.json", page(record), "README.md")
    return
  rows = [measure(label, flags, args) for label, flags in CONFIGS]
  for r in rows:
    print(json.dumps(r), flush=True)
  record = {
    "command": " ".join(["python", "experiments/step_copies.py", *(argv or sys.argv[1:])]),
    "date": utc_now(),
    "commit": git_commit(),
    "machine": machine_line(),
    "model": args.model,
    "mesh": args.mesh,
    "target": args.target,
    "time_model": args.time_model if args.time_steps else None,
    "time_steps": args.time_steps,
    "rows": rows,
  }
  write_page(args.out, record, "step_copies.json", page(record), "README.md")


if __name__ == "__main__":
  main()
