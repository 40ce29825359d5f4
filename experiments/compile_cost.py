"""CPU time of compiling test-sized steps under the XLA flags tests/conftest.py sets, with and
without each of them, and what the compiled programs send: the flags must cut compile work and
leave the collectives alone.

    python experiments/compile_cost.py --out experiments/results/compile_cost

Each setting runs in its own process (XLA reads its flags once). CPU time (`time.process_time`,
all threads) is counted rather than wall time, so the figures hold on a busy machine too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.pages import machine_line  # noqa: E402

BASE = ["--xla_force_host_platform_device_count=8"]
SETTINGS = {
  "XLA's defaults": [],
  "+ backend opt level 0, no expensive LLVM passes": [
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
  ],
  "+ older fusion emitters (tests/conftest.py)": [
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
  ],
}
STRATEGIES = ("IIG", "GGG", "NIG", "NNN")

CHILD = """
import json, sys, time
import jax.numpy as jnp
from models.llama import Llama, LlamaConfig
from paro_jax.analysis.abstract import abstract_inputs
from paro_jax.analysis.inspector import report
from paro_jax.core.engine import Engine, OptimConfig
from paro_jax.core.mesh import make_mesh
from paro_jax.core.strategy import parse_strategy

cfg = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)
out = {}
for name in sys.argv[1:]:
  engine = Engine(
    Llama(cfg, jnp.float32), parse_strategy(name), make_mesh(2, 4), OptimConfig(), micro_batches=4
  )
  lowered = engine.train_step.lower(*abstract_inputs(engine, 8, 8))
  start = time.process_time()
  compiled = lowered.compile()
  seconds = time.process_time() - start
  r = report(engine, compiled)
  out[name] = {"compile_cpu_s": seconds, **r["measured"]}
print(json.dumps(out))
"""


def measure(flags: list[str]) -> dict:
  root = pathlib.Path(__file__).resolve().parent.parent
  env = {**os.environ, "XLA_FLAGS": " ".join(BASE + flags), "JAX_PLATFORMS": "cpu"}
  env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
  done = subprocess.run(
    [sys.executable, "-c", CHILD, *STRATEGIES],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="experiments/results/compile_cost")
  args = ap.parse_args(argv)
  results = {name: measure(flags) for name, flags in SETTINGS.items()}
  os.makedirs(args.out, exist_ok=True)
  meta = {
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    "machine": machine_line(),
    "command": "python experiments/compile_cost.py " + " ".join(sys.argv[1:]),
  }
  with open(os.path.join(args.out, "compile_cost.json"), "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=1)
  lines = [
    "# Compile cost of test-sized steps under the tests' XLA flags",
    "",
    f"`{meta['command']}`",
    "",
    f"{meta['date']}; {meta['machine']}. The `test_inspector.py` model"
    " (vocab 64, dim 32, 2 layers) on 2x4 virtual CPU devices, A=4, XLA's collectives; CPU"
    " seconds of `lowered.compile()` (all threads), summed over "
    + ", ".join(STRATEGIES)
    + ". The bytes are what the compiled programs send (`paro-jax inspect`'s measured traffic)."
    " CPU time, not wall time: other jobs may share the machine (contention inflates CPU time"
    " somewhat; the rows ran one after the other).",
    "",
    "| flags | compile CPU s | inter bytes | intra bytes | same bytes as XLA's defaults |",
    "|---|---:|---:|---:|---|",
  ]
  ref = results["XLA's defaults"]
  for name, r in results.items():
    cpu = sum(v["compile_cpu_s"] for v in r.values())
    inter = sum(v["inter_bytes"] for v in r.values())
    intra = sum(v["intra_bytes"] for v in r.values())
    same = all(
      r[s]["inter_bytes"] == ref[s]["inter_bytes"] and r[s]["intra_bytes"] == ref[s]["intra_bytes"]
      for s in STRATEGIES
    )
    lines.append(
      f"| {name} | {cpu:.2f} | {inter:,.0f} | {intra:,.0f} | {'yes' if same else 'NO'} |"
    )
  with open(os.path.join(args.out, "README.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
