"""`paro-jax plan` (no devices needed) and `paro-jax probe` (measures the mesh it runs on): their
flags and their entries. Imports no jax: probe's measurements are imported once devices exist."""

from __future__ import annotations

from paro_jax.analysis.planner.config import PlanConfig
from paro_jax.analysis.planner.planner import run_plan
from paro_jax.core.config import options
from paro_jax.core.flags import Invocation, add_options, add_process_flags, add_wire, config_of


def add_plan_parser(sub) -> None:
  plan = sub.add_parser(
    "plan", help="rank the 14 strategies for a cluster: memory, step time, the pick and why"
  )
  own = [path for path, _ in options(PlanConfig) if not path.startswith("wire.")]
  add_options(plan, PlanConfig, *own)
  add_wire(plan, PlanConfig)


def plan_main(args, inv: Invocation) -> None:
  run_plan(config_of(args, PlanConfig))


def add_probe_parser(sub) -> None:
  probe = sub.add_parser(
    "probe",
    help="measure collectives (per level) and FLOP/s of this mesh "
    "into a JSON profile for `plan --profile`",
  )
  probe.add_argument(
    "--mesh", default=None, help="GROUPSxDEVICES, e.g. 2x4 (default: one group per process)"
  )
  probe.add_argument(
    "--sizes",
    default="64KiB,1MiB,4MiB",
    help="per-device buffer sizes, comma-separated (default %(default)s)",
  )
  probe.add_argument("--repeats", type=int, default=5, help="timed calls per size (median)")
  probe.add_argument("--no-flops", action="store_true", help="skip the matmul FLOP/s")
  probe.add_argument("--out", default="probe.json", help="the JSON profile to write")
  add_process_flags(probe.add_argument_group("multi-process", "as for train"))


def probe_main(args, inv: Invocation) -> None:
  from paro_jax.analysis.planner.probe import run_probe  # jax: after the device flag is set

  run_probe(inv.mesh, args.sizes, args.repeats, not args.no_flops, args.out)
