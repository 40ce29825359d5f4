"""Pre-tokenized `.bin` files of uint16 or uint32 token ids, read by os.pread window by window
(`BinFile`: never loaded whole, and a file truncated under the run is one error, `DataChanged`,
not a SIGBUS), and the shard directories of `paro-jax prepare-data` (data/prepare.py), checked
against their meta.json before a run reads them."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from paro_jax.data.config import BIN_DTYPE_NAMES, DataConfig

BIN_DTYPES = {name: np.dtype(name).type for name in BIN_DTYPE_NAMES}


def bin_dtype_for(cfg: DataConfig, vocab_size: int) -> np.dtype:
  """--bin-dtype if given; else uint16 (the nanoGPT convention) unless the vocabulary (the
  tokenizer's, else the model's) does not fit in 16 bits, then uint32."""
  if cfg.bin_dtype:
    return np.dtype(BIN_DTYPES[cfg.bin_dtype])
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


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


SHARD = re.compile(r"shard-\d{5}\.bin")  # the files of `paro-jax prepare-data` (data/prepare.py)
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
