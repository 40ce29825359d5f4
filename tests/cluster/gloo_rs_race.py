"""XLA:CPU's reduce-scatter through gloo returns wrong sums now and then; an all-reduce does not.

  python -m paro_jax launch --nodes 2 --devices-per-node 2 --loopback -- \
    python tests/cluster/gloo_rs_race.py --reps 100 --out experiments/results/gloo_rs_race

Each process sums, over its own devices (the mesh's `intra` axis, which jaxlib 0.10.2 runs through
gloo once jax.distributed joins processes), `lax.psum_scatter` of an array of small integers, whose
fp32 sums are exact, REPS times, and counts the device results that differ from the exact sums:
first with gloo's reduce-scatter (`maybe_initialize(gloo_reduce_scatter=True)`), then with the
lowering every multi-process run uses (paro_jax/cluster/gloo_rs.py: an all-reduce and a slice).
With two devices a process, it also checks the mechanism paro_jax/cluster/gloo_rs.py describes:
every wrong element of device 0 equals its own element plus device 1's *reduced* element of the
other half (device 1 overwrote the data it was still sending). Process 0 writes OUT/race.json and
OUT/README.md.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from experiments.pages import machine_line, utc_now, write_page


def operands(g: int, m: int, n: int) -> np.ndarray:
  """[G, M, n] fp32 integers below 2^20: every sum over M <= 16 devices is exact in fp32."""
  i = np.arange(n, dtype=np.int64)
  return np.stack(
    [np.stack([(i % 4096) + 8192 * (1 + d) + 65536 * k for d in range(m)]) for k in range(g)]
  ).astype(np.float32)


def count_wrong(f, x, X: np.ndarray, reps: int) -> dict:
  """Over `reps` calls: device results that differ from the exact sums, their wrong elements, and
  (two devices a process) how many of those equal the stale-send value."""
  g, m, n = X.shape
  h = n // m
  bad_results, wrong, stale = 0, [], 0
  for _ in range(reps):
    y = f(x)
    for s in y.addressable_shards:
      k, d = s.index[0].start, s.index[1].start
      got = np.asarray(s.data)[0, 0]
      want = X[k, :, d * h : (d + 1) * h].sum(axis=0)
      idx = np.nonzero(got != want)[0]
      if len(idx):
        bad_results += 1
        wrong.append(int(len(idx)))
        if m == 2 and d == 0:  # device 1's reduced second half instead of its first half
          stale_value = X[k, 0, :h] + X[k, 0, h:] + X[k, 1, h:]
          stale += int(np.all(got[idx] == stale_value[idx]))
  return {
    "device_results": reps * len(y.addressable_shards),
    "wrong_results": bad_results,
    "wrong_elements": wrong,
    "wrong_results_explained_by_stale_send": stale,
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--reps", type=int, default=100)
  p.add_argument("--elements", type=int, default=1 << 22, help="per device, before the scatter")
  p.add_argument("--out", default="experiments/results/gloo_rs_race")
  p.add_argument("--mesh", required=True, help="GxM (appended by paro-jax launch)")
  p.add_argument("--coordinator")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  args = p.parse_args()
  from paro_jax.cluster import gloo_rs
  from paro_jax.cluster.distributed import maybe_initialize

  maybe_initialize(args.coordinator, args.num_processes, args.process_id, gloo_reduce_scatter=True)
  import jax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  g, m = (int(v) for v in args.mesh.split("x"))
  mesh = Mesh(np.array(jax.devices()).reshape(g, m), ("inter", "intra"))
  X = operands(g, m, args.elements)
  spec = P("inter", "intra")
  x = jax.make_array_from_callback(X.shape, NamedSharding(mesh, spec), lambda i: X[i])

  def program():  # a new function each time: compiled with the lowering registered now
    def body(v):
      return jax.lax.psum_scatter(v[0, 0], "intra", scatter_dimension=0, tiled=True)[None, None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

  results = {}
  for name in ("gloo reduce-scatter", "all-reduce and slice"):
    if name == "all-reduce and slice":
      gloo_rs.register()
    f = program()
    hlo = f.lower(x).compile().as_text()
    mine = count_wrong(f, x, X, args.reps)
    every = (
      multihost_utils.process_allgather(
        np.array(
          [
            mine["device_results"],
            mine["wrong_results"],
            mine["wrong_results_explained_by_stale_send"],
          ]
        )
      )
      .reshape(-1, 3)
      .sum(axis=0)
    )
    wrong = multihost_utils.process_allgather(np.array([max(mine["wrong_elements"], default=0)]))
    results[name] = {
      "hlo_reduce_scatters": hlo.count("reduce-scatter("),
      "hlo_all_reduces": hlo.count("all-reduce("),
      "device_results": int(every[0]),
      "wrong_results": int(every[1]),
      "wrong_results_explained_by_stale_send": int(every[2]),
      "most_wrong_elements": int(np.max(wrong)),
    }
    if jax.process_index() == 0:
      print(name, json.dumps(results[name]), flush=True)
  if jax.process_index():
    return
  page = {
    "command": f"python -m paro_jax launch --nodes {g} --devices-per-node {m} --loopback -- "
    f"python tests/cluster/gloo_rs_race.py --reps {args.reps} --elements {args.elements} "
    f"--out {args.out}",
    "date": utc_now(),
    "machine": machine_line(),
    "mesh": args.mesh,
    "elements": args.elements,
    "reps": args.reps,
    "results": results,
  }
  write_page(args.out, page, "race.json", _page(page), "README.md")


def _page(page: dict) -> str:
  lines = [
    "# XLA:CPU's reduce-scatter through gloo, against an all-reduce and a slice",
    "",
    f"`{page['command']}`, {page['date']}, "
    f"{page['machine']}, mesh {page['mesh']}, one process a node.",
    "",
    f"Each device reduce-scatters {page['elements']} small-integer fp32 elements over its "
    f"process's devices {page['reps']} times; a result is wrong where any element differs from "
    "the exact sum. Stale send: every wrong element equals its device's own element plus the "
    "other device's reduced element of the other half (two devices a process only).",
    "",
    "| lowering | reduce-scatters in HLO | all-reduces in HLO | wrong device results | "
    "explained by a stale send | most wrong elements in one result |",
    "|---|---|---|---|---|---|",
  ]
  for name, r in page["results"].items():
    lines.append(
      f"| {name} | {r['hlo_reduce_scatters']} | {r['hlo_all_reduces']} | "
      f"{r['wrong_results']} of {r['device_results']} | "
      f"{r['wrong_results_explained_by_stale_send']} | {r['most_wrong_elements']} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
