"""The `paro-jax` command line. Flags are parsed here and nowhere else."""

from __future__ import annotations

import argparse
import os
import sys

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _provide_cpu_devices(count: int) -> None:
  """Ask XLA for `count` virtual CPU devices; must run before jax is imported.

  The flag only shapes the host (CPU) platform, so it is harmless where a GPU is the backend.
  A count the user already set in XLA_FLAGS is left alone.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if DEVICE_COUNT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()


def parse_mesh_shape(text: str) -> tuple[int, int]:
  """'2x4' -> (inter=2, intra=4)."""
  parts = text.lower().split("x")
  if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"bad --mesh {text!r}: write GROUPSxDEVICES_PER_GROUP, e.g. 2x4 "
                     f"(2 groups, i.e. nodes, of 4 devices each)")
  return int(parts[0]), int(parts[1])


def _add_common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default="tiny", help="preset: tiny, small, 7b, 13b, 65b")
  p.add_argument("--strategy", default="IIG",
                 help="three letters P,G,OS from {N,I,G} (e.g. IIG) or ddp/zero1/zero2/zero3/mics")
  p.add_argument("--mesh", default=None,
                 help="GROUPSxDEVICES, e.g. 2x4 (default: one group per process)")
  p.add_argument("--micro-batches", type=int, default=1, help="A: micro-batches per step")
  p.add_argument("--batch-size", type=int, default=16, help="global micro-batch size (sequences)")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="compute dtype")
  p.add_argument("--collectives", default="xla", choices=["xla", "ring", "hring", "horing"])


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="paro-jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  train = sub.add_parser("train", help="train a Flax LLaMA with a PaRO strategy")
  _add_common(train)
  train.add_argument("--steps", type=int, default=50)
  train.add_argument("--seed", type=int, default=0)
  train.add_argument("--lr", type=float, default=3e-3)
  train.add_argument("--warmup", type=int, default=10)
  train.add_argument("--data", default=None, help="a text file (default: built-in corpus)")
  train.add_argument("--out", default="runs/latest", help="run directory (metrics.jsonl)")
  return parser


def main(argv=None) -> None:
  args = build_parser().parse_args(argv)
  try:
    mesh = parse_mesh_shape(args.mesh) if args.mesh else None
    if mesh:
      _provide_cpu_devices(mesh[0] * mesh[1])
    if args.command == "train":
      from paro_jax.train import RunConfig, train  # imports jax: after the device flag is set

      train(RunConfig(
          model=args.model, strategy=args.strategy, mesh=mesh, micro_batches=args.micro_batches,
          batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
          collectives=args.collectives, steps=args.steps, seed=args.seed, lr=args.lr,
          warmup=args.warmup, data=args.data, out=args.out))
  except (ValueError, FileNotFoundError) as e:
    print(f"paro-jax: error: {e}", file=sys.stderr)
    sys.exit(2)
