"""Two `paro-jax prepare-data` processes into one --out: the lock on it (core/run_lock.py) lets
one write; the other is refused in one line, and only one says it wrote."""

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(path, n, word):
  with open(path, "w") as f:
    f.writelines(json.dumps({"text": f"{word} {i} " + "x" * 50}) + "\n" for i in range(n))


def _start(source, out):
  cmd = [sys.executable, "-m", "paro_jax", "prepare-data", str(source), "--out", str(out)]
  cmd += ["--shard-tokens", str(2**20)]
  return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(text):  # without the progress bar's
  return [
    x for x in text.replace("\r", "\n").splitlines() if x.strip() and "prepare-data:" not in x
  ]


def test_a_second_prepare_data_into_the_same_out_is_refused(tmp_path):
  """The second starts while the first writes its shards: refused in one line naming the first's
  pid; the first publishes its own shards, whole."""
  _records(tmp_path / "first.jsonl", 200_000, "first")
  _records(tmp_path / "second.jsonl", 10, "second")
  out = tmp_path / "shards"
  first = _start(tmp_path / "first.jsonl", out)
  deadline = time.monotonic() + 60
  while not any(n.startswith(".partial-") for n in (os.listdir(out) if out.exists() else [])):
    assert first.poll() is None and time.monotonic() < deadline, first.communicate()
    time.sleep(0.05)
  second = _start(tmp_path / "second.jsonl", out)
  out2, err2 = second.communicate(timeout=60)
  out1, err1 = first.communicate(timeout=120)
  assert first.returncode == 0 and "paro-jax: wrote" in out1, err1[-3000:]
  assert second.returncode == 2 and "wrote" not in out2, (out2, err2)
  assert _lines(err2) == [
    f"paro-jax: error: {out} is in use by another prepare-data (pid {first.pid} on "
    f"{os.uname().nodename}): wait for it to finish, stop it, or pass another --out"
  ], err2
  meta = json.loads((out / "meta.json").read_text())
  assert meta["sources"] == [str(tmp_path / "first.jsonl")]
  assert sorted(os.listdir(out)) == ["meta.json"] + [s["file"] for s in meta["shards"]]


@pytest.mark.parametrize("trial", range(2))
def test_two_prepare_data_started_together_one_writes(tmp_path, trial):
  """Started at once: exactly one says it wrote (rc 0); the other is refused in one line (the
  directory in use, or holding the first's shards already); the shards are the writer's."""
  sources = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
  _records(sources[0], 20_000, "a")
  _records(sources[1], 20_000 + 1, "b")
  out = tmp_path / "shards"
  procs = [_start(s, out) for s in sources]
  results = [(p.returncode, *p.communicate(timeout=120)) for p in procs]
  results = [(p.returncode, o, e) for p, (_, o, e) in zip(procs, results)]
  wrote = [k for k, (rc, o, _) in enumerate(results) if rc == 0 and "paro-jax: wrote" in o]
  assert len(wrote) == 1, results
  rc, o, e = results[1 - wrote[0]]
  assert rc == 2 and "wrote" not in o, results
  (line,) = _lines(e)
  assert "is in use by another prepare-data" in line or "already holds" in line, line
  meta = json.loads((out / "meta.json").read_text())
  assert meta["sources"] == [str(sources[wrote[0]])]
  assert sorted(os.listdir(out)) == ["meta.json"] + [s["file"] for s in meta["shards"]]
