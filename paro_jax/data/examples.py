"""Examples of instruction data and the batches a run trains on.

An example is a token sequence with a target mask (data/instruct.py). `Examples` holds them laid end
to end, read by index: in memory (encoded from JSONL/Parquet at the start of a run) or from the
shards `paro-jax prepare-data` writes (tokens, masks and each example's start, read by pread).

Batches (`ExampleBatches`), deterministic in (seed, step) like the token stream's, so `--resume`
continues exactly: each epoch takes the examples in an order shuffled by (seed, epoch) and lays
them into rows of L+1 tokens, one example per row right-padded, or with `--pack` as many as fit
(at most MAX_SEGMENTS, in order: a row takes the next example while it fits), each its own
segment. Step s takes rows s*A*B .. (s+1)*A*B-1 of the epochs in turn. A target counts where its
token is a target of the same example as the token before it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.config import MAX_SEGMENTS
from paro_jax.core.batch import Batch
from paro_jax.data.config import LONG_EXAMPLES


@dataclasses.dataclass
class Examples:
  """Examples laid end to end: example i is tokens[starts[i]:starts[i+1]] (and its mask)."""

  tokens: object  # 1-D ids (an array, or a stream read by index)
  mask: object  # 1-D uint8, 1 for a target
  starts: np.ndarray  # int64, one more than the examples
  dropped: dict = dataclasses.field(default_factory=dict)  # why -> how many, when encoded
  chat_template: str | None = None  # the text of the chat template chat records were rendered with

  def __len__(self) -> int:
    return len(self.starts) - 1

  def lengths(self) -> np.ndarray:
    return np.diff(self.starts)

  def read_count(self) -> int:
    """The records read: the examples kept and those left out when encoded."""
    return len(self) + sum(self.dropped.values())

  def read(self, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n tokens of example i, and their mask."""
    index = np.arange(self.starts[i], self.starts[i] + n)
    return np.asarray(self.tokens[index]), np.asarray(self.mask[index])


def from_encoded(encoded) -> Examples:
  """Examples from (tokens, mask) pairs; those with no target are dropped and counted."""
  tokens, masks, lengths, no_target = [], [], [], 0
  for t, m in encoded:
    if not np.any(m[1:]):
      no_target += 1
      continue
    tokens.append(t)
    masks.append(m)
    lengths.append(len(t))
  starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
  join = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)
  dropped = {"no target": no_target} if no_target else {}
  return Examples(join(tokens, np.uint32), join(masks, np.uint8), starts, dropped)


@dataclasses.dataclass(frozen=True)
class Selection:
  """The examples a run uses and how many tokens of each (`select`)."""

  ids: np.ndarray  # indices into the Examples
  lengths: np.ndarray  # tokens taken of each (truncated ones: L+1)
  dropped: dict  # why -> how many

  def __len__(self) -> int:
    return len(self.ids)

  def split(self, fraction: float) -> tuple[Selection, Selection]:
    """(train, eval): the last `fraction` of the examples held out."""
    n_eval = int(len(self) * fraction)
    cut = len(self) - n_eval
    part = lambda a, b: Selection(self.ids[a:b], self.lengths[a:b], self.dropped)
    return part(0, cut), part(cut, len(self))


def select(examples: Examples, seq_len: int, long_examples: str) -> Selection:
  """The examples that fit a row of seq_len+1 tokens; longer ones dropped or truncated
  (`--long-examples`), a truncated one dropped if no target is left in it. Counted by why."""
  if long_examples not in LONG_EXAMPLES:
    raise ValueError(f"--long-examples must be one of {LONG_EXAMPLES}, got {long_examples!r}")
  L1 = seq_len + 1
  lengths = examples.lengths()
  fits = lengths <= L1
  dropped = dict(examples.dropped)
  ids = np.flatnonzero(fits)
  if long_examples == "truncate":
    cut = [
      i for i in np.flatnonzero(~fits) if np.any(examples.read(int(i), L1)[1][1:])
    ]  # only the long ones are read
    if len(cut) < int(np.sum(~fits)):
      dropped["no target within --seq-len"] = int(np.sum(~fits)) - len(cut)
    ids = np.sort(np.concatenate([ids, np.asarray(cut, np.int64)]))
  elif not fits.all():
    dropped[f"longer than --seq-len {seq_len} + 1 tokens"] = int(np.sum(~fits))
  return Selection(ids.astype(np.int64), np.minimum(lengths[ids], L1), dropped)


def dropped_line(dropped: dict, total: int, what: str = "examples") -> str | None:
  """One line saying which examples were left out and why (None: none)."""
  if not any(dropped.values()):
    return None
  parts = ", ".join(f"{n} {why}" for why, n in dropped.items() if n)
  return f"paro-jax: {sum(dropped.values())} of {total} {what} left out: {parts}"


def pack_rows(lengths: np.ndarray, capacity: int, max_examples: int = MAX_SEGMENTS) -> np.ndarray:
  """Row boundaries of examples of these lengths laid in order: a row takes the next example
  while it fits (and holds fewer than `max_examples`). Row r is examples bounds[r]..bounds[r+1]."""
  bounds, used, count = [0], 0, 0
  for i, n in enumerate(lengths.tolist()):
    if count and (used + n > capacity or count == max_examples):
      bounds.append(i)
      used, count = 0, 0
    used, count = used + n, count + 1
  if len(lengths):
    bounds.append(len(lengths))
  return np.asarray(bounds, np.int64)


class ExampleBatches:
  """Batches of examples: `batches(step)` is the global (A, B, L+1) Batch of step `step`,
  `batches(step, rows=(lo, hi))` its rows lo..hi-1 of every micro-batch (one process's).

  `shuffle=False`: the examples in their order, once (eval): rows past the last are empty (all
  padding, no target)."""

  def __init__(
    self,
    examples: Examples,
    selection: Selection,
    micro_batches: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    pack: bool = False,
    shuffle: bool = True,
    what: str = "the training examples",
  ):
    if not len(selection):
      why = "; ".join(f"{n} {reason}" for reason, n in selection.dropped.items() if n)
      shortest = int(examples.lengths().min()) if len(examples) else 0
      longer = "a longer --seq-len"
      if len(examples) and shortest > seq_len + 1:  # all too long: the length that fits one
        longer = f"--seq-len {shortest - 1} or more (the shortest example is {shortest} tokens)"
      fix = f"use {longer}, --long-examples truncate, or more data"
      raise ValueError(
        f"{what}: no example left to train on (of {examples.read_count()}"
        + (f": {why}" if why else "")
        + f"): {fix}"
      )
    self.examples, self.selection = examples, selection
    self.seed, self.pack, self.shuffle = seed, pack, shuffle
    self.shape = (micro_batches, batch_size, seq_len + 1)
    self._epochs: dict[int, np.ndarray] = {}  # epoch -> its rows' bounds in its order
    self._ends = [0]  # rows of the epochs so far, cumulative
    self.note = None  # which examples were left out, for the run's log

  def describe(self, attention: str = "xla") -> str:
    """The banner's line: the examples, how they are laid out, how attention keeps them apart."""
    rows = self.rows_per_epoch()
    layout = (
      f"packed, up to {MAX_SEGMENTS} per sequence ({rows} sequences an epoch)"
      if self.pack
      else "one per sequence, right-padded"
    )
    apart = ""
    if self.pack:
      apart = (
        "; attention inside each example by cuDNN's fused kernel in its packed layout (Hopper "
        "GPUs and later)"
        if attention == "cudnn"
        else "; attention inside each example (a mask per sequence)"
      )
    return (
      f"paro-jax: instruction data: {len(self.selection)} training examples, {layout}; loss on "
      f"their target tokens only{apart}"
    )

  def _order(self, epoch: int) -> np.ndarray:
    n = len(self.selection)
    if not self.shuffle:
      return np.arange(n)
    return np.random.default_rng([self.seed, epoch]).permutation(n)

  def _bounds(self, epoch: int) -> np.ndarray:
    if epoch not in self._epochs:
      order = self._order(epoch)
      if self.pack:
        self._epochs[epoch] = pack_rows(self.selection.lengths[order], self.shape[2])
      else:
        self._epochs[epoch] = np.arange(len(order) + 1, dtype=np.int64)
    return self._epochs[epoch]

  def rows_per_epoch(self, epoch: int = 0) -> int:
    return len(self._bounds(epoch)) - 1

  def row_examples(self, row: int) -> list[int]:
    """Positions in the selection of the examples of global row `row` (epochs in turn)."""
    while row >= self._ends[-1]:
      if not self.shuffle and len(self._ends) > 1:
        return []  # past the only pass
      self._ends.append(self._ends[-1] + self.rows_per_epoch(len(self._ends) - 1))
    epoch = int(np.searchsorted(self._ends, row, side="right")) - 1
    bounds, row = self._bounds(epoch), row - self._ends[epoch]
    return self._order(epoch)[bounds[row] : bounds[row + 1]].tolist()

  def row(self, row: int):
    """(tokens L+1, weights L, segments L) of global row `row`."""
    L1 = self.shape[2]
    tokens = np.zeros(L1, np.int32)
    is_target = np.zeros(L1, bool)
    segments = np.zeros(L1, np.int32)
    at = 0
    for k, pos in enumerate(self.row_examples(row), 1):
      n = int(self.selection.lengths[pos])
      t, m = self.examples.read(int(self.selection.ids[pos]), n)
      tokens[at : at + n], is_target[at : at + n], segments[at : at + n] = t, m, k
      at += n
    # a target counts where its token is a target of the example its input token is in
    weights = is_target[1:] & (segments[1:] == segments[:-1]) & (segments[1:] > 0)
    return tokens, weights.astype(np.int32), segments[:-1]

  def __call__(self, step: int, rows: tuple[int, int] | None = None) -> Batch:
    A, B, L1 = self.shape
    lo, hi = rows or (0, B)
    first = step * A * B
    parts = [self.row(first + a * B + b) for a in range(A) for b in range(lo, hi)]
    stack = lambda i: np.stack([p[i] for p in parts]).reshape(A, hi - lo, -1)
    return Batch(stack(0), stack(1), stack(2) if self.pack else None)

  def process_rows(self, process: int, processes: int) -> tuple[int, int]:
    """The rows process `process` of `processes` holds (as Batches.process_rows)."""
    B = self.shape[1]
    if B % processes:
      raise ValueError(f"batch size {B} is not divisible by the {processes} processes")
    return process * B // processes, (process + 1) * B // processes
