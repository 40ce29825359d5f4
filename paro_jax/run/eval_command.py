"""`paro-jax eval SOURCE`: its flags (built from `EvalConfig`'s fields) and its entry, run once
the entry point has set up the devices (paro_jax/run/evaluate.py scores)."""

from __future__ import annotations

from paro_jax.core.config import options
from paro_jax.core.flags import Invocation, add_options, config_of
from paro_jax.run.config import EvalConfig


def add_parser(sub) -> None:
  ev = sub.add_parser(
    "eval",
    help="score a run's newest checkpoint or an HF model on --data: mean loss and perplexity",
    description="The mean next-token cross-entropy and perplexity of SOURCE over --data: a "
    "token stream in consecutive, non-overlapping windows of --seq-len + 1 tokens from token 0 "
    "(a trailing partial window dropped), instruction data over the target tokens training "
    "counts (examples longer than --seq-len are left out, and said, unless --long-examples "
    "truncate); the same whatever --batch-size, --mesh, --strategy and --pack.",
  )
  fields = dict(options(EvalConfig))
  ev.add_argument("source", metavar="SOURCE", help=fields["source"].metadata["help"])
  add_options(ev, EvalConfig, "strategy", "mesh", "batch_size", "seq_len", "dtype")
  add_options(ev, EvalConfig, "collectives", "attention")
  data = ev.add_argument_group("data", "as train reads it (default: the built-in corpus)")
  add_options(data, EvalConfig, "data.paths", "data.text_field", "data.tokenizer")
  add_options(data, EvalConfig, "data.bin_dtype", "data.data_format", "data.chat_template")
  add_options(data, EvalConfig, "data.long_examples", "data.pack")
  tasks = ev.add_argument_group("benchmark tasks", "lm-eval-harness's, instead of --data")
  add_options(tasks, EvalConfig, "tasks", "num_fewshot", "limit", "include_path")
  add_options(ev, EvalConfig, "as_json")


def main(args, inv: Invocation) -> None:
  # all of --data is scored (one example per row, or packed: the same sums, fewer rows)
  cfg = config_of(args, EvalConfig, mesh=inv.mesh, **{"data.eval_fraction": 0.0})
  if cfg.tasks is not None:
    from paro_jax.run.benchmarks import run_benchmarks  # imports jax: after the device flag

    run_benchmarks(cfg)
    return
  from paro_jax.run.evaluate import run_eval  # imports jax: after the device flag is set

  run_eval(cfg)
