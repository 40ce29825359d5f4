"""`paro-jax eval SOURCE --tasks NAMES`: lm-eval-harness's tasks on a run's newest checkpoint or
an HF model, through `lm_eval.simple_evaluate` with the model of run/lm_eval_model.py.

SOURCE is read as `paro-jax eval` reads it (run/source.py), its weights at the strategy's P
placement on --mesh; the text with --tokenizer, else the run's, else the HF directory's
tokenizer.json. --seq-len is lm-eval's max_length (the longest row scored, context and new tokens
of a generation together): by default the model's max_position_embeddings, as lm-eval's HF
backend takes it from the model's config. --batch-size rows are scored, or decoded, at once.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax

from paro_jax.core.config import StepConfig
from paro_jax.data.prompts import prompt_tokenizer
from paro_jax.data.tokenizers import HFTokenizer
from paro_jax.run.config import EvalConfig
from paro_jax.run.generate import stop_ids
from paro_jax.run.source import open_source, source_engine

LM_EVAL_INSTALL = "pip install 'paro-jax[lm-eval]'"
DEFAULT_MAX_LENGTH = 2048  # lm-eval's HF backend's, for a model that names no positions


def require_lm_eval():
  """The `lm_eval` package, else one line naming the extra that installs it."""
  try:
    import lm_eval  # an optional dependency: the lm-eval extra
  except ImportError:
    raise ValueError(
      f"--tasks runs lm-eval-harness, which is not installed: {LM_EVAL_INSTALL}"
    ) from None
  return lm_eval


def benchmark_model(cfg: EvalConfig):
  """The lm-eval model (run/lm_eval_model.py ParoLM) of `cfg`'s SOURCE, tokenizer and step."""
  require_lm_eval()
  from paro_jax.run.lm_eval_model import ParoLM  # imports lm_eval, checked just above

  if jax.process_count() > 1:  # the host reads every row's scores and tokens
    raise ValueError(
      f"paro-jax eval --tasks runs in one process, and this is process {jax.process_index()} "
      f"of {jax.process_count()}: run it outside a multi-process job, on one host's devices"
    )
  source = open_source(cfg.source)
  limit = source.max_positions
  max_length = cfg.seq_len or limit or DEFAULT_MAX_LENGTH
  if limit and max_length > limit:
    raise ValueError(
      f"--seq-len {max_length} is longer than the {limit} positions of {source.path}'s model "
      f"(max_position_embeddings in its config.json): pass --seq-len {limit} or less"
    )
  tokenizer = prompt_tokenizer(
    cfg.data.tokenizer, source.tokenizer, source.hf_dir, source.config.vocab
  )
  if not isinstance(tokenizer, HFTokenizer):
    raise ValueError(
      "--tasks needs an HF tokenizer (lm-eval's tasks are text, and their requests name bos "
      "and eos tokens), and this model reads bytes: pass --tokenizer with an HF tokenizer.json"
    )
  step = dataclasses.replace(cfg, seq_len=min(max_length, StepConfig.seq_len))
  engine, params = source_engine(source, step)
  engine.check_batch_size(cfg.batch_size)
  return ParoLM(engine, params, tokenizer, max_length, cfg.batch_size, stop_ids(source, tokenizer))


@functools.cache
def task_manager(include_path: str | None):
  """lm-eval's index of its tasks and --include-path's (built once: it reads every task YAML)."""
  require_lm_eval()
  from lm_eval.tasks import TaskManager  # an optional dependency, checked just above

  return TaskManager(include_path=include_path)


def evaluate_tasks(lm, cfg: EvalConfig, log_samples: bool = False) -> dict:
  """`lm_eval.simple_evaluate` of `lm` on --tasks (with --include-path's YAMLs)."""
  lm_eval = require_lm_eval()
  manager = task_manager(cfg.include_path)
  names = cfg.task_names()
  unknown = [name for name in names if name not in manager.all_tasks]
  if unknown:
    where = f" or in {cfg.include_path}" if cfg.include_path else ""
    raise ValueError(
      f"--tasks {','.join(unknown)}: no such lm-eval task{where}: check the name (lm-eval ls "
      f"tasks lists them), or pass --include-path with the directory of your task YAMLs"
    )
  return lm_eval.simple_evaluate(
    model=lm,
    tasks=names,
    num_fewshot=cfg.num_fewshot,
    limit=cfg.limit,
    task_manager=manager,
    log_samples=log_samples,
  )


def run_benchmarks(cfg: EvalConfig) -> dict:
  """`paro-jax eval --tasks`: the tasks' results, printed as lm-eval's table (or --json)."""
  results = evaluate_tasks(benchmark_model(cfg), cfg)
  from lm_eval.utils import make_table  # an optional dependency, checked by evaluate_tasks

  if cfg.as_json:
    shown = {k: results[k] for k in ("results", "versions", "n-shot") if k in results}
    print(json.dumps(shown, default=str), flush=True)
  else:
    print(make_table(results), flush=True)
    if results.get("groups"):
      print(make_table(results, "groups"), flush=True)
  return results
