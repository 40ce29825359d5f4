"""`paro-jax prepare-data` and training on many .bin shards: shards are read by memory map as one
stream (never joined), batches equal those of the joined tokens (so the resume position is
exact), and both preparing and reading stay within a memory budget smaller than the data."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from paro_jax.data.bins import BinFile

from paro_jax.data.config import DataConfig

from paro_jax.data.streams import Batches, load_tokens, split_eval, TokenStream
from paro_jax.data.prepare import prepare_data
from tests.fast_compile import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _text(path, size, seed):
  rng = np.random.default_rng(seed)
  data = rng.integers(32, 127, size, dtype=np.uint8)
  data[rng.integers(0, size, size // 60)] = 10  # lines
  data.tofile(path)
  return data


def test_shards_read_as_one_stream(tmp_path):
  """Byte-level shards equal the files' bytes; windows that span shards, per-process rows, the
  eval split and every step's batch equal those of the joined tokens."""
  texts = [_text(tmp_path / f"t{k}.txt", 30_000 + 777 * k, k) for k in range(3)]
  joined = np.concatenate(texts)
  meta = prepare_data(
    [str(tmp_path / "t*.txt")], str(tmp_path / "shards"), shard_tokens=7_000, progress=False
  )
  assert meta["tokens"] == joined.size and meta["dtype"] == "uint16"
  assert [s["tokens"] for s in meta["shards"]][:-1] == [7_000] * (len(meta["shards"]) - 1)
  stream = load_tokens(DataConfig(paths=(str(tmp_path / "shards" / "*.bin"),)), 256)
  assert isinstance(stream, TokenStream) and len(stream.parts) == len(meta["shards"])
  assert all(isinstance(p, BinFile) for p in stream.parts)
  np.testing.assert_array_equal(stream[np.arange(stream.size)], joined)
  train_s, eval_s = split_eval(stream, 0.05)
  train_j, eval_j = split_eval(joined, 0.05)
  np.testing.assert_array_equal(eval_s[np.arange(eval_s.size)], eval_j)
  a, b = Batches(train_s, 2, 8, 64, seed=3), Batches(train_j, 2, 8, 64, seed=3)
  for step in (0, 1, 17, 1000):
    np.testing.assert_array_equal(a(step), b(step))
    np.testing.assert_array_equal(a(step, rows=(4, 6)), b(step, rows=(4, 6)))
  # several text files (no shards) are a stream too, equal to their bytes
  direct = load_tokens(DataConfig(paths=(str(tmp_path / "t*.txt"),)), 256)
  assert isinstance(direct, TokenStream)
  np.testing.assert_array_equal(direct[np.arange(direct.size)], joined)


def test_prepare_data_jsonl_errors_and_cli(tmp_path, capsys):
  from paro_jax.cli import main

  with open(tmp_path / "d.jsonl", "w") as f:
    for i in range(50):
      f.write(json.dumps({"text": f"record {i}\n"}) + "\n")
  main(["prepare-data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "s")])
  out = capsys.readouterr().out
  assert "train with --data '" in out and "s/*.bin' --bin-dtype uint16" in out
  want = np.frombuffer("".join(f"record {i}\n" for i in range(50)).encode(), np.uint8)
  got = load_tokens(DataConfig(paths=(str(tmp_path / "s" / "*.bin"),)), 256)
  np.testing.assert_array_equal(got, want)
  # again into the same directory: refused, nothing overwritten
  with pytest.raises(SystemExit):
    main(["prepare-data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "s")])
  assert "already holds 1 shards" in capsys.readouterr().err
  (tmp_path / "bad.txt").write_bytes(b"ok line\n" * 10 + b"\xff\xfe rest\n")
  with pytest.raises(ValueError, match=r"bad.txt is not UTF-8 text \(byte 0xff at offset 80\)"):
    prepare_data([str(tmp_path / "bad.txt")], str(tmp_path / "b"), progress=False)
  assert glob.glob(str(tmp_path / "b" / "*.bin")) == []  # no partial shards left


BUDGET_MB = 120  # peak RSS allowed to preparing and to reading; the shards are 2x that

# The peak resident memory of this process since its exec (VmHWM; ru_maxrss would carry the
# forking pytest's peak over the exec).
PEAK = "int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) // 1024"

# The reader's own memory is its anonymous resident memory (RssAnon), sampled every step: pages
# of the memory-mapped shards it touched also count as resident (RssFile), but they are the page
# cache's, shared and dropped under pressure, not memory the run holds.
READER = """
import sys
import numpy as np
from paro_jax.data.config import DataConfig
from paro_jax.data.streams import Batches, load_tokens, split_eval, TokenStream
def rss(kind):
  return int(open("/proc/self/status").read().split(kind + ":")[1].split()[0]) // 1024
tokens = load_tokens(DataConfig(paths=(sys.argv[1],)), 256)
assert isinstance(tokens, TokenStream), type(tokens)
train, _ = split_eval(tokens, 0.01)
batches = Batches(train, 2, 16, 256, seed=0)
peak = rss("RssAnon")
for step in range(200):
  batches(step, rows=(4, 8))  # one process's rows of 2 processes
  peak = max(peak, rss("RssAnon"))
print(tokens.size, peak, rss("RssFile"))
"""


def test_larger_than_memory_budget(tmp_path):
  """240 MB of shards from 120 MB of generated text: prepare-data (peak RSS) and a reader of 200
  steps' batches (the vocab check over every shard included; peak anonymous RSS) each stay
  below the 120 MB budget."""
  size = BUDGET_MB * 2**20
  for k in range(2):
    _text(tmp_path / f"big{k}.txt", size // 2, k)
  prep = subprocess.run(
    [
      sys.executable,
      "-c",
      f"import sys; from paro_jax.cli import main; main(sys.argv[1:]); print({PEAK})",
      "prepare-data",
      str(tmp_path / "big*.txt"),
      "--out",
      str(tmp_path / "shards"),
      "--shard-tokens",
      str(20 * 2**20),
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert prep.returncode == 0, prep.stderr[-3000:]
  for k in range(2):
    os.remove(tmp_path / f"big{k}.txt")
  shards = sorted(glob.glob(str(tmp_path / "shards" / "*.bin")))
  on_disk = sum(os.path.getsize(p) for p in shards)
  assert len(shards) == 6 and on_disk == 2 * size > BUDGET_MB * 2**20
  assert "100%" in prep.stderr  # the progress bar
  assert int(prep.stdout.split()[-1]) < BUDGET_MB, prep.stdout
  read = subprocess.run(
    [sys.executable, "-c", READER, str(tmp_path / "shards" / "*.bin")],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert read.returncode == 0, read.stderr[-3000:]
  tokens, peak, mapped = map(int, read.stdout.split())
  assert tokens == size
  assert peak < BUDGET_MB, f"reader peaked at {peak} MB (and {mapped} MB of mapped file pages)"


def test_training_on_shards_equals_training_on_the_joined_file(tmp_path):
  """train --data 'shards/*.bin' (a TokenStream, eval split included) logs the very losses of a
  run on one .bin file holding the same tokens."""
  from paro_jax.run.config import EvalOptions, OptimizerOptions, RunConfig
  from paro_jax.run.train import train

  texts = [_text(tmp_path / f"t{k}.txt", 20_000, k) for k in range(2)]
  prepare_data([str(tmp_path / "t*.txt")], str(tmp_path / "s"), shard_tokens=3_000, progress=False)
  np.concatenate(texts).astype(np.uint16).tofile(tmp_path / "joined.bin")
  losses = []
  for name, data in (
    ("shards", str(tmp_path / "s" / "*.bin")),
    ("one", str(tmp_path / "joined.bin")),
  ):
    cfg = RunConfig(
      model="test",
      mesh=(2, 4),
      batch_size=8,
      seq_len=32,
      optimizer=OptimizerOptions(steps=3, warmup=1),
      dtype="fp32",
      data=DataConfig(paths=(data,), eval_fraction=0.1),
      eval=EvalOptions(every=3),
      out=str(tmp_path / name),
    )
    rows = [json.loads(line) for line in open(train(cfg))]
    losses.append([(r["loss"], r.get("eval_loss")) for r in rows])
  assert losses[0] == losses[1] and len(losses[0]) == 3 and losses[0][-1][1] is not None


def _wait_for(predicate, timeout, what):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return
    time.sleep(0.05)
  pytest.fail(f"{what} did not happen in {timeout} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stopped_prepare_data_publishes_nothing(tmp_path, sig):
  """SIGTERM (timeout, kill, SLURM), SIGHUP (a closed terminal) or Ctrl-C while shards are being
  written: one line saying nothing was published, exit 128 + the signal, and OUT as it was: no
  shard (complete or partial) that `train --data 'OUT/*.bin'` would take for the whole corpus."""
  with open(tmp_path / "big.jsonl", "w") as f:  # records are tokenized one by one: seconds
    f.writelines(json.dumps({"text": f"record {i} " + "x" * 50}) + "\n" for i in range(400_000))
  out = tmp_path / "shards"
  cmd = [sys.executable, "-m", "paro_jax", "prepare-data", str(tmp_path / "big.jsonl")]
  cmd += ["--out", str(out), "--shard-tokens", str(2**20)]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  def written():  # three shards, wherever prepare-data writes them (glob skips .hidden dirs)
    return sum(n.startswith("shard-") for _, _, names in os.walk(out) for n in names) >= 3

  _wait_for(lambda: written() or proc.poll() is not None, 60, "three shards written")
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + sig, err[-3000:]
  lines = [line for line in err.splitlines() if line.strip() and "prepare-data:" not in line]
  assert lines == [
    f"paro-jax: stopped by {sig.name}: nothing was published in {out} (the partial shards were "
    f"removed): run the same command again"
  ], err[-3000:]
  assert not out.exists()  # it made the directory: a stopped run leaves none


def test_shards_are_checked_against_their_meta_json(tmp_path):
  """train reads a prepare-data directory only whole: meta.json present (written last) and
  every shard the size it records; a leftover of a killed prepare-data is never read."""
  _text(tmp_path / "t.txt", 20_000, 0)
  shards = tmp_path / "s"
  prepare_data([str(tmp_path / "t.txt")], str(shards), shard_tokens=7_000, progress=False)
  glob_bin = DataConfig(paths=(str(shards / "*.bin"),))
  assert load_tokens(glob_bin, 256).size == 20_000
  with pytest.raises(ValueError, match="--bin-dtype uint32, but .*meta.json says its shards are"):
    load_tokens(DataConfig(paths=glob_bin.paths, bin_dtype="uint32"), 256)
  meta = json.loads((shards / "meta.json").read_text())
  (shards / "meta.json").unlink()  # what a prepare-data stopped before this fix left
  with pytest.raises(
    ValueError, match=r"holds prepare-data shards \(shard-00000.bin, ...\) but no"
  ):
    load_tokens(glob_bin, 256)
  (shards / "meta.json").write_text(json.dumps(meta)[:40])
  with pytest.raises(ValueError, match="is not a complete prepare-data meta.json"):
    load_tokens(glob_bin, 256)
  (shards / "meta.json").write_text(json.dumps(meta))
  os.truncate(shards / "shard-00001.bin", 1000)
  with pytest.raises(ValueError, match="shard-00001.bin is 1000 bytes, but meta.json records 7000"):
    load_tokens(glob_bin, 256)
  os.remove(shards / "shard-00001.bin")
  with pytest.raises(ValueError, match=r"lists 3 shards, .* holds 2 \(shard-00001.bin is missing"):
    load_tokens(DataConfig(paths=(str(shards / "shard-00000.bin"),)), 256)
  # A prepare-data killed with -9 leaves its .partial-PID directory: not data; the next one
  # into that directory removes it.
  dead = tmp_path / "again" / ".partial-999999999"
  dead.mkdir(parents=True)
  (dead / "shard-00000.bin").write_bytes(b"x" * 10)
  prepare_data([str(tmp_path / "t.txt")], str(tmp_path / "again"), progress=False)
  assert sorted(os.listdir(tmp_path / "again")) == ["meta.json", "shard-00000.bin"]


def test_a_shard_truncated_while_training_is_one_line_and_keeps_the_steps(tmp_path):
  """Another program truncates the shard a run reads: one line naming the file (not SIGBUS, rc
  135), the steps done saved as on a stop, and that checkpoint resumes once the file is back."""
  _text(tmp_path / "t.txt", 50_000, 0)
  shards = tmp_path / "s"
  prepare_data([str(tmp_path / "t.txt")], str(shards), progress=False)
  shard = shards / "shard-00000.bin"
  kept = shard.read_bytes()
  out = tmp_path / "run"
  train = [sys.executable, "-m", "paro_jax", "train", "--model", "test", "--mesh", "1x2"]
  train += ["--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--dtype", "fp32"]
  train += ["--data", str(shards / "*.bin"), "--eval-fraction", "0", "--out", str(out)]
  # As a user runs it (conftest's JAX_PLATFORMS would let JAX's CUDA plugin log its lines).
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["XLA_FLAGS"] = FAST_COMPILE
  proc = subprocess.Popen(
    [*train, "--steps", "100000"], cwd=REPO, env=env, stdout=subprocess.PIPE,
    stderr=subprocess.PIPE, text=True,
  )  # fmt: skip
  metrics = out / "metrics.jsonl"
  rows = lambda: len(metrics.read_text().splitlines()) if metrics.exists() else 0  # noqa: E731
  _wait_for(lambda: rows() >= 3 or proc.poll() is not None, 300, "three steps")
  os.truncate(shard, 0)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 2, err[-3000:]
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("paro-jax: error: "), err[-3000:]
  step = int(re.search(r"checkpoint step (\d+) is in", lines[0]).group(1))
  assert f"{shard} shrank from {len(kept)} to 0 bytes while the run read it" in lines[0]
  assert lines[0].endswith("and run the same command with --resume")
  assert step >= 3 and json.loads(metrics.read_text().splitlines()[-1])["step"] == step
  shard.write_bytes(kept)
  again = subprocess.run(
    [*train, "--steps", str(step + 1), "--resume"], cwd=REPO, env=env, capture_output=True,
    text=True, timeout=300,
  )  # fmt: skip
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from {out}/checkpoints/{step}" in again.stdout


def test_shards_of_another_tokenizer_are_refused(tmp_path):
  """prepare-data's meta.json records its tokenizer (by the hash of its tokenizer.json): shards
  of byte-level tokens, or of another tokenizer, into a run whose tokenizer differs are one line
  (they trained silently: byte ids are valid ids of any vocabulary)."""
  from paro_jax.data.tokenizers import BYTES, resolve_tokenizer

  llama = os.path.join(REPO, "tests", "fixtures", "hf_llama", "llama3_gqa")
  other = os.path.join(REPO, "tests", "fixtures", "hf_llama", "llama2_mha")
  (tmp_path / "t.txt").write_text("some text to tokenize, twice over. " * 50)
  prepare_data([str(tmp_path / "t.txt")], str(tmp_path / "bytes"), progress=False)
  tok = os.path.join(llama, "tokenizer.json")
  prepare_data([str(tmp_path / "t.txt")], str(tmp_path / "llama"), tokenizer=tok, progress=False)
  byte_shards = glob.glob(str(tmp_path / "bytes" / "*.bin"))
  llama_shards = glob.glob(str(tmp_path / "llama" / "*.bin"))
  data = DataConfig(paths=(str(tmp_path / "llama" / "*.bin"),))
  # the model's own tokenizer (its HF directory's), or the same file named elsewhere: taken
  assert resolve_tokenizer(data, llama, 288, llama_shards).tokenizer == tok
  # byte shards into the model of the HF directory, or with no tokenizer given
  with pytest.raises(ValueError, match=r"bytes holds shards tokenized with bytes .*but this run's"):
    resolve_tokenizer(data, llama, 288, byte_shards)
  with pytest.raises(ValueError, match=r"holds shards of byte-level tokens .* vocabulary is 288"):
    resolve_tokenizer(data, None, 288, byte_shards)
  assert resolve_tokenizer(DataConfig(tokenizer=BYTES), None, 288, byte_shards).tokenizer == BYTES
  # another HF tokenizer than the shards'
  with pytest.raises(ValueError, match=r"llama holds shards tokenized with .*llama3_gqa"):
    resolve_tokenizer(data, other, 288, llama_shards)
