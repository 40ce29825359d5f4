"""`paro-jax inspect`: its flags and its entry (analysis/inspect/inspection.py compiles and
reports). Imports no jax: the CLI builds the parser before jax starts, and the compile is imported
once the device flags (or the GPU target's environment) are set."""

from __future__ import annotations

from paro_jax.analysis.gpu import targets
from paro_jax.analysis.inspect.config import InspectConfig
from paro_jax.core.flags import Invocation, add_options, add_step_flags, check_shape, config_of
from paro_jax.core.units import parse_rate


def add_parser(sub) -> None:
  inspect = sub.add_parser(
    "inspect", help="compile a training step (no allocation) and report its communication"
  )
  add_step_flags(inspect, InspectConfig)
  add_options(inspect, InspectConfig, "as_json", "target", "inter_bandwidth", "prefetch")
  add_options(inspect, InspectConfig, "hlo_out", "pack")


def check_args(args) -> None:
  if args.inter_bandwidth and not args.target:
    raise ValueError(
      "--inter-bandwidth sets the link of XLA's step-time estimate, made only for a GPU "
      "compile: pass --target h100 (or h200) with it, or leave it out"
    )


def main_for_target(args, inv: Invocation) -> None:
  """A compile for GPUs described, not present: no devices; XLA's environment set first."""
  check_shape(args, inv.mesh)
  args.target = targets.check_target(args.target)
  targets.prepare_deviceless_compile()
  from paro_jax.analysis.gpu import estimate  # numpy: not at the CLI's start

  if inv.mesh is None:
    raise ValueError("--target needs --mesh NODESxGPUS, e.g. --mesh 2x8")
  rate = parse_rate(args.inter_bandwidth) if args.inter_bandwidth else None
  estimate.prepare_environment(rate, inv.mesh[1])  # before jax starts: XLA reads it once
  from paro_jax.analysis.inspect.inspection import inspect  # jax: once XLA's environment is set

  inspect(config_of(args, InspectConfig, mesh=inv.mesh))


def main(args, inv: Invocation) -> None:
  """On this machine's devices, set up by the entry point."""
  from paro_jax.analysis.inspect.inspection import inspect  # jax: after the device flags

  inspect(config_of(args, InspectConfig, mesh=inv.mesh))
