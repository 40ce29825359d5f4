"""`paro-jax prepare-data`: tokenize text, JSONL and Parquet files into `.bin` shards, in bounded
memory.

The sources are read in sorted order (as `train --data` reads them), a block at a time: text files
in blocks of whole lines (about 1 MiB), JSONL files a record at a time, Parquet files a batch of
rows at a time (run/records.py). Instruction data (prompt-completion or chat records) becomes
shards of examples with their target masks (run/example_shards.py). Tokens go to
`OUT/shard-00000.bin`, `shard-00001.bin`, ... of at most `--shard-tokens` ids each (uint16, or
uint32 when the tokenizer's vocabulary needs it), written as they come; memory stays at a few
blocks whatever the size of the data. `OUT/meta.json` records the tokenizer, dtype and counts.
`train --data 'OUT/*.bin'` then reads the shards by memory map.

Byte-level tokens are exactly what `train --data FILE` would use for the same files. With an HF
tokenizer, text files are tokenized per block of lines, so a token never spans a block boundary
(JSONL records are tokenized one by one either way).
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
from tqdm import tqdm

from paro_jax.run import sources
from paro_jax.run.example_shards import ExampleShardWriter
from paro_jax.run.instruct import TEXT, Encoder, tokenizer_directory
from paro_jax.run.records import read_records, read_texts
from paro_jax.run.data import (
  BIN_DTYPES,
  TEXT_SAMPLE,
  ByteTokenizer,
  HFTokenizer,
  _not_utf8,
  check_text,
  expand_paths,
  read_jsonl,
)

META = "meta.json"
BLOCK = 1 << 20  # bytes of text tokenized at once


class ShardWriter:
  """Appends token arrays to OUT/shard-NNNNN.bin files of at most `shard_tokens` ids."""

  def __init__(self, out: str, dtype: np.dtype, shard_tokens: int):
    self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
    self.paths: list[str] = []
    self.counts: list[int] = []
    self.total = 0
    self._file = None

  def write(self, tokens: np.ndarray) -> None:
    tokens = np.asarray(tokens).astype(self.dtype, copy=False)
    while tokens.size:
      if self._file is None or self.counts[-1] == self.shard_tokens:
        self._next()
      room = self.shard_tokens - self.counts[-1]
      head, tokens = tokens[:room], tokens[room:]
      head.tofile(self._file)
      self.counts[-1] += head.size
      self.total += head.size

  def _next(self) -> None:
    if self._file:
      self._file.close()
    self.paths.append(os.path.join(self.out, f"shard-{len(self.paths):05d}.bin"))
    self.counts.append(0)
    self._file = open(self.paths[-1], "wb")

  def close(self) -> None:
    if self._file:
      self._file.close()
      self._file = None


def _text_blocks(path: str, block: int = BLOCK):
  """(bytes, text) blocks of whole lines; the file is checked for being UTF-8 text."""
  with open(path, "rb") as f:
    check_text(path, f.read(TEXT_SAMPLE))
    f.seek(0)
    offset, rest = 0, b""
    while True:
      chunk = f.read(block)
      data = rest + chunk
      if not chunk:
        cut = len(data)
      else:
        cut = data.rfind(b"\n") + 1 or len(data)  # a block of whole lines (or all of one)
      piece, rest = data[:cut], data[cut:]
      if piece:
        try:
          text = piece.decode("utf-8")
        except UnicodeDecodeError as e:
          raise ValueError(_not_utf8(path, e, base=offset)) from None
        yield piece, text
        offset += len(piece)
      if not chunk:
        return


def prepare_data(
  paths,
  out: str,
  tokenizer: str | None = None,
  text_field: str = "text",
  shard_tokens: int = 100_000_000,
  bin_dtype: str | None = None,
  block: int = BLOCK,
  progress: bool | None = None,
  data_format: str = "auto",
  chat_template: str | None = None,
) -> dict:
  """Tokenize `paths` (files and globs) into shards in `out`; returns the meta.json contents.
  Instruction data (prompt-completion or chat records, `data_format`) become shards of examples
  with their target masks (run/example_shards.py); examples with no target are left out and
  counted in meta.json."""
  if shard_tokens < 1:
    raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
  files = expand_paths(paths, flag="")
  bins = [p for p in files if p.endswith(".bin")]
  if bins:
    raise ValueError(
      f"{bins[0]} is already token ids (.bin): pass it to train --data as it is, not to "
      f"prepare-data"
    )
  tok = HFTokenizer(tokenizer) if tokenizer else ByteTokenizer()
  if bin_dtype is not None and bin_dtype not in BIN_DTYPES:
    raise ValueError(f"unknown --bin-dtype {bin_dtype!r}; choose one of {list(BIN_DTYPES)}")
  dtype = np.dtype(
    BIN_DTYPES[bin_dtype] if bin_dtype else np.uint16 if tok.vocab_size <= 2**16 else np.uint32
  )
  if tok.vocab_size > np.iinfo(dtype).max + 1:
    raise ValueError(
      f"the tokenizer's vocabulary of {tok.vocab_size} does not fit in {dtype.name}: pass "
      f"--bin-dtype uint32"
    )
  os.makedirs(out, exist_ok=True)
  old = sorted(glob.glob(os.path.join(out, "shard-*.bin")))
  if old:
    raise ValueError(
      f"{out} already holds {len(old)} shards ({os.path.basename(old[0])}, ...): pass another "
      f"--out, or delete them to prepare the data again"
    )
  fmt = sources.data_format(files, text_field, data_format)
  encoder, dropped = None, 0
  if fmt != TEXT:
    encoder = Encoder(fmt, tok, tokenizer_directory(tokenizer), chat_template)
    writer = ExampleShardWriter(out, dtype, shard_tokens)
  else:
    writer = ShardWriter(out, dtype, shard_tokens)
  total_bytes = sum(os.path.getsize(p) for p in files)
  bar = tqdm(
    total=total_bytes, unit="B", unit_scale=True, desc="prepare-data", disable=progress is False
  )
  try:
    for path in files:
      before = writer.total
      if encoder is not None:  # one record at a time (Parquet: a batch of rows)
        for where, record in read_records(path, progress=bar.update):
          tokens, mask = encoder(where, record)
          if np.any(mask[1:]):
            writer.write(tokens, mask)
          else:
            dropped += 1
      elif path.endswith(".jsonl"):
        for text in read_jsonl(path, text_field, progress=bar.update):
          writer.write(tok.encode(text))
      elif path.endswith(".parquet"):
        for text in read_texts(path, text_field, progress=bar.update):
          writer.write(tok.encode(text))
      else:
        for raw, text in _text_blocks(path, block):
          writer.write(
            np.frombuffer(raw, np.uint8) if isinstance(tok, ByteTokenizer) else tok.encode(text)
          )
          bar.update(len(raw))
      if writer.total == before and encoder is None:
        raise ValueError(f"data file {path!r} is empty: give a file with text in it")
    if encoder is not None and not writer.total:
      raise ValueError(f"no example with a target token in {', '.join(files)}: nothing to train on")
  except BaseException:
    writer.close()
    for p in writer.paths() if encoder else writer.paths:  # no partial set of shards that a
      os.remove(p)  # later train would take as whole
    raise
  finally:
    bar.close()
  writer.close()
  meta = {
    "tokenizer": tokenizer or "bytes",
    "vocab_size": tok.vocab_size,
    "dtype": dtype.name,
    "tokens": writer.total,
    "shards": [
      {"file": os.path.basename(p), "tokens": n} for p, n in zip(writer.paths, writer.counts)
    ]
    if encoder is None
    else writer.meta()["shards"],
    "sources": files,
  }
  if encoder is not None:
    meta.update(
      format=fmt, examples=writer.examples, dropped={"no target": dropped} if dropped else {}
    )
  with open(os.path.join(out, META), "w") as f:
    json.dump(meta, f, indent=1)
  return meta
