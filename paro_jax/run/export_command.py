"""`paro-jax export RUN_DIR --out HF_DIR`: its flags and its entry (paro_jax/run/export.py
writes), with the one line that says what was written. In a multi-process job (the launcher's
flags, or SLURM / Open MPI) every process joins before it runs (cli.py) and process 0 says it."""

from __future__ import annotations

from paro_jax.core.flags import Invocation, add_process_flags
from paro_jax.core.units import parse_size


def shard_size(text: str) -> int:
  """--max-shard-size: bytes, or a size with a unit (5GB, 500MB: decimal, as transformers'
  max_shard_size; 2GiB), read before any checkpoint is restored (a ValueError: one line)."""
  try:
    size = parse_size(text, "--max-shard-size")
  except ValueError:
    size = None
  if size is None or size < 1:
    raise ValueError(
      f"--max-shard-size {text!r} is not a size: pass a number of bytes (e.g. 1000000) or one "
      f"with a unit (5GB, 500MB, 2GiB)"
    )
  return int(size)


def add_parser(sub) -> None:
  export = sub.add_parser("export", help="the newest checkpoint of a run as an HF LLaMA directory")
  export.add_argument("run", nargs="?", metavar="RUN_DIR", help="a run directory (--out of train)")
  export.add_argument("--run", dest="run_flag", metavar="RUN_DIR", help="the same, as an option")
  export.add_argument(
    "--out",
    required=True,
    metavar="HF_DIR",
    help="directory to write the HF model into: config.json, the safetensors weights, the "
    "tokenizer files and generation_config.json",
  )
  export.add_argument(
    "--overwrite", action="store_true", help="replace the files of an existing, non-empty --out"
  )
  export.add_argument(
    "--dtype",
    default=None,
    type=str.lower,
    choices=("bf16", "fp16", "fp32"),
    help="the weights' dtype (default: the dtype of the --init-from weights the run started "
    "from; bf16 for a run trained from scratch)",
  )
  export.add_argument(
    "--max-shard-size",
    default="5GB",
    metavar="SIZE",
    help="split the weights into safetensors shards of at most SIZE: a number of bytes, or with "
    "a unit (KB, MB, GB, TB: decimal, as transformers' max_shard_size; KiB, MiB, GiB: binary) "
    "with model.safetensors.index.json",
  )
  export.add_argument(
    "--adapter",
    action="store_true",
    help="for a LoRA run started from --init-from: write the adapters alone as a PEFT adapter "
    "(adapter_config.json, adapter_model.safetensors) instead of the merged model. peft "
    "generates with the base model's generation_config.json: pass a chat fine-tune's stop "
    "tokens to generate(), or ship the merged model",
  )
  export.add_argument(
    "--base-model",
    metavar="NAME",
    help="with --adapter: the base model adapter_config.json names (base_model_name_or_path), "
    "e.g. its Hub id (default: the absolute path of the HF directory the run started from)",
  )
  add_process_flags(
    export.add_argument_group(
      "multi-process",
      "as for train: every process restores its devices' shards and takes part in each "
      "tensor's gather; process 0 alone writes --out",
    )
  )


def check_args(args, error) -> None:
  """The run directory, given positionally or as --run (`error`: the parser's, one usage line)."""
  if args.run and args.run_flag and args.run != args.run_flag:
    error(f"two run directories: {args.run} and --run {args.run_flag}; give one")
  args.run = args.run or args.run_flag
  if not args.run:
    error("the run directory is required: paro-jax export RUN_DIR --out HF_DIR")
  if args.base_model is not None and not args.adapter:
    error(
      f"--base-model {args.base_model} names the base model of a PEFT adapter: pass it with "
      f"--adapter, or leave it out (the merged model needs no base)"
    )
  if args.base_model is not None and not args.base_model.strip():
    error("--base-model is empty: pass the base model's Hub id or path, or leave it out")


def main(args, inv: Invocation) -> None:
  max_shard_size = shard_size(args.max_shard_size)  # before the restore, which takes a while
  import jax  # once the devices are set up and the processes joined (cli.py)

  from paro_jax.run.export import export_run  # jax: the CLI's start and its parser stay free of it

  done = export_run(
    args.run,
    args.out,
    overwrite=args.overwrite,
    dtype=args.dtype,
    max_shard_size=max_shard_size,
    adapter=args.adapter,
    base_model=args.base_model,
  )
  if jax.process_index():  # process 0 says what the processes wrote together
    return
  what = "its LoRA adapters (PEFT)" if args.adapter else "the model"
  shards = [w for w in done.weights if w.startswith("model-")]
  weights = [w for w in done.weights if w not in shards]
  if shards:  # model-00001-of-0000N.safetensors ...: counted, not listed
    weights.insert(1, f"{len(shards)} shards ({shards[0]}, ...)")
  copied = f"; copied {', '.join(done.copied)}" if done.copied else ""
  if done.missing:
    copied += f"; could not copy {', and '.join(done.missing)}"
  elif not done.copied:
    copied = "; no tokenizer files"
  if done.chat_template:
    copied += "; chat_template.jinja: the chat template the run trained with"
  if done.stops:
    copied += (
      f"; generation_config.json: eos_token_id {done.stops} (generation stops at the chat "
      f"template's end of turn, {done.stops[-1]})"
    )
  if args.adapter:
    named = "--base-model" if args.base_model else "the local path; --base-model NAME for a Hub id"
    copied += (
      f"; base_model_name_or_path {done.base_model} ({named}); peft generates with the base "
      f"model's generation_config.json, not this one: "
      + (
        f"pass eos_token_id={done.chat_stops} (its end of text and the chat template's end "
        f"of turn) to generate(), or ship the merged export (without --adapter)"
        if done.chat_stops
        else "pass your stop tokens to generate(), or ship the merged export"
      )
    )
  print(
    f"paro-jax: wrote checkpoint step {done.step} of {args.run} to {args.out}: {what} in "
    f"{done.dtype} ({done.dtype_why}), {', '.join(weights)}{copied}"
  )
