"""The import and the export of a real-size HF directory on one GPU, for gpu_measure.py's suite:
the goal that import_hf and stream_hf run at the rate safetensors itself reads and writes the
same bytes, per process (docs/memory.md). On the CPU's virtual devices the import's check,
conversion and writes into place run on the same two cores as safetensors' read
(experiments/results/model_io); on a GPU they run on the device, and the host reads, copies to
the device and writes.

`io_run` makes the random bf16 directory of the Llama 3.2 1B shape (experiments/model_dirs.py,
2.47 GB) in a temporary folder (never under the suite's --out, whose files come back), then
times, each in a child process of this tree (experiments/io_timing.py, one GPU): safetensors'
read of every tensor against import_hf at 1x1, and safetensors' write of every file against
stream_hf, both in bf16. `--dry-run`: a committed tiny fixture on the CPU, the plumbing only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from experiments.pages import utc_now

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "io-1b"  # the suite's name of this run
SECONDS = 120  # what the suite plans for it (the directory made, two children of 4 timings)
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_llama", "llama3_gqa")


def io_run(device: str, jax_version: str, dry_run: bool, repeats: int = 3) -> dict:
  """The run's record: the directory's bytes, the seconds of making it, and each timing's least
  of `repeats` (experiments/io_timing.py's names); where it fails, the error instead (written on
  the suite's page: it costs the suite no other run)."""
  from experiments.model_dirs import make
  from experiments.model_io import time_child

  started = time.perf_counter()
  record = {
    "name": NAME,
    "device": device,
    "jax": jax_version,
    "date": utc_now(),
    "directory": os.path.relpath(FIXTURE, ROOT) if dry_run else "Llama 3.2 1B shape",
    "repeats": repeats,
  }
  work = tempfile.mkdtemp(prefix="gpu_io-")
  directory, export_to = os.path.join(work, "model"), os.path.join(work, "export")
  try:
    if dry_run:
      shutil.copytree(FIXTURE, directory)
    else:
      make(directory, "1b")
    record["make_s"] = round(time.perf_counter() - started, 1)
    names = os.listdir(directory)
    record["directory_bytes"] = sum(os.path.getsize(os.path.join(directory, n)) for n in names)
    extra = ("--platform", "cpu" if dry_run else "gpu", "--repeats", str(repeats))
    extra += ("--export-to", export_to)
    record["seconds"] = {
      **time_child("time-import", directory, ROOT, extra),
      **time_child("time-export", directory, ROOT, extra),
    }
  except Exception as e:  # noqa: BLE001 - any: on the page
    record["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return {**record, "wall_s": round(time.perf_counter() - started, 1)}


def io_lines(r: dict) -> list[str]:
  """The suite page's section of the run: each path against safetensors' own (or its error)."""
  from experiments.io_timing import EXPORT, ONE, READ, WRITE

  if "error" in r:
    return ["", f"## Import and export on one GPU ({r['name']})", "", f"Failed: {r['error']}"]
  s = r["seconds"]
  gb = r["directory_bytes"] / 1e9
  rows = ((READ, None), (ONE, READ), (WRITE, None), (EXPORT, WRITE))
  lines = [
    "",
    f"## Import and export on one GPU ({r['name']})",
    "",
    f"A random bf16 HF directory, {r['directory']} ({gb:.2f} GB, made in {r['make_s']} s), "
    "each path timed in a child process of its own on one device (experiments/io_timing.py): "
    f"once untimed, then {r['repeats']} times in turn, the least kept; the writes from a `sync` "
    "to their bytes on the disk. The goal: the import and the export at safetensors' own "
    "rate (x safetensors near 1).",
    "",
    "| what | seconds | GB/s | x safetensors |",
    "|---|---:|---:|---:|",
  ]
  for what, peer in rows:  # a tiny fixture's times may round to 0
    rate = f"{gb / s[what]:.2f}" if s[what] else "-"
    ratio = f"{s[what] / s[peer]:.2f}" if peer and s[peer] else "-"
    lines.append(f"| {what} | {s[what]} | {rate} | {ratio} |")
  return lines
