"""Token streams and deterministic batches.

Sources (`--data`, any number of paths and globs, in sorted order): text files; JSONL files whose
records carry the text in one field (`--text-field`), and Parquet files likewise (one column,
read a batch of rows at a time: data/records.py); pre-tokenized `.bin` files of uint16 or uint32
ids (read by os.pread, window by window: never loaded whole, any number of them, e.g. the shards
of `paro-jax prepare-data`, paro_jax/data/prepare.py, checked against their meta.json). Several
sources are read as one stream (`TokenStream`) without being joined in memory. Text is tokenized
at byte level (vocabulary 256) or by an HF `tokenizer.json` (`--tokenizer`, through the
`tokenizers` package); with an HF tokenizer each document (a text file,
a JSONL or Parquet record) starts with the special tokens its post-processor adds and ends with
its end-of-sequence token (data/tokenizers.py), as bytes each is its bytes alone.

The default corpus is real text that every Python installation carries: the source files of
the Python standard library, so a training run needs no download.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np

from paro_jax.data.bins import SHARD, bin_dtype_for, bin_max, check_shards, read_bin
from paro_jax.data.config import DataConfig
from paro_jax.data.records import check_surrogates, not_text, read_records
from paro_jax.data.tokenizers import BYTES, check_vocab, make_tokenizer


# --- sources ---------------------------------------------------------------------------------
def expand_paths(patterns, flag: str = "--data") -> list[str]:
  """Files named or matched by globs, each pattern's matches sorted; loud on a miss. `flag`
  names them in errors: train's --data, or prepare-data's inputs (an empty `flag`)."""
  files = []
  named = f"{flag} " if flag else ""
  for pattern in patterns:
    # A file whose name holds glob characters (`data[1].txt`) is that file, not a pattern.
    literal = not glob.has_magic(pattern) or os.path.exists(pattern)
    matches = [pattern] if literal else sorted(glob.glob(pattern))
    if not matches:
      raise FileNotFoundError(f"{named or 'input '}{pattern!r} matches no file")
    for path in matches:
      if os.path.isdir(path):
        raise IsADirectoryError(
          f"{named or 'input '}{path!r} is a directory: pass its files, e.g. {named}"
          f"'{os.path.join(path, '*.txt')}' (quoted: paro-jax expands the glob, in sorted order)"
        )
      if not os.path.isfile(path):
        fix = (
          f"pass {flag} with existing files, or leave {flag} out to train on the built-in corpus"
          if flag
          else "pass existing text or .jsonl files"
        )
        raise FileNotFoundError(f"data file {path!r} does not exist: {fix}")
      files.append(path)
  return files


def read_jsonl(path: str, field: str, progress=None):
  """The `field` text of each record (records.read_records: a line that is not a JSON object, or
  not UTF-8, is one error naming it); `progress(n)` is called with the bytes of each line."""
  for where, record in read_records(path, None, progress):
    if field not in record:
      raise ValueError(
        f"{where}: the record has no {field!r} field (it has {sorted(record)}): pass "
        f"--text-field with the field that holds the text"
      )
    text = record[field]
    if not isinstance(text, str):
      fix = "fix or drop that record, or pass --text-field with the field that holds the text"
      raise not_text(where, field, text, fix)
    check_surrogates(where, f"the {field!r} field", text)
    yield text


TEXT_SAMPLE = 1 << 20  # bytes of a text file checked for being text
MAX_CONTROL = 0.05  # fraction of control characters (other than tab, newlines, form feed) allowed


def _not_utf8(path: str, e: UnicodeDecodeError, base: int = 0) -> str:
  return (
    f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {base + e.start}): pass "
    f"text files, .jsonl, or token ids in files named *.bin"
  )


def check_text(path: str, head: bytes) -> None:
  """Refuse a file that is not text: invalid UTF-8, or mostly control characters (binary data
  trained on as bytes would run, silently, on garbage). `head` is the file's first bytes."""
  try:
    text = head.decode("utf-8")
  except UnicodeDecodeError as e:
    if not (len(head) >= TEXT_SAMPLE and e.start >= len(head) - 4):  # not a character cut off
      raise ValueError(_not_utf8(path, e)) from None
    text = head[: e.start].decode("utf-8")
  control = sum(1 for c in text if ord(c) < 32 and c not in "\t\n\r\f") + text.count("\x7f")
  if text and control / len(text) > MAX_CONTROL:
    raise ValueError(
      f"{path} is mostly not printable text ({control / len(text):.0%} control characters in "
      f"its first {len(text)} characters): pass text files, .jsonl, or token ids in files named "
      f"*.bin"
    )


def load_tokens(cfg: DataConfig, model_vocab: int) -> np.ndarray:
  """All tokens of the sources, in order; ids checked against the model's vocabulary."""
  tokenizer = make_tokenizer(cfg)
  check_vocab(
    tokenizer.vocab_size,
    model_vocab,
    f"tokenizer {tokenizer.name}" if tokenizer.name != BYTES else "the byte-level tokenizer",
  )
  if not cfg.paths:
    if tokenizer.name != BYTES:  # its ids would be bytes read as the tokenizer's tokens
      raise ValueError(
        f"the built-in corpus (no --data) is bytes, and this run reads text with tokenizer "
        f"{tokenizer.name}: pass --data with the text to train on, or --tokenizer {BYTES} for "
        f"the built-in corpus"
      )
    return default_corpus()
  shard_dtypes = {}  # directory of prepare-data shards -> their dtype (meta.json)
  parts = []
  for path in expand_paths(cfg.paths):
    if path.endswith(".bin"):
      if SHARD.fullmatch(os.path.basename(path)):
        where = os.path.dirname(path) or "."
        if where not in shard_dtypes:
          shard_dtypes[where] = check_shards(where, cfg.bin_dtype)
        dtype = shard_dtypes[where]
      else:
        hf = tokenizer.name != BYTES
        dtype = bin_dtype_for(cfg, tokenizer.vocab_size if hf else model_vocab)
      tokens = read_bin(path, dtype)
      top = bin_max(path, dtype) if tokens.size else 0
      if top >= model_vocab:
        raise ValueError(
          f"{path} holds token id {top}, outside the model's vocabulary of "
          f"{model_vocab} (read as {dtype.name}; is --bin-dtype right?)"
        )
    elif path.endswith((".jsonl", ".parquet")):
      from paro_jax.data.records import read_texts  # (it imports this module)

      texts = (
        read_jsonl(path, cfg.text_field)
        if path.endswith(".jsonl")
        else read_texts(path, cfg.text_field)
      )
      docs = [tokenizer.document(text) for text in texts]
      tokens = np.concatenate(docs) if docs else np.zeros(0, np.uint8)
    elif tokenizer.name != BYTES:
      with open(path, "rb") as f:
        raw = f.read()
      check_text(path, raw[:TEXT_SAMPLE])
      try:
        tokens = tokenizer.document(raw.decode("utf-8"))
      except UnicodeDecodeError as e:
        raise ValueError(_not_utf8(path, e)) from None
    else:
      with open(path, "rb") as f:
        check_text(path, f.read(TEXT_SAMPLE))
      tokens = np.fromfile(path, dtype=np.uint8)  # bytes as they are, no decoding
    if tokens.size == 0:
      raise ValueError(f"data file {path!r} is empty: give a file with text in it")
    parts.append(tokens)
  # One file stays as it is (a BinFile for .bin); several are read as one stream, not joined.
  return parts[0] if len(parts) == 1 else TokenStream(parts)


class TokenStream:
  """Several 1-D token arrays (BinFiles of .bin shards) read as their concatenation, which is never
  built: `stream[idx]` (integer arrays) gathers from the parts the indices fall in (a window may
  span two), `stream[lo:hi]` is a stream over views. Only the tokens asked for are read."""

  def __init__(self, parts):
    self.parts = [p for p in parts if p.size]
    self.offsets = np.cumsum([0] + [p.size for p in self.parts])
    self.size = int(self.offsets[-1])
    self.dtype = np.result_type(*[p.dtype for p in self.parts]) if self.parts else np.uint8

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index):
    if isinstance(index, slice):
      lo, hi, step = index.indices(self.size)
      if step != 1:
        raise IndexError("a TokenStream slice must have step 1")
      parts = []
      for k, part in enumerate(self.parts):
        a, b = max(lo, self.offsets[k]), min(hi, self.offsets[k + 1])
        if a < b:
          parts.append(part[a - self.offsets[k] : b - self.offsets[k]])
      return TokenStream(parts)
    idx = np.asarray(index)
    if idx.size and (idx.min() < 0 or idx.max() >= self.size):
      raise IndexError(f"token index out of range [0, {self.size})")
    which = np.searchsorted(self.offsets, idx, side="right") - 1
    out = np.empty(idx.shape, self.dtype)
    for k in np.unique(which):
      sel = which == k
      out[sel] = self.parts[k][idx[sel] - self.offsets[k]]
    return out

  def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
    """`self[starts[..., None] + arange(length)]`: a window inside one part is read by that
    part's `windows` (one read for a BinFile); one that spans two is gathered."""
    starts = np.asarray(starts)
    flat = starts.reshape(-1)
    out = np.empty((flat.size, length), self.dtype)
    first = np.searchsorted(self.offsets, flat, side="right") - 1
    last = np.searchsorted(self.offsets, flat + length - 1, side="right") - 1
    for k in np.unique(first):
      sel = (first == k) & (last == k)
      if sel.any():
        out[sel] = windows(self.parts[k], flat[sel] - self.offsets[k], length)
    spans = first != last
    if spans.any():
      out[spans] = self[flat[spans][:, None] + np.arange(length)]
    return out.reshape(*starts.shape, length)


def windows(tokens, starts: np.ndarray, length: int) -> np.ndarray:
  """The windows of `length` tokens at `starts`: through `tokens.windows` where it has one
  (BinFile, TokenStream), else by indexing (an array in memory)."""
  if hasattr(tokens, "windows"):
    return tokens.windows(starts, length)
  return np.asarray(tokens)[np.asarray(starts)[..., None] + np.arange(length)]


def split_eval(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval): the last `fraction` of the tokens is the eval split."""
  n_eval = int(tokens.size * fraction)
  return tokens[: tokens.size - n_eval], tokens[tokens.size - n_eval :]


def default_corpus(max_bytes: int = 4_000_000) -> np.ndarray:
  """Bytes of the standard library's own .py files (sorted, so the same on every host)."""
  root = sysconfig.get_paths()["stdlib"]
  chunks, total = [], 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("test", "site-packages", "__pycache__"))
    for name in sorted(filenames):
      if name.endswith(".py"):
        with open(os.path.join(dirpath, name), "rb") as f:
          chunks.append(f.read())
        total += len(chunks[-1])
        if total >= max_bytes:
          return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
  if not chunks:
    raise FileNotFoundError(
      f"no Python source files found under {root} for the default corpus; "
      f"pass --data FILE with some text"
    )
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


# --- batches ---------------------------------------------------------------------------------
class Batches:
  """Random windows of seq_len+1 tokens; batch `step` depends only on (seed, step).

  `batches(step)` is the global (A, B, L+1) batch; `batches(step, rows=(lo, hi))` only its rows
  lo..hi-1 of every micro-batch, reading only their tokens (what one process feeds its devices).
  """

  def __init__(
    self,
    tokens: np.ndarray,
    micro_batches: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    what: str = "the corpus",
  ):
    if tokens.size < seq_len + 2:
      raise ValueError(
        f"{what} has {tokens.size} tokens, fewer than one sequence of "
        f"{seq_len + 1}: use a shorter --seq-len or more data"
      )
    self.tokens, self.seed = tokens, seed
    self.shape = (micro_batches, batch_size, seq_len + 1)

  def __call__(self, step: int, rows: tuple[int, int] | None = None) -> np.ndarray:
    A, B, L1 = self.shape
    lo, hi = rows or (0, B)
    rng = np.random.default_rng([self.seed, step])
    starts_AxB = rng.integers(0, self.tokens.size - L1, size=(A, B))[:, lo:hi]
    return windows(self.tokens, starts_AxB, L1).astype(np.int32)

  def process_rows(self, process: int, processes: int) -> tuple[int, int]:
    """The rows process `process` of `processes` holds: the batch is split over the mesh's
    (inter, intra) axes, inter-major, so each process's devices hold one contiguous slice."""
    B = self.shape[1]
    if B % processes:
      raise ValueError(f"batch size {B} is not divisible by the {processes} processes")
    return process * B // processes, (process + 1) * B // processes
