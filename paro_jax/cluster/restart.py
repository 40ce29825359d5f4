"""Restarting a launch that lost a node: the train command continuing from the newest checkpoint
on the nodes left (no jax: the launcher process never imports it)."""

from __future__ import annotations

import math
import os


def _flag(argv: list[str], name: str, default: str | None) -> str | None:
  """The last value of `--name V` / `--name=V` in argv."""
  value = default
  for i, a in enumerate(argv):
    if a == name and i + 1 < len(argv):
      value = argv[i + 1]
    elif a.startswith(name + "="):
      value = a.split("=", 1)[1]
  return value


def _without(argv: list[str], name: str) -> list[str]:
  """argv without `--name V` / `--name=V`."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a == name:
      skip = True
    elif not a.startswith(name + "="):
      out.append(a)
  return out


def checkpoint_steps(out: str) -> list[int]:
  """The finished checkpoints of run directory `out` (paro_jax/run/checkpoint.py, no jax)."""
  d = os.path.join(out, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def restart_argv(train_argv: list[str], nodes: int, devices_per_node: int) -> tuple[list, str]:
  """The train command continuing a failed run on `nodes` nodes, and what changes; ValueError
  where the run cannot continue there."""
  if not train_argv or train_argv[0] != "train":
    raise ValueError("only a `train` command can be restarted")
  if nodes < 1:
    raise ValueError("no node is left")
  out = _flag(train_argv, "--out", "runs/latest")
  steps = checkpoint_steps(out)
  if not steps:
    raise ValueError(
      f"{out} holds no checkpoint to continue from: pass --checkpoint-every N to the train "
      f"command so that a run can restart"
    )
  batch = int(_flag(train_argv, "--batch-size", "16"))
  old = [a for i, a in enumerate(train_argv) if a == "--mesh" or a.startswith("--mesh=")]
  was = nodes + 1
  devices = nodes * devices_per_node
  if batch % devices:
    raise ValueError(
      f"the global batch of {batch} sequences cannot be kept on {nodes} nodes x "
      f"{devices_per_node} devices ({batch} is not divisible by {devices}): pass a --batch-size "
      f"divisible by the device counts the run may shrink to (e.g. "
      f"{math.lcm(devices, was * devices_per_node)})"
    )
  argv = _without(train_argv, "--mesh") if old else list(train_argv)
  if "--resume" not in argv:
    argv.append("--resume")
  rows = (batch // (was * devices_per_node), batch // devices)
  why = (
    f"continuing on {nodes} nodes (mesh {nodes}x{devices_per_node}) from checkpoint step "
    f"{steps[-1]} in {out}/checkpoints (states resharded, the steps after it redone): the global "
    f"batch stays {batch} sequences per micro-batch, in the same order, now {rows[1]} rows per "
    f"device instead of {rows[0]}"
  )
  return argv, why
