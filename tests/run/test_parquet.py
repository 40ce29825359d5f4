"""Parquet input (the format of datasets on the Hugging Face hub), read through pyarrow: the same
records as JSONL give the same tokens and the same batches."""

import json
import os

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (the hf extra)")
import pyarrow.parquet as pq  # noqa: E402

from paro_jax.run.data import DataConfig, HFTokenizer, load_tokens  # noqa: E402
from paro_jax.run.examples import ExampleBatches, select  # noqa: E402
from paro_jax.run.instruct import CHAT, PROMPT_COMPLETION, Encoder  # noqa: E402
from paro_jax.run.sources import data_format, load_examples  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
MODEL = os.path.join(FIXTURES, "chat_llama")


def records(n=30, seed=0):
  rng = np.random.default_rng(seed)
  words = "the harbour master kept a logbook for forty one years every morning".split()
  say = lambda k: " ".join(rng.choice(words, k))
  pc = [{"prompt": say(int(rng.integers(2, 9))), "completion": say(3)} for _ in range(n)]
  chats = [
    {
      "messages": [
        {"role": "user", "content": r["prompt"]},
        {"role": "assistant", "content": r["completion"]},
      ]
    }
    for r in pc
  ]
  return pc, chats


def write_both(tmp_path, rows, name):
  jsonl = tmp_path / f"{name}.jsonl"
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
  parquet = tmp_path / f"{name}.parquet"
  pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=7)  # several row groups
  return str(jsonl), str(parquet)


@pytest.mark.parametrize("fmt", [PROMPT_COMPLETION, CHAT])
def test_parquet_records_batch_like_jsonl(tmp_path, fmt):
  pc, chats = records()
  jsonl, parquet = write_both(tmp_path, pc if fmt == PROMPT_COMPLETION else chats, fmt)
  assert data_format([jsonl], "text") == data_format([parquet], "text") == fmt
  tok = HFTokenizer(os.path.join(MODEL, "tokenizer.json"))
  batches = []
  for path in (jsonl, parquet):
    ex = load_examples([path], Encoder(fmt, tok, MODEL), 300)
    sel = select(ex, 96, "drop")
    assert len(sel) == len(pc)  # none left out
    train, held = sel.split(0.2)
    batches.append(
      (
        [ExampleBatches(ex, train, 2, 2, 96, seed=1, pack=True)(s) for s in range(4)],
        ExampleBatches(ex, held, 1, 8, 96, seed=1, shuffle=False)(0),
      )
    )
  (steps_a, eval_a), (steps_b, eval_b) = batches
  for x, y in zip([*steps_a, eval_a], [*steps_b, eval_b]):
    for u, v in zip(x, y):
      np.testing.assert_array_equal(u, v)
  assert sum(b.targets() for b in steps_a) > 0 and eval_a.targets() > 0


def test_parquet_text_is_a_token_stream_like_jsonl(tmp_path):
  rows = [{"text": f"document {i}: " + "words " * i} for i in range(20)]
  jsonl, parquet = write_both(tmp_path, rows, "text")
  a = load_tokens(DataConfig(paths=(jsonl,)), 256)
  b = load_tokens(DataConfig(paths=(parquet,)), 256)
  np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"has no 'body' column \(it has \['text'\]\): pass --text"):
    load_tokens(DataConfig(paths=(parquet,), text_field="body"), 256)


def test_not_parquet_is_one_line(tmp_path):
  bad = tmp_path / "bad.parquet"
  bad.write_text("not parquet")
  with pytest.raises(ValueError, match=r"bad.parquet is not a readable Parquet file .*\*\.parquet"):
    load_tokens(DataConfig(paths=(str(bad),)), 256)
