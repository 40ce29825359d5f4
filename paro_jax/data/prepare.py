"""`paro-jax prepare-data`: tokenize text, JSONL and Parquet files into `.bin` shards, in bounded
memory.

The sources are read in sorted order (as `train --data` reads them), a block at a time: text files
in blocks of whole lines (about 1 MiB), JSONL files a record at a time, Parquet files a batch of
rows at a time (data/records.py). Instruction data (prompt-completion or chat records) becomes
shards of examples with their target masks (data/example_shards.py). Tokens go to
`OUT/shard-00000.bin`, `shard-00001.bin`, ... of at most `--shard-tokens` ids each (uint16, or
uint32 when the tokenizer's vocabulary needs it), written as they come; memory stays at a few
blocks whatever the size of the data. `OUT/meta.json` records the tokenizer, dtype and counts.
`train --data 'OUT/*.bin'` then reads the shards, checked against meta.json (paro_jax/data/bins.py).

Nothing is published until everything is written: the shards are written into `OUT/.partial-PID/`
and moved into OUT, then meta.json is written, only at the end. A stop (SIGINT, SIGTERM, SIGHUP:
Ctrl-C, `timeout`, `kill`, SLURM) or an error (a full disk included) removes the partial shards and
leaves OUT as it was; a `kill -9` leaves its `.partial-PID/` (never read as data), which the next
prepare-data into OUT removes.

Byte-level tokens are exactly what `train --data FILE` would use for the same files. With an HF
tokenizer each document starts and ends as `train --data` makes it (the post-processor's special
tokens, then the end-of-sequence token: data/tokenizers.py); text files are tokenized per block of
lines, so a token never spans a block boundary (JSONL and Parquet records are tokenized one by
one either way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import json
import os
import shutil
import signal
import threading

import numpy as np
from tqdm import tqdm

from paro_jax import report
from paro_jax.core.run_lock import LOCK, RunLock
from paro_jax.data import sources
from paro_jax.data.example_shards import ExampleShardWriter
from paro_jax.data.instruct import CHAT, TEXT, Encoder, tokenizer_directory
from paro_jax.data.records import read_records, read_texts
from paro_jax.data.bins import BIN_DTYPES, META
from paro_jax.data.streams import _not_utf8, check_text, expand_paths, read_jsonl, TEXT_SAMPLE
from paro_jax.data.tokenizers import BYTES, ByteTokenizer, HFTokenizer, tokenizer_identity

BLOCK = 1 << 20  # bytes of text tokenized at once


PARTIAL = ".partial-"  # OUT/.partial-PID/: the shards of a prepare-data still writing


class Stopped(KeyboardInterrupt):
  """prepare-data was stopped by a signal; nothing was published."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class ShardWriter:
  """Appends token arrays to `directory`/shard-NNNNN.bin files of at most `shard_tokens` ids."""

  def __init__(self, directory: str, dtype: np.dtype, shard_tokens: int):
    self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
    self.paths: list[str] = []
    self.counts: list[int] = []
    self.total = 0
    self._file = None

  def write(self, tokens: np.ndarray) -> None:
    tokens = np.ascontiguousarray(np.asarray(tokens).astype(self.dtype, copy=False))
    while tokens.size:
      if self._file is None or self.counts[-1] == self.shard_tokens:
        self._next()
      room = self.shard_tokens - self.counts[-1]
      head, tokens = tokens[:room], tokens[room:]
      self._file.write(head.data)  # a file's write, not tofile: a full disk is ENOSPC
      self.counts[-1] += head.size
      self.total += head.size

  def _next(self) -> None:
    self.close()
    self.paths.append(os.path.join(self.directory, shard_name(len(self.paths))))
    self.counts.append(0)
    self._file = open(self.paths[-1], "wb")

  def close(self) -> None:
    if self._file:
      file, self._file = self._file, None
      file.close()


def shard_name(k: int) -> str:
  return f"shard-{k:05d}.bin"


class _StopOn:
  """SIGTERM and SIGHUP raise `Stopped` in the main thread as Ctrl-C raises KeyboardInterrupt, so
  that the partial shards are removed (their default action would end the process on the spot)."""

  SIGNALS = (signal.SIGTERM, signal.SIGHUP)

  def __init__(self):
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._old[sig] = signal.signal(sig, self._raise)
    return self

  def _raise(self, signum, _frame):
    raise Stopped(signum)

  def hold(self) -> None:
    """From here on no signal interrupts, Ctrl-C included: the publishing renames are quick, and
    a set cut between them would be neither published nor removed."""
    if threading.current_thread() is not threading.main_thread():
      return
    self._old.setdefault(signal.SIGINT, signal.getsignal(signal.SIGINT))
    for sig in self._old:
      signal.signal(sig, signal.SIG_IGN)

  def __exit__(self, *_exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def _remove_stale(out: str) -> None:
  """Remove the `.partial-PID` directories of prepare-data runs that were killed (-9)."""
  for path in glob.glob(os.path.join(glob.escape(out), PARTIAL + "*")):
    pid = path.rsplit(PARTIAL, 1)[1]
    if pid.isdigit() and not pid_alive(int(pid)):
      shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
  """Whether process `pid` exists on this host."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _disk_full(e: OSError, out: str) -> ValueError | None:
  if e.errno not in (errno.ENOSPC, errno.EDQUOT):
    return None
  what = "the disk is full" if e.errno == errno.ENOSPC else "the disk quota is exceeded"
  out = report.shown(out)
  return ValueError(
    f"{what}: could not write the shards into {out}; nothing was published there (the partial "
    f"shards were removed). Free space on the disk holding {out}, or pass another --out"
  )


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
  with their target masks (data/example_shards.py); examples with no target are left out and
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
  tok = HFTokenizer(tokenizer) if tokenizer not in (None, BYTES) else ByteTokenizer()
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
  fmt = sources.data_format(files, text_field, data_format)
  encoder = None
  if fmt != TEXT:
    if fmt == CHAT and tokenizer is None:
      raise ValueError(
        "chat records are tokenized with the model's tokenizer and rendered with its chat "
        "template, and no --tokenizer names them: pass --tokenizer with the tokenizer.json of the "
        "model's HF directory (its chat template is used unless --chat-template FILE names "
        f"another), or --tokenizer {BYTES} to tokenize the chats as bytes"
      )
    flags = "--tokenizer with the tokenizer.json of the model's HF directory"
    encoder = Encoder(fmt, tok, tokenizer_directory(tokenizer), chat_template, None, flags)
  made = _missing_top(out)
  os.makedirs(out, exist_ok=True)
  with RunLock(out, True, "prepare-data", remove=True):  # the whole run: checks and renames
    try:
      job = _Job(files, out, tok, tokenizer, text_field, dtype, shard_tokens, fmt, encoder)
      return _prepare_locked(job, block, progress)
    except BaseException:
      if made is not None:  # a failed run leaves no directory it made
        _remove_made(made, out)
      raise


def _missing_top(out: str) -> str | None:
  """The top directory `os.makedirs(out)` would create (None: `out` exists)."""
  path, top = os.path.abspath(out), None
  while not os.path.exists(path):
    path, top = os.path.dirname(path), path
  return top


def _remove_made(top: str, out: str) -> None:
  """Remove `out` and its parents up to `top` (those this run made) where they hold nothing but
  the lock file, still held (a run taking it next makes the directory again)."""
  path = os.path.abspath(out)
  with contextlib.suppress(OSError):
    os.unlink(os.path.join(path, LOCK))
  while True:
    try:
      os.rmdir(path)
    except OSError:
      return
    if path == top:
      return
    path = os.path.dirname(path)


@dataclasses.dataclass(frozen=True)
class _Job:
  """What a prepare-data run was asked, checked before its --out is made."""

  files: list[str]
  out: str
  tok: ByteTokenizer | HFTokenizer
  tokenizer: str | None  # as given (meta.json names it)
  text_field: str
  dtype: np.dtype
  shard_tokens: int
  fmt: str
  encoder: Encoder | None  # instruction data's


def _prepare_locked(job: _Job, block: int, progress: bool | None) -> dict:
  """prepare_data within the lock on its --out."""
  files, out, tok, text_field = job.files, job.out, job.tok, job.text_field
  dtype, shard_tokens, fmt, encoder = job.dtype, job.shard_tokens, job.fmt, job.encoder
  _remove_stale(out)
  old = sorted(glob.glob(os.path.join(glob.escape(out), "shard-*.bin")))
  if old or os.path.exists(os.path.join(out, META)):
    what = f"{len(old)} shards ({os.path.basename(old[0])}, ...)" if old else META
    raise ValueError(
      f"{report.shown(out)} already holds {what}: pass another --out, or delete them to prepare "
      f"the data again"
    )
  dropped = 0
  partial = os.path.join(out, f"{PARTIAL}{os.getpid()}")
  os.makedirs(partial)
  if encoder is not None:
    writer = ExampleShardWriter(partial, dtype, shard_tokens)
  else:
    writer = ShardWriter(partial, dtype, shard_tokens)
  total_bytes = sum(os.path.getsize(p) for p in files)
  bar = tqdm(
    total=total_bytes, unit="B", unit_scale=True, desc="prepare-data", disable=progress is False
  )
  try:
    with _StopOn() as stop:
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
            writer.write(tok.document(text))
        elif path.endswith(".parquet"):
          for text in read_texts(path, text_field, progress=bar.update):
            writer.write(tok.document(text))
        else:  # one document, in blocks: its first and last ids as tok.document's
          first, last = tok.document_ends()
          for k, (raw, text) in enumerate(_text_blocks(path, block)):
            if k == 0:
              writer.write(first)
            writer.write(
              np.frombuffer(raw, np.uint8) if isinstance(tok, ByteTokenizer) else tok.ids(text)
            )
            bar.update(len(raw))
          if writer.total > before:
            writer.write(last)
        if writer.total == before and encoder is None:
          raise ValueError(f"data file {path!r} is empty: give a file with text in it")
      if encoder is not None and not writer.total:
        raise ValueError(
          f"no record with a target token in {', '.join(files)}: nothing to train on"
        )
      writer.close()
      meta = {
        "tokenizer": job.tokenizer or "bytes",
        "tokenizer_identity": tokenizer_identity(job.tokenizer),  # what train compares its own to
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "tokens": writer.total,
        "shards": [
          {"file": os.path.basename(p), "tokens": n} for p, n in zip(writer.paths, writer.counts)
        ],
        "sources": files,
      }
      if encoder is not None:  # instruction data: the examples' shards (data/example_shards.py)
        dropped = {"no target": dropped} if dropped else {}
        meta.update(**writer.meta(), format=fmt, dropped=dropped)
        if encoder.template is not None:  # what train records and export ships (chat data)
          meta["chat_template"] = encoder.template.source
      with open(os.path.join(partial, META), "w") as f:
        json.dump(meta, f, indent=1)
      stop.hold()
      # Published: every shard moved into OUT, then meta.json, which train requires: a set
      # interrupted between the renames has no meta.json and is refused whole.
      for p in writer.paths:
        os.rename(p, os.path.join(out, os.path.basename(p)))
      os.rename(os.path.join(partial, META), os.path.join(out, META))
  except OSError as e:
    full = _disk_full(e, out)
    if full is None:
      raise
    raise full from None
  finally:
    bar.close()
    try:
      writer.close()
    except OSError:
      pass  # the error being raised says it (a full disk fails the flush again)
    shutil.rmtree(partial, ignore_errors=True)  # after an error or stop: the partial shards
  return meta
