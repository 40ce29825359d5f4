"""`paro-jax eval SOURCE`: the mean next-token loss and perplexity of a model on `--data`.

SOURCE is a run directory (train's --out: its newest intact checkpoint, restored onto the asked
strategy and mesh) or an HF LlamaForCausalLM directory. What is scored does not depend on the
batch size, the mesh or the strategy:
- a token stream: consecutive, non-overlapping windows of seq_len+1 tokens from token 0 (window k
  is tokens[k(S+1) : (k+1)(S+1)], its first S tokens the inputs, its last S the targets), a
  trailing partial window dropped; every full window exactly once, the last batch filled with
  rows whose targets do not count;
- instruction data: every example (after --long-examples), one per row, its targets those
  training counts (the completion's, the assistant's).
The loss is the sum of the scored targets' losses over their count, summed on the host in fp64.
--seq-len defaults to the run's own (an HF directory: StepConfig's default) and is refused above
the model's max_position_embeddings, as train refuses it; instruction examples left out (longer
than --seq-len) are said in one line, as train says them. A loss that is not finite (weights that
are finite but whose logits overflow) is refused in one line (exit 2): nothing is printed that a
script could take for a score; a finite loss whose perplexity overflows a float prints it as
null in --json (strict JSON), with a warning.
The text is read with --tokenizer, else the run's tokenizer (as its checkpoints record it), else
the HF directory's tokenizer.json (data/tokenizers.py resolve_tokenizer); chat records are rendered
with --chat-template, else the template the run trained with (its checkpoints record it), else
the HF directory's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import jax
import numpy as np

from paro_jax.core.batch import Batch
from paro_jax.core.engine import Engine
from paro_jax.core.config import StepConfig
from paro_jax.data.chat import ChatTemplate, special_tokens
from paro_jax.run.config import EvalConfig
from paro_jax.data.streams import expand_paths, load_tokens
from paro_jax.data.examples import ExampleBatches, dropped_line, select
from paro_jax.data.instruct import CHAT, TEXT
from paro_jax.data.sources import data_format, hf_directory, instruction_examples
from paro_jax.data.tokenizers import resolve_tokenizer
from paro_jax.run.source import Source, open_source, source_engine


def window_batches(tokens, seq_len: int, batch_size: int):
  """The token stream's windows (module docstring) as Batches of one micro-batch of
  `batch_size` rows; the last filled with empty rows. Yields (batch, windows in it)."""
  L1 = seq_len + 1
  n = len(tokens) // L1
  if n == 0:
    raise ValueError(
      f"--data has {len(tokens)} tokens, fewer than one window of --seq-len {seq_len} + 1: use a "
      f"shorter --seq-len or more data"
    )
  for lo in range(0, n, batch_size):
    rows = min(batch_size, n - lo)
    batch = np.zeros((1, batch_size, L1), np.int32)
    batch[0, :rows] = np.asarray(tokens[lo * L1 + np.arange(rows * L1)]).reshape(rows, L1)
    weights = np.zeros((1, batch_size, seq_len), np.int32)
    weights[0, :rows] = 1
    yield Batch(batch, weights), rows


def example_batches(batches: ExampleBatches):
  """Every example of an unshuffled ExampleBatches once, a batch at a time: (batch, examples)."""
  rows, B = batches.rows_per_epoch(), batches.shape[1]
  for step in range(math.ceil(rows / B)):
    yield batches(step), min(B, rows - step * B)


def scored_seq_len(cfg: EvalConfig, source: Source) -> int:
  """--seq-len, else the run's own (an HF directory: StepConfig's default); refused above the
  model's max_position_embeddings, as train refuses it (run/fit.py check_fits)."""
  seq_len = cfg.seq_len or source.seq_len or StepConfig.seq_len
  limit = source.max_positions
  if limit and seq_len > limit:
    given = "--seq-len" if cfg.seq_len else "the --seq-len it trained with,"
    raise ValueError(
      f"{given} {seq_len} is longer than the {limit} positions of {source.path}'s model "
      f"(max_position_embeddings in its config.json): pass --seq-len {limit} or less"
    )
  return seq_len


def score(engine: Engine, params, batches) -> tuple[float, int]:
  """(the sum of the losses of the scored targets of `batches`, (Batch, rows) pairs, with the
  weights `params` at the P placement; their count)."""
  total, targets = 0.0, 0
  for batch, _ in batches:
    placed = engine.shard_batch(batch, any_micro_batches=True)
    loss_sum, count = engine.forward.sums(params, placed)
    total += float(jax.device_get(loss_sum))
    targets += int(jax.device_get(count))
  return total, targets


def mean_loss(total: float, targets: int, where: str, dtype: str) -> tuple[float, float | None]:
  """(the mean loss, its perplexity: None where exp overflows a float, said in a warning). A
  loss that is not finite is refused: the weights are finite (checkpoints and --init-from are
  checked) but the model's activations overflow."""
  loss = total / max(targets, 1)
  if not math.isfinite(loss):
    fix = "try --dtype fp32, or " if dtype != "fp32" else ""
    raise ValueError(
      f"{where}: the loss is {loss} over {targets} target tokens: the model's activations "
      f"overflow in {dtype} (its weights are finite but too large); nothing scored: "
      f"{fix}check the weights (a run that diverged?)"
    )
  try:
    return loss, math.exp(loss)
  except OverflowError:
    warnings.warn(
      f"{where}: the loss is {loss:.6g}: its perplexity exp(loss) overflows a float (null in "
      f"--json); the model predicts the data far worse than chance: check the weights",
      stacklevel=2,
    )
    return loss, None


def left_out_line(examples, selection, cfg: EvalConfig, limit: int | None) -> str | None:
  """The warning naming the examples left out (as train says them), with the --seq-len that
  scores them all where the model's positions allow it."""
  line = dropped_line(selection.dropped, examples.read_count())
  if line is None:
    return None
  line = line.removeprefix("paro-jax: ")
  longest = int(examples.lengths().max()) - 1 if len(examples) else 0
  fixes = []
  if longest > cfg.seq_len and (not limit or longest <= limit):
    fixes.append(f"--seq-len {longest} to score them all")
  if cfg.data.long_examples != "truncate":
    fixes.append("--long-examples truncate")
  if fixes:
    line += f" (pass {', or '.join(fixes)})"
  return line


def run_eval(cfg: EvalConfig) -> dict:
  """`paro-jax eval`: score SOURCE on its data and print it."""
  source = open_source(cfg.source)
  cfg = dataclasses.replace(cfg, seq_len=scored_seq_len(cfg, source))
  data = cfg.data
  files = expand_paths(data.paths) if data.paths else []
  if data.tokenizer is None and source.tokenizer:  # the run's own
    data = dataclasses.replace(data, tokenizer=source.tokenizer)
  data = resolve_tokenizer(data, source.hf_dir, source.config.vocab, files)
  fmt = data_format(files, data.text_field, data.data_format)
  engine, params = source_engine(source, cfg)
  engine.check_batch_size(cfg.batch_size)
  vocab = source.config.vocab
  if fmt == TEXT:
    tokens = load_tokens(data, vocab)
    batches = window_batches(tokens, cfg.seq_len, cfg.batch_size)
    counted = {"windows": len(tokens) // (cfg.seq_len + 1)}
  else:
    directory = hf_directory(data, source.hf_dir)
    template = None
    if fmt == CHAT and source.chat_template is not None:  # the run's (--chat-template first)
      where = f"{cfg.source} (the template its checkpoints record)"
      template = ChatTemplate(source.chat_template, special_tokens(directory), where)
    examples = instruction_examples(data, files, fmt, directory, vocab, template)
    selection = select(examples, cfg.seq_len, data.long_examples)
    rows = ExampleBatches(
      examples,
      selection,
      1,
      cfg.batch_size,
      cfg.seq_len,
      seed=0,
      pack=data.pack,
      shuffle=False,
      what=f"the examples of {', '.join(files)}",
    )
    left_out = left_out_line(examples, selection, cfg, source.max_positions)
    if left_out and jax.process_index() == 0:
      warnings.warn(left_out, stacklevel=2)
    batches = example_batches(rows)
    counted = {
      "examples": len(selection),
      "examples_left_out": examples.read_count() - len(selection),
    }
  total, targets = score(engine, params, batches)
  loss, perplexity = mean_loss(total, targets, cfg.source, cfg.dtype)
  result = {"loss": loss, "perplexity": perplexity, "tokens": targets, **counted}
  if jax.process_index() == 0:
    if cfg.as_json:
      print(json.dumps(result, allow_nan=False), flush=True)
    else:
      what = "windows" if fmt == TEXT else "examples"
      shown = "inf" if perplexity is None else f"{perplexity:.4f}"
      print(
        f"paro-jax: {cfg.source}: loss {loss:.6f}, perplexity {shown} over {targets} target "
        f"tokens in {result[what]} {what} (strategy {engine.strategy} on mesh "
        f"{engine.inter}x{engine.intra}, {cfg.dtype})",
        flush=True,
      )
  return result
