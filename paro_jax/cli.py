"""The `paro-jax` command line: subcommands, their flags, the device set-up before jax starts."""

from __future__ import annotations

import argparse
import sys

from paro_jax.core.names import (
  COLLECTIVE_IMPLS,
  DEFAULT_INT8_BLOCK,
  GRAD_DTYPES,
  WIRE_FORMATS,
  parse_mesh_shape,
)
from paro_jax.core.xla_flags import add_xla_flags, cpu_without_gpu_driver, provide_cpu_devices


def _lora_config(args):
  """The LoraConfig the LoRA flags ask for, or None (full training)."""
  from models.llama import LoraConfig  # imports jax: only once the device flags are set

  return LoraConfig.from_flags(args.lora_rank, args.lora_alpha, args.lora_targets)


def _note_cpu_platform() -> None:
  """Before jax starts: with the CUDA plugin but no GPU driver, run on the CPU and say so."""
  if note := cpu_without_gpu_driver():
    print(f"paro-jax: {note}", file=sys.stderr, flush=True)


def _by_name(args, target, **given):
  """The keyword arguments of `target` (a function or dataclass) that `args` has, by name."""
  import inspect

  names = inspect.signature(target).parameters
  return {**{k: v for k, v in vars(args).items() if k in names}, **given}


def _add_wire(p: argparse.ArgumentParser) -> None:
  """--inter-params, --inter-grads, --int8-block, --grad-dtype (train, inspect, plan)."""
  w = p.add_argument_group(
    "communication precision",
    "what the parameter gathers and gradient reductions carry across nodes (the inter level, "
    "also of a collective over all devices); intra-node traffic keeps the compute / "
    "accumulation dtype (docs/collectives.md)",
  )
  w.add_argument("--inter-params", default="same", choices=WIRE_FORMATS)
  w.add_argument("--inter-grads", default="same", choices=WIRE_FORMATS)
  w.add_argument(
    "--int8-block",
    type=int,
    default=DEFAULT_INT8_BLOCK,
    help=f"elements per fp32 scale of the int8 format (default {DEFAULT_INT8_BLOCK})",
  )
  w.add_argument(
    "--grad-dtype",
    default="compute",
    choices=GRAD_DTYPES,
    help="gradient accumulation and boundary reduction dtype (default: the compute dtype)",
  )


def _add_common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default="tiny", help="preset: tiny, small, 7b, 13b, 65b")
  p.add_argument(
    "--strategy",
    default="IIG",
    help="three letters P,G,OS from {N,I,G} (e.g. IIG) or ddp/zero1/zero2/zero3/mics; "
    "train also takes auto (probe the mesh, take the planner's pick)",
  )
  p.add_argument(
    "--mesh", default=None, help="GROUPSxDEVICES, e.g. 2x4 (default: one group per process)"
  )
  p.add_argument("--micro-batches", type=int, default=1, help="A: micro-batches per step")
  p.add_argument("--batch-size", type=int, default=16, help="global micro-batch size (sequences)")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="compute dtype")
  p.add_argument("--collectives", default="xla", choices=COLLECTIVE_IMPLS)
  _add_wire(p)
  p.add_argument(
    "--remat",
    default="full",
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
  parser = argparse.ArgumentParser(prog="paro-jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  train = sub.add_parser("train", help="train a Flax LLaMA with a PaRO strategy")
  _add_common(train)
  train.add_argument("--steps", type=int, default=50)
  train.add_argument("--seed", type=int, default=0)
  train.add_argument("--lr", type=float, default=3e-3)
  train.add_argument("--warmup", type=int, default=10)
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
  train.add_argument(
    "--out", default="runs/latest", help="run directory: metrics.jsonl and checkpoints/"
  )
  ckpt = train.add_argument_group(
    "checkpoints", "saved asynchronously into OUT/checkpoints/, also at the end and on Ctrl-C"
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
  dist.add_argument("--num-processes", type=int, default=None)
  dist.add_argument("--process-id", type=int, default=None)
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
    "--hlo-out", default=None, metavar="FILE", help="write the compiled (scheduled) HLO text here"
  )
  plot = sub.add_parser("plot", help="PNG of loss (train, eval) and throughput of runs")
  plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (--out of train)")
  plot.add_argument("--out", default="runs/plot.png", help="the PNG to write")
  export = sub.add_parser("export", help="the newest checkpoint of a run as an HF LLaMA directory")
  export.add_argument(
    "--run", required=True, metavar="RUN_DIR", help="a run directory (--out of train)"
  )
  export.add_argument(
    "--out",
    required=True,
    metavar="HF_DIR",
    help="directory to write config.json and model.safetensors (fp32) into",
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
    "--loopback",
    action="store_true",
    help="plain processes on 127.0.0.1, no namespaces and no shaping",
  )
  _add_planner_commands(sub)
  return parser


def _add_planner_commands(sub) -> None:
  """`plan` (no devices needed) and `probe` (measures the mesh it runs on)."""
  plan = sub.add_parser(
    "plan", help="rank the 14 strategies for a cluster: memory, step time, the pick and why"
  )
  plan.add_argument("--model", default="7b", help="preset: tiny, small, 7b, 13b, 65b")
  plan.add_argument("--nodes", type=int, required=True, help="G: nodes (groups)")
  plan.add_argument("--devices-per-node", type=int, required=True, help="M: devices per node")
  from paro_jax.analysis.hardware import GPUS  # no jax

  plan.add_argument(
    "--gpu", default="a100-80gb", help=f"device model for peak FLOP/s and memory: {', '.join(GPUS)}"
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
  plan.add_argument("--seq-len", type=int, default=2048)
  plan.add_argument(
    "--trainable-fraction",
    type=float,
    default=1.0,
    help="Ψ'/Ψ: 1 for full training, e.g. 0.003 for LoRA",
  )
  plan.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="compute dtype")
  plan.add_argument(
    "--collectives",
    default="xla",
    choices=COLLECTIVE_IMPLS,
    help="how collectives over all devices run: xla (NCCL) and hring in two "
    "levels, ring flat (docs/design.md), horing two overlapped levels",
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
  dist.add_argument("--num-processes", type=int, default=None)
  dist.add_argument("--process-id", type=int, default=None)


def main(argv=None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  child_argv = []
  if argv[:1] == ["launch"] and "--" in argv:  # everything after -- is the child train command
    cut = argv.index("--")
    argv, child_argv = argv[:cut], argv[cut + 1 :]
  args = build_parser().parse_args(argv)
  try:
    if args.command == "launch":
      from paro_jax.cluster.launch import launch  # no jax in the launcher process

      sys.exit(
        launch(
          child_argv,
          nodes=args.nodes,
          devices_per_node=args.devices_per_node,
          inter_bandwidth=args.inter_bandwidth,
          inter_latency=args.inter_latency,
          intra_bandwidth=args.intra_bandwidth,
          shaped=not args.loopback,
        )
      )
    if args.command == "plot":
      from paro_jax.run.plot import plot_runs  # no jax needed

      print(f"paro-jax: wrote {plot_runs(args.runs, args.out)}")
      return
    if args.command == "export":
      _note_cpu_platform()
      from paro_jax.run.export import export_run  # one device: no device flags needed

      step = export_run(args.run, args.out)
      print(f"paro-jax: wrote checkpoint step {step} of {args.run} to {args.out}")
      return
    if args.command == "plan":
      from paro_jax.analysis.planner import run_plan  # no devices needed

      run_plan(**_by_name(args, run_plan, as_json=args.json))
      return
    mesh = parse_mesh_shape(args.mesh) if args.mesh else None
    if getattr(args, "target", None):  # a compile for GPUs described, not present: no devices
      from paro_jax.analysis import gpu

      args.target = gpu.check_target(args.target)
      gpu.prepare_environment()
      from paro_jax.analysis.inspector import inspect

      inspect(**_by_name(args, inspect, mesh=mesh, lora=_lora_config(args), as_json=args.json))
      return
    _note_cpu_platform()
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
      provide_cpu_devices(mesh[0] * mesh[1] // processes)  # per process
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
    print(f"paro-jax: error: {e}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:
    sys.exit(130)
