"""Token streams and deterministic batches.

Sources (`--data`, any number of paths and globs, in sorted order): text files; JSONL files whose
records carry the text in one field (`--text-field`), and Parquet files likewise (one column,
read a batch of rows at a time: run/records.py); pre-tokenized `.bin` files of uint16 or uint32
ids (read by os.pread, window by window: never loaded whole, any number of them, e.g. the shards
of `paro-jax prepare-data`, paro_jax/run/prepare.py, checked against their meta.json). Several
sources are read as one stream (`TokenStream`) without being joined in memory. Text is tokenized
at byte level (vocabulary 256) or by an HF `tokenizer.json` (`--tokenizer`, needs the
`tokenizers` package: `pip install -e ".[hf]"`).

The default corpus is real text that every Python installation carries: the source files of
the Python standard library, so a training run needs no download.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sysconfig

import numpy as np

from paro_jax.run.config import BIN_DTYPE_NAMES, DataConfig  # noqa: F401 - also imported from here

BYTE_VOCAB = 256
BIN_DTYPES = {name: np.dtype(name).type for name in BIN_DTYPE_NAMES}


# --- tokenizers ------------------------------------------------------------------------------
class ByteTokenizer:
  vocab_size = BYTE_VOCAB

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

  def encode_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(the bytes, the character span each byte belongs to)."""
    spans = [(i, i + 1) for i, c in enumerate(text) for _ in range(len(c.encode("utf-8")))]
    return self.encode(text), spans

  def token_id(self, token: str) -> int | None:
    return None  # no special tokens in 256 bytes


class HFTokenizer:
  """An HF `tokenizer.json` through the `tokenizers` package."""

  def __init__(self, path: str):
    try:
      import tokenizers  # optional: only for HF tokenizer files
    except ImportError as e:
      raise ValueError(
        f'--tokenizer {path} needs the `tokenizers` package: pip install -e ".[hf]"'
      ) from e
    if os.path.isdir(path):  # an HF model directory: its tokenizer.json
      inside = os.path.join(path, "tokenizer.json")
      if not os.path.isfile(inside):
        raise FileNotFoundError(
          f"--tokenizer {path} is a directory without a tokenizer.json: pass the tokenizer.json "
          f"of an HF model (or its directory), or leave --tokenizer out for byte-level tokens"
        )
      path = inside
    if not os.path.isfile(path):
      raise FileNotFoundError(
        f"tokenizer file {path!r} does not exist: pass --tokenizer with an "
        f"HF tokenizer.json, or leave it out for byte-level tokens"
      )
    self.path = path
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a bare Exception
      why = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise ValueError(
        f"--tokenizer {path} is not a valid HF tokenizer.json ({why}): pass the tokenizer.json "
        f"of an HF model, or leave --tokenizer out for byte-level tokens"
      ) from None
    # Ids need not be contiguous (a tokenizer.json may number its tokens with gaps): the largest
    # id + 1 is what a model's embedding must hold.
    ids = self._tok.get_vocab(with_added_tokens=True).values()
    self.vocab_size = max(
      self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1
    )

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text).ids, dtype=np.uint32)

  def encode_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(the ids without the special tokens the post-processor adds, each one's character span
    in `text`): as transformers tokenizes a rendered chat."""
    encoding = self._tok.encode(text, add_special_tokens=False)
    return np.asarray(encoding.ids, dtype=np.uint32), encoding.offsets

  def token_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)


def make_tokenizer(cfg: DataConfig):
  return HFTokenizer(cfg.tokenizer) if cfg.tokenizer else ByteTokenizer()


def check_vocab(vocab_size: int, model_vocab: int, what: str) -> None:
  if vocab_size > model_vocab:
    raise ValueError(
      f"{what} has a vocabulary of {vocab_size}, more than the model's {model_vocab}:"
      f" use a model with vocab >= {vocab_size}, or a smaller tokenizer"
    )


def bin_dtype_for(cfg: DataConfig, vocab_size: int) -> np.dtype:
  """--bin-dtype if given; else uint16 (the nanoGPT convention) unless the vocabulary (the
  tokenizer's, else the model's) does not fit in 16 bits, then uint32."""
  if cfg.bin_dtype:
    return np.dtype(BIN_DTYPES[cfg.bin_dtype])
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


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


def bin_max(path: str, dtype: np.dtype, chunk: int = 1 << 22) -> int:
  """The largest id of a .bin file, read in chunks by plain reads (pages of a memory map would
  stay in the process's resident memory)."""
  top = 0
  with open(path, "rb") as f:
    while block := f.read(chunk * dtype.itemsize):
      top = max(top, int(np.frombuffer(block, dtype).max()))
  return top


def read_bin(path: str, dtype: np.dtype) -> BinFile:
  size = os.path.getsize(path)
  if size % dtype.itemsize:
    raise ValueError(
      f"{path}: {size} bytes is not a whole number of {dtype.name} tokens; is --bin-dtype right?"
    )
  return BinFile(path, dtype)


class DataChanged(ValueError):
  """A data file shrank while the run read it."""


class _Fd:
  """An open file descriptor, closed when the last BinFile view on it goes."""

  def __init__(self, path: str):
    self.fd = os.open(path, os.O_RDONLY)
    self.bytes = os.fstat(self.fd).st_size  # when the run opened it
    if hasattr(os, "posix_fadvise"):  # random windows: no read-ahead of megabytes per window
      os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

  def __del__(self):
    try:
      os.close(self.fd)
    except (OSError, TypeError):  # already closed, or the interpreter is shutting down
      pass


class BinFile:
  """The token ids of a .bin file, as a 1-D array that reads only what is indexed, by os.pread.

  Not a memory map: a file truncated while the run reads it (another program rewriting a shard)
  makes a mapped read past its new end a SIGBUS, which kills the process without a word; a short
  pread is a `DataChanged` error naming the file. `f[lo:hi]` is a view; `f[idx]` (an integer
  array) reads each run of consecutive indices (a batch's windows) with one call."""

  def __init__(self, path: str, dtype, _fd: _Fd | None = None, start: int = 0, size=None):
    self.path, self.dtype = path, np.dtype(dtype)
    self._fd = _fd or _Fd(path)
    self.start = start
    self.size = self._fd.bytes // self.dtype.itemsize - start if size is None else size
    self.shape = (self.size,)
    self.ndim = 1

  def __len__(self) -> int:
    return self.size

  def _read(self, lo: int, n: int, into: np.ndarray | None = None) -> np.ndarray:
    """Tokens lo..lo+n-1, read into `into` (n tokens, contiguous) or a new array."""
    into = np.empty(n, self.dtype) if into is None else into
    got = os.preadv(self._fd.fd, [memoryview(into).cast("B")], (self.start + lo) * into.itemsize)
    if got < into.nbytes:
      now = os.fstat(self._fd.fd).st_size
      raise DataChanged(
        f"{self.path} shrank from {self._fd.bytes} to {now} bytes while the run read it "
        f"(truncated or rewritten by another program)"
      )
    return into

  def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
    """`self[starts[..., None] + arange(length)]`, each window read straight into its row."""
    starts = np.asarray(starts)
    if starts.size and (starts.min() < 0 or starts.max() + length > self.size):
      raise IndexError(f"token index out of range [0, {self.size})")
    out = np.empty((*starts.shape, length), self.dtype)
    for row, lo in zip(out.reshape(-1, length), starts.reshape(-1).tolist()):
      self._read(lo, length, into=row)
    return out

  def __getitem__(self, index):
    if isinstance(index, slice):
      lo, hi, step = index.indices(self.size)
      if step != 1:
        raise IndexError("a BinFile slice must have step 1")
      return BinFile(self.path, self.dtype, self._fd, self.start + lo, max(0, hi - lo))
    idx = np.asarray(index)
    flat = idx.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= self.size):
      raise IndexError(f"token index out of range [0, {self.size})")
    out = np.empty(flat.size, self.dtype)
    cuts = np.flatnonzero(np.diff(flat) != 1) + 1  # where a run of consecutive indices ends
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, flat.size]):
      out[a:b] = self._read(int(flat[a]), int(b - a))
    return out.reshape(idx.shape)

  def __array__(self, dtype=None, copy=None):
    whole = self._read(0, self.size)
    return whole if dtype is None else whole.astype(dtype)


def read_jsonl(path: str, field: str, progress=None):
  """The `field` text of each record; `progress(n)` is called with the bytes of each line."""
  try:
    yield from _read_jsonl(path, field, progress)
  except UnicodeDecodeError as e:
    raise ValueError(_not_utf8(path, e)) from None


def _read_jsonl(path: str, field: str, progress):
  with open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      if progress:
        progress(len(raw))
      line = raw.decode("utf-8")
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from e
      if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
          f"{path}:{n}: the record has no {field!r} field (it has {keys}): pass "
          f"--text-field with the field that holds the text"
        )
      text = record[field]
      if not isinstance(text, str):
        raise ValueError(
          f"{path}:{n}: the {field!r} field is {json.dumps(text)[:40]} ({type(text).__name__}), "
          f"not text: fix or drop that record, or pass --text-field with the field that holds "
          f"the text"
        )
      if bad := _SURROGATE.search(text):  # JSON's "\ud800" escape: no character, no UTF-8
        raise ValueError(
          f"{path}:{n}: the {field!r} field holds a lone surrogate ({ascii(bad.group())} at "
          f"character {bad.start()}), which is not text: fix or drop that record"
        )
      yield text


_SURROGATE = re.compile("[\ud800-\udfff]")
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


SHARD = re.compile(r"shard-\d{5}\.bin")  # the files of `paro-jax prepare-data` (run/prepare.py)
META = "meta.json"


def check_shards(directory: str, dtype_flag: str | None) -> np.dtype:
  """A directory of prepare-data shards must be complete: its meta.json written (prepare-data
  writes it last) and every shard on disk the size it records. Returns the shards' dtype."""
  fix = f"prepare the data again (paro-jax prepare-data ... --out {directory})"
  on_disk = sorted(n for n in os.listdir(directory) if SHARD.fullmatch(n))
  path = os.path.join(directory, META)
  if not os.path.exists(path):
    raise ValueError(
      f"{directory} holds prepare-data shards ({on_disk[0]}, ...) but no {META}: the "
      f"preparation did not finish (stopped or killed), so the set may be partial: {fix}"
    )
  try:
    with open(path) as f:
      meta = json.load(f)
    listed = {s["file"]: int(s["tokens"]) for s in meta["shards"]}
    dtype = np.dtype(meta["dtype"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path} is not a complete prepare-data {META} ({e!r}): {fix}") from None
  if dtype_flag and np.dtype(BIN_DTYPES[dtype_flag]) != dtype:
    raise ValueError(
      f"--bin-dtype {dtype_flag}, but {path} says its shards are {dtype.name}: pass --bin-dtype "
      f"{dtype.name} (or leave it out)"
    )
  missing = sorted(set(listed) - set(on_disk))
  extra = sorted(set(on_disk) - set(listed))
  if missing or extra:
    what = f"{missing[0]} is missing" if missing else f"{extra[0]} is not in it"
    raise ValueError(
      f"{path} lists {len(listed)} shards, {directory} holds {len(on_disk)} ({what}): {fix}"
    )
  for name, tokens in listed.items():
    size = os.path.getsize(os.path.join(directory, name))
    if size != tokens * dtype.itemsize:
      raise ValueError(
        f"{os.path.join(directory, name)} is {size} bytes, but {META} records {tokens} "
        f"{dtype.name} tokens ({tokens * dtype.itemsize} bytes): it was truncated or rewritten: "
        f"{fix}"
      )
  return dtype


def load_tokens(cfg: DataConfig, model_vocab: int) -> np.ndarray:
  """All tokens of the sources, in order; ids checked against the model's vocabulary."""
  tokenizer = make_tokenizer(cfg)
  check_vocab(
    tokenizer.vocab_size,
    model_vocab,
    f"tokenizer {cfg.tokenizer}" if cfg.tokenizer else "the byte-level tokenizer",
  )
  if not cfg.paths:
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
        dtype = bin_dtype_for(cfg, tokenizer.vocab_size if cfg.tokenizer else model_vocab)
      tokens = read_bin(path, dtype)
      top = bin_max(path, dtype) if tokens.size else 0
      if top >= model_vocab:
        raise ValueError(
          f"{path} holds token id {top}, outside the model's vocabulary of "
          f"{model_vocab} (read as {dtype.name}; is --bin-dtype right?)"
        )
    elif path.endswith((".jsonl", ".parquet")):
      from paro_jax.run.records import read_texts  # (it imports this module)

      texts = (
        read_jsonl(path, cfg.text_field)
        if path.endswith(".jsonl")
        else read_texts(path, cfg.text_field)
      )
      docs = [tokenizer.encode(text) for text in texts]
      tokens = np.concatenate(docs) if docs else np.zeros(0, np.uint8)
    elif cfg.tokenizer:
      with open(path, "rb") as f:
        raw = f.read()
      check_text(path, raw[:TEXT_SAMPLE])
      try:
        tokens = tokenizer.encode(raw.decode("utf-8"))
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
