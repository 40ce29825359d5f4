"""Token streams and deterministic batches.

The default corpus is real text that every Python installation carries: the source files of
the Python standard library, read as bytes and tokenized at byte level (vocabulary 256), so a
training run needs no download.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

BYTE_VOCAB = 256


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
    raise FileNotFoundError(f"no Python source files found under {root} for the default corpus; "
                            f"pass --data FILE with some text")
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load_text_bytes(path: str) -> np.ndarray:
  """A text file as byte tokens; a clear error if it is missing or empty."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file {path!r} does not exist: pass --data with an existing text "
                            f"file, or leave --data out to train on the built-in corpus")
  tokens = np.fromfile(path, dtype=np.uint8)
  if tokens.size == 0:
    raise ValueError(f"data file {path!r} is empty: give a file with text in it")
  return tokens


class Batches:
  """Random windows of seq_len+1 tokens; batch `step` depends only on (seed, step)."""

  def __init__(self, tokens: np.ndarray, micro_batches: int, batch_size: int, seq_len: int,
               seed: int):
    if tokens.size < seq_len + 2:
      raise ValueError(f"the corpus has {tokens.size} tokens, fewer than one sequence of "
                       f"{seq_len + 1}: use a shorter --seq-len or more data")
    self.tokens, self.seed = tokens, seed
    self.shape = (micro_batches, batch_size, seq_len + 1)

  def __call__(self, step: int) -> np.ndarray:
    A, B, L1 = self.shape
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, self.tokens.size - L1, size=A * B)
    windows = self.tokens[starts[:, None] + np.arange(L1)[None, :]]
    return windows.reshape(A, B, L1).astype(np.int32)
