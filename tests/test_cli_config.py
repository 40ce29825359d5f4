"""The CLI's flags are the config dataclasses' fields: each option of RunConfig, InspectConfig and
PlanConfig, its groups' included (paro_jax/core/config.py `options`), is a flag of its command
with the field's default, parsing no flags gives the default config, a field without a flag is an
error, and no help text writes a default by hand."""

import argparse
import dataclasses
import re

import pytest

from paro_jax import cli
from paro_jax.core import flags as cli_flags
from paro_jax.analysis.inspect.config import InspectConfig
from paro_jax.analysis.planner.config import PlanConfig
from paro_jax.core.config import (
  LoraOptions,
  OuterOptions,
  WireOptions,
  group,
  make_config,
  option,
  options,
  value_at,
)
from paro_jax.core.names import parse_mesh_shape
from paro_jax.run.config import RunConfig

COMMANDS = {"train": RunConfig, "inspect": InspectConfig, "plan": PlanConfig}
REQUIRED = {"plan": ["--nodes", "2"]}  # flags without a default
BY_CLI = {"mesh"}  # parsed by cli.py from the flag's text


def _subparsers():
  return cli.build_parser()._subparsers._group_actions[0].choices


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_with_the_fields_default(command):
  actions = {a.dest: a for a in _subparsers()[command]._actions if a.option_strings}
  for path, field in options(COMMANDS[command]):
    assert path in actions, f"{COMMANDS[command].__name__}.{path} has no flag"
    action = actions[path]
    if field.default is dataclasses.MISSING:
      assert action.required, path
    else:
      assert action.default == field.default, (path, action.default, field.default)
    assert action.help == field.metadata["help"], path


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flags_parse_to_the_default_config(command):
  cls = COMMANDS[command]
  args = cli.build_parser().parse_args([command, *REQUIRED.get(command, [])])
  given = {k: getattr(args, k) for k in BY_CLI if hasattr(cls, k)}
  parsed = cli_flags.config_of(args, cls, **given)
  required = {"nodes": 2} if command == "plan" else {}
  assert parsed == cls(**required)
  # the flags reach their fields, converted as the field's type says
  args = cli.build_parser().parse_args(
    [command, *REQUIRED.get(command, []), "--seq-len", "96", "--dtype", "FP32", "--json"]
    if command != "train"
    else [command, "--seq-len", "96", "--dtype", "FP32", "--no-memory-check", "--lora-rank", "4"]
    + ["--data", "a.txt", "b.txt", "--divergence-window", "7", "--steps", "9", "--warmup", "2"]
  )
  parsed = cli_flags.config_of(
    args, cls, **{k: getattr(args, k) for k in BY_CLI if hasattr(cls, k)}
  )
  assert (parsed.seq_len, parsed.dtype) == (96, "fp32")
  if command == "train":  # the groups' flags reach their groups
    assert (parsed.memory_check, parsed.lora.rank, parsed.guard.window) == (False, 4, 7)
    assert parsed.data.paths == ("a.txt", "b.txt") and parsed.optimizer.steps == 9
  else:
    assert parsed.as_json is True


@pytest.mark.parametrize("errfb", [None, True, False])
def test_step_flags_parse_back_to_the_step(errfb):
  """`train --strategy auto` hands the run's step to `inspect --target` as flags
  (core/flags.py step_flags): `inspect` parses them back to every StepConfig field."""
  from paro_jax.core.config import StepConfig
  from paro_jax.core.flags import step_flags

  step = RunConfig(
    model="small", strategy="nig", mesh=(2, 4), micro_batches=3, batch_size=24, seq_len=96,
    dtype="fp32", collectives="horing", attention="xla", error_feedback=errfb,
    param_delta=False, remat="layer", lora=LoraOptions(rank=4, alpha=8.5, targets="wq,wo"),
    wire=WireOptions(inter_params="int8", inter_grads="bf16", int8_block=64, grad_dtype="fp32"),
  )  # fmt: skip
  # The outer loop's options (which refuse a G placement and compressed parameters): below.
  for path, field in options(StepConfig):  # every option away from its default
    if path != "error_feedback" and not path.startswith("outer."):
      assert value_at(step, path) != field.default, path
  outer = RunConfig(
    strategy="nii",
    outer=OuterOptions(sync=8, lr=0.5, momentum=0.8, fragments=2, delay=3, mix=0.5, state="I"),
  )
  for path, field in options(OuterOptions, "outer."):
    assert value_at(outer, path) != field.default, path
  for cfg in (step, outer):
    args = cli.build_parser().parse_args(["inspect", *step_flags(cfg)])
    mesh = parse_mesh_shape(args.mesh) if args.mesh else None
    parsed = cli_flags.config_of(args, InspectConfig, mesh=mesh)
    for path, _ in options(StepConfig):
      assert value_at(parsed, path) == value_at(cfg, path), path
  # a value replaced, and one left out (None: its flag's default)
  flags = step_flags(step, strategy=None, model="7b")
  assert "--strategy" not in flags and flags[flags.index("--model") + 1] == "7b"


def test_a_field_without_a_flag_is_an_error():
  args = cli.build_parser().parse_args(["inspect"])
  del args.hlo_out  # as if InspectConfig had gained a field the parser does not know
  with pytest.raises(TypeError, match=r"field but no flag \['hlo_out'\]"):
    cli_flags.config_of(args, InspectConfig)
  args = cli.build_parser().parse_args(["inspect"])
  with pytest.raises(TypeError, match=r"given but no field \['meshes'\]"):
    cli_flags.config_of(args, InspectConfig, meshes=(1, 8))


def test_a_flag_of_an_unknown_field_is_an_error():
  with pytest.raises(KeyError, match="InspectConfig has no field 'seq_length'"):
    cli_flags.add_options(argparse.ArgumentParser(), InspectConfig, "seq_length")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Toy:
  steps: int = option(5, "how many")
  speed: float = option(0.5, "how fast")
  name: str = option("x", "what")
  fast: bool = option(False, "whether")
  needed: int = option(help="no default", type=int)


def test_flags_take_the_fields_defaults_and_types():
  p = argparse.ArgumentParser()
  cli_flags.add_options(p, _Toy, "steps", "speed", "name", "fast", "needed")
  args = p.parse_args(["--needed", "7", "--speed", "2"])
  assert cli_flags.config_of(argparse.Namespace(command="toy", **vars(args)), _Toy) == _Toy(
    needed=7, speed=2.0
  )
  assert p.parse_args(["--needed", "1", "--fast", "--steps", "3"]).steps == 3
  with pytest.raises(SystemExit):
    p.parse_args([])  # --needed is required


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Limits:
  low: int = option(1, "the least", flag="--limit-low")
  high: int = option(9, "the most", flag="--limit-high", metavar="N")
  note: str = "kept"  # no option: keeps its default


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Grouped:
  steps: int = option(5, "how many")
  limits: _Limits = group(_Limits)


def test_a_groups_options_are_flags_and_build_the_group():
  assert [path for path, _ in options(_Grouped)] == ["steps", "limits.low", "limits.high"]
  p = argparse.ArgumentParser()
  cli_flags.add_options(p, _Grouped, "steps", "limits.low", "limits.high")
  # argparse's metavar is the flag's (LIMIT_LOW), not the dest's (LIMITS.LOW)
  assert "--limit-low LIMIT_LOW" in p.format_help() and "--limit-high N" in p.format_help()
  args = argparse.Namespace(command="toy", **vars(p.parse_args(["--limit-high", "4"])))
  assert cli_flags.config_of(args, _Grouped) == _Grouped(limits=_Limits(high=4))
  assert make_config(_Grouped, {"limits.low": 2}).limits == _Limits(low=2)
  assert make_config(_Grouped, {"limits.note": "set"}).limits.note == "set"  # not an option
  with pytest.raises(TypeError, match="_Limits has no field lo"):
    make_config(_Grouped, {"limits.lo": 2})  # a misspelt path is no default silently used
  assert value_at(_Grouped(), "limits.high") == 9
  del vars(args)["limits.low"]  # as if the parser lacked a group's flag
  with pytest.raises(TypeError, match=r"field but no flag \['limits.low'\]"):
    cli_flags.config_of(args, _Grouped)


# A default written by hand beside "default": the help should say %(default)s instead.
HAND_WRITTEN = re.compile(r"default:?\s+([^\s,;:)]+)")


def _hand_written_defaults(parser) -> list[str]:
  found = []
  for action in parser._actions:
    if not action.help or action.default in (None, argparse.SUPPRESS):
      continue
    for m in HAND_WRITTEN.finditer(action.help):
      if m.group(1) in (str(action.default), f"{action.default:g}" if _number(action) else ""):
        found.append(f"{'/'.join(action.option_strings)}: {action.help!r}")
  return found


def _number(action) -> bool:
  return isinstance(action.default, (int, float)) and not isinstance(action.default, bool)


def test_no_help_writes_its_default_by_hand():
  problems = [p for sub in _subparsers().values() for p in _hand_written_defaults(sub)]
  assert not problems, "write %(default)s (or %(default)g) instead:\n" + "\n".join(problems)


def test_the_hand_written_default_check_fails_where_it_should():
  p = argparse.ArgumentParser()
  p.add_argument("--keep", type=int, default=3, help="keep the newest K (default 3)")
  p.add_argument("--cap", type=float, default=16.0, help="the cap (default 16; 0: none)")
  p.add_argument("--fine", type=int, default=3, help="keep the newest K (default %(default)s)")
  assert len(_hand_written_defaults(p)) == 2


@pytest.mark.parametrize(
  "change,message",
  [
    ({"target": "h100", "compile_top": 0}, "--compile-top must be >= 1, got 0"),
    ({"gpu": "tpu"}, "unknown --gpu 'tpu'; choose one of "),
    ({"trainable_fraction": 0.0}, "--trainable-fraction must be in (0, 1]"),
    ({"trainable_fraction": 1.5}, "LoRA), got 1.5"),
    ({"dtype": "fp8"}, "unknown --dtype 'fp8'; choose bf16 or fp32"),
    ({"peak_tflops": -1.0}, "--peak-tflops must be positive, got -1.0"),
    ({"wire.grad_dtype": "bf16"}, "unknown --grad-dtype 'bf16'; choose compute or fp32"),
  ],
)
def test_plan_config_checks_its_values(change, message):
  with pytest.raises(ValueError) as e:
    make_config(PlanConfig, {"nodes": 2, **change})
  assert message in str(e.value) and "\n" not in str(e.value)


def test_plan_config_gpu_any_case_and_target_sets_it():
  assert PlanConfig(nodes=2, gpu=" H100 ").gpu == "h100"
  # with --target the GPU is the target's: a --gpu the planner does not know is not checked
  assert PlanConfig(nodes=2, target="h100", gpu="tpu").target == "h100"


def test_plan_step_flags_parse_back_to_the_plans_workload():
  """`plan --target` compiles the plan's workload (analysis/planner/rerank.py plan_step_flags,
  through step_flags): `inspect` parses its flags back to the plan's inputs."""
  from paro_jax.analysis.planner import planner, rerank
  from paro_jax.analysis.planner.config import PlanConfig

  plan = planner.run_plan(
    PlanConfig(
      model="7b",
      nodes=2,
      devices_per_node=8,
      micro_batches=4,
      seq_len=512,
      dtype="fp32",
      wire=WireOptions(inter_params="int8", inter_grads="bf16", int8_block=64, grad_dtype="fp32"),
    )  # fmt: skip
  )
  inputs = plan.inputs
  args = cli.build_parser().parse_args(["inspect", *rerank.plan_step_flags(inputs, "xla")])
  parsed = cli_flags.config_of(args, InspectConfig, mesh=parse_mesh_shape(args.mesh))
  assert parsed.mesh == (inputs["nodes"], inputs["devices_per_node"]) == (2, 8)
  assert parsed.batch_size == inputs["micro_batch"] * 16 and parsed.attention == "xla"
  for name in ("model", "collectives", "micro_batches", "seq_len", "dtype"):
    assert getattr(parsed, name) == inputs[name], name
  for name in ("inter_params", "inter_grads", "int8_block", "grad_dtype"):
    assert getattr(parsed.wire, name) == inputs[name], name
  assert (parsed.micro_batches, parsed.seq_len, parsed.wire.int8_block) == (4, 512, 64)
