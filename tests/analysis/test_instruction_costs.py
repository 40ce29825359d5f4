"""What XLA charged each instruction (its schedule dump) and the matmuls it prices out of line,
on a hand-written dump and module whose answer is known by hand."""

import pytest

from paro_jax.analysis.gpu import instruction_costs

# Four [1000,1000] x [1000,1000] bf16 matmuls (2e9 FLOPs each: 2 us at 1e15 FLOP/s, above their
# 6 MB / 2e12 B/s = 3 us of traffic, so the roofline is 3 us each) in a loop body run 5 times,
# and one in the entry. XLA charges the body's at 3, 3, 4.5 and 6 us and the entry's at 60 us.
HLO = """HloModule m, is_scheduled=true

%dot_comp (a: bf16[1000,1000], b: bf16[1000,1000]) -> bf16[1000,1000] {
  %a = bf16[1000,1000]{1,0} parameter(0)
  %b = bf16[1000,1000]{1,0} parameter(1)
  ROOT %d = bf16[1000,1000]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cond (c: bf16[1000,1000]) -> pred[] {
  %c = bf16[1000,1000]{1,0} parameter(0)
  ROOT %t = pred[] constant(true)
}

%body (x: bf16[1000,1000]) -> bf16[1000,1000] {
  %x = bf16[1000,1000]{1,0} parameter(0)
  %m1 = bf16[1000,1000]{1,0} fusion(%x, %x), kind=kCustom, calls=%dot_comp
  %m2 = bf16[1000,1000]{1,0} fusion(%m1, %x), kind=kCustom, calls=%dot_comp
  %m3 = bf16[1000,1000]{1,0} fusion(%m2, %x), kind=kCustom, calls=%dot_comp
  ROOT %m4 = bf16[1000,1000]{1,0} fusion(%m3, %x), kind=kCustom, calls=%dot_comp
}

ENTRY %main (p: bf16[1000,1000]) -> bf16[1000,1000] {
  %p = bf16[1000,1000]{1,0} parameter(0)
  %w = bf16[1000,1000]{1,0} while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %head = bf16[1000,1000]{1,0} fusion(%w, %p), kind=kCustom, calls=%dot_comp, metadata={op_name="jit(step)/Head/dot_general"}
}
"""  # noqa: E501


def _instr(name: str, iid: int) -> str:
  return (
    f'    instructions {{\n      name: "{name}"\n      opcode: "fusion"\n'
    f'      metadata {{\n        op_name: "x"\n      }}\n      id: {iid}\n    }}\n'
  )


def _sched(cid: int, rows) -> str:
  body = "".join(
    f"  instructions {{\n    id: {iid}\n    start_timestamp_cycles: {s}\n"
    f"    end_timestamp_cycles: {e}\n    memory_usage_after: 1\n  }}\n"
    for iid, s, e in rows
  )
  return f"computation_schedules {{\n  computation_id: {cid}\n{body}}}\n"


DUMP = (
  'hlo_module {\n  name: "m"\n'
  + '  computations {\n    name: "body"\n'
  + "".join(_instr(f"m{k}", 10 + k) for k in range(1, 5))
  + "    id: 2\n  }\n"
  + '  computations {\n    name: "main"\n'
  + _instr("w", 20)
  + _instr("head", 21)
  + "    id: 3\n  }\n}\n"
  + _sched(2, [(11, 0, 3), (12, 3, 6), (13, 6, 10.5), (14, 10.5, 16.5)])
  + _sched(3, [(20, 0, 0), (21, 0, 60)])
)


def test_reads_what_xla_charged_each_instruction():
  costs = instruction_costs.read(DUMP)
  assert costs["body"] == pytest.approx({"m1": 3e-6, "m2": 3e-6, "m3": 4.5e-6, "m4": 6e-6})
  assert costs["main"] == pytest.approx({"w": 0.0, "head": 60e-6})


def test_the_out_of_line_matmul_and_its_overcharge():
  out = instruction_costs.overpriced(instruction_costs.read(DUMP), HLO, 1e15, 2e12)
  # Cost over roofline (all rooflines 3 us): 1, 1, 1.5 and 2 in the body, 5 times a step each
  # (weight 15 us each), and 20 for the head, once (weight 3 us). Half the weight (31.5 us) is
  # reached at 1.5: the median. Only the head is out of line (20 > 4 x 1.5, while 2 < 6); at the
  # median it would cost 4.5 us, so it is overcharged 55.5 us, once per step.
  assert out["median_over_roofline"] == pytest.approx(1.5)
  assert [m["instruction"] for m in out["matmuls"]] == ["head"]
  head = out["matmuls"][0]
  assert head["op_name"] == "jit(step)/Head/dot_general"
  assert head["roofline_s"] == pytest.approx(3e-6)
  assert head["executions"] == 1
  assert head["overcharge_s"] == pytest.approx(55.5e-6)
  assert out["overcharge_s"] == pytest.approx(55.5e-6)


def test_nothing_out_of_line_when_xla_prices_evenly():
  even = DUMP.replace("(21, 0, 60)", "(21, 0, 6)").replace(
    "start_timestamp_cycles: 0\n    end_timestamp_cycles: 60",
    "start_timestamp_cycles: 0\n    end_timestamp_cycles: 6",
  )  # noqa: E501
  out = instruction_costs.overpriced(instruction_costs.read(even), HLO, 1e15, 2e12)
  assert out["matmuls"] == [] and out["overcharge_s"] == 0.0
