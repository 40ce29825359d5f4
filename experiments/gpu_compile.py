"""One step compiled for a GPU target without a GPU, kept on disk: its scheduled HLO and what
XLA's scheduler logged while compiling it, so the roofline and the estimate composed from them
(paro_jax/analysis/gpu/) can be re-read without compiling again.

  python experiments/gpu_compile.py --model 7b --layers 4 --mesh 1x1 --old all --out DIR/NAME

writes DIR/NAME.hlo, DIR/NAME.log (XLA's scheduler statistics) and DIR/NAME.json (the run's
settings, tokens and model FLOPs per step, and `report`: what `paro-jax inspect --target --json`
reports of the program: overlap, memory, non-matmul bytes by purpose, estimate). `--old` undoes
the GPU step's changes as experiments/gpu_variants.py does (`all`: the step as measured on the H100
of experiments/results/gpu_measure/). Run one per process: XLA reads its logging and network
options once, when jax starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--target", default="h100")
  ap.add_argument("--model", default="7b")
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--mesh", default="1x1")
  ap.add_argument("--strategy", default="IIG")
  ap.add_argument("--collectives", default="xla")
  ap.add_argument("--micro-batches", type=int, default=1)
  ap.add_argument("--batch-size", type=int, default=None, help="default: one sequence per GPU")
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--remat", default="full")
  ap.add_argument("--attention", default="cudnn")
  ap.add_argument("--old", default="none", help="as gpu_measure.py's (gpu_variants.py)")
  ap.add_argument("--out", required=True, help="path prefix of the .hlo, .log and .json")
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  from experiments import gpu_variants
  from paro_jax.analysis.gpu import estimate, targets
  from paro_jax.core.names import parse_mesh_shape

  old = gpu_variants.parse(args.old)
  inter, intra = parse_mesh_shape(args.mesh)
  targets.prepare_deviceless_compile()
  estimate.prepare_environment(None, intra)  # before jax starts
  from paro_jax.analysis.inspect.abstract import compile_for_target
  from paro_jax.analysis.inspect.gpu_report import gpu_report
  from paro_jax.core.mesh import make_mesh
  from paro_jax.core.xla_flags import GPU_FLAGS

  mesh = make_mesh(inter, intra, devices=targets.devices(args.target, inter, intra))
  engine = gpu_variants.engine_for(args, mesh, old)
  cfg = engine.model.cfg
  batch = args.batch_size or inter * intra
  t = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="gpu_compile-") as dump:
    with gpu_variants.undone(old, engine), estimate.captured_stderr() as log:
      compiled = compile_for_target(engine, args.target, batch, args.seq_len, GPU_FLAGS, dump)
    report = gpu_report(engine, compiled, args.target, batch, args.seq_len, dump, log[0])
  report["overlap"].pop("collectives", None)  # per-op rows: not kept
  tokens = args.micro_batches * batch * args.seq_len
  meta = {
    **vars(args),
    "old": list(old),
    "layers": cfg.layers,
    "batch_size": batch,
    "tokens_per_step": tokens,
    "flops_per_step": cfg.flops_per_token(args.seq_len) * tokens,
    "compile_s": time.perf_counter() - t,
    "report": report,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".hlo", "w") as f:
    f.write(compiled.as_text())
  with open(args.out + ".log", "w") as f:
    f.write("".join(line for line in log[0].splitlines(True) if "latency_hiding" in line))
  with open(args.out + ".json", "w") as f:
    json.dump(meta, f, indent=1, default=str)
  print(f"{args.out}: compiled in {meta['compile_s']:.0f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
