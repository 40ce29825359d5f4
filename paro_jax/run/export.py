"""`paro-jax export`: the newest checkpoint of a training run as an HF directory a user can ship.

The checkpoint's weights alone are restored through paro_jax.run.checkpoint, sharded over every
device (EXPORT_STRATEGY, mesh processes x local devices) for the model config the checkpoint
records (--adapter: the adapters alone), and streamed out a tensor at a time
(paro_jax/hf/stream_out.py: host memory one output shard plus one tensor). What is written:
- the model (the files paro_jax.hf.weights.save_hf writes): config.json with the fields of the
  config.json the run started from (--init-from's or --model's, as the checkpoint records it:
  bos/eos ids, max_position_embeddings, ...) and our shapes, RoPE and tying; the weights in
  `--dtype` (by default the dtype the --init-from weights came in, bf16 for a run trained from
  scratch), in shards of at most `--max-shard-size` with their index above it. A LoRA run's
  adapters are merged into its frozen base: the export is a plain LLaMA;
- or, with `--adapter` (a LoRA run started from --init-from), the adapters alone as PEFT writes
  them (paro_jax/hf/peft.py), for the HF directory the run started from: adapter_config.json's
  base_model_name_or_path is `--base-model NAME` (its Hub id), by default that directory's
  absolute path;
- beside either, the tokenizer the run read its data with (tokenizer.json and the files of its
  directory: tokenizer_config.json, special_tokens_map.json, chat_template.jinja) and the source
  directory's generation_config.json, so that transformers' AutoTokenizer and
  AutoModelForCausalLM load the directory as they load the source. The tokenizer files are
  copied as they are (their tokenizer_class included): the export tokenizes as the source does.
  A tokenizer.json with no tokenizer_config.json beside it gets a minimal one naming
  PreTrainedTokenizerFast, the class transformers 4 and 5 both load (5 writes its own name,
  TokenizersBackend, which 4 cannot load);
- a run on chat records: the chat template they were rendered with (its checkpoint records it)
  as chat_template.jinja, where the copied files would give another one or none (a
  --chat-template FILE): transformers (4.47 and later) takes that file over a
  tokenizer_config.json's chat_template, so `apply_chat_template` renders as the run trained;
  and the special token that template ends an assistant's turn with (`<|eot_id|>`, `<|im_end|>`)
  added to generation_config.json's eos_token_id where it is not there (a base model's lists
  only its end of text), so that generation stops where the run's answers ended. Without a
  generation_config.json to copy, one is written with config.json's bos and eos ids and it. The
  token is the one the checkpoints record (run/stops.py): the source directory may be gone.
  A file that could not be copied (the source directory or the tokenizer moved or deleted) is
  named in the export's line (`Exported.missing`).

The files are written into a hidden directory and moved into place once complete: a failed
export (a full disk, Ctrl-C) leaves --out as it was. A new --out is that directory
(`.NAME.partial-PID`, beside it) renamed; into an existing one (empty, or with --overwrite) the
directory is made inside it (`.partial-PID`) and its files are moved in one by one, so that an
--out that cannot be replaced by a rename (a mount point: EBUSY; the parent on another disk:
EXDEV) is written on its own filesystem (paro_jax/run/publish.py).

In a multi-process job (jax.distributed: `paro-jax launch -- export ...`, SLURM, Open MPI) every
process restores its devices' shards and takes part in each tensor's gather; process 0 alone
reads --out and writes, and after each of its writes the processes agree that it went through
(cluster/agree.py `OneWriter`): an error on any process stops them all, each with a line, and
they finish together. The files are those one process writes, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax

from models.config import LlamaConfig, LoraConfig
from models.hf_config import CONFIG
from paro_jax.hf.weights import MAX_SHARD_SIZE, WEIGHT_DTYPES, weights_dtype
from paro_jax.hf.stream_out import NonFinite, gather_adapters, stream_hf
from paro_jax.hf.peft import save_adapter
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.cluster.agree import OneWriter
from paro_jax.run.publish import EXPORT_PARTIAL, publish, remove_stale
from paro_jax.core.config import LoraOptions, StepConfig
from paro_jax.core.factory import build_engine
from paro_jax.core.shards import join_trainable
from paro_jax.core.mesh import make_mesh
from paro_jax.data.chat import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, find_template
from paro_jax.data.tokenizers import BYTES, TOKENIZER_FILE
from paro_jax.run.stops import GENERATION_CONFIG, end_of_turn_id, stop_at_end_of_turn

EXPORT_DTYPES = tuple(WEIGHT_DTYPES)  # bf16, fp16, fp32
# The export's placement of the weights: sharded over every device of every process (ZeRO-3's
# P), whatever strategy the run trained with, so that each device holds 1/n of them.
EXPORT_STRATEGY = "GGG"
SCRATCH_DTYPE = "bf16"  # of a run trained from scratch: the dtype Llama checkpoints ship in
# The files of a tokenizer's HF directory that travel with its tokenizer.json.
TOKENIZER_SIDE_FILES = (TOKENIZER_CONFIG, "special_tokens_map.json", CHAT_TEMPLATE_FILE)


@dataclasses.dataclass(frozen=True)
class Exported:
  """What an export wrote, for its line."""

  step: int
  dtype: str
  dtype_why: str  # where the dtype came from
  weights: list[str]  # the weight files written
  copied: list[str]  # the tokenizer and generation files copied in
  chat_template: bool = False  # chat_template.jinja written: the template the run trained with
  stops: list[int] | None = None  # generation_config.json's eos_token_id, where it was extended
  missing: tuple[str, ...] = ()  # what could not be copied, and why
  base_model: str | None = None  # an adapter's base_model_name_or_path
  # a chat run's stops: the source config.json's eos ids and its chat template's end of turn
  chat_stops: list[int] | None = None


def _check_out(out: str, overwrite: bool) -> None:
  if os.path.isfile(out):
    raise ValueError(f"--out {out} is a file: pass a directory to write the HF model into")
  if os.path.isdir(out):  # an export killed (-9) inside it left its partial directory
    remove_stale(os.path.join(os.path.abspath(out), EXPORT_PARTIAL))
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ValueError(
      f"--out {out} already exists and is not empty: pass another --out, or --overwrite to "
      f"replace the files the export writes"
    )


def _source_dir(meta) -> str | None:
  """The HF directory the run started from (--init-from), as its checkpoints record it."""
  return meta.model_name[3:] if meta.model_name.startswith("hf:") else None


def _base_config(meta, source: str | None) -> dict | None:
  """The config.json the run's model came from: as the checkpoint recorded it, else (a
  checkpoint from before that was recorded) the source directory's, if it is still there."""
  if isinstance(meta.source_config, dict):
    return meta.source_config
  if source is None:
    return None
  try:
    with open(os.path.join(source, CONFIG)) as f:
      base = json.load(f)
  except (OSError, ValueError):
    return None  # the source is gone or unreadable: write our fields only
  return base if isinstance(base, dict) else None


def export_dtype(requested: str | None, source: str | None, base: dict | None) -> tuple[str, str]:
  """(the dtype to write, why): --dtype; else the dtype of the --init-from weights (their
  safetensors, or the config.json the checkpoint recorded when they are gone); else bf16."""
  if requested is not None:
    if requested not in EXPORT_DTYPES:
      raise ValueError(f"unknown --dtype {requested!r}; choose one of {', '.join(EXPORT_DTYPES)}")
    return requested, "--dtype"
  if source is None:
    return SCRATCH_DTYPE, "trained from scratch"
  stored = weights_dtype(source) if os.path.isdir(source) else None
  if stored:
    return stored, f"the dtype of {source}'s weights"
  named = (base or {}).get("torch_dtype") or (base or {}).get("dtype")
  by_name = {torch: ours for ours, (_, torch, _) in WEIGHT_DTYPES.items()}
  if named in by_name:
    return by_name[named], f"the dtype {source}'s config.json names"
  return SCRATCH_DTYPE, f"{source}'s weights are not readable to tell theirs"


def export_run(
  run_dir: str,
  out: str,
  overwrite: bool = False,
  dtype: str | None = None,
  max_shard_size: str | int = MAX_SHARD_SIZE,
  adapter: bool = False,
  base_model: str | None = None,
) -> Exported:
  """Write the newest intact checkpoint of `run_dir` (train's --out) to `out` (module
  docstring). An existing non-empty `out` needs `overwrite`; the HF directory the run started
  from (its --init-from) is never overwritten. `base_model`: an adapter's
  base_model_name_or_path (default: the absolute path of that directory)."""
  together = OneWriter("export")  # process 0 writes; an error anywhere stops every process
  with together.step():  # --out, which process 0 alone reads, before any other collective
    if together.writer:
      _check_out(out, overwrite)
  ckpt = None
  try:
    with together.step():
      directory = os.path.join(run_dir, CHECKPOINTS)
      if not os.path.isdir(directory):
        raise FileNotFoundError(
          f"{run_dir} has no {CHECKPOINTS}/ directory: pass the --out of a `paro-jax train` run"
        )
      ckpt = Checkpointer(directory, read_only=True)
      if not ckpt.steps():
        raise FileNotFoundError(f"no checkpoint in {directory} to export")
      meta = ckpt.newest_meta()  # a step rotated away while read: the newer one
      source = _source_dir(meta)
      if together.writer and source and os.path.isdir(out) and _same(source, out):
        raise ValueError(
          f"--out {out} is the HF directory the run started from (--init-from): pass another "
          f"--out; overwriting it would lose the original weights"
        )
      base = _base_config(meta, source)
      written_dtype, why = export_dtype(dtype, source, base)
      cfg = LlamaConfig(**meta.model_config)
      lora = LoraConfig(**meta.lora) if meta.lora else None
      if adapter and (lora is None or source is None):
        raise ValueError(
          f"--adapter writes the LoRA adapters of a run started from --init-from, and {run_dir} "
          f"{'has no LoRA adapters' if lora is None else 'trained its base from scratch'}: "
          f"export it without --adapter (a plain LLaMA)"
        )
    # The weights alone, sharded over every device (EXPORT_STRATEGY): no device or host holds
    # the whole model. The one restore path resume uses: it verifies the checksums of the
    # arrays as written (whatever dtype the run trained in); its processes agree on the step.
    sharded = StepConfig(strategy=EXPORT_STRATEGY, dtype="fp32", lora=LoraOptions.of(lora))
    mesh = make_mesh(jax.process_count(), jax.local_device_count(), jax.devices())
    engine = build_engine(sharded, cfg, mesh)
    # --adapter: the adapters alone (the master of a LoRA run); the frozen base is not read
    state, meta = ckpt.restore(engine, meta.model_name, weights_only=True, frozen=not adapter)
  finally:
    if ckpt is not None:
      ckpt.close()
  params, adapters = state.master, None
  if lora and adapter:  # the adapters alone, to host (they are small)
    try:
      adapters = gather_adapters(state.master)
    except NonFinite as e:
      raise _nonfinite(meta.step, run_dir, e) from None
  elif lora:
    params = join_trainable(engine.mask, state.master, state.frozen)
  np_dtype = WEIGHT_DTYPES[written_dtype][0]
  copied: list[str] = []
  written: list[str] = []  # besides the weights: chat_template.jinja, generation_config.json
  stops: list[int] = []  # generation_config.json's eos_token_id, where extended
  missing: list[str] = []  # what could not be copied
  tokenizer = meta.data.get("tokenizer")
  # as the checkpoint records it; computed again for a checkpoint from before it was recorded
  eot = meta.end_of_turn
  if eot is None:
    eot = end_of_turn_id(meta.chat_template, tokenizer)
  if adapter and base_model is None:
    base_model = os.path.abspath(source) if os.path.isdir(source) else source

  def write(partial: str | None) -> None:  # on every process; `partial` on process 0's alone
    if adapter and together.writer:
      save_adapter(cfg, lora, adapters, partial, base_model, np_dtype)
    elif not adapter:
      try:
        stream_hf(
          cfg, params, partial, base, written_dtype, max_shard_size, lora, params, together.check
        )
      except NonFinite as e:
        raise _nonfinite(meta.step, run_dir, e) from None
    if not together.writer:
      return
    copied.extend(_copy_side_files(partial, tokenizer, source, missing))
    if _ship_chat_template(partial, meta.chat_template):
      written.append(CHAT_TEMPLATE_FILE)
    stops.extend(stop_at_end_of_turn(partial, eot))
    if stops:
      written.append(GENERATION_CONFIG)
    copied[:] = [name for name in copied if name not in written]  # rewritten after the copy

  names: list[str] = []  # process 0 publishes; the others wait on its verdict
  with together.step():
    names = publish(write, out) if together.writer else write(None) or []
  files = [name for name in names if name not in copied + written]
  chat = CHAT_TEMPLATE_FILE in written
  return Exported(
    meta.step,
    written_dtype,
    why,
    files,
    copied,
    chat,
    stops or None,
    tuple(missing),
    base_model if adapter else None,
    _chat_stops(base, eot),
  )


def _same(source: str, out: str) -> bool:
  return os.path.isdir(source) and os.path.samefile(source, out)


def _nonfinite(step: int, run_dir: str, what) -> ValueError:
  return ValueError(
    f"checkpoint step {step} of {run_dir} holds NaN or Inf weights ({what}): not exported"
  )


def _chat_stops(base: dict | None, eot: int | None) -> list[int] | None:
  """The eos ids of the config.json the run started from, and `eot` (None: not a chat run)."""
  if eot is None:
    return None
  eos = (base or {}).get("eos_token_id")
  stops = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
  return stops + [eot] if eot not in stops else stops


def _ship_chat_template(partial: str, template: str | None) -> bool:
  """Write `template` (the text a run's chat records were rendered with) as chat_template.jinja
  unless the tokenizer files copied into `partial` already give it; True if written."""
  if template is None:
    return False
  try:
    if find_template(partial) == template:
      return False
  except ValueError:  # named templates without a default: ours is the one to use
    pass
  with open(os.path.join(partial, CHAT_TEMPLATE_FILE), "w", encoding="utf-8") as f:
    f.write(template)
  return True


def _copy_side_files(
  partial: str, tokenizer: str | None, source: str | None, missing: list[str]
) -> list[str]:
  """Copy into `partial` the run's tokenizer (its tokenizer.json and the files beside it; a
  minimal tokenizer_config.json if it has none) and the source's generation_config.json; what
  is gone is added to `missing` (said in the export's line). Returns the names copied."""
  copied = []
  if tokenizer and tokenizer != BYTES:
    path = os.path.join(tokenizer, TOKENIZER_FILE) if os.path.isdir(tokenizer) else tokenizer
    if not os.path.isfile(path):
      missing.append(
        f"the tokenizer files ({path} is gone: copy its tokenizer.json and "
        f"tokenizer_config.json beside the export)"
      )
    else:
      shutil.copyfile(path, os.path.join(partial, TOKENIZER_FILE))
      copied.append(TOKENIZER_FILE)
      beside = os.path.dirname(path)
      for name in TOKENIZER_SIDE_FILES:
        if os.path.isfile(os.path.join(beside, name)):
          shutil.copyfile(os.path.join(beside, name), os.path.join(partial, name))
          copied.append(name)
      if TOKENIZER_CONFIG not in copied:
        with open(os.path.join(partial, TOKENIZER_CONFIG), "w") as f:
          json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
          f.write("\n")
        copied.append(TOKENIZER_CONFIG)
  if source and os.path.isfile(os.path.join(source, GENERATION_CONFIG)):
    shutil.copyfile(
      os.path.join(source, GENERATION_CONFIG), os.path.join(partial, GENERATION_CONFIG)
    )
    copied.append(GENERATION_CONFIG)
  elif source and not os.path.isdir(source):
    missing.append(f"{source}/{GENERATION_CONFIG} ({source}, the run's --init-from, is gone)")
  return copied
