"""`RunConfig`: what `paro-jax train` runs, a training step's configuration plus the run's;
`DataConfig`: where its tokens come from.

Its flags are built from these fields by paro_jax/cli.py (analysis/config.py `option`). The
module imports no jax or numpy: the CLI builds its parser before jax starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings

from paro_jax.analysis.config import StepConfig, option
from paro_jax.run.divergence import MODES, GuardConfig

_GUARD = GuardConfig()
# Characters the checkpoint library cannot have in a path: orbax finds a save's per-process files
# with a glob of the directory (`[`, `]`, `*`, `?` are patterns there) and TensorStore reads `\`
# as an escape; the arrays of such a save are written but can never be read back.
UNSAFE_PATH_CHARS = "[]*?\\"
BIN_DTYPE_NAMES = ("uint16", "uint32")  # of .bin token files (run/data.py BIN_DTYPES)
DATA_FORMATS = ("auto", "text", "prompt-completion", "chat")  # run/instruct.py
LONG_EXAMPLES = ("drop", "truncate")


def unsafe_path_chars(path: str) -> str:
  """The characters of `path`'s absolute form that checkpoints cannot live under, in order."""
  absolute = os.path.abspath(path)
  return "".join(dict.fromkeys(c for c in absolute if c in UNSAFE_PATH_CHARS))


def refuse_unsafe_path(path: str, what: str) -> None:
  """One line, before anything is written, for a directory whose checkpoints could not be read
  back (e.g. `--out 'exp[lr=3e-3]'`)."""
  bad = unsafe_path_chars(path)
  if not bad:
    return
  safe = re.sub(r"-+(/|$)", r"\1", re.sub("[" + re.escape(UNSAFE_PATH_CHARS) + "]+", "-", path))
  fix = f" (e.g. {safe!r})" if safe != path else " (a directory above it has them)"
  raise ValueError(
    f"{what} {path!r}: its path {os.path.abspath(path)} holds {' '.join(bad)}, which the "
    f"checkpoint library (orbax) reads as glob patterns, so no checkpoint saved there could be "
    f"read back; pass a path without any of {' '.join(UNSAFE_PATH_CHARS)}{fix}"
  )


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where a run's tokens come from (run/data.py reads them)."""

  paths: tuple[str, ...] = ()  # files and globs; empty: the built-in corpus
  text_field: str = "text"  # the field of a JSONL record that holds its text
  tokenizer: str | None = None  # an HF tokenizer.json; None: bytes
  bin_dtype: str | None = None  # of .bin files; None: inferred (see bin_dtype_for)
  eval_fraction: float = 0.01  # the last fraction of the tokens is held out for eval
  # instruction data (run/instruct.py, run/examples.py)
  data_format: str = "auto"  # of the records; auto: from each file's first record
  chat_template: str | None = None  # a jinja2 file; None: the model's HF directory's
  pack: bool = False  # several examples per row, kept apart
  long_examples: str = "drop"  # examples longer than a row: dropped (counted) or truncated

  def __post_init__(self):
    if self.data_format not in DATA_FORMATS:
      raise ValueError(f"unknown --data-format {self.data_format!r}; choose one of {DATA_FORMATS}")
    if self.long_examples not in LONG_EXAMPLES:
      raise ValueError(
        f"unknown --long-examples {self.long_examples!r}; choose one of {LONG_EXAMPLES}"
      )
    if self.bin_dtype is not None and self.bin_dtype not in BIN_DTYPE_NAMES:
      raise ValueError(
        f"unknown --bin-dtype {self.bin_dtype!r}; choose one of {list(BIN_DTYPE_NAMES)}"
      )
    if not 0 <= self.eval_fraction < 1:
      raise ValueError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(StepConfig):
  steps: int = option(50, "optimizer steps of the whole run")
  compile_top: int = option(
    3,
    "with --strategy auto on H100/H200 GPUs: compile the analytic top K, any within 10%% of "
    "the first and any faster one the analytic memory rules out by less than 30%% for this "
    "cluster, and take the fastest by XLA's estimate of the compiled step whose memory fits; "
    "0: the analytic pick alone (default %(default)s)",
    metavar="K",
  )
  seed: int = option(0, "of the initial weights and the batches")
  lr: float = option(3e-3, "peak learning rate (AdamW)")
  warmup: int = option(10, "steps of linear warmup, then cosine decay")
  # DataConfig's
  data: tuple[str, ...] = option(  # a str is one path; empty: the built-in corpus
    DataConfig.paths,
    "files and globs: *.jsonl (JSON lines), *.bin (token ids), else text",
    nargs="+",
    metavar="PATH",
  )
  text_field: str = option(DataConfig.text_field, "the JSONL field holding the text")
  tokenizer: str | None = option(
    DataConfig.tokenizer,
    "an HF tokenizer.json (needs the hf extra; default: bytes, vocab 256)",
    metavar="TOKENIZER_JSON",
  )
  bin_dtype: str | None = option(
    DataConfig.bin_dtype,
    ".bin token dtype (default: uint16, or uint32 when the tokenizer's "
    "vocab, else the model's, exceeds 65536)",
    type=str.lower,
    choices=BIN_DTYPE_NAMES,
  )
  eval_fraction: float = option(
    DataConfig.eval_fraction,
    "the last fraction of the tokens (of instruction data: of the examples) held out for eval "
    "(default %(default)s)",
  )
  data_format: str = option(
    DataConfig.data_format,
    "what the records hold: text, a prompt and its completion (loss on the completion and EOS), "
    "or chat messages (loss on the assistant's turns); default %(default)s: from each file's "
    "first record",
    choices=DATA_FORMATS,
  )
  chat_template: str | None = option(
    DataConfig.chat_template,
    "a jinja2 chat template for chat records (default: the one of --init-from's HF directory, "
    "else of --tokenizer's)",
    metavar="FILE",
  )
  pack: bool = option(
    DataConfig.pack,
    "instruction data: pack several examples into each sequence, each attending only to itself "
    "(default: one example per sequence, padded)",
  )
  long_examples: str = option(
    DataConfig.long_examples,
    "instruction examples longer than --seq-len + 1 tokens: drop them (counted in the log) or "
    "keep their first --seq-len + 1 tokens (default %(default)s)",
    choices=LONG_EXAMPLES,
  )
  eval_every: int = option(0, "eval loss every N steps (default %(default)s: never)", metavar="N")
  eval_batches: int = option(
    1,
    "the eval loss is the mean over K fixed batches of the eval split (default %(default)s)",
    metavar="K",
  )
  out: str = option("runs/latest", "run directory: metrics.jsonl and checkpoints/")
  checkpoint_every: int = option(
    0, "save every N steps (default %(default)s: only at the end)", metavar="N"
  )
  keep: int = option(3, "keep the newest K (default %(default)s)", metavar="K")
  resume: bool = option(False, "continue from the newest checkpoint in OUT (any strategy or mesh)")
  init_from: str | None = option(  # the model (`model` is ignored) and, fresh, the weights
    None,
    "start from the weights of an HF LlamaForCausalLM directory (config.json "
    "+ safetensors); its config.json defines the model and --model is ignored. "
    "Pass it again with --resume",
    metavar="HF_DIR",
  )
  max_bad_steps: int = option(
    3,
    "a step whose loss or gradient norm is NaN/Inf leaves the weights as they were; stop "
    "after N such steps in a row (default %(default)s)",
    metavar="N",
  )
  # run/divergence.py: a loss or gradient norm that leaves its running band
  divergence_guard: str = option(
    _GUARD.mode,
    "stop the run, warn once, or only check NaN/Inf (default %(default)s)",
    choices=MODES,
  )
  divergence_window: int = option(
    _GUARD.window,
    "the band: the mean of the previous N in-band steps (default %(default)s)",
    metavar="N",
  )
  divergence_loss_factor: float = option(
    _GUARD.loss_factor,
    "out of band: loss above X times its band (default %(default)g)",
    metavar="X",
  )
  divergence_grad_factor: float = option(
    _GUARD.grad_factor,
    "out of band: gradient norm above X times its band (default %(default)g)",
    metavar="X",
  )
  divergence_patience: int = option(
    _GUARD.patience,
    "stop after N out-of-band steps in a row (default %(default)s)",
    metavar="N",
  )
  divergence_loss_cap: float = option(
    _GUARD.loss_cap,
    f"out of band: loss above L (default %(default)g: {_GUARD.cap_times_uniform:g} x "
    f"ln(vocab), twice the loss of a uniform guess)",
    metavar="L",
  )
  progress_timeout: float = option(
    0.0,
    "exit (code 3, naming the last step) when no step finished for S seconds, the first "
    "compile included: for SLURM/mpirun, where a dead or hung peer otherwise blocks the others "
    "for good; paro-jax launch watches its nodes itself (default %(default)g: off)",
    metavar="S",
  )
  # run/fit.py: refuse, before compiling, a run the planner's estimate says cannot fit
  memory_check: bool = option(
    True,
    "compile even when the planner's memory estimate exceeds the devices' memory (by "
    "default such a run is refused before compiling)",
    flag="--no-memory-check",
    action="store_false",
  )

  def __post_init__(self):
    from paro_jax.core.engine import DTYPES  # jax: this module is read before jax starts

    if self.dtype not in DTYPES:
      raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
    if not (math.isfinite(self.lr) and self.lr > 0):
      raise ValueError(f"--lr must be a positive finite number, got {self.lr}")
    if self.warmup < 0:
      raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
    if not 0 <= self.seed < 2**63:  # jax.random.key takes an int64, the batches' rng no sign
      raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
    super().__post_init__()
    for name in ("steps", "keep", "max_bad_steps", "eval_batches"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
    if isinstance(self.data, str):
      object.__setattr__(self, "data", (self.data,))
    for name in ("checkpoint_every", "eval_every", "progress_timeout", "compile_top"):
      if getattr(self, name) < 0:
        raise ValueError(
          f"--{name.replace('_', '-')} must be >= 0 (0: off), got {getattr(self, name)}"
        )
    self.data_config()  # its checks
    self.guard()  # its checks
    refuse_unsafe_path(self.out, "--out")
    # Last: a run refused for another flag gets its one error line, not this warning first.
    if self.warmup > self.steps:
      warnings.warn(
        f"--warmup {self.warmup} is more than --steps {self.steps}: the learning rate warms up "
        f"over all {self.steps} steps instead and reaches --lr only at the last one (pass "
        f"--warmup {self.steps} or less to silence this)",
        stacklevel=3,
      )

  def guard(self) -> GuardConfig:
    return GuardConfig(
      mode=self.divergence_guard,
      window=self.divergence_window,
      loss_factor=self.divergence_loss_factor,
      grad_factor=self.divergence_grad_factor,
      patience=self.divergence_patience,
      loss_cap=self.divergence_loss_cap,
    )

  def data_config(self) -> DataConfig:
    return DataConfig(
      paths=tuple(self.data),
      text_field=self.text_field,
      tokenizer=self.tokenizer,
      bin_dtype=self.bin_dtype,
      eval_fraction=self.eval_fraction,
      data_format=self.data_format,
      chat_template=self.chat_template,
      pack=self.pack,
      long_examples=self.long_examples,
    )

  def data_position(self) -> dict:
    """Besides (seed, step), what the batch of a step depends on."""
    return {
      **dataclasses.asdict(self.data_config()),
      "micro_batches": self.micro_batches,
      "batch_size": self.batch_size,
      "seq_len": self.seq_len,
    }


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What `paro-jax eval` scores (run/evaluate.py): SOURCE on --data, on a step's mesh."""

  source: str
  strategy: str
  mesh: tuple | None
  batch_size: int
  seq_len: int
  dtype: str
  collectives: str
  attention: str
  data: tuple[str, ...]
  text_field: str
  tokenizer: str | None
  bin_dtype: str | None
  data_format: str
  chat_template: str | None
  long_examples: str
  as_json: bool = False

  def data_config(self) -> DataConfig:
    return DataConfig(
      paths=tuple(self.data),
      text_field=self.text_field,
      tokenizer=self.tokenizer,
      bin_dtype=self.bin_dtype,
      data_format=self.data_format,
      chat_template=self.chat_template,
      long_examples=self.long_examples,
    )
