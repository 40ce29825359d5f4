"""Parquet input (the format of datasets on the Hugging Face hub), read through pyarrow: the same
records as JSONL give the same tokens and the same batches."""

import json
import os

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (the hf extra)")
import pyarrow.parquet as pq  # noqa: E402

from paro_jax.data.config import DataConfig  # noqa: E402

from paro_jax.data.streams import load_tokens  # noqa: E402

from paro_jax.data.tokenizers import HFTokenizer  # noqa: E402
from paro_jax.data.examples import ExampleBatches, select  # noqa: E402
from paro_jax.data.instruct import CHAT, PROMPT_COMPLETION, Encoder  # noqa: E402
from paro_jax.data.sources import data_format, load_examples  # noqa: E402

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


CHILD = """
import resource, sys
import pyarrow.parquet as pq
from paro_jax.data.prepare import prepare_data

small, big, out, cap, mode = sys.argv[1:6]
prepare_data([small], out + "-warm", progress=False)  # imports, thread pools, first allocations
status = open("/proc/self/status").read().split("VmSize:")[1]
limit = int(status.split()[0]) * 1024 + int(cap)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # from here, `cap` bytes more at most
if mode == "whole":
  print("read", len(pq.read_table(big).to_pylist()))
else:
  meta = prepare_data([big], out, progress=False)
  print("prepared", meta["examples"], meta["tokens"])
"""
CAP = 16 << 20


def write_records(path, records, size, rng):
  letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)
  writer = None
  for _ in range(records // 1000):
    rows = [
      {"prompt": rng.choice(letters, size).tobytes().decode(), "completion": " done."}
      for _ in range(1000)
    ]
    table = pa.Table.from_pylist(rows)
    writer = writer or pq.ParquetWriter(path, table.schema)
    writer.write_table(table)
  writer.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmSize from /proc")
def test_prepare_data_of_a_parquet_file_larger_than_the_memory_cap(tmp_path):
  """A 64 MB Parquet file of instruction records is prepared with 16 MiB of address space to
  spare; reading the same file whole under the same cap fails (the cap is real)."""
  import subprocess
  import sys

  rng = np.random.default_rng(0)
  small, big = tmp_path / "small.parquet", tmp_path / "big.parquet"
  write_records(small, 1000, 20, rng)
  write_records(big, 16000, 4000, rng)
  assert os.path.getsize(big) > 3 * CAP
  env = {**os.environ, "MALLOC_ARENA_MAX": "2", "JAX_PLATFORMS": "cpu"}  # no arena per thread
  run = lambda mode, out: subprocess.run(
    [sys.executable, "-c", CHILD, str(small), str(big), str(tmp_path / out), str(CAP), mode],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  whole = run("whole", "whole")
  assert whole.returncode != 0 and ("MemoryError" in whole.stderr or "Resource" in whole.stderr)
  done = run("prepare", "shards")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split()[-2:] == ["16000", str(16000 * (4000 + len(" done.")))]
  with open(tmp_path / "shards" / "meta.json") as f:
    meta = json.load(f)
  assert meta["format"] == "prompt-completion" and meta["examples"] == 16000
