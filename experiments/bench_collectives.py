"""Time all-gather and reduce-scatter over both mesh axes for the four implementations.

Sizes are the per-device buffer (the all-gather's result, the reduce-scatter's input), from
1 KB to 64 MB. On one machine's virtual CPU devices every "link" is a memory copy, so this
shows the cost of each schedule's steps rather than link bandwidth; under `paro-jax launch`
(one process per node, shaped links) the inter level is a real, slower network.

  python experiments/bench_collectives.py --mesh 2x4 --out experiments/results/collectives_1proc
  paro-jax launch --nodes 2 --devices-per-node 4 --inter-bandwidth 1gbit -- \
      python experiments/bench_collectives.py --out experiments/results/collectives_2node_1gbit

Under the launcher each process gets --mesh GxM and --coordinator/--num-processes/--process-id;
all processes run the same programs and process 0 reports its own timings (the collectives
synchronise them) and writes the files. The link description the launcher exports
(PARO_JAX_LINK) and --note go into the JSON's meta.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from paro_jax.cluster import distributed  # noqa: E402
from paro_jax.core.names import parse_mesh_shape  # noqa: E402
from paro_jax.core.xla_flags import provide_cpu_devices  # noqa: E402
from paro_jax.core.xla_flags import add_xla_flags  # noqa: E402


def _shape_of(shape, idx):
  """The shape of `np.empty(shape)[idx]`, without allocating it."""
  import numpy as np

  return np.broadcast_to(np.zeros((), np.int8), shape)[idx].shape


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--mesh", default="2x4")
  ap.add_argument("--min-bytes", type=int, default=2**10)
  ap.add_argument("--max-bytes", type=int, default=2**26)
  ap.add_argument("--factor", type=int, default=4, help="size step between measurements")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--impls", default="xla,ring,hring,horing")
  ap.add_argument("--out", default="experiments/results/collectives")
  ap.add_argument("--note", default=None, help="free text recorded in the JSON's meta")
  dist = ap.add_argument_group("multi-process", "set by `paro-jax launch`")
  dist.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  dist.add_argument("--num-processes", type=int, default=None)
  dist.add_argument("--process-id", type=int, default=None)
  args = ap.parse_args()
  inter, intra = parse_mesh_shape(args.mesh)
  multi = (args.coordinator, args.num_processes, args.process_id)
  processes = distributed.process_count(*multi)
  if (inter * intra) % processes:
    ap.error(f"--mesh {args.mesh} is not divisible among {processes} processes")
  provide_cpu_devices(inter * intra // processes)  # per process
  add_xla_flags()  # as `paro-jax train` does (GPU overlap flags; harmless on CPU)
  distributed.maybe_initialize(*multi)  # before anything touches devices

  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from paro_jax.core import collectives
  from paro_jax.core.mesh import make_mesh

  mesh = make_mesh(inter, intra)
  n, axes = inter * intra, ("intra", "inter")
  spec = P(("intra", "inter"))  # the G layout: intra-major
  results = []
  lead = jax.process_index() == 0
  say = print if lead else (lambda *a, **k: None)

  def place(shape, spec):
    """A global f32 array of ones, each process filling only its own shards."""
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(
      shape, sharding, lambda idx: np.ones(_shape_of(shape, idx), np.float32)
    )

  def timed(fn, x):
    jax.block_until_ready(fn(x))  # compile and warm up
    times = []
    for _ in range(args.repeats):
      t = time.perf_counter()
      jax.block_until_ready(fn(x))
      times.append(time.perf_counter() - t)
    return statistics.median(times)

  size = args.min_bytes
  say(f"{'op':16s}{'bytes/device':>14s}" + "".join(f"{i:>12s}" for i in args.impls.split(",")))
  while size <= args.max_bytes:
    elems = max(n, size // 4 // n * n)  # f32, divisible by n
    row = {}
    for op in ("all_gather", "reduce_scatter"):
      times = {}
      for impl in args.impls.split(","):
        if op == "all_gather":  # per-device shard elems/n -> full buffer of elems
          body = lambda x, impl=impl: collectives.all_gather(x, axes, dim=0, impl=impl)
          x = place((elems,), spec)
          out_spec = P(("inter", "intra"))
        else:  # per-device buffer of elems -> shard of elems/n
          body = lambda x, impl=impl: collectives.reduce_scatter(x, axes, dim=0, impl=impl)
          x = place((elems * n,), P(("inter", "intra")))
          out_spec = spec
        # Hand-written rings give replicated results typed varying, so they run without check_vma
        # (the docstring of paro_jax/core/collectives.py; Engine._train_step in core/engine.py).
        fn = jax.jit(
          jax.shard_map(
            body, mesh=mesh, in_specs=x.sharding.spec, out_specs=out_spec, check_vma=impl == "xla"
          )
        )
        times[impl] = timed(fn, x)
        results.append(
          {"op": op, "impl": impl, "bytes_per_device": elems * 4, "seconds": times[impl]}
        )
      row[op] = times
      say(
        f"{op:16s}{elems * 4:14d}" + "".join(f"{t * 1e3:10.3f}ms" for t in times.values()),
        flush=True,
      )
    size *= args.factor

  if not lead:
    return
  os.makedirs(args.out, exist_ok=True)
  meta = {
    "mesh": {"inter": inter, "intra": intra},
    "platform": jax.devices()[0].platform,
    "device_kind": jax.devices()[0].device_kind,
    "processes": jax.process_count(),
    "machine": platform.machine(),
    "cpu_count": os.cpu_count(),
    "jax": jax.__version__,
    "repeats": args.repeats,
    "local_devices": jax.local_device_count(),
    "link": os.environ.get("PARO_JAX_LINK", "one process: no network link"),
    "note": args.note,
  }
  with open(os.path.join(args.out, "collectives.json"), "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=2)
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot (pip install -e '.[plots]')")
    return
  fig, panels = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, op in zip(panels, ("all_gather", "reduce_scatter")):
    for impl in args.impls.split(","):
      pts = [
        (r["bytes_per_device"], r["seconds"])
        for r in results
        if r["op"] == op and r["impl"] == impl
      ]
      ax.loglog(*zip(*pts), marker="o", label=impl)
    where = f", {processes} processes" if processes > 1 else ", 1 process"
    ax.set_title(f"{op} over (intra, inter), mesh {inter}x{intra}{where}", fontsize=10)
    ax.set_xlabel("bytes per device")
    ax.grid(True, which="both", alpha=0.3)
  panels[0].set_ylabel("seconds (median)")
  panels[0].legend()
  import textwrap

  footer = f"link: {meta['link']}" + (f"  ({args.note})" if args.note else "")
  fig.text(0.5, 0.005, textwrap.fill(footer, 170), ha="center", va="bottom", fontsize=7)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(os.path.join(args.out, "collectives.png"), dpi=120)
  print(f"wrote {args.out}/collectives.json and collectives.png")


if __name__ == "__main__":
  main()
