"""Model I/O at real size: peak memory of `paro-jax eval` of an HF directory before and after the
sharded, streaming import (paro_jax/hf/stream.py), and the import's time against safetensors'
own read of the same bytes.

  python experiments/model_io.py make --dir /tmp/llama1b            # random bf16, never committed
  git archive BASE | tar -x -C /tmp/base                              # the code of before
  python experiments/model_io.py measure --dir /tmp/llama1b --base /tmp/base \\
      --out experiments/results/model_io

`make` (experiments/model_dirs.py) writes a random bf16 LlamaForCausalLM directory of the
Llama-3.2-1B shape (vocab 128,256, hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, tied
embeddings: 1.24B parameters, 2.47 GB; --shape 3b and 8b: Llama 3.2 3B, Llama 3.1 8B) in
safetensors files of about 2 GiB with their index, one file in memory at a time. `measure`
runs `paro-jax eval` of it on mesh 1x8 (GGG) and 1x1, each in a memory cgroup of --cap GiB
(/work/shared/tools/capped: /usr/bin/time -v's peak RSS; killed at the cap), with the code of
--base (before) and of this tree (after), one batch of 8 x 64 tokens; then times, in a child
process of this tree, safetensors' read of every tensor against `import_hf` of the whole model
(in bf16, at 1x1 and at G on 1x8), each after one untimed read (the files in the page cache),
the least of --repeats (3) runs. `import-page` times that again, for the code of --base and of
this tree one after the other, and writes it into --out's page:

  python experiments/model_io.py import-page --dir /tmp/llama1b --base /tmp/base \
      --base-commit BASE --out experiments/results/model_io
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.io_timing import EIGHT, EXPORT, ONE, PLATFORMS, READ, WRITE  # noqa: E402
from experiments.io_timing import importer, time_export, time_import  # noqa: E402
from experiments.model_dirs import SHAPES, make  # noqa: E402
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402

CAPPED = "/work/shared/tools/capped"
# The shapes of `make`: Llama 3.2 1B and 3B (tied), Llama 3.1 8B (its own head).
RUNS = [("1x8", "GGG"), ("1x1", "GGG")]


def eval_run(tree: str, directory: str, mesh: str, strategy: str, cap: int, text: str) -> dict:
  """`paro-jax eval` with the code of `tree`, capped: peak RSS, seconds, exit code, score."""
  command = [
    CAPPED,
    str(cap),
    sys.executable,
    "-m",
    "paro_jax",
    "eval",
    directory,
    *("--data", text, "--tokenizer", "bytes", "--seq-len", "64", "--batch-size", "8"),
    *("--mesh", mesh, "--strategy", strategy, "--dtype", "bf16", "--json"),
  ]
  env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  start = time.time()
  done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
  rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
  score = None
  if done.returncode == 0:
    score = json.loads(done.stdout.strip().splitlines()[-1])
  return {
    "mesh": mesh,
    "strategy": strategy,
    "rc": done.returncode,
    "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2) if rss else None,
    "seconds": round(time.time() - start, 1),
    "score": score,
    "error": None if done.returncode == 0 else done.stderr.strip().splitlines()[-25:],
  }


def time_child(what: str, directory: str, tree: str, extra: tuple = ()) -> dict:
  """`what` (time-import, -export) of `directory` in a child with `tree`'s code on the path (on a
  GPU, allocating as it goes: beside another process that holds the GPU, gpu_io.py's suite)."""
  child = subprocess.run(
    [sys.executable, os.path.abspath(__file__), what, "--dir", directory, *extra],
    env={**os.environ, "PYTHONPATH": tree, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    capture_output=True,
    text=True,
  )
  if child.returncode:
    raise RuntimeError(f"{what}: {child.stderr[-3000:]}")
  return json.loads(child.stdout.strip().splitlines()[-1])


def import_page(args) -> None:
  """time-import and time-export of --base's code (before, if given) and of this tree's (after),
  one child process each, one after the other: written into the record in --out as
  `import_time`, with the load average of the machine's other work around them, and its page
  written again."""
  rows = []
  for code, tree in ((("before", args.base),) if args.base else ()) + (("after", ROOT),):
    load = os.getloadavg()[0]
    extra = ["--repeats", str(args.repeats), "--code", tree]
    seconds = {
      **time_child("time-import", args.dir, tree, extra),
      **time_child("time-export", args.dir, tree, extra),
    }
    load = round(max(load, os.getloadavg()[0]), 1)
    rows.append({"code": code, "tree": tree, "seconds": seconds, "load_average": load})
    print(json.dumps(rows[-1]), flush=True)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
  path = os.path.join(args.out, "model_io.json")
  with open(path) as f:
    record = json.load(f)
  record["import_time"] = {
    "command": " ".join(sys.argv),
    "date": utc_now(),
    "machine": machine_line(),
    "before_commit": args.base_commit if args.base else None,
    "after_commit": commit.stdout.decode().strip(),
    "repeats": args.repeats,
    "rows": rows,
  }
  write_page(args.out, record, "model_io.json", page(record), "README.md")


def import_peak(directory: str, devices: int) -> dict:
  """import_hf of the whole model in bf16 alone (at G on 1x`devices`, N on 1x1): seconds, and
  this process's peak RSS before and after it (getrusage)."""
  import resource

  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.strategy import Placement

  _, load = importer(directory)
  mesh = make_mesh(1, devices)
  placement = Placement.G if devices > 1 else Placement.N
  peak = lambda: round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # noqa: E731
  before, start = peak(), time.perf_counter()
  load(mesh, placement)
  return {
    "mesh": f"1x{devices}",
    "seconds": round(time.perf_counter() - start, 1),
    "peak_rss_gib_before_import": before,
    "peak_rss_gib": peak(),
  }


# `paro-jax eval`'s weights alone, up to its first batch, with the code on PYTHONPATH (before or
# after): run/source.py source_engine, and before, the params(state) its score gathered.
WEIGHTS_STAGE = """
import json, os, resource, sys, time
n = int(sys.argv[2])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from paro_jax.core.config import make_config
from paro_jax.run.config import EvalConfig
from paro_jax.run.source import open_source, source_engine
flags = {"source": sys.argv[1], "mesh": (1, n), "strategy": "GGG", "dtype": "bf16"}
cfg = make_config(EvalConfig, {**flags, "batch_size": 8, "seq_len": 64})
start = time.perf_counter()
engine, held = source_engine(open_source(cfg.source), cfg)
if hasattr(held, "master"):  # before: a training state, gathered to P by score()
  held = (held, engine.params(held))
jax.block_until_ready(held)
seconds = round(time.perf_counter() - start, 1)
print(json.dumps({"seconds": seconds, "peak_rss_gib": resource.getrusage(0).ru_maxrss / 2**20}))
"""


def weights_stages(args) -> None:
  """Add the weights stage of before and after to the record in --out and write its page again."""
  path = os.path.join(args.out, "model_io.json")
  with open(path) as f:
    record = json.load(f)
  stages = []
  for code, tree in (("before", args.base), ("after", ROOT)):
    for devices in (8, 1):
      done = subprocess.run(
        [CAPPED, str(args.cap), sys.executable, "-c", WEIGHTS_STAGE, args.dir, str(devices)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": tree},
        capture_output=True,
        text=True,
      )
      rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
      row = {"code": code, "mesh": f"1x{devices}", "rc": done.returncode}
      row["peak_rss_gib"] = round(int(rss.group(1)) / 2**20, 2) if rss else None
      if done.returncode == 0:
        row["seconds"] = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
      stages.append(row)
      print(json.dumps(row), flush=True)
  record["weights_stage"] = stages
  record["weights_stage_command"] = " ".join(sys.argv)
  write_page(args.out, record, "model_io.json", page(record), "README.md")


def measure(args) -> None:
  text = os.path.join(os.path.dirname(os.path.abspath(args.dir)), "model_io_text.txt")
  with open(text, "w") as f:  # one batch: 8 windows of 64 + 1 tokens (bytes)
    f.write(("The quick brown fox jumps over the lazy dog. " * 12)[: 8 * 65])
  runs = []
  for code, tree in (("before", args.base), ("after", ROOT)):
    for mesh, strategy in RUNS:
      runs.append({"code": code, **eval_run(tree, args.dir, mesh, strategy, args.cap, text)})
      print(json.dumps(runs[-1]), flush=True)
  peaks = []
  for devices in (8, 1):
    done = subprocess.run(
      [CAPPED, str(args.cap), sys.executable, os.path.abspath(__file__), "import-peak"]
      + ["--dir", args.dir, "--devices", str(devices)],
      env={**os.environ, "PYTHONPATH": ROOT},
      capture_output=True,
      text=True,
    )
    if done.returncode:
      raise SystemExit(done.stderr[-3000:])
    peaks.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(json.dumps(peaks[-1]), flush=True)
  seconds = time_child("time-import", args.dir, ROOT)
  size = sum(os.path.getsize(os.path.join(args.dir, n)) for n in os.listdir(args.dir))
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
  record = {
    "date": utc_now(),
    "machine": machine_line(),
    "command": " ".join(sys.argv),
    "after_commit": commit.stdout.decode().strip(),
    "before_commit": args.base_commit,
    "directory_bytes": size,
    "cap_gib": args.cap,
    "eval": runs,
    "import_seconds": seconds,
    "import_peaks": peaks,
  }
  write_page(args.out, record, "model_io.json", page(record), "README.md")


def page(r: dict) -> str:
  gb = r["directory_bytes"] / 1e9
  lines = [
    "# Model I/O: `paro-jax eval` of a real-size HF directory, before and after",
    "",
    f"Command: `python {r['command']}`  ",
    f"Date: {r['date']}  ",
    f"Machine: {r['machine']}  ",
    f"Code: before = {r['before_commit']}, after = {r['after_commit']} (+ the working tree)",
    "",
    f"A random bf16 HF directory of the Llama-3.2-1B shape ({gb:.2f} GB, two shards), scored on",
    "one batch of 8 x 64 byte tokens in bf16, each run in a memory cgroup of "
    f"{r['cap_gib']} GiB (`/work/shared/tools/capped`); peak RSS is /usr/bin/time -v's (the",
    "whole process: on CPU the 8 virtual devices' buffers are host memory too). rc 137: killed",
    "at the cap.",
    "",
    "| code | mesh | strategy | rc | peak RSS (GiB) | seconds | loss |",
    "|---|---|---|---|---|---|---|",
  ]
  for run in r["eval"]:
    loss = f"{run['score']['loss']:.6f}" if run["score"] else "-"
    lines.append(
      f"| {run['code']} | {run['mesh']} | {run['strategy']} | {run['rc']} | "
      f"{run['peak_rss_gib']} | {run['seconds']} | {loss} |"
    )
  lines += [
    "",
    "Import time (one process, files in the page cache, each timed once after one untimed run):",
    "",
    "| what | seconds | GB/s |",
    "|---|---|---|",
  ]
  for what, s in r["import_seconds"].items():
    lines.append(f"| {what} | {s} | {gb / s:.2f} |")
  lines += [
    "",
    "The import alone (`import_hf` of the whole model in bf16, in a capped process of its own;",
    "peak RSS from getrusage, of the whole process, before and after the import):",
    "",
    "| mesh | seconds | peak RSS before (GiB) | peak RSS after (GiB) |",
    "|---|---|---|---|",
  ]
  for p in r["import_peaks"]:
    lines.append(
      f"| {p['mesh']} | {p['seconds']} | {p['peak_rss_gib_before_import']} | {p['peak_rss_gib']} |"
    )
  if "weights_stage" in r:
    lines += [
      "",
      f"`eval`'s weights alone (`python {r['weights_stage_command']}`): run/evaluate.py",
      "`source_engine` up to the first batch (before: the training state it built and the",
      "`params(state)` its score gathered to P; after: the weights at P), capped the same way:",
      "",
      "| code | mesh | rc | peak RSS (GiB) | seconds |",
      "|---|---|---|---|---|",
    ]
    for w in r["weights_stage"]:
      lines.append(
        f"| {w['code']} | {w['mesh']} | {w['rc']} | {w['peak_rss_gib']} | {w.get('seconds', '-')} |"
      )
  if "import_time" in r:
    t = r["import_time"]
    before = f"before = {t['before_commit']}, " if t["before_commit"] else ""
    lines += [
      "",
      "## The import against safetensors' read of the same files, measured again",
      "",
      f"Command: `python {t['command']}`  ",
      f"Date: {t['date']}  ",
      f"Machine: {t['machine']}  ",
      f"Code: {before}after = {t['after_commit']} (+ the working tree)",
      "",
      "One child process per code, one after the other: safetensors' `get_tensor` of every",
      "tensor, then `import_hf` of the whole model in bf16 at 1x1 and at G on 1x8; each run once",
      f"untimed (the files in the page cache, the programs compiled), then {t['repeats']} times in",
      "turn, the least of each kept. Load average: the machine's, at the start or the end of the",
      "child, the larger (other engineers' work on its 2 cores).",
      "",
      "| code | load average | safetensors (s) | 1x1 (s) | x safetensors | G on 1x8 (s) "
      "| x safetensors |",
      "|---|---|---|---|---|---|---|",
    ]
    for row in t["rows"]:
      sec = [row["seconds"][what] for what in (READ, ONE, EIGHT)]
      lines.append(
        f"| {row['code']} | {row['load_average']} | {sec[0]} | {sec[1]} | {sec[1] / sec[0]:.1f} | "
        f"{sec[2]} | {sec[2] / sec[0]:.1f} |"
      )
    exports = [row for row in t["rows"] if EXPORT in row["seconds"]]
    if exports:
      lines += [
        "",
        "The export in the same child: safetensors' `save_file` of every file of the directory",
        "(each read first, untimed), then `stream_hf` of the model imported on 1x1, in bf16; each",
        "timed from a `sync` to its bytes on the disk (a second `sync`), of tensors made afresh,",
        f"once untimed, then {t['repeats']} times in turn, the least kept.",
        "",
        "| code | safetensors write (s) | export 1x1 (s) | x safetensors |",
        "|---|---|---|---|",
      ]
      for row in exports:
        write, export = row["seconds"][WRITE], row["seconds"][EXPORT]
        lines.append(f"| {row['code']} | {write} | {export} | {export / write:.1f} |")
  if "notes" in r:  # written after the runs, kept in the record so that a run keeps them
    lines += ["", "## Notes (written after the runs)", "", *r["notes"]]
  return "\n".join(lines) + "\n"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  what = "make measure weights-stages time-import import-page time-export import-peak"
  p.add_argument("what", choices=what.split())
  p.add_argument("--devices", type=int, default=8, help="import-peak: 1x1 or 1xN")
  p.add_argument("--export-to", default="/tmp/model_io_export", help="time-export: emptied")
  p.add_argument("--dir", required=True)
  p.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="make: the model's shape")
  p.add_argument("--base", help="a tree of the code of before (git archive BASE)")
  p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "model_io"))
  p.add_argument("--cap", type=int, default=12)
  p.add_argument("--repeats", type=int, default=3, help="time-import, -export: the least of")
  p.add_argument("--code", help="time-import, -export: the tree whose paro_jax is timed")
  p.add_argument("--platform", choices=PLATFORMS, default="cpu", help="time-import, -export")
  p.add_argument("--base-commit", default="", help="the commit --base was made from")
  args = p.parse_args()
  if args.code:
    sys.path.insert(0, os.path.abspath(args.code))
  if args.what == "make":
    make(args.dir, args.shape)
  elif args.what == "weights-stages":
    weights_stages(args)
  elif args.what == "import-peak":
    print(json.dumps(import_peak(args.dir, args.devices)))
  elif args.what == "time-import":
    print(json.dumps(time_import(args.dir, args.repeats, args.platform)))
  elif args.what == "import-page":
    import_page(args)
  elif args.what == "time-export":
    print(json.dumps(time_export(args.dir, args.export_to, args.repeats, args.platform)))
  else:
    measure(args)


if __name__ == "__main__":
  main()
