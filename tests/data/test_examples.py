"""Examples of instruction data and their batches (data/examples.py, data/example_shards.py)."""

import numpy as np
import pytest

from models.config import MAX_SEGMENTS
from paro_jax.data.example_shards import ExampleShardWriter, read_examples
from paro_jax.data.examples import ExampleBatches, from_encoded, pack_rows, select

L = 16


def encoded(n=40, seed=0):
  """(tokens, mask) of n examples of 2..24 tokens, a prompt then a completion; every 7th has no
  completion (no target)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    length = int(rng.integers(2, 25))
    tokens = rng.integers(1, 100, length).astype(np.uint32)
    mask = np.zeros(length, np.uint8)
    if i % 7:
      mask[int(rng.integers(1, length)) :] = 1
    out.append((tokens, mask))
  return out


def test_examples_without_targets_are_counted_out():
  ex = from_encoded(encoded())
  assert len(ex) == 40 - 6 and ex.dropped == {"no target": 6}
  kept = [e for i, e in enumerate(encoded()) if i % 7]
  for i, (t, m) in enumerate(kept):
    got_t, got_m = ex.read(i, len(t))
    np.testing.assert_array_equal(got_t, t)
    np.testing.assert_array_equal(got_m, m)


def test_long_examples_dropped_or_truncated():
  ex = from_encoded(encoded())
  long = int(np.sum(ex.lengths() > L + 1))
  assert long
  dropped = select(ex, L, "drop")
  assert len(dropped) == len(ex) - long
  assert dropped.dropped == {"no target": 6, f"longer than --seq-len {L} + 1 tokens": long}
  cut = select(ex, L, "truncate")
  lost = cut.dropped.get("no target within --seq-len", 0)  # targets only past the cut
  assert len(cut) == len(ex) - lost and cut.lengths.max() == L + 1
  for i, n in zip(cut.ids, cut.lengths):
    assert ex.read(int(i), int(n))[1][1:].any()
  with pytest.raises(ValueError, match="--long-examples must be one of"):
    select(ex, L, "keep")


def test_no_example_left_names_why_and_the_seq_len_that_fits_one():
  ex = from_encoded(encoded())
  shortest = int(ex.lengths().min())  # counted here from the examples themselves
  too_short = shortest - 2  # rows of shortest - 1 tokens: none fits
  selection = select(ex, too_short, "drop")
  with pytest.raises(ValueError) as e:
    ExampleBatches(ex, selection, 1, 2, too_short, seed=0)
  assert f"(of 40: 6 no target; {len(ex)} longer than --seq-len {too_short} + 1 " in str(e.value)
  assert f"use --seq-len {shortest - 1} or more (the shortest example is {shortest} tokens)" in str(
    e.value
  )
  assert len(select(ex, shortest - 1, "drop"))  # and that one does fit one


def test_packing_fills_rows_in_order():
  lengths = np.array([5, 9, 3, 17, 2, 2, 16])
  assert pack_rows(lengths, 17).tolist() == [0, 3, 4, 6, 7]  # 5+9+3, 17, 2+2, 16
  assert pack_rows(np.ones(2 * MAX_SEGMENTS + 1, int), 1000).tolist() == [
    0,
    MAX_SEGMENTS,
    2 * MAX_SEGMENTS,
    2 * MAX_SEGMENTS + 1,
  ]


@pytest.mark.parametrize("pack", [False, True])
def test_an_epoch_takes_every_example_once(pack):
  ex = from_encoded(encoded())
  sel = select(ex, L, "drop")
  batches = ExampleBatches(ex, sel, 2, 4, L, seed=3, pack=pack)
  rows = batches.rows_per_epoch()
  seen = [p for r in range(rows) for p in batches.row_examples(r)]
  assert sorted(seen) == list(range(len(sel)))
  assert seen != sorted(seen)  # shuffled
  second = [
    p for r in range(rows, rows + batches.rows_per_epoch(1)) for p in batches.row_examples(r)
  ]
  assert sorted(second) == list(range(len(sel))) and second != seen  # a new order each epoch


@pytest.mark.parametrize("pack", [False, True])
def test_batches_count_exactly_the_examples_targets(pack):
  """The weights of an epoch's rows: each example's targets (its mask past its first token),
  nothing from padding or from one example's last token to the next's first."""
  ex = from_encoded(encoded())
  sel = select(ex, L, "drop")
  batches = ExampleBatches(ex, sel, 1, 1, L, seed=0, pack=pack)
  for r in range(batches.rows_per_epoch()):
    tokens, weights, segments = batches.row(r)
    want = sum(
      int(ex.read(int(sel.ids[p]), int(sel.lengths[p]))[1][1:].sum())
      for p in batches.row_examples(r)
    )
    assert weights.sum() == want
    if pack:
      assert segments.max() == len(batches.row_examples(r))


def test_batches_depend_on_seed_and_step_only():
  ex = from_encoded(encoded())
  sel = select(ex, L, "drop")
  make = lambda: ExampleBatches(ex, sel, 2, 4, L, seed=5, pack=True)
  a, b = make(), make()
  b(0)
  for step in (7, 3, 0):  # any order: a resumed run reads step 7 first
    x, y = a(step), b(step)
    for u, v in zip(x, y):
      np.testing.assert_array_equal(u, v)
  full = a(2)
  lo, hi = a.process_rows(1, 2)
  part = a(2, rows=(lo, hi))
  for u, v in zip(full, part):
    np.testing.assert_array_equal(u[:, lo:hi], v)
  assert full.tokens.shape == (2, 4, L + 1) and full.weights.shape == (2, 4, L)


def test_eval_rows_take_each_example_once_then_padding():
  ex = from_encoded(encoded())
  sel = select(ex, L, "drop")
  batches = ExampleBatches(ex, sel, 1, 8, L, seed=0, shuffle=False)
  rows = batches.rows_per_epoch()
  assert [batches.row_examples(r) for r in range(3)] == [[0], [1], [2]]
  assert batches.row_examples(rows) == [] and batches.row(rows + 5)[1].sum() == 0


def test_prepared_shards_read_back(tmp_path):
  kept = [e for i, e in enumerate(encoded()) if i % 7]
  writer = ExampleShardWriter(str(tmp_path), np.uint16, shard_tokens=100)
  for t, m in kept:
    writer.write(t, m)
  writer.close()
  import json

  meta = {"dtype": "uint16", "format": "chat", **writer.meta()}
  with open(tmp_path / "meta.json", "w") as f:
    json.dump(meta, f)
  assert len(writer.shards) > 2 and all(
    n <= 100 or e == 1 for n, e in zip(writer.counts, map(len, writer.starts))
  )
  ex = read_examples(writer.shards)
  assert len(ex) == len(kept)
  for i, (t, m) in enumerate(kept):
    got_t, got_m = ex.read(i, len(t))
    np.testing.assert_array_equal(got_t, t)
    np.testing.assert_array_equal(got_m, m)
  with open(str(writer.shards[1])[: -len(".bin")] + ".mask", "ab") as f:
    f.write(b"\0")
  with pytest.raises(ValueError, match=r"shard-00001\.mask: .* bytes, meta.json records"):
    read_examples(writer.shards)
