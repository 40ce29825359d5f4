"""`RunConfig`: what `paro-jax train` runs, a training step's configuration plus the run's, the
run's in groups: `optimizer` (the schedule), `data` (where its tokens come from), `eval`,
`checkpoints`, `guard` (the divergence guard, run/divergence.py), `sinks` (where the metrics rows
go besides metrics.jsonl, run/sinks.py) and `profile` (a profiler trace, run/profiling.py).

Its flags are built from these fields by run/train_command.py (core/flags.py, from core/config.py
`option`, `group`). The module imports no jax or numpy: the CLI builds its parser before jax
starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings

from paro_jax.core.config import LoraOptions, StepConfig, group, option, option_like
from paro_jax.data.config import DataConfig
from paro_jax.run.divergence import GuardConfig

# Characters the checkpoint library cannot have in a path: orbax finds a save's per-process files
# with a glob of the directory (`[`, `]`, `*`, `?` are patterns there) and TensorStore reads `\`
# as an escape; the arrays of such a save are written but can never be read back.
UNSAFE_PATH_CHARS = "[]*?\\"


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerOptions:
  """The run's length and AdamW's learning-rate schedule (core/engine.py OptimConfig)."""

  steps: int = option(50, "optimizer steps of the whole run")
  lr: float = option(3e-3, "peak learning rate (AdamW)")
  warmup: int = option(10, "steps of linear warmup, then cosine decay")

  def __post_init__(self):
    if not (math.isfinite(self.lr) and self.lr > 0):
      raise ValueError(f"--lr must be a positive finite number, got {self.lr}")
    if self.warmup < 0:
      raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
    if self.steps < 1:
      raise ValueError(f"--steps must be >= 1, got {self.steps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalOptions:
  """The eval loss: how often, over how many fixed batches of the eval split."""

  every: int = option(
    0, "eval loss every N steps (default %(default)s: never)", flag="--eval-every", metavar="N"
  )
  batches: int = option(
    1,
    "the eval loss is the mean over K fixed batches of the eval split (default %(default)s)",
    flag="--eval-batches",
    metavar="K",
  )

  def __post_init__(self):
    if self.batches < 1:
      raise ValueError(f"--eval-batches must be >= 1, got {self.batches}")
    if self.every < 0:
      raise ValueError(f"--eval-every must be >= 0 (0: off), got {self.every}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
  """When the run saves into OUT/checkpoints/, how many it keeps, and whether it resumes."""

  every: int = option(
    0,
    "save every N steps (default %(default)s: only at the end)",
    flag="--checkpoint-every",
    metavar="N",
  )
  keep: int = option(3, "keep the newest K (default %(default)s)", metavar="K")
  resume: bool = option(False, "continue from the newest checkpoint in OUT (any strategy or mesh)")
  keep_base: bool = option(
    False,
    "a LoRA run from --init-from: store the frozen base in each checkpoint (default: only its "
    "directory and fingerprint, and resume and export read it from there again)",
  )

  def __post_init__(self):
    if self.keep < 1:
      raise ValueError(f"--keep must be >= 1, got {self.keep}")
    if self.every < 0:
      raise ValueError(f"--checkpoint-every must be >= 0 (0: off), got {self.every}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SinkOptions:
  """Where each step's metrics row goes besides OUT/metrics.jsonl (run/sinks.py)."""

  tensorboard: bool = option(
    True,
    "write no TensorBoard event files (by default the rows go to OUT/tensorboard/ too)",
    flag="--no-tensorboard",
    action="store_false",
  )
  wandb: str | None = option(
    None,
    "log the rows to this Weights & Biases project too (pip install wandb; WANDB_MODE=offline "
    "keeps the run on disk, under OUT/wandb/)",
    flag="--wandb",
    metavar="PROJECT",
  )
  mlflow: str | None = option(
    None,
    "log the rows to the MLflow tracking server at URI too (http://HOST:PORT, or file:///DIR "
    "for a local store; pip install mlflow-skinny)",
    flag="--mlflow",
    metavar="URI",
  )

  def __post_init__(self):
    for name in ("wandb", "mlflow"):
      if getattr(self, name) is not None and not getattr(self, name).strip():
        raise ValueError(f"--{name} needs a value, got an empty string")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileOptions:
  """A jax.profiler trace of a window of steps (run/profiling.py)."""

  steps: str | None = option(
    None,
    "trace steps A to B-1 (numbered as metrics.jsonl's `step`: 1 is the first) with "
    "jax.profiler into OUT/profile/ (TensorBoard's profile tab, XProf, Perfetto)",
    flag="--profile-steps",
    metavar="A:B",
  )
  process: int | None = option(
    None,
    "with several processes: trace on process N only (default: on every process)",
    flag="--profile-process",
    metavar="N",
    type=int,
  )

  def __post_init__(self):
    self.window()  # a bad A:B is refused before anything starts
    if self.process is not None and self.process < 0:
      raise ValueError(f"--profile-process must be >= 0, got {self.process}")

  def window(self) -> tuple[int, int] | None:
    """(A, B) of --profile-steps A:B: the steps A..B-1 are traced; None: no trace."""
    if self.steps is None:
      return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", self.steps)
    if not match or not 1 <= int(match[1]) < int(match[2]):
      raise ValueError(
        f"--profile-steps {self.steps!r}: pass A:B with 1 <= A < B (steps A to B-1, numbered "
        f"from 1 as metrics.jsonl's step), e.g. --profile-steps 3:5"
      )
    return int(match[1]), int(match[2])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(StepConfig):
  """A training run: its step (StepConfig's fields), then the run's own fields and groups."""

  optimizer: OptimizerOptions = group(OptimizerOptions)
  compile_top: int = option(
    3,
    "with --strategy auto on H100/H200 GPUs: compile the analytic top K, any within 10%% of "
    "the first and any faster one the analytic memory rules out by less than 30%% for this "
    "cluster, and take the fastest by XLA's estimate of the compiled step whose memory fits; "
    "0: the analytic pick alone (default %(default)s)",
    metavar="K",
  )
  seed: int = option(0, "of the initial weights and the batches")
  data: DataConfig = group(DataConfig)
  eval: EvalOptions = group(EvalOptions)
  out: str = option("runs/latest", "run directory: metrics.jsonl and checkpoints/")
  checkpoints: CheckpointOptions = group(CheckpointOptions)
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
  guard: GuardConfig = group(GuardConfig)
  sinks: SinkOptions = group(SinkOptions)
  profile: ProfileOptions = group(ProfileOptions)
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
    from paro_jax.core.state import DTYPES  # jax: this module is read before jax starts

    if self.dtype not in DTYPES:
      raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
    if not 0 <= self.seed < 2**63:  # jax.random.key takes an int64, the batches' rng no sign
      raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
    super().__post_init__()
    if self.max_bad_steps < 1:
      raise ValueError(f"--max-bad-steps must be >= 1, got {self.max_bad_steps}")
    for name in ("progress_timeout", "compile_top"):
      if getattr(self, name) < 0:
        raise ValueError(
          f"--{name.replace('_', '-')} must be >= 0 (0: off), got {getattr(self, name)}"
        )
    refuse_unsafe_path(self.out, "--out")
    # Last: a run refused for another flag gets its one error line, not this warning first.
    steps, warmup = self.optimizer.steps, self.optimizer.warmup
    if warmup > steps:
      warnings.warn(
        f"--warmup {warmup} is more than --steps {steps}: the learning rate warms up "
        f"over all {steps} steps instead and reaches --lr only at the last one (pass "
        f"--warmup {steps} or less to silence this)",
        stacklevel=3,
      )

  def fine_tune_lr_warning(self) -> str | None:
    """The line for a run from --init-from weights at the from-scratch default --lr."""
    if not (self.init_from and self.optimizer.lr == OptimizerOptions().lr):
      return None
    return (
      f"--lr {self.optimizer.lr:g} is the default for training small models from scratch, far "
      f"above what fine-tuning --init-from weights starts from (2e-5 for full training, 3e-4 "
      f"for LoRA, with a warmup: docs/hf_and_lora.md): pass --lr to silence this"
    )

  def data_position(self) -> dict:
    """Besides (seed, step), what the batch of a step depends on."""
    return {
      **dataclasses.asdict(self.data),
      "micro_batches": self.micro_batches,
      "batch_size": self.batch_size,
      "seq_len": self.seq_len,
    }


TASK_FLAGS = ("num_fewshot", "limit", "include_path")  # options of --tasks alone
# --data's options that --tasks refuses (its tasks read their own data; --tokenizer still counts)
DATA_FLAGS = (
  "paths",
  "text_field",
  "bin_dtype",
  "data_format",
  "chat_template",
  "pack",
  "long_examples",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
  """What `paro-jax eval` scores (run/evaluate.py): SOURCE on --data, with a step's strategy,
  mesh, batch and dtype, none of which changes what is scored."""

  source: str = option(  # the command's positional argument
    help="a run directory (train's --out: its newest intact checkpoint) or an HF "
    "LlamaForCausalLM directory"
  )
  strategy: str = option_like(StepConfig, "strategy")
  mesh: tuple[int, int] | None = option_like(StepConfig, "mesh")
  batch_size: int = option_like(StepConfig, "batch_size")
  seq_len: int | None = option(  # None: the run's own (run/evaluate.py scored_seq_len)
    None,
    "tokens per sequence (default: the --seq-len a run directory trained with; "
    f"{StepConfig.seq_len} for an HF directory); at most the model's max_position_embeddings",
    type=int,
    metavar="SEQ_LEN",
  )
  dtype: str = option_like(StepConfig, "dtype")
  collectives: str = option_like(StepConfig, "collectives")
  attention: str = option_like(StepConfig, "attention")
  data: DataConfig = group(DataConfig)  # as train reads it; all of it is scored
  tasks: str | None = option(  # None: --data's loss and perplexity (run/evaluate.py)
    None,
    "lm-eval-harness tasks, comma-separated (e.g. hellaswag,arc_easy): run them through "
    "lm_eval.simple_evaluate instead of scoring --data (pip install 'paro-jax[lm-eval]'); "
    "--seq-len is then the longest row (default: the model's max_position_embeddings)",
    metavar="NAMES",
  )
  num_fewshot: int | None = option(
    None, "--tasks: few-shot examples per prompt (default: each task's own)", type=int
  )
  limit: int | None = option(
    None, "--tasks: score only the first N documents of each task (for a quick look)", type=int
  )
  include_path: str | None = option(
    None, "--tasks: a directory of task YAMLs of your own, beside lm-eval's", metavar="DIR"
  )
  as_json: bool = option(
    False,
    "print one JSON object (strict JSON): loss, perplexity (null where exp(loss) overflows), "
    "tokens (the targets scored), and windows scored (a token stream) or examples scored and "
    "examples_left_out (instruction data); with --tasks, lm-eval's results",
    flag="--json",
  )

  def __post_init__(self):
    if self.seq_len is not None and self.seq_len < 1:
      raise ValueError(f"--seq-len must be >= 1, got {self.seq_len}")
    if self.tasks is None:
      given = [f for f in TASK_FLAGS if getattr(self, f) is not None]
      if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag} is an option of --tasks: pass --tasks NAMES, or drop {flag}")
      return
    if not [name for name in self.tasks.split(",") if name.strip()]:
      raise ValueError("--tasks names no task: pass lm-eval task names, comma-separated")
    if self.num_fewshot is not None and self.num_fewshot < 0:
      raise ValueError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
    if self.limit is not None and self.limit < 1:
      raise ValueError(f"--limit must be >= 1 (documents per task), got {self.limit}")
    default = DataConfig()
    for name in DATA_FLAGS:
      if getattr(self.data, name) != getattr(default, name):
        flag = DataConfig.__dataclass_fields__[name].metadata["flag"] or "--" + name.replace(
          "_", "-"
        )
        raise ValueError(
          f"{flag} is for scoring --data, and --tasks reads each task's own dataset: drop "
          f"{flag}, or drop --tasks"
        )

  def task_names(self) -> list[str]:
    """--tasks as a list of names."""
    return [name.strip() for name in (self.tasks or "").split(",") if name.strip()]

  def step(self, lora: LoraOptions) -> StepConfig:
    """The step whose engine scores (core/factory.py), with the source's adapters."""
    names = ("strategy", "mesh", "batch_size", "seq_len", "dtype", "collectives", "attention")
    return StepConfig(**{n: getattr(self, n) for n in names}, lora=lora)
