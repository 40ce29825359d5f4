"""Instruction data as `paro-jax prepare-data` writes it: each shard's token ids
(`shard-NNNNN.bin`, as for a token stream), their target mask (`shard-NNNNN.mask`, one uint8 per
token, 1 for a target) and where each example starts (`shard-NNNNN.starts`, int64, one more than
its examples: the last is its token count). An example never spans two shards. meta.json names
the records' format (chat, prompt-completion), the examples and those left out (no target).
`train --data 'OUT/*.bin'` reads them back as `Examples` (data/examples.py), by pread.
"""

from __future__ import annotations

import json
import os

import numpy as np

from paro_jax.data.bins import META, read_bin

from paro_jax.data.streams import TokenStream
from paro_jax.data.examples import Examples
from paro_jax.data.instruct import CHAT, PROMPT_COMPLETION

MASK, STARTS = ".mask", ".starts"


def companions(shard: str) -> tuple[str, str]:
  """The mask and starts files of a shard-NNNNN.bin."""
  stem = shard[: -len(".bin")]
  return stem + MASK, stem + STARTS


class ExampleShardWriter:
  """Writes examples into `directory`/shard-NNNNN.{bin,mask,starts}, a new shard once the next
  example would take one past `shard_tokens` ids (a longer example gets a shard of its own)."""

  def __init__(self, directory: str, dtype: np.dtype, shard_tokens: int):
    self.directory, self.dtype, self.shard_tokens = directory, np.dtype(dtype), shard_tokens
    self.shards: list[str] = []  # the .bin files
    self.counts: list[int] = []  # tokens of each
    self.starts: list[list[int]] = []
    self.total = 0
    self._files = None

  @property
  def examples(self) -> int:
    return sum(len(s) for s in self.starts)

  @property
  def paths(self) -> list[str]:
    """Every file written, each shard's three (what prepare-data publishes)."""
    return [p for shard in self.shards for p in (shard, *companions(shard))]

  def write(self, tokens: np.ndarray, mask: np.ndarray) -> None:
    n = len(tokens)
    if self._files is None or (self.counts[-1] and self.counts[-1] + n > self.shard_tokens):
      self._next()
    tokens_file, mask_file = self._files
    tokens_file.write(np.ascontiguousarray(np.asarray(tokens).astype(self.dtype)).data)
    mask_file.write(np.ascontiguousarray(np.asarray(mask, np.uint8)).data)
    self.starts[-1].append(self.counts[-1])
    self.counts[-1] += n
    self.total += n

  def _next(self) -> None:
    self.close()
    self.shards.append(os.path.join(self.directory, f"shard-{len(self.shards):05d}.bin"))
    self.counts.append(0)
    self.starts.append([])
    self._files = (open(self.shards[-1], "wb"), open(companions(self.shards[-1])[0], "wb"))

  def close(self) -> None:
    if self._files is None:
      return
    files, self._files = self._files, None
    for f in files:
      f.close()
    starts = np.asarray([*self.starts[-1], self.counts[-1]], np.int64)
    with open(companions(self.shards[-1])[1], "wb") as f:
      f.write(starts.data)

  def meta(self) -> dict:
    """meta.json's fields for the shards."""
    return {
      "tokens": self.total,
      "examples": self.examples,
      "shards": [
        {"file": os.path.basename(p), "tokens": n, "examples": len(s)}
        for p, n, s in zip(self.shards, self.counts, self.starts)
      ],
    }


def read_meta(directory: str) -> dict | None:
  """meta.json of a prepare-data directory; None if it has none."""
  path = os.path.join(directory, META)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def example_format(shard: str) -> str | None:
  """The records' format of a prepare-data shard of instruction data; None for a token stream."""
  meta = read_meta(os.path.dirname(shard) or ".")
  fmt = meta.get("format") if meta else None
  return fmt if fmt in (CHAT, PROMPT_COMPLETION) else None


def read_examples(shards: list[str]) -> Examples:
  """The examples of prepare-data shards (of one or more directories), in order; each shard's
  files checked against its meta.json."""
  tokens, masks, starts, offset, dropped = [], [], [], 0, {}
  metas = {}
  for shard in shards:
    directory = os.path.dirname(shard) or "."
    if directory not in metas:
      metas[directory] = read_meta(directory)
      for why, n in metas[directory].get("dropped", {}).items():
        dropped[why] = dropped.get(why, 0) + n
    meta = metas[directory]
    listed = {s["file"]: s for s in meta["shards"]}
    entry = listed.get(os.path.basename(shard))
    fix = f"prepare the data again (paro-jax prepare-data ... --out {directory})"
    if entry is None:
      raise ValueError(f"{shard} is not in {os.path.join(directory, META)}: {fix}")
    mask_path, starts_path = companions(shard)
    dtype = np.dtype(meta["dtype"])
    sizes = (
      (shard, entry["tokens"] * dtype.itemsize),
      (mask_path, entry["tokens"]),
      (starts_path, 8 * (entry["examples"] + 1)),
    )
    for path, size in sizes:
      if not os.path.isfile(path) or os.path.getsize(path) != size:
        got = os.path.getsize(path) if os.path.isfile(path) else "missing"
        raise ValueError(
          f"{path}: {got} bytes, {META} records {size} (its shard holds {entry['tokens']} tokens, "
          f"{entry['examples']} examples): {fix}"
        )
    tokens.append(read_bin(shard, dtype))
    masks.append(read_bin(mask_path, np.dtype(np.uint8)))
    local = np.fromfile(starts_path, np.int64)
    starts.append(local[:-1] + offset)
    offset += int(local[-1])
  starts.append(np.asarray([offset], np.int64))
  stream = lambda parts: parts[0] if len(parts) == 1 else TokenStream(parts)
  template = shards_chat_template(metas)
  return Examples(stream(tokens), stream(masks), np.concatenate(starts), dropped, template)


def shards_chat_template(metas: dict[str, dict]) -> str | None:
  """The chat template the shards' records were rendered with (meta.json's `chat_template`;
  None for prompt-completion data and shards prepared before it was recorded). Directories
  rendered with different templates are refused: the run would learn two formats."""
  known = {d: m["chat_template"] for d, m in metas.items() if m.get("chat_template") is not None}
  if len(set(known.values())) > 1:
    a = next(iter(known))
    b = next(d for d, t in known.items() if t != known[a])
    raise ValueError(
      f"{a} and {b} were prepared with different chat templates ({META}): prepare them again "
      f"with one --chat-template, or train on one of them"
    )
  return next(iter(known.values()), None)
