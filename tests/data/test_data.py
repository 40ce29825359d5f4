"""Data sources, tokenizers, per-process rows, the eval split and eval loss, and run plots."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import Llama
from models.loss import next_token_loss
from models.presets import get_config
from paro_jax.data.bins import BinFile
from paro_jax.data.config import DataConfig
from paro_jax.run.config import EvalOptions, OptimizerOptions, RunConfig
from paro_jax.data.streams import Batches, load_tokens, split_eval
from paro_jax.core.state import OptimConfig
from paro_jax.core.engine import Engine
from paro_jax.core.mesh import make_mesh
from paro_jax.analysis.gpu.hardware import mfu, peak_flops
from paro_jax.core.strategy import parse_strategy
from paro_jax.run.train import train

TEXT = "def add(a, b):\n  return a + b\n" * 40


pytestmark = pytest.mark.usefixtures("compilation_cache")


def test_text_glob_jsonl_and_bin_sources(tmp_path):
  (tmp_path / "a.txt").write_text(TEXT[:100])
  (tmp_path / "b.txt").write_text(TEXT[100:300])
  got = load_tokens(DataConfig(paths=(str(tmp_path / "*.txt"),)), 256)
  np.testing.assert_array_equal(got, np.frombuffer(TEXT[:300].encode(), np.uint8))

  records = [{"text": "hello", "id": 1}, {"text": " world", "id": 2}]
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
  got = load_tokens(DataConfig(paths=(str(tmp_path / "d.jsonl"),)), 256)
  assert bytes(got.astype(np.uint8)) == b"hello world"
  with pytest.raises(ValueError, match="has no 'body' field .* pass --text-field"):
    load_tokens(DataConfig(paths=(str(tmp_path / "d.jsonl"),), text_field="body"), 256)

  ids = np.arange(1000, dtype=np.uint16) % 300
  ids.tofile(tmp_path / "t.bin")
  got = load_tokens(DataConfig(paths=(str(tmp_path / "t.bin"),)), 512)
  assert isinstance(got, BinFile) and got.dtype == np.uint16
  np.testing.assert_array_equal(got, ids)
  # Read as uint32 the same bytes are other ids: outside a 512 vocabulary, a clear error.
  with pytest.raises(ValueError, match="outside the model's vocabulary of 512 .*uint32"):
    load_tokens(DataConfig(paths=(str(tmp_path / "t.bin"),), bin_dtype="uint32"), 512)
  # With no flag, a vocabulary over 65536 means uint32.
  np.arange(10, dtype=np.uint32).tofile(tmp_path / "u.bin")
  assert load_tokens(DataConfig(paths=(str(tmp_path / "u.bin"),)), 100_000).dtype == np.uint32


@pytest.mark.parametrize(
  "make,message",
  [
    (lambda d: (d / "missing.txt", None), "does not exist"),
    (lambda d: (d / "nothing-*.txt", None), "matches no file"),
    (lambda d: (d / "empty.txt", ""), "is empty"),
  ],
)
def test_missing_or_empty_data_is_a_clear_error(tmp_path, make, message):
  path, content = make(tmp_path)
  if content is not None:
    path.write_text(content)
  with pytest.raises((FileNotFoundError, ValueError), match=message):
    load_tokens(DataConfig(paths=(str(path),)), 256)


def test_hf_tokenizer(tmp_path):
  tokenizers = pytest.importorskip(
    "tokenizers", reason="tokenizers (a core dependency) is not installed"
  )
  from tokenizers import models, pre_tokenizers, trainers

  def make(vocab_size):
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator([TEXT, "the quick brown fox jumps over the lazy dog"] * 5, trainer)
    path = str(tmp_path / f"tokenizer-{vocab_size}.json")
    tok.save(path)
    return path, tok

  path, tok = make(60)
  (tmp_path / "c.txt").write_text(TEXT)
  data = DataConfig(paths=(str(tmp_path / "c.txt"),), tokenizer=path)
  # Without an end-of-sequence token the documents could not be told apart: refused.
  with pytest.raises(ValueError, match="names no end-of-sequence token.*tokenizer_config.json"):
    load_tokens(data, 64)
  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
  got = load_tokens(data, 64)
  # The file is one document: its tokens, then the end-of-sequence token (this tokenizer's
  # post-processor adds nothing).
  np.testing.assert_array_equal(got, tok.encode(TEXT).ids + [tok.token_to_id("</s>")])
  with pytest.raises(ValueError, match=r"vocabulary of \d+, more than the model's 32"):
    load_tokens(DataConfig(paths=(str(tmp_path / "c.txt"),), tokenizer=path), 32)


def test_names_with_glob_characters_and_tokenizer_directories(tmp_path):
  """A file named like a glob (`data[1].txt`, common in generated names) is that file; an HF
  model directory given as --tokenizer is read through its tokenizer.json."""
  pytest.importorskip("tokenizers", reason="the HF tokenizer path needs `tokenizers`")
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  (tmp_path / "data[1].txt").write_text(TEXT)
  got = load_tokens(DataConfig(paths=(str(tmp_path / "data[1].txt"),)), 256)
  np.testing.assert_array_equal(got, np.frombuffer(TEXT.encode(), np.uint8))
  (tmp_path / "data1.txt").write_text("other")  # what the pattern would match: not taken
  got = load_tokens(DataConfig(paths=(str(tmp_path / "data[1].txt"),)), 256)
  assert got.size == len(TEXT.encode())
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"])
  tok.train_from_iterator([TEXT] * 3, trainer)
  (tmp_path / "hf").mkdir()
  tok.save(str(tmp_path / "hf" / "tokenizer.json"))
  (tmp_path / "hf" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
  data = (str(tmp_path / "data[1].txt"),)
  got = load_tokens(DataConfig(paths=data, tokenizer=str(tmp_path / "hf")), 64)
  np.testing.assert_array_equal(got, tok.encode(TEXT).ids + [tok.token_to_id("</s>")])


def test_byte_tokens_need_a_256_vocabulary():
  with pytest.raises(
    ValueError, match="byte-level tokenizer has a vocabulary of 256, more than the model's 64"
  ):
    load_tokens(DataConfig(), 64)


def test_process_rows_tile_the_global_batch():
  batches = Batches(np.arange(5000) % 256, 2, 8, 16, seed=3)
  full = batches(7)
  assert full.shape == (2, 8, 17)
  parts = [batches(7, batches.process_rows(p, 4)) for p in range(4)]
  np.testing.assert_array_equal(np.concatenate(parts, axis=1), full)
  with pytest.raises(ValueError, match="not divisible by the 3 processes"):
    batches.process_rows(0, 3)


def test_eval_split_is_the_tail():
  train_tokens, eval_tokens = split_eval(np.arange(1000), 0.01)
  np.testing.assert_array_equal(eval_tokens, np.arange(990, 1000))
  assert train_tokens.size == 990


@pytest.mark.parametrize("strategy,mesh_shape", [("IIG", (2, 4)), ("GGG", (1, 8))])
def test_eval_loss_equals_a_dense_forward(strategy, mesh_shape):
  cfg = get_config("test")
  params = Llama(cfg).init(jax.random.key(0))
  tokens = Batches(np.arange(4000) * 7 % 256, 2, 8, 16, seed=0)(0)
  want = np.mean([next_token_loss(Llama(cfg).apply(params, t[:, :-1]), t[:, 1:]) for t in tokens])
  engine = Engine(
    Llama(cfg, jnp.float32),
    parse_strategy(strategy),
    make_mesh(*mesh_shape),
    OptimConfig(),
    micro_batches=2,
  )
  state = engine.state_from_params(params)
  got = engine.eval_loss(state, engine.shard_batch(tokens))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  placed = engine.shard_local_batch(tokens, tokens.shape)  # one process: all rows are local
  np.testing.assert_array_equal(np.asarray(placed), tokens)


def test_peak_table():
  assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
  assert peak_flops("cpu") is None and mfu(1e12, 1.0, 8, "cpu") is None
  assert mfu(989e12 * 8 / 2, 1.0, 8, "NVIDIA H200") == pytest.approx(0.5)


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory):
  """A run on a JSONL file with eval every 2 steps."""
  root = tmp_path_factory.mktemp("jsonl")
  with open(root / "corpus.jsonl", "w") as f:
    for i in range(200):
      f.write(json.dumps({"content": f"{i}: " + TEXT[i % 50 : i % 50 + 60]}) + "\n")
  out = root / "run"
  train(
    RunConfig(
      model="test",
      strategy="IIG",
      mesh=(2, 4),
      micro_batches=2,
      batch_size=8,
      seq_len=16,
      optimizer=OptimizerOptions(steps=4),
      data=DataConfig(paths=(str(root / "corpus.jsonl"),), text_field="content", eval_fraction=0.1),
      eval=EvalOptions(every=2),
      out=str(out),
    )
  )
  return out


def test_training_on_jsonl_logs_eval_loss(jsonl_run):
  rows = [json.loads(line) for line in open(jsonl_run / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert ["eval_loss" in r for r in rows] == [False, True, False, True]
  assert all(np.isfinite(r["eval_loss"]) for r in rows if "eval_loss" in r)


def test_plot_writes_a_png(jsonl_run, tmp_path):
  pytest.importorskip("matplotlib", reason="paro-jax plot needs matplotlib (the plots extra)")
  from paro_jax.cli import main

  other = tmp_path / "other"
  other.mkdir()
  rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0 + s} for s in range(1, 5)]
  (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  png = tmp_path / "curves.png"
  main(["plot", str(jsonl_run), str(other), "--out", str(png)])
  data = png.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
  with pytest.raises(SystemExit):
    main(["plot", str(tmp_path / "nope"), "--out", str(png)])


def test_plot_marks_non_finite_steps_and_writes_the_file_named(tmp_path, monkeypatch, capsys):
  """null (and an older run's NaN) losses are marked, not dropped; a truncated last line is
  ignored with a warning naming the file (run/metrics.py read_rows); --out without a suffix is
  written as named."""
  pytest.importorskip("matplotlib", reason="paro-jax plot needs matplotlib (the plots extra)")
  import matplotlib.axes

  from paro_jax.cli import main

  run = tmp_path / "run"
  run.mkdir()
  lines = [
    '{"step": 1, "loss": 5.0, "tokens_per_s": 10.0}',
    '{"step": 2, "loss": null, "tokens_per_s": 10.0, "skipped": true}',
    '{"step": 3, "loss": NaN, "tokens_per_s": 10.0}',
    '{"step": 4, "loss": 4.0, "tokens_per_s": 10.0}',
    '{"step": 5, "lo',
  ]
  (run / "metrics.jsonl").write_text("\n".join(lines))
  labels, real_plot = [], matplotlib.axes.Axes.plot

  def plot(self, *args, **kwargs):
    labels.append((kwargs.get("label"), list(args[0])))
    return real_plot(self, *args, **kwargs)

  monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
  out = tmp_path / "curves"
  main(["plot", str(run), "--out", str(out)])  # the CLI's warning: one line, the file named
  err = capsys.readouterr().err.splitlines()
  assert err == [f"paro-jax: warning: {run / 'metrics.jsonl'}:5: ignoring a truncated last line"]
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert ("run: 2 non-finite steps", [2, 3]) in labels
  (run / "metrics.jsonl").write_text("\n".join(lines[:2] + ["{oops", *lines[3:4]]) + "\n")
  with pytest.raises(SystemExit):
    main(["plot", str(run), "--out", str(out)])
