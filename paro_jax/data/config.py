"""`DataConfig`: where a run's tokens come from, and the names its flags choose from.

Its flags are built from these fields by the commands that read data (train, eval, prepare-data).
The module imports no jax or numpy: the CLI builds its parser before jax starts.
"""

from __future__ import annotations

import dataclasses

from paro_jax.core.config import option

BIN_DTYPE_NAMES = ("uint16", "uint32")  # of .bin token files (data/bins.py BIN_DTYPES)
DATA_FORMATS = ("auto", "text", "prompt-completion", "chat")  # data/instruct.py
LONG_EXAMPLES = ("drop", "truncate")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where a run's tokens come from (data/streams.py reads them)."""

  paths: tuple[str, ...] = option(  # files and globs (a str is one path); empty: built-in corpus
    (),
    "files and globs: *.jsonl (JSON lines), *.parquet, *.bin (token ids), else text",
    flag="--data",
    nargs="+",
    metavar="PATH",
  )
  text_field: str = option("text", "the JSONL field holding the text")
  tokenizer: str | None = option(  # None: the model's (data/tokenizers.py resolve_tokenizer)
    None,
    "an HF tokenizer.json (or its model's directory), or 'bytes' (vocab 256); default: the "
    "tokenizer.json of --init-from's directory, else bytes",
    metavar="TOKENIZER_JSON",
  )
  bin_dtype: str | None = option(  # of .bin files; None: inferred (data/bins.py bin_dtype_for)
    None,
    ".bin token dtype (default: uint16, or uint32 when the tokenizer's "
    "vocab, else the model's, exceeds 65536)",
    type=str.lower,
    choices=BIN_DTYPE_NAMES,
  )
  eval_fraction: float = option(
    0.01,
    "the last fraction of the tokens (of instruction data: of the examples) held out for eval "
    "(default %(default)s)",
  )
  # instruction data (data/instruct.py, data/examples.py)
  data_format: str = option(
    "auto",
    "what the records hold: text, a prompt and its completion (loss on the completion and EOS), "
    "or chat messages (loss on the assistant's turns); default %(default)s: from each file's "
    "first record",
    choices=DATA_FORMATS,
  )
  chat_template: str | None = option(  # None: the model's HF directory's
    None,
    "a jinja2 chat template for chat records (default: the one of --init-from's HF directory, "
    "else of --tokenizer's)",
    metavar="FILE",
  )
  pack: bool = option(
    False,
    "instruction data: pack several examples into each sequence, each attending only to itself "
    "(default: one example per sequence, padded)",
  )
  long_examples: str = option(
    "drop",
    "instruction examples longer than --seq-len + 1 tokens: drop them (counted in the log) or "
    "keep their first --seq-len + 1 tokens (default %(default)s)",
    choices=LONG_EXAMPLES,
  )

  def __post_init__(self):
    paths = (self.paths,) if isinstance(self.paths, str) else tuple(self.paths)
    object.__setattr__(self, "paths", paths)  # the flag's list, or one path
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
