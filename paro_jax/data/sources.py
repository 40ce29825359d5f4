"""What `--data` holds: a token stream (text, JSONL or Parquet text, .bin ids) or instruction data
(prompt-completion or chat records, or the shards prepare-data made of them), and the examples of
instruction data (data/instruct.py, data/examples.py).

`--data-format auto` takes each records file's shape from its first record; every file must then
be of one kind (a text file beside chat records is refused, naming both).
"""

from __future__ import annotations

import numpy as np

from paro_jax.data.chat import read_template_file
from paro_jax.data.config import DATA_FORMATS, DataConfig
from paro_jax.data.tokenizers import check_vocab, make_tokenizer
from paro_jax.data.example_shards import example_format, read_examples
from paro_jax.data.examples import ExampleBatches, Examples, dropped_line, from_encoded, select
from paro_jax.data.instruct import TEXT, Encoder, detect_format, tokenizer_directory
from paro_jax.data.records import first_record, is_records, read_records


def data_format(files: list[str], text_field: str, requested: str = "auto") -> str:
  """The format of the --data files: TEXT, PROMPT_COMPLETION or CHAT; one for all of them."""
  if requested not in DATA_FORMATS:
    raise ValueError(f"unknown --data-format {requested!r}; choose one of {DATA_FORMATS}")
  found = {}
  for path in files:
    if path.endswith(".bin"):
      fmt = example_format(path) or TEXT
    elif is_records(path):
      fmt = detect_format(*first_record(path), text_field) if requested == "auto" else requested
    else:
      fmt = TEXT
    found.setdefault(fmt, path)
  if len(found) > 1:
    (a, pa), (b, pb) = list(found.items())[:2]
    raise ValueError(
      f"--data mixes {a} data ({pa}) and {b} data ({pb}): train on one kind at a time"
    )
  fmt = next(iter(found), TEXT)
  if requested not in ("auto", fmt):
    raise ValueError(
      f"--data-format {requested}, but {found[fmt]} holds {fmt} data (text files and token "
      f"ids are text): pass records of that shape, or --data-format auto"
    )
  return fmt


def load_examples(files: list[str], encoder: Encoder | None, model_vocab: int) -> Examples:
  """The examples of the --data files: prepare-data's shards as they are, records encoded; with
  the chat template they were rendered with (chat data)."""
  shards = [p for p in files if p.endswith(".bin")]
  if shards:
    if len(shards) < len(files):
      raise ValueError(
        f"--data mixes prepared shards ({shards[0]}) and records: prepare them all, or none"
      )
    return read_examples(shards)
  examples = from_encoded(
    encoder(where, record) for path in files for where, record in read_records(path)
  )
  top = int(np.max(examples.tokens)) if len(examples) else 0
  check_vocab(top + 1, model_vocab, "the encoded examples' largest id")
  if encoder.template is not None:
    examples.chat_template = encoder.template.source
  return examples


def hf_directory(data: DataConfig, init_from: str | None) -> str | None:
  """The HF directory whose chat template and special tokens the records use: the model's
  (--init-from), else the one --tokenizer's tokenizer.json lives in."""
  return init_from or tokenizer_directory(data.tokenizer)


def instruction_examples(
  data: DataConfig, files, fmt: str, directory, model_vocab: int, template=None
):
  """The examples of instruction data files (records encoded, or prepared shards); `template`:
  the ChatTemplate to render chat records with where no --chat-template is given."""
  needs_encoder = any(not p.endswith(".bin") for p in files)
  encoder = None
  if needs_encoder:
    tokenizer = make_tokenizer(data)
    check_vocab(tokenizer.vocab_size, model_vocab, f"tokenizer {data.tokenizer or 'bytes'}")
    encoder = Encoder(fmt, tokenizer, directory, data.chat_template, template)
  examples = load_examples(files, encoder, model_vocab)
  if encoder is None and data.chat_template:  # shards: rendered when they were prepared
    check_shards_template(examples.chat_template, data.chat_template)
  return examples


def check_shards_template(recorded: str | None, chat_template: str) -> None:
  """--chat-template FILE with prepare-data's shards, which are rendered already: refused where
  the shards record another template (or none: prompt-completion shards, or shards prepared
  before the template was recorded), so that the flag never goes unused."""
  if read_template_file(chat_template) == recorded:
    return
  what = "another chat template" if recorded else "no chat template (meta.json)"
  raise ValueError(
    f"--chat-template {chat_template}: the prepared shards were rendered with {what}: prepare "
    f"the records again with --chat-template {chat_template}, or leave the flag out"
  )


def instruction_batches(
  data: DataConfig,
  files,
  fmt,
  directory,
  model_vocab,
  micro_batches,
  batch_size,
  seq_len,
  seed,
  eval_micro_batches=None,
):
  """(train batches, eval batches or None, the line saying which examples were left out or
  None): the last --eval-fraction of the examples held out, in order, for eval."""
  examples = instruction_examples(data, files, fmt, directory, model_vocab)
  selection = select(examples, seq_len, data.long_examples)
  train, held = selection.split(data.eval_fraction)
  batches = ExampleBatches(
    examples, train, micro_batches, batch_size, seq_len, seed, pack=data.pack
  )
  eval_batches = None
  if eval_micro_batches:
    eval_batches = ExampleBatches(
      examples,
      held,
      eval_micro_batches,
      batch_size,
      seq_len,
      seed,
      pack=data.pack,
      shuffle=False,
      what=f"the eval split (the last {data.eval_fraction:g} of the examples)",
    )
  return batches, eval_batches, dropped_line(selection.dropped, examples.read_count())
