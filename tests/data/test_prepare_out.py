"""prepare-data's --out: a failed run leaves no directory it made (and a directory it found as it
was), an --out with a newline in it is shown escaped (each message stays one line), and the help
says how the shards are read."""

import json
import os

import pytest

from paro_jax.cli import main


def _jsonl(path, n=20, bad_at=None):
  rows = [{"text": f"record {i}"} for i in range(n)]
  if bad_at is not None:
    rows[bad_at] = {"body": "no text field"}
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _error(capsys, argv) -> str:
  with pytest.raises(SystemExit) as e:
    main([str(a) for a in argv])
  assert e.value.code == 2
  err = capsys.readouterr().err.replace("\r", "\n")
  lines = [x for x in err.splitlines() if x.strip() and not x.startswith("prepare-data:")]
  assert len(lines) == 1 and "Traceback" not in err, err
  return lines[0]


def test_a_failed_run_leaves_no_directory_it_made(tmp_path, capsys):
  data = _jsonl(tmp_path / "d.jsonl", bad_at=15)  # fails while writing, after --out is made
  line = _error(capsys, ["prepare-data", data, "--out", tmp_path / "a" / "b" / "c"])
  assert "d.jsonl:16: the record has no 'text' field" in line
  assert os.listdir(tmp_path) == ["d.jsonl"]  # neither c nor the parents it made
  (tmp_path / "there").mkdir()  # a directory it found: left as it was, empty (no lock file)
  _error(capsys, ["prepare-data", data, "--out", tmp_path / "there"])
  assert os.listdir(tmp_path / "there") == []
  # done: the shards and meta.json, no lock file
  main(["prepare-data", _jsonl(tmp_path / "ok.jsonl"), "--out", str(tmp_path / "there")])
  assert sorted(os.listdir(tmp_path / "there")) == ["meta.json", "shard-00000.bin"]


def test_a_newline_in_out_is_shown_escaped(tmp_path, capsys):
  out = tmp_path / "two\nlines"
  main(["prepare-data", _jsonl(tmp_path / "d.jsonl"), "--out", str(out)])
  printed = capsys.readouterr().out.replace("\r", "\n").splitlines()
  wrote = [x for x in printed if x.strip() and not x.startswith("prepare-data:")]
  tokens = sum(len(f"record {i}") for i in range(20))  # bytes: no end-of-document token
  assert wrote == [
    f"paro-jax: wrote {tokens} tokens (uint16) in 1 shards to {str(out)!r}: train with --data "
    f"{os.path.join(str(out), '*.bin')!r} --bin-dtype uint16"
  ]
  line = _error(capsys, ["prepare-data", tmp_path / "d.jsonl", "--out", out])
  assert line == (
    f"paro-jax: error: {str(out)!r} already holds 1 shards (shard-00000.bin, ...): pass another "
    f"--out, or delete them to prepare the data again"
  )


def test_the_help_says_what_prepare_data_does(capsys):
  with pytest.raises(SystemExit):
    main(["prepare-data", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "memory map" not in text and "os.pread" in text
  assert "--init-from" not in text  # a flag of train and eval, not of prepare-data
