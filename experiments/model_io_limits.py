"""Real-size models in and out against their memory limits: peak RSS and seconds of `paro-jax
eval`, a LoRA fine-tune from `--init-from` with its checkpoints, resume and exports, and a
two-process fine-tune, on random bf16 HF directories of the Llama 3.2 1B / 3B and Llama 3.1 8B
shapes, beside transformers' own load + forward (1B, 3B) and load + save_pretrained (1B) of the
same directories. (transformers' forward of 8B is left out: its 1B forward takes ~3 minutes of
this 2-core machine, 8B would take ~20.)

  python experiments/model_io.py make --dir /tmp/llama1b --shape 1b    # and 3b, 8b: never committed
  python experiments/model_io_limits.py --dirs /tmp/llama1b /tmp/llama3b /tmp/llama8b \\
      --hf-python PYTHON --out experiments/results/model_io_limits

Every command runs in a memory cgroup (/work/shared/tools/capped: /usr/bin/time -v's peak RSS,
killed at the cap). The limits, with W the bf16 bytes of the weights the process's devices hold
at the strategy's P placement and Lg two gathered layers (bf16) per device of the process (on CPU
all the virtual devices' buffers are the process's memory):
  eval, GGG 1x8 and IIG 2x4, 1B                  W + Lg + 1.5 GB
  eval, 1x1: 3B                                 1.15 x the checkpoint + 1.5 GB; 8B: 20 GB
  LoRA fine-tune, ING 2x4, 1B: train, resume, export merged      W + Lg + 2 GB; --adapter: 1.5 GB
  two processes x 4 devices, GGG LoRA fine-tune of 1B: each process  W + Lg + 2 GB
`--only NAME,...` runs some rows and keeps the others of an earlier results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.model_dirs import hf_tensors  # noqa: E402
from experiments.model_io import CAPPED  # noqa: E402
from experiments.pages import machine_line, utc_now, write_page  # noqa: E402

GB = 1e9
TEXT = ("The quick brown fox jumps over the lazy dog. " * 12)[: 8 * 65]  # one batch of 8 x 65
COMMON = ("--tokenizer", "bytes", "--seq-len", "64", "--batch-size", "8", "--dtype", "bf16")
LORA = ("--lora-rank", "8", "--lr", "3e-4", "--warmup", "1", "--checkpoint-every", "1")

# transformers' side: load the directory in bf16, then a forward with the loss of one batch, or
# save_pretrained of what it loaded (sys.argv: directory, what, output directory).
HF_PEER = """
import sys, time, torch, transformers
start = time.time()
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)
if sys.argv[2] == "forward":
  ids = torch.tensor([list(sys.argv[3].encode())[:65]] * 8)
  with torch.no_grad():
    print(float(model(ids[:, :64], labels=ids[:, :64]).loss))
else:
  model.save_pretrained(sys.argv[3])
print(f"seconds {time.time() - start:.1f}")
"""


def config_of(directory: str) -> dict:
  with open(os.path.join(directory, "config.json")) as f:
    return json.load(f)


def checkpoint_bytes(directory: str) -> int:
  return sum(
    os.path.getsize(os.path.join(directory, n))
    for n in os.listdir(directory)
    if n.endswith(".safetensors")
  )


def layer_bytes(config: dict) -> int:
  """One decoder layer's bf16 bytes."""
  size = 0
  for name, shape in hf_tensors(config).items():
    if name.startswith("model.layers.0."):
      n = 1
      for s in shape:
        n *= s
      size += 2 * n
  return size


def limit(directory: str, copies: float, devices: int, slack: float) -> dict:
  """The row's limit in GB: W (the checkpoint's bytes x `copies`, the P placement's copies over
  the process's devices) + Lg (two layers per device, when the weights are gathered) + `slack`;
  with the terms it is made of (the page's test recomputes it)."""
  w = checkpoint_bytes(directory) * copies
  lg = 2 * layer_bytes(config_of(directory)) * devices if devices > 1 else 0
  terms = dict(model=os.path.basename(directory), copies=copies, devices=devices, slack=slack)
  return {"gb": round((w + lg) / GB + slack, 2), "terms": terms}


def fixed(gb: float, model: str | None = None, factor: float | None = None) -> dict:
  """A limit of `gb` GB, or `factor` x the checkpoint of `model` + `gb`."""
  if factor is None:
    return {"gb": gb, "terms": {"fixed": gb}}
  terms = dict(model=os.path.basename(model), factor=factor, slack=gb)
  return {"gb": round(factor * checkpoint_bytes(model) / GB + gb, 2), "terms": terms}


def capped(cap: int, command: list[str], env: dict, cwd: str) -> dict:
  start = time.time()
  done = subprocess.run(
    [CAPPED, str(cap), *command], cwd=cwd, env=env, capture_output=True, text=True
  )
  rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
  return {
    "rc": done.returncode,
    "peak_rss_gb": round(int(rss.group(1)) * 1024 / GB, 2) if rss else None,
    "seconds": round(time.time() - start, 1),
    "stdout_tail": done.stdout.strip().splitlines()[-3:],
    "error": None if done.returncode == 0 else done.stderr.strip().splitlines()[-30:],
  }


def ours(*argv: str) -> list[str]:
  return [sys.executable, "-m", "paro_jax", *argv]


def rows(args, work: str) -> list[dict]:
  """Each row: name, command, the environment's device count, cap, limit (GB), note."""
  d1, d3, d8 = args.dirs
  text, eval_text = os.path.join(work, "text.txt"), os.path.join(work, "eval.txt")
  run, run2 = os.path.join(work, "lora_ing"), os.path.join(work, "lora_ggg_2proc")
  out = lambda name: os.path.join(work, name)  # noqa: E731
  ev = lambda d, mesh, s: ours(
    "eval", d, "--data", eval_text, *COMMON, "--mesh", mesh, "--strategy", s, "--json"
  )  # noqa: E731,E501
  train_ing = ours(
    "train", "--init-from", d1, "--data", text, *COMMON, *LORA,
    "--strategy", "ING", "--mesh", "2x4", "--out", run,
  )  # fmt: skip
  return [
    dict(name="eval 1B GGG 1x8", cmd=ev(d1, "1x8", "GGG"), devices=8, limit=limit(d1, 1, 8, 1.5)),
    dict(name="eval 1B IIG 2x4", cmd=ev(d1, "2x4", "IIG"), devices=8, limit=limit(d1, 2, 8, 1.5)),
    dict(name="eval 3B 1x1", cmd=ev(d3, "1x1", "GGG"), devices=1,
         limit=fixed(1.5, d3, 1.15)),
    dict(name="eval 8B 1x1", cmd=ev(d8, "1x1", "GGG"), devices=1, limit=fixed(20.0)),
    dict(name="LoRA 1B ING 2x4: train 2 steps", cmd=[*train_ing, "--steps", "2"], devices=8,
         limit=limit(d1, 2, 8, 2), fresh=run),
    dict(name="LoRA 1B ING 2x4: resume to step 3", cmd=[*train_ing, "--steps", "3", "--resume"],
         devices=8, limit=limit(d1, 2, 8, 2)),
    dict(name="LoRA 1B ING 2x4: export merged", devices=8, limit=limit(d1, 2, 8, 2),
         cmd=ours("export", run, "--out", out("merged"), "--overwrite"), fresh=out("merged")),
    dict(name="LoRA 1B ING 2x4: export --adapter", devices=8, limit=fixed(1.5),
         fresh=out("adapter"),
         cmd=ours("export", run, "--adapter", "--out", out("adapter"), "--overwrite")),
    dict(name="LoRA 1B GGG, 2 processes x 4: train 2 steps (largest process)", devices=4,
         limit=limit(d1, 0.5, 4, 2), fresh=run2, launch=True,
         cmd=ours("launch", "--nodes", "2", "--devices-per-node", "4", "--inter-bandwidth",
                  "10gbit", "--", "train", "--init-from", d1, "--data", text, *COMMON, *LORA,
                  "--strategy", "GGG", "--steps", "2", "--out", run2)),
    dict(name="LoRA 1B GGG, 2 processes: export merged (1 process x 8)", devices=8,
         limit=limit(d1, 1, 8, 2), fresh=out("merged2"),
         cmd=ours("export", run2, "--out", out("merged2"), "--overwrite")),
    dict(name="LoRA 1B GGG, 2 processes: export --adapter (1 process x 8)", devices=8,
         limit=fixed(1.5), fresh=out("adapter2"),
         cmd=ours("export", run2, "--adapter", "--out", out("adapter2"), "--overwrite")),
    dict(name="transformers: load + forward 1B", cmd=[args.hf_python, "-c", HF_PEER, d1, "forward", TEXT], devices=1, limit=None, peer=True),  # noqa: E501
    dict(name="transformers: load + forward 3B", cmd=[args.hf_python, "-c", HF_PEER, d3, "forward", TEXT], devices=1, limit=None, peer=True),  # noqa: E501
    dict(name="transformers: load + save_pretrained 1B", devices=1, limit=None, peer=True,
         cmd=[args.hf_python, "-c", HF_PEER, d1, "save", out("hf_saved")], fresh=out("hf_saved")),
  ]  # fmt: skip


def measure(args) -> None:
  work = os.path.abspath(args.work)
  os.makedirs(work, exist_ok=True)
  with open(os.path.join(work, "text.txt"), "w") as f:
    f.write(TEXT * 40)
  with open(os.path.join(work, "eval.txt"), "w") as f:
    f.write(TEXT)
  path = os.path.join(args.out, "results.json")
  record = {"rows": []}
  if (args.only or args.notes) and os.path.exists(path):
    with open(path) as f:
      record = json.load(f)
  only = set(args.only.split(",")) if args.only else None
  kept = {r["name"]: r for r in record["rows"]}
  defined = rows(args, work)
  for row in defined:
    if args.notes and not only:
      break  # only the notes: the rows as they are
    if only and not any(o in row["name"] for o in only):
      continue
    if row.get("fresh"):
      shutil.rmtree(row["fresh"], ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    if row["devices"] > 1 and not row.get("launch"):
      env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={row['devices']}"
    result = capped(args.cap, row["cmd"], env, ROOT)
    kept[row["name"]] = {
      "name": row["name"],
      "limit_gb": row["limit"] and row["limit"]["gb"],
      "limit_terms": row["limit"] and row["limit"]["terms"],
      "commit": head_commit(),
      "cap_gib": args.cap,
      "peer": bool(row.get("peer")),
      "command": " ".join(
        os.path.relpath(c, ROOT) if c.startswith(work) else c for c in row["cmd"][2:]
      )
      if not row.get("peer")
      else "transformers (HF_PEER in this script)",
      **result,
    }
    print(json.dumps(kept[row["name"]]), flush=True)
  order, old = [r["name"] for r in defined], record
  for row in defined:  # the limits as this script states them, for kept rows too
    if row["name"] in kept:
      kept[row["name"]]["limit_gb"] = row["limit"] and row["limit"]["gb"]
      kept[row["name"]]["limit_terms"] = row["limit"] and row["limit"]["terms"]
  record = {
    "date": utc_now(),
    "machine": machine_line(),
    "command": shlex.join(sys.argv),
    "commit": head_commit(),
    "checkpoint_gb": {os.path.basename(d): round(checkpoint_bytes(d) / GB, 2) for d in args.dirs},
    "checkpoint_bytes": {os.path.basename(d): checkpoint_bytes(d) for d in args.dirs},
    "layer_bytes": {os.path.basename(d): layer_bytes(config_of(d)) for d in args.dirs},
    "lora_base_bytes": checkpoint_bytes(args.dirs[0]),
    "lora_step_bytes": step_bytes(os.path.join(work, "lora_ggg_2proc", "checkpoints"))
    or old.get("lora_step_bytes"),
    "rows": [kept[n] for n in order if n in kept],
    "notes": open(args.notes).read() if args.notes else old.get("notes", ""),
  }
  if args.notes and not only:  # the notes added to the page of the runs: its line stays
    record |= {k: old[k] for k in ("date", "machine", "command", "commit")}
  write_page(args.out, record, "results.json", page(record), "README.md")


def head_commit() -> str:
  """This tree's commit (short), + where the tree has uncommitted changes."""
  git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout  # noqa: E731
  return git("rev-parse", "--short", "HEAD").strip() + (
    "+" if git("status", "--porcelain", "-uno").strip() else ""
  )


def step_bytes(path: str) -> dict | None:
  """Each kept checkpoint step's bytes on disk."""
  if not os.path.isdir(path):
    return None
  size = lambda d: sum(os.path.getsize(os.path.join(p, n)) for p, _, ns in os.walk(d) for n in ns)  # noqa: E731
  return {s: size(os.path.join(path, s)) for s in sorted(os.listdir(path)) if s.isdigit()}


def page(r: dict) -> str:
  lines = [
    "# Real-size models in and out: memory against the limits",
    "",
    f"Command: `python {r['command']}`  ",
    f"Date: {r['date']}  ",
    f"Machine: {r['machine']}  ",
    f"Code: {r['commit']} when the page was written; each row names the commit checked out when it"
    " finished (+: with uncommitted changes)",
    "",
    "Random bf16 HF directories (`experiments/model_io.py make`): "
    + ", ".join(f"{k} {v} GB" for k, v in r["checkpoint_gb"].items())
    + ". Each command in a memory cgroup (its cap: the row's `cap_gib` in results.json); peak RSS"
    " from /usr/bin/time -v"
    " (for `launch`, its largest process). rc 137: killed at the cap. The limits are in this"
    " script's docstring (W: the bf16 weights the process's devices hold at P; Lg: two"
    " gathered layers per device).",
    "",
    "| what | rc | peak RSS (GB) | limit (GB) | met | seconds | code |",
    "|---|---|---|---|---|---|---|",
  ]
  for row in r["rows"]:
    lim = row["limit_gb"]
    met = "-" if lim is None else ("yes" if row["rc"] == 0 and row["peak_rss_gb"] <= lim else "NO")
    lines.append(
      f"| {row['name']} | {row['rc']} | {row['peak_rss_gb']} | {lim if lim else '-'} | {met} "
      f"| {row['seconds']} | {row['commit']} |"
    )
  if r.get("lora_step_bytes"):
    base = r["lora_base_bytes"]
    sizes = ", ".join(f"step {s}: {b / 1e6:.1f} MB" for s, b in r["lora_step_bytes"].items())
    worst = max(r["lora_step_bytes"].values()) / base
    lines += [
      "",
      f"The two-process LoRA run's checkpoints (GGG, rank 8, without `--keep-base`): {sizes}; "
      "the largest is "
      f"{100 * worst:.2f}% of the 1B base's bytes (limit 5%).",
    ]
  if r.get("notes"):
    lines += ["", "## Notes (written after the runs)", "", r["notes"].strip()]
  return "\n".join(lines) + "\n"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dirs", nargs=3, required=True, metavar=("DIR_1B", "DIR_3B", "DIR_8B"))
  p.add_argument("--hf-python", required=True, help="a python with torch and transformers")
  p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "model_io_limits"))
  p.add_argument("--work", default="/tmp/model_io_limits", help="runs and exports (not kept)")
  p.add_argument("--cap", type=int, default=22)
  p.add_argument("--only", default="", help="comma-separated parts of row names")
  p.add_argument("--notes", help="a markdown file: the page's notes, written after the runs")
  measure(p.parse_args())


if __name__ == "__main__":
  main()
