"""What `--data` holds: a token stream (text, JSONL or Parquet text, .bin ids) or instruction data
(prompt-completion or chat records, or the shards prepare-data made of them), and the examples of
instruction data (run/instruct.py, run/examples.py).

`--data-format auto` takes each records file's shape from its first record; every file must then
be of one kind (a text file beside chat records is refused, naming both).
"""

from __future__ import annotations

import numpy as np

from paro_jax.run.data import check_vocab
from paro_jax.run.example_shards import example_format, read_examples
from paro_jax.run.examples import Examples, from_encoded
from paro_jax.run.instruct import DATA_FORMATS, TEXT, Encoder, detect_format
from paro_jax.run.records import first_record, is_records, read_records


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
  """The examples of the --data files: prepare-data's shards as they are, records encoded."""
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
  return examples
