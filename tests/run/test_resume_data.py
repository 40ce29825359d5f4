"""Resuming compares the data by content (data/fingerprint.py): a file appended to, replaced or
added by a glob is said, with what changed; the same file reached by another path is not."""

import os
import shutil
import warnings

import pytest

from paro_jax.core.config import make_config
from paro_jax.data.config import DataConfig
from paro_jax.run.config import RunConfig
from paro_jax.data.fingerprint import EDGE, data_change, data_fingerprint
from paro_jax.run.train import train
from tests.run.tiny_run import RUN, losses

pytestmark = pytest.mark.usefixtures("compilation_cache")

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))


def fingerprint(*paths):
  return data_fingerprint(DataConfig(paths=tuple(str(p) for p in paths)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run of 4 steps on one text file, checkpointed at step 2 and 4."""
  root = tmp_path_factory.mktemp("data_run")
  (root / "corpus.txt").write_text(TEXT)
  run = {
    **RUN,
    "optimizer.steps": 4,
    "checkpoints.every": 2,
    "data.paths": (str(root / "corpus.txt"),),
  }
  train(make_config(RunConfig, {**run, "out": str(root / "run")}))
  return root, run


def resume(root, run, tmp_path, **change):
  """Resume a copy of the trained run from its step-2 checkpoint; the warnings it gave."""
  out = tmp_path / "run"
  shutil.copytree(root / "run", out)
  shutil.rmtree(out / "checkpoints" / "4")
  cfg = {**run, "out": str(out), "checkpoints.resume": True, **change}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    train(make_config(RunConfig, cfg))
  assert losses(out)[0] == [1, 2, 3, 4]
  return [str(w.message) for w in caught if "resuming" in str(w.message)]


def test_an_appended_file_is_said(trained, tmp_path):
  root, run = trained
  data = tmp_path / "corpus.txt"
  data.write_text(TEXT + "one more line\n")
  said = resume(root, run, tmp_path, **{"data.paths": (str(data),)})
  before, after = len(TEXT.encode()), len(TEXT.encode()) + 14
  assert len(said) == 1, said
  assert f"corpus.txt grew from {before} to {after} bytes" in said[0]
  assert "the batches after step 2 differ from an uninterrupted run's" in said[0]


def test_the_same_file_by_another_path_is_not_said(trained, tmp_path, monkeypatch):
  """The checkpoint's run named the file by its absolute path; this one by a relative path from
  its directory (the old check compared the strings and warned)."""
  root, run = trained
  monkeypatch.chdir(root)
  assert resume(root, run, tmp_path, **{"data.paths": ("corpus.txt",)}) == []


def test_changes_in_words(tmp_path):
  a, b, c = (tmp_path / n for n in ("a.txt", "b.txt", "c.txt"))
  a.write_text("x" * (3 * EDGE))
  b.write_text("y" * 100)
  was = fingerprint(a, b)
  assert data_change(was, fingerprint(a, b)) is None
  # a glob that now matches one more file
  c.write_text("z" * 10)
  said = data_change(was, fingerprint(tmp_path / "*.txt"))
  assert said == f"--data now reads 3 files, the checkpoint's run read 2 files (new: {c})"
  # a file replaced by one of the same size: its head (or tail) differs
  b.write_text("w" * 100)
  assert data_change(was, fingerprint(a, b)) == f"{b} holds other content (same size, 100 bytes)"
  a.write_text("x" * (3 * EDGE - 1) + "!")  # only the last byte: the tail's hash sees it
  assert str(a) in data_change(was, fingerprint(a, b))
  # shrunk; a file gone
  b.write_text("y" * 50)
  assert f"{b} shrank from 100 to 50 bytes" in data_change(was, fingerprint(a, b))
  assert data_change(was, fingerprint(a)).startswith("--data now reads 1 file, ")
  # the built-in corpus against files
  corpus = data_fingerprint(DataConfig())
  assert data_change(corpus, data_fingerprint(DataConfig())) is None
  assert "built-in corpus" in data_change(corpus, was)
  os.remove(c)
