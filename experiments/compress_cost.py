"""What compressing the inter-node traffic costs in compute: the wire formats' quantize and
dequantize (paro_jax/core/compress.py), timed on the device present.

Each format's encode (`quantize`) and decode (`dequantize` back to the tensor's dtype) of a
bf16 tensor (parameters on the wire) and an fp32 one (gradients with `--grad-dtype fp32`) is
jitted alone and timed: the median of `--reps` calls after 5 of warm-up, each waited for. The
page gives each time, the bytes each moves (read plus written) over it, and the time over a
reference compute time (`--per`, e.g. one layer's forward and backward on the same device) for
the tensors a step encodes and decodes per that time.

  python experiments/compress_cost.py --sizes 202375168 --out experiments/results/compress_cost
  python experiments/compress_cost.py --sizes 1048576 --reps 5 --out /tmp/cc   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ("int8", "bf16")


def _time(fn, x, reps: int) -> float:
  import jax  # imported by main first

  for _ in range(5):
    jax.block_until_ready(fn(x))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def measure(sizes: list[int], reps: int, block: int, dtypes=("bfloat16",)) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from paro_jax.core.wire import Codec, SCALE_BYTES
  from paro_jax.core.compress import dequantize, quantize

  rows = []
  for n, dtype in ((n, d) for n in sizes for d in dtypes):
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32).astype(dtype)
    for fmt in FORMATS:
      if fmt == "bf16" and x.dtype == jnp.bfloat16:
        continue  # bf16 on the wire of a bf16 tensor is the tensor itself: nothing to time
      codec = Codec(fmt, block)
      encode = jax.jit(lambda v, c=codec: quantize(v, c))
      payload = encode(x)
      decode = jax.jit(lambda p, c=codec, d=x.dtype: dequantize(p, c, (n,), d))
      wire = sum(p.size * p.dtype.itemsize for p in payload)
      if fmt == "int8":
        assert wire == n + -(-n // block) * SCALE_BYTES, wire
      t_enc, t_dec = _time(encode, x, reps), _time(decode, payload, reps)
      rows.append(
        {
          "format": fmt,
          "dtype": str(x.dtype),
          "elements": n,
          "wire_bytes": wire,
          "encode_s": t_enc,
          "decode_s": t_dec,
          # read the tensor and write the payload; read the payload and write the tensor
          "encode_bytes_per_s": (x.nbytes + wire) / t_enc,
          "decode_bytes_per_s": (x.nbytes + wire) / t_dec,
        }
      )
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--sizes", default="202375168", help="elements, comma-separated")
  ap.add_argument("--reps", type=int, default=50)
  ap.add_argument("--block", type=int, default=32)
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument(
    "--per",
    default=None,
    help="NAME=SECONDS: a compute time to compare with (e.g. 7b-layer=8.28e-3)",
  )
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  import jax

  from experiments.pages import machine_line, utc_now, write_page

  device = jax.devices()[0]
  sizes = [int(s) for s in args.sizes.split(",")]
  rows = measure(sizes, args.reps, args.block, args.dtypes.split(","))
  per = None
  if args.per:
    name, seconds = args.per.split("=")
    per = (name, float(seconds))
  record = {
    "date": utc_now(),
    "machine": machine_line(),
    "device": f"{device.platform}: {device.device_kind}",
    "jax": jax.__version__,
    "block": args.block,
    "reps": args.reps,
    "per": per,
    "rows": rows,
  }
  lines = [
    "# What the wire formats cost in compute",
    "",
    f"{record['device']}, jax {record['jax']}, {record['date']} ({record['machine']}); "
    f"`python experiments/compress_cost.py --sizes {args.sizes} --reps {args.reps} "
    f"--block {args.block} --dtypes {args.dtypes}"
    + (f" --per {args.per}" if args.per else "")
    + f" --out DIR`: the median of {args.reps} jitted calls, after 5 of warm-up.",
    "",
    "| format | tensor | elements | wire bytes | encode (ms) | decode (ms) | encode GB/s | "
    "decode GB/s |" + (f" encode + decode / {per[0]} |" if per else ""),
    "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if per else ""),
  ]
  for r in rows:
    lines.append(
      f"| {r['format']} | {r['dtype']} | {r['elements']:,} | {r['wire_bytes']:,} | "
      f"{r['encode_s'] * 1e3:.3f} | "
      f"{r['decode_s'] * 1e3:.3f} | {r['encode_bytes_per_s'] / 1e9:.0f} | "
      f"{r['decode_bytes_per_s'] / 1e9:.0f} |"
      + (f" {(r['encode_s'] + r['decode_s']) / per[1]:.1%} |" if per else "")
    )
  write_page(args.out, record, "compress_cost.json", "\n".join(lines) + "\n", "README.md")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
