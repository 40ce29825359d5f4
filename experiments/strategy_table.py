"""The README's strategy table: per-device memory and traffic of all 14 strategies, from the
analytic formulas of paro_jax/analysis/planner/costs.py (docs/design.md), for a model preset on a
G x M cluster.

  python experiments/strategy_table.py --model 7b --mesh 4x8 --micro-batches 8
"""

from __future__ import annotations

import argparse

from models.presets import get_config
from paro_jax.core.names import parse_mesh_shape
from paro_jax.analysis.planner.costs import model_state_bytes, step_traffic
from paro_jax.core.strategy import KNOWN_NAMES, VALID_NAMES, parse_strategy

WHEN = {
  "NNN": "small models; memory is plentiful",
  "NNI": "optimizer memory tight, inter links slow, params+grads fit",
  "NNG": "optimizer memory tight, inter links fast",
  "NII": "params fit replicated; cut grad+optimizer memory, one inter sync per step",
  "NIG": "params fit replicated (paper's pick when memory allows)",
  "NGG": "inter links fast, grads do not fit replicated",
  "INI": "dominated by III/IIG: grads replicated but params sharded",
  "ING": "few trainable params (LoRA/PEFT): no gradient traffic per micro-batch",
  "III": "memory per group is enough for one copy of everything",
  "IIG": "full training on slow inter links (paper's best trade-off)",
  "IGG": "less memory than IIG, inter traffic every micro-batch",
  "GNG": "rarely: global param gathers but replicated grads",
  "GIG": "rarely: global param gathers, intra grad reduction",
  "GGG": "memory is the limit; inter links fast",
}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default="7b")
  ap.add_argument("--mesh", default="4x8")
  ap.add_argument("--micro-batches", type=int, default=8)
  args = ap.parse_args()
  g, m = parse_mesh_shape(args.mesh)
  psi, A = get_config(args.model).param_count(), args.micro_batches
  gib = 2**30
  print(
    f"{args.model} ({psi / 1e9:.2f}B params) on {g} groups x {m} devices, A={A}, bf16 "
    f"params/grads, fp32 master+Adam; GiB per device"
  )
  print(
    "| strategy | known as | model states | inter / step, A=1 | inter / step, A="
    + str(A)
    + " | intra / step, A="
    + str(A)
    + " | when to use it |"
  )
  print("|---|---|---:|---:|---:|---:|---|")
  for name in VALID_NAMES:
    s = parse_strategy(name)
    mem = model_state_bytes(s, psi, psi, g, m)["total"] / gib
    one, many = (step_traffic(s, psi, psi, g, m, a) for a in (1, A))
    print(
      f"| {name} | {KNOWN_NAMES.get(name, '')} | {mem:.1f} | {one.inter / gib:.1f} | "
      f"{many.inter / gib:.1f} | {many.intra / gib:.1f} | {WHEN[name]} |"
    )


if __name__ == "__main__":
  main()
