"""The `paro-jax` command line: subcommands, their flags, the device set-up before jax starts."""
# (the parser's description is DESCRIPTION below, not this docstring)

from __future__ import annotations

import argparse
import os
import sys

from paro_jax import report
from paro_jax.cluster import watch
from paro_jax.core.names import (
  ATTENTION_IMPLS,
  AUTO_COLLECTIVES,
  COLLECTIVE_IMPLS,
  DEFAULT_INT8_BLOCK,
  GRAD_DTYPES,
  WIRE_FORMATS,
  check_batch_divides,
  parse_mesh_shape,
)
from paro_jax.core.strategy import ALIASES
from paro_jax.core.xla_flags import add_xla_flags, cpu_without_gpu_driver, provide_cpu_devices


DESCRIPTION = (
  "Train Flax LLaMA models with PaRO sharding strategies in JAX, and inspect, plan, probe, "
  "launch, export and plot such runs. `paro-jax COMMAND --help` shows each command's options "
  "and their defaults."
)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
  """Every option's help ends with its default, unless it says it already or there is none."""

  def _get_help_string(self, action):
    help = action.help or ""
    if (
      "default" in help.lower()
      or action.required
      or action.default is None
      or action.default is False
      or action.default == argparse.SUPPRESS
      or not action.option_strings
    ):
      return help
    return f"{help} (default: %(default)s)" if help else "(default: %(default)s)"


MAX_CPU_DEVICES = 1024  # virtual CPU devices per process: beyond, XLA's start-up eats memory


def _check_shape(args, mesh) -> None:
  """Batch and sequence flags of train / inspect, before anything compiles."""
  for name in ("micro_batches", "batch_size", "seq_len"):
    value = getattr(args, name, None)
    if value is not None and value < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  if mesh and args.command in ("inspect", "train"):
    check_batch_divides(args.batch_size, *mesh)


def _lora_config(args):
  """The LoraConfig the LoRA flags ask for, or None (full training)."""
  from models.llama import LoraConfig  # imports jax: only once the device flags are set

  return LoraConfig.from_flags(args.lora_rank, args.lora_alpha, args.lora_targets)


def _note_cpu_platform(args) -> None:
  """Before jax starts: with the CUDA plugin but no GPU driver, run on the CPU and say so (on
  stdout, with the run's other notes: stderr is for problems; beside --json output, stderr)."""
  if note := cpu_without_gpu_driver():
    report.note(note, file=sys.stderr if getattr(args, "json", False) else sys.stdout)


def _divergence_args(train) -> None:
  """The divergence guard's flags (paro_jax/run/divergence.py; docs/failures.md)."""
  from paro_jax.run.divergence import MODES, GuardConfig  # imports no jax

  g = train.add_argument_group(
    "divergence guard",
    "a step is out of band when its loss or gradient norm is NaN/Inf, its loss is above the "
    "cap, or either is more than a factor above the mean of the previous in-band steps; "
    "--divergence-patience such steps in a row stop the run, naming the newest checkpoint "
    "saved before it (never rotated away; later ones are set aside as diverged-<step>)",
  )
  d = GuardConfig()
  g.add_argument(
    "--divergence-guard",
    choices=MODES,
    default=d.mode,
    help=f"stop the run, warn once, or only check NaN/Inf (default {d.mode})",
  )
  g.add_argument(
    "--divergence-window",
    type=int,
    default=d.window,
    metavar="N",
    help=f"the band: the mean of the previous N in-band steps (default {d.window})",
  )
  g.add_argument(
    "--divergence-loss-factor",
    type=float,
    default=d.loss_factor,
    metavar="X",
    help=f"out of band: loss above X times its band (default {d.loss_factor:g})",
  )
  g.add_argument(
    "--divergence-grad-factor",
    type=float,
    default=d.grad_factor,
    metavar="X",
    help=f"out of band: gradient norm above X times its band (default {d.grad_factor:g})",
  )
  g.add_argument(
    "--divergence-patience",
    type=int,
    default=d.patience,
    metavar="N",
    help=f"stop after N out-of-band steps in a row (default {d.patience})",
  )
  g.add_argument(
    "--divergence-loss-cap",
    type=float,
    default=d.loss_cap,
    metavar="L",
    help=f"out of band: loss above L (default 0: {d.cap_times_uniform:g} x "
    f"ln(vocab), twice the loss of a uniform guess)",
  )


def _by_name(args, target, **given):
  """The keyword arguments of `target` (a function or dataclass) that `args` has, by name."""
  import inspect

  names = inspect.signature(target).parameters
  return {**{k: v for k, v in vars(args).items() if k in names}, **given}


MODEL_HELP = (
  "preset: tiny, small, 7b, 13b, 65b; or an HF LLaMA config.json (its shapes, from scratch)"
)


def _model_arg(value: str) -> str:
  """Preset names in any case; a path as given."""
  return value if os.sep in value or value.endswith(".json") else value.lower()


def _add_wire(p: argparse.ArgumentParser) -> None:
  """--inter-params, --inter-grads, --int8-block, --grad-dtype (train, inspect, plan)."""
  w = p.add_argument_group(
    "communication precision",
    "what the parameter gathers and gradient reductions carry across nodes (the inter level, "
    "also of a collective over all devices); intra-node traffic keeps the compute / "
    "accumulation dtype (docs/collectives.md)",
  )
  w.add_argument(
    "--inter-params",
    default="same",
    type=str.lower,
    choices=WIRE_FORMATS,
    help="parameter gathers across nodes: same (the compute dtype), bf16, or int8 with a scale "
    "per block (default same)",
  )
  w.add_argument(
    "--inter-grads",
    default="same",
    type=str.lower,
    choices=WIRE_FORMATS,
    help="gradient reductions across nodes: same (the accumulation dtype), bf16, or int8 sent "
    "once to each chunk's owner and summed in fp32 (default same)",
  )
  w.add_argument(
    "--int8-block",
    type=int,
    default=DEFAULT_INT8_BLOCK,
    help=f"elements per fp32 scale of the int8 format (default {DEFAULT_INT8_BLOCK})",
  )
  w.add_argument(
    "--grad-dtype",
    default="compute",
    type=str.lower,
    choices=GRAD_DTYPES,
    help="gradient accumulation and boundary reduction dtype (default: the compute dtype)",
  )


def _add_feedback(p: argparse.ArgumentParser) -> None:
  """--error-feedback, --param-delta (train, inspect; `plan` counts their defaults' memory)."""
  w = p.add_argument_group("int8 corrections")
  w.add_argument(
    "--error-feedback",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="keep each device's int8 gradient rounding error and add it to the next step's "
    "gradient (default: on with --inter-grads int8 where the strategy reduces gradients across "
    "nodes at the step's end; --no-error-feedback to compare)",
  )
  w.add_argument(
    "--param-delta",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="int8 parameter syncs send each weight's change since the last step against a copy "
    "every device keeps (default: on with --inter-params int8 where the step's parameter sync "
    "crosses nodes; --no-param-delta to compare)",
  )


def _add_common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default="tiny", type=_model_arg, help=MODEL_HELP)
  p.add_argument(
    "--strategy",
    default="IIG",
    help="three letters P,G,OS from {N,I,G} (e.g. IIG, any case) or an alias: "
    + ", ".join(f"{k}={v}" for k, v in ALIASES.items())
    + "; train also takes auto (probe the mesh, take the planner's pick) (default IIG)",
  )
  p.add_argument(
    "--mesh", default=None, help="GROUPSxDEVICES, e.g. 2x4 (default: one group per process)"
  )
  p.add_argument("--micro-batches", type=int, default=1, help="A: micro-batches per step")
  p.add_argument("--batch-size", type=int, default=16, help="global micro-batch size (sequences)")
  p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
  p.add_argument(
    "--dtype", default="bf16", type=str.lower, choices=["bf16", "fp32"], help="compute dtype"
  )
  p.add_argument(
    "--collectives",
    default="xla",
    type=str.lower,
    choices=(AUTO_COLLECTIVES, *COLLECTIVE_IMPLS),
    help="how collectives over all devices run: xla (XLA's own) and hring in two levels, ring "
    "flat, horing two overlapped levels, hring+xla / horing+xla the rings over both axes and "
    "XLA's over one; auto: hring+xla where XLA's would cross nodes on every hop (CPU "
    "processes), else xla",
  )
  p.add_argument(
    "--attention",
    default="auto",
    type=str.lower,
    choices=ATTENTION_IMPLS,
    help="xla: attention written out (scores, mask, softmax); cudnn: cuDNN's fused kernel "
    "(GPUs, bf16); auto: cudnn where it applies, else xla",
  )
  _add_wire(p)
  _add_feedback(p)
  p.add_argument(
    "--remat",
    default="full",
    type=str.lower,
    choices=["full", "layer", "none"],
    help="what backward recomputes per layer: full (all, weight gather included), "
    "layer (all but matmul outputs), none (keeps every layer's weights)",
  )
  lora = p.add_argument_group(
    "LoRA",
    "train low-rank adapters only; the base weights are frozen "
    "(held once, at the P placement, with no gradient or optimizer state)",
  )
  lora.add_argument(
    "--lora-rank", type=int, default=0, metavar="R", help="adapter rank (default 0: full training)"
  )
  lora.add_argument(
    "--lora-alpha",
    type=float,
    default=16.0,
    help="adapter scale alpha (the update is alpha/R x A B; default 16)",
  )
  lora.add_argument(
    "--lora-targets",
    default="wq,wv",
    help="comma-separated weights to adapt, from wq,wk,wv,wo,w_gate,w_up,w_down (default wq,wv)",
  )


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="paro-jax", description=DESCRIPTION, formatter_class=_Help)
  sub = parser.add_subparsers(dest="command", required=True)
  train = sub.add_parser("train", help="train a Flax LLaMA with a PaRO strategy")
  _add_common(train)
  train.add_argument("--steps", type=int, default=50, help="optimizer steps of the whole run")
  train.add_argument("--seed", type=int, default=0, help="of the initial weights and the batches")
  train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
  train.add_argument(
    "--warmup", type=int, default=10, help="steps of linear warmup, then cosine decay"
  )
  data = train.add_argument_group(
    "data",
    "text, JSONL and pre-tokenized .bin files (default: "
    "the built-in corpus, Python's standard library sources)",
  )
  data.add_argument(
    "--data",
    nargs="+",
    default=(),
    metavar="PATH",
    help="files and globs: *.jsonl (JSON lines), *.bin (token ids), else text",
  )
  data.add_argument("--text-field", default="text", help="the JSONL field holding the text")
  data.add_argument(
    "--tokenizer",
    default=None,
    metavar="TOKENIZER_JSON",
    help="an HF tokenizer.json (needs the hf extra; default: bytes, vocab 256)",
  )
  data.add_argument(
    "--bin-dtype",
    default=None,
    type=str.lower,
    choices=["uint16", "uint32"],
    help=".bin token dtype (default: uint16, or uint32 when the tokenizer's "
    "vocab, else the model's, exceeds 65536)",
  )
  data.add_argument(
    "--eval-fraction",
    type=float,
    default=0.01,
    help="the last fraction of the tokens held out for eval (default 0.01)",
  )
  data.add_argument(
    "--eval-every",
    type=int,
    default=0,
    metavar="N",
    help="eval loss every N steps (default 0: never)",
  )
  data.add_argument(
    "--eval-batches",
    type=int,
    default=1,
    metavar="K",
    help="the eval loss is the mean over K fixed batches of the eval split (default 1)",
  )
  train.add_argument(
    "--out", default="runs/latest", help="run directory: metrics.jsonl and checkpoints/"
  )
  ckpt = train.add_argument_group(
    "checkpoints",
    "saved asynchronously into OUT/checkpoints/, also at the end and on Ctrl-C or SIGTERM "
    "(then the run stops after the current step; a second signal stops at once)",
  )
  ckpt.add_argument(
    "--checkpoint-every",
    type=int,
    default=0,
    metavar="N",
    help="save every N steps (default 0: only at the end)",
  )
  ckpt.add_argument(
    "--keep", type=int, default=3, metavar="K", help="keep the newest K (default 3)"
  )
  ckpt.add_argument(
    "--max-bad-steps",
    type=int,
    default=3,
    metavar="N",
    help="a step whose loss or gradient norm is NaN/Inf leaves the weights as they were; stop "
    "after N such steps in a row (default 3)",
  )
  _divergence_args(train)
  train.add_argument(
    "--no-memory-check",
    dest="memory_check",
    action="store_false",
    help="compile even when the planner's memory estimate exceeds the devices' memory (by "
    "default such a run is refused before compiling)",
  )
  ckpt.add_argument(
    "--resume",
    action="store_true",
    help="continue from the newest checkpoint in OUT (any strategy or mesh)",
  )
  train.add_argument(
    "--init-from",
    default=None,
    metavar="HF_DIR",
    help="start from the weights of an HF LlamaForCausalLM directory (config.json "
    "+ safetensors); its config.json defines the model and --model is ignored. "
    "Pass it again with --resume",
  )
  dist = train.add_argument_group(
    "multi-process",
    "one process per node, joined by jax.distributed (auto-detected under "
    "SLURM srun / Open MPI mpirun); --mesh GxM then counts all processes' devices",
  )
  dist.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  dist.add_argument(
    "--num-processes", type=int, default=None, help="N: processes in all (with --coordinator)"
  )
  dist.add_argument(
    "--process-id", type=int, default=None, help="I: this process, 0..N-1 (with --coordinator)"
  )
  dist.add_argument(
    "--progress-timeout",
    type=float,
    default=0.0,
    metavar="S",
    help="exit (code 3, naming the last step) when no step finished for S seconds, the first "
    "compile included: for SLURM/mpirun, where a dead or hung peer otherwise blocks the others "
    "for good; paro-jax launch watches its nodes itself (default 0: off)",
  )
  inspect = sub.add_parser(
    "inspect", help="compile a training step (no allocation) and report its communication"
  )
  _add_common(inspect)
  inspect.add_argument("--json", action="store_true", help="print one JSON object")
  inspect.add_argument(
    "--target",
    default=None,
    help="compile for a cluster of these GPUs, no GPU needed: h100, h200, a100-80gb, a100-40gb "
    "(--mesh NODESxGPUS); reports async collectives, streams, overlap and memory vs the plan",
  )
  inspect.add_argument(
    "--inter-bandwidth",
    default=None,
    metavar="RATE",
    help="with --target: each node's inter-node link for XLA's network model in the step time "
    "estimate, a tc rate such as 100gbit (default: XLA's own network defaults, named in the "
    "output)",
  )
  inspect.add_argument(
    "--no-prefetch",
    action="store_true",
    help="compile without the prefetching layer stack (each layer's gather waits for its use), "
    "to compare",
  )
  inspect.add_argument(
    "--hlo-out", default=None, metavar="FILE", help="write the compiled (scheduled) HLO text here"
  )
  plot = sub.add_parser("plot", help="PNG of loss (train, eval) and throughput of runs")
  plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (--out of train)")
  plot.add_argument("--out", default="runs/plot.png", help="the PNG to write")
  export = sub.add_parser("export", help="the newest checkpoint of a run as an HF LLaMA directory")
  export.add_argument("run", nargs="?", metavar="RUN_DIR", help="a run directory (--out of train)")
  export.add_argument("--run", dest="run_flag", metavar="RUN_DIR", help="the same, as an option")
  export.add_argument(
    "--out",
    required=True,
    metavar="HF_DIR",
    help="directory to write config.json and model.safetensors (fp32) into",
  )
  export.add_argument(
    "--overwrite", action="store_true", help="replace the files of an existing, non-empty --out"
  )
  launch = sub.add_parser(
    "launch",
    help="emulate a cluster here: one train process per node, shaped links",
    usage="paro-jax launch --nodes G --devices-per-node M [options] -- train [train options]",
    description="Start G `paro-jax train` processes with M virtual CPU devices each, joined by "
    "jax.distributed; as root with ip/tc each runs in its own network namespace behind a "
    "shaped link, otherwise on loopback without shaping. Everything after -- is the per-node "
    "command: `train ...` or `python SCRIPT [args]`; the launcher adds --mesh GxM and the "
    "multi-process flags.",
  )
  launch.add_argument("--nodes", type=int, required=True, help="G: processes (nodes)")
  launch.add_argument("--devices-per-node", type=int, required=True, help="M: devices per node")
  launch.add_argument("--inter-bandwidth", default="1gbit", help="tc rate of each node's link")
  launch.add_argument("--inter-latency", default="0.5ms", help="one-way delay (netem); 0 for none")
  launch.add_argument(
    "--intra-bandwidth",
    default=None,
    help="tc rate of each node's loopback (intra-node traffic); default unshaped",
  )
  launch.add_argument(
    "--heartbeat-timeout",
    type=float,
    default=60.0,
    metavar="S",
    help="a node with no heartbeat for S s (stopped, frozen) fails the run (default 60; 0: off)",
  )
  launch.add_argument(
    "--progress-timeout",
    type=float,
    default=900.0,
    metavar="S",
    help="a node that finished no step for S s (hung), the first compile included, fails the "
    "run (default 900; 0: off)",
  )
  launch.add_argument(
    "--stop-grace",
    type=float,
    default=120.0,
    metavar="S",
    help="after Ctrl-C, how long the nodes get to checkpoint and exit before SIGKILL (default 120)",
  )
  launch.add_argument(
    "--max-restarts",
    type=int,
    default=0,
    metavar="K",
    help="when a node dies, freezes or hangs, continue the run from its newest checkpoint on the "
    "nodes left (one fewer, mesh rebuilt, global batch and data order kept), up to K times",
  )
  launch.add_argument(
    "--show-gloo",
    action="store_true",
    help="print the nodes' Gloo connection messages (kept in OUT/paro-jax.launch.log otherwise)",
  )
  launch.add_argument(
    "--loopback",
    action="store_true",
    help="plain processes on 127.0.0.1, no namespaces and no shaping",
  )
  prep = sub.add_parser(
    "prepare-data",
    help="tokenize text/JSONL files into .bin shards for train --data 'OUT/*.bin'",
    description="Tokenize text and JSONL files (byte-level, or an HF tokenizer.json) into .bin "
    "shards of token ids, a block at a time (memory stays small whatever the data's size), "
    "with a progress bar. Train on them with --data 'OUT/*.bin': the shards are read by memory "
    "map, each process reading only the tokens of its rows.",
  )
  prep.add_argument("inputs", nargs="+", metavar="PATH", help="text / .jsonl files and globs")
  prep.add_argument("--out", required=True, metavar="DIR", help="directory for the shards")
  prep.add_argument(
    "--tokenizer",
    default=None,
    metavar="TOKENIZER_JSON",
    help="an HF tokenizer.json (needs the hf extra; default: bytes, vocab 256)",
  )
  prep.add_argument("--text-field", default="text", help="the JSONL field holding the text")
  prep.add_argument(
    "--shard-tokens", type=int, default=100_000_000, metavar="N", help="token ids per shard"
  )
  prep.add_argument(
    "--bin-dtype",
    default=None,
    type=str.lower,
    choices=["uint16", "uint32"],
    help="token dtype (default: uint16, or uint32 when the tokenizer's vocab exceeds 65536)",
  )
  _add_planner_commands(sub)
  for p in sub.choices.values():
    p.formatter_class = _Help
  return parser


def _add_planner_commands(sub) -> None:
  """`plan` (no devices needed) and `probe` (measures the mesh it runs on)."""
  plan = sub.add_parser(
    "plan", help="rank the 14 strategies for a cluster: memory, step time, the pick and why"
  )
  plan.add_argument("--model", default="7b", type=_model_arg, help=MODEL_HELP)
  plan.add_argument("--nodes", type=int, required=True, help="G: nodes (groups)")
  plan.add_argument(
    "--devices-per-node", type=int, default=8, help="M: devices per node (default 8)"
  )
  from paro_jax.analysis.hardware import GPUS  # no jax

  plan.add_argument(
    "--gpu", default="a100-80gb", help=f"device model for peak FLOP/s and memory: {', '.join(GPUS)}"
  )
  plan.add_argument(
    "--target",
    default=None,
    help="compile the top strategies for this GPU (h100, h200; no GPU needed) and pick by XLA's "
    "estimate of the compiled step; sets --gpu",
  )
  plan.add_argument(
    "--compile-top",
    type=int,
    default=3,
    metavar="K",
    help="with --target: compile the analytic top K, and any within 10%% of the first (default 3)",
  )
  plan.add_argument(
    "--device-memory", default=None, help="per device, e.g. 80GB or 80GiB (default: the GPU's)"
  )
  plan.add_argument(
    "--peak-tflops",
    type=float,
    default=None,
    help="dense bf16 peak per device (default: the GPU's, or the profile's)",
  )
  plan.add_argument(
    "--mfu",
    type=float,
    default=0.5,
    help="fraction of peak the compute alone reaches (default 0.5)",
  )
  plan.add_argument(
    "--inter-bandwidth",
    default="100gbit",
    help="each node's inter-node link, shared by its devices (e.g. 100gbit, 400Gb/s, 50GB/s)",
  )
  plan.add_argument(
    "--intra-bandwidth",
    default="300GB/s",
    help="per device inside a node (e.g. 300GB/s for NVLink A100)",
  )
  plan.add_argument("--inter-latency", default="50us", help="per collective between nodes")
  plan.add_argument("--intra-latency", default="10us", help="per collective inside a node")
  plan.add_argument(
    "--micro-batch", type=int, default=1, help="sequences per device and micro-batch"
  )
  plan.add_argument("--micro-batches", type=int, default=8, help="A: micro-batches per step")
  plan.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
  plan.add_argument(
    "--trainable-fraction",
    type=float,
    default=1.0,
    help="trainable parameters / all parameters: 1 for full training, e.g. 0.003 for LoRA",
  )
  plan.add_argument(
    "--dtype", default="bf16", type=str.lower, choices=["bf16", "fp32"], help="compute dtype"
  )
  plan.add_argument(
    "--collectives",
    default="xla",
    type=str.lower,
    choices=COLLECTIVE_IMPLS,
    help="how collectives over all devices run: xla (NCCL) and hring in two "
    "levels, ring flat (docs/design.md), horing two overlapped levels",
  )
  plan.add_argument(
    "--attention",
    default="auto",
    type=str.lower,
    choices=ATTENTION_IMPLS,
    help="the attention the GPUs run (activation memory): auto (cuDNN's fused kernel in bf16), "
    "xla (scores written out) or cudnn",
  )
  plan.add_argument(
    "--overlap",
    type=float,
    default=0.0,
    help="fraction of per-micro-batch traffic hidden behind compute (default 0)",
  )
  plan.add_argument(
    "--usable-memory",
    type=float,
    default=0.9,
    help="fraction of device memory the plan may fill (default 0.9)",
  )
  plan.add_argument(
    "--profile",
    default=None,
    metavar="FILE",
    help="a `paro-jax probe` JSON: its measured links (and FLOP/s) override",
  )
  plan.add_argument("--json", action="store_true", help="print one JSON object")
  _add_wire(plan)
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
    help="per-device buffer sizes, comma-separated (default 64KiB,1MiB,4MiB)",
  )
  probe.add_argument("--repeats", type=int, default=5, help="timed calls per size (median)")
  probe.add_argument("--no-flops", action="store_true", help="skip the matmul FLOP/s")
  probe.add_argument("--out", default="probe.json", help="the JSON profile to write")
  dist = probe.add_argument_group("multi-process", "as for train")
  dist.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  dist.add_argument(
    "--num-processes", type=int, default=None, help="N: processes in all (with --coordinator)"
  )
  dist.add_argument(
    "--process-id", type=int, default=None, help="I: this process, 0..N-1 (with --coordinator)"
  )


def _parse(argv: list[str]) -> argparse.Namespace:
  """The arguments; an unknown flag is answered with its subcommand's usage (argparse would show
  the top level's), `export`'s run directory taken positionally or as --run."""
  parser = build_parser()
  args, unknown = parser.parse_known_args(argv)
  sub = parser._subparsers._group_actions[0].choices[args.command]
  if unknown:
    sub.error(f"unrecognized arguments: {' '.join(unknown)}")
  if args.command == "export":
    if args.run and args.run_flag and args.run != args.run_flag:
      sub.error(f"two run directories: {args.run} and --run {args.run_flag}; give one")
    args.run = args.run or args.run_flag
    if not args.run:
      sub.error("the run directory is required: paro-jax export RUN_DIR --out HF_DIR")
  return args


def _check_node_command(child_argv: list[str]) -> None:
  """`launch -- train ...`: the per-node flags parsed here first, so that a bad one is one line
  before any node starts (not the usage of every node)."""
  train = build_parser()._subparsers._group_actions[0].choices["train"]

  def fail(message):
    raise ValueError(f"the per-node command after --: {message} (see paro-jax train --help)")

  train.error = fail
  _, unknown = train.parse_known_args(child_argv[1:])
  if unknown:
    fail(f"unrecognized arguments: {' '.join(unknown)}")


def _log_place(args, child_argv: list[str]) -> tuple[str | None, str]:
  """Where the full texts of this command go: its run directory, a name per process."""
  if args.command == "train":
    rank = args.process_id
    if rank is None:  # under SLURM / Open MPI the rank is in the environment
      ranks = (os.environ.get(v, "") for v in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"))
      rank = next((int(r) for r in ranks if r.isdigit()), 0)
    return args.out, report.LOG_NAME if not rank else f"paro-jax.node{rank}.log"
  if args.command == "export":
    return args.run, report.LOG_NAME
  if args.command == "launch" and child_argv[:1] == ["train"]:
    from paro_jax.cluster.restart import _flag  # no jax

    return _flag(child_argv, "--out", "runs/latest"), "paro-jax.launch.log"
  return None, report.LOG_NAME


def main(argv=None) -> None:
  """The `paro-jax` command. Its reporter (paro_jax/report.py) stays installed until the process
  exits (libraries print their noise at shutdown too); a caller in Python that passes `argv`
  gets its own warning, logging and exception hooks back on return."""
  restore = report.install()
  try:
    _main(argv)
  finally:
    if argv is not None:
      restore()


def _main(argv) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  child_argv = []
  if argv[:1] == ["launch"] and "--" in argv:  # everything after -- is the child train command
    cut = argv.index("--")
    argv, child_argv = argv[:cut], argv[cut + 1 :]
  args = _parse(argv)
  report.set_log_dir(*_log_place(args, child_argv))
  try:
    if args.command == "launch":
      from paro_jax.cluster.launch import launch  # no jax in the launcher process

      if child_argv[:1] == ["train"]:
        _check_node_command(child_argv)

      sys.exit(
        launch(
          child_argv,
          nodes=args.nodes,
          devices_per_node=args.devices_per_node,
          inter_bandwidth=args.inter_bandwidth,
          inter_latency=args.inter_latency,
          intra_bandwidth=args.intra_bandwidth,
          shaped=not args.loopback,
          heartbeat_timeout=args.heartbeat_timeout,
          progress_timeout=args.progress_timeout,
          stop_grace=args.stop_grace,
          max_restarts=args.max_restarts,
          show_gloo=args.show_gloo,
        )
      )
    if args.command == "prepare-data":
      from paro_jax.run.prepare import prepare_data  # no jax

      meta = prepare_data(
        args.inputs, args.out, args.tokenizer, args.text_field, args.shard_tokens, args.bin_dtype
      )
      print(
        f"paro-jax: wrote {meta['tokens']} tokens ({meta['dtype']}) in {len(meta['shards'])} "
        f"shards to {args.out}: train with --data '{os.path.join(args.out, '*.bin')}' "
        f"--bin-dtype {meta['dtype']}"
      )
      return
    if args.command == "plot":
      from paro_jax.run.plot import plot_runs  # no jax needed

      print(f"paro-jax: wrote {plot_runs(args.runs, args.out)}")
      return
    if args.command == "export":
      _note_cpu_platform(args)
      from paro_jax.run.export import export_run  # one device: no device flags needed

      step = export_run(args.run, args.out, overwrite=args.overwrite)
      print(f"paro-jax: wrote checkpoint step {step} of {args.run} to {args.out}")
      return
    if args.command == "plan":
      from paro_jax.analysis.planner import run_plan  # no devices needed

      run_plan(**_by_name(args, run_plan, as_json=args.json))
      return
    mesh = parse_mesh_shape(args.mesh) if args.mesh else None
    if getattr(args, "target", None):  # a compile for GPUs described, not present: no devices
      from paro_jax.analysis import gpu

      _check_shape(args, mesh)
      args.target = gpu.check_target(args.target)
      gpu.prepare_environment()
      from paro_jax.analysis import estimate
      from paro_jax.core.units import parse_rate

      if mesh is None:
        raise ValueError("--target needs --mesh NODESxGPUS, e.g. --mesh 2x8")
      rate = parse_rate(args.inter_bandwidth) if args.inter_bandwidth else None
      estimate.prepare_environment(rate, mesh[1])  # before jax starts: XLA reads it once
      from paro_jax.analysis.inspector import inspect

      inspect(**_by_name(args, inspect, mesh=mesh, lora=_lora_config(args), as_json=args.json))
      return
    if args.command == "train":
      if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(
          f"--out {args.out} is a file: pass a directory for the run (metrics.jsonl, checkpoints/)"
        )
      from paro_jax.cluster.watch import start_heartbeat

      start_heartbeat()  # when paro-jax launch asked for one (env PARO_JAX_HEARTBEAT)
    _note_cpu_platform(args)
    from paro_jax.cluster import distributed

    multi = (
      getattr(args, "coordinator", None),
      getattr(args, "num_processes", None),
      getattr(args, "process_id", None),
    )
    processes = distributed.process_count(*multi)
    if mesh:
      if (mesh[0] * mesh[1]) % processes:
        raise ValueError(
          f"--mesh {args.mesh} has {mesh[0] * mesh[1]} devices, not divisible by "
          f"the {processes} processes"
        )
      per_process = mesh[0] * mesh[1] // processes
      if per_process > MAX_CPU_DEVICES:
        raise ValueError(
          f"--mesh {args.mesh} asks for {per_process} devices per process; at most "
          f"{MAX_CPU_DEVICES} virtual CPU devices are emulated (each costs memory and threads). "
          f"Use a smaller mesh, or `inspect --target h100 --mesh NODESxGPUS` to compile for a "
          f"large GPU cluster without its devices"
        )
      provide_cpu_devices(per_process)
    _check_shape(args, mesh)
    add_xla_flags()  # GPU collective overlap (HO-Ring); harmless elsewhere
    distributed.maybe_initialize(*multi)  # before anything touches devices
    if args.command == "probe":
      from paro_jax.analysis.probe import run_probe  # imports jax: after the device flag is set

      run_probe(mesh, args.sizes, args.repeats, not args.no_flops, args.out)
    if args.command == "inspect":
      from paro_jax.analysis.inspector import inspect  # imports jax: after the device flag is set

      inspect(**_by_name(args, inspect, mesh=mesh, lora=_lora_config(args), as_json=args.json))
    if args.command == "train":
      from paro_jax.run.train import RunConfig, train  # imports jax: after the device flag is set

      train(RunConfig(**_by_name(args, RunConfig, mesh=mesh, data=tuple(args.data))))
  except (ValueError, OSError) as e:  # OSError: missing files, a full disk while checkpointing
    report.error(e)
    sys.exit(2)
  except watch.PeerLost as e:  # another process of the run is gone: one line, as for a hang
    report.error(e)
    sys.exit(watch.LOST_EXIT)
  except KeyboardInterrupt as e:  # 128 + the signal: 130 for SIGINT, 143 for SIGTERM
    sys.exit(128 + getattr(e, "signum", 2))
