"""`paro-jax eval` (paro_jax/run/evaluate.py) under the inputs a user gets wrong: what is scored is
said, never silently less than asked.

The run fine-tunes tests/fixtures/chat_llama (its max_position_embeddings cut to 160) on chat
records of 60 to 108 tokens at --seq-len 128: the default --seq-len 64 of an HF directory leaves
most of them out. Counts are checked against the records' own lengths (encoded here, not by the
eval), the packed score against the unpacked one.
"""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paro_jax.cli import main
from paro_jax.data.instruct import CHAT, Encoder
from paro_jax.data.tokenizers import HFTokenizer
from paro_jax.run.reporting import summary
from tests.run.test_sft import CHAT_MODEL, FP32, chat_records, write_jsonl

POSITIONS, SEQ, RECORDS = 160, 128, 16
FLAGS = ["--mesh", "2x4", "--batch-size", "8", *FP32]


def _edit_json(path, **fields):
  with open(path) as f:
    d = json.load(f)
  d.update(fields)
  with open(path, "w") as f:
    json.dump(d, f, indent=2)


def _model(tmp, name, lm_head_scale=None):
  """chat_llama with POSITIONS positions; `lm_head_scale`: its output weights times that (finite
  weights whose logits overflow)."""
  target = tmp / name
  shutil.copytree(CHAT_MODEL, target)
  _edit_json(target / "config.json", max_position_embeddings=POSITIONS)
  if lm_head_scale is not None:
    tensors = load_file(target / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * np.float32(lm_head_scale)
    assert np.isfinite(tensors["lm_head.weight"]).all()
    save_file(tensors, target / "model.safetensors")
  return str(target)


def _lengths(records):
  """Each record's tokens, as the chat template and tokenizer of chat_llama give them."""
  tok = HFTokenizer(os.path.join(CHAT_MODEL, "tokenizer.json"))
  encode = Encoder(CHAT, tok, CHAT_MODEL)
  return np.asarray([len(encode("record", r)[0]) for r in records])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("eval-inputs")
  records = chat_records(n=RECORDS)
  data = write_jsonl(tmp / "chat.jsonl", records)
  base = _model(tmp, "base")
  out = str(tmp / "run")
  main(
    ["train", "--init-from", base, "--steps", "1", "--warmup", "0", "--lr", "1e-3"]
    + ["--seq-len", str(SEQ), "--data", data, "--out", out, *FLAGS]
  )
  return tmp, base, out, data, _lengths(records)


def _eval(capsys, source, *flags):
  capsys.readouterr()
  main(["eval", source, "--json", *FLAGS, *flags])
  captured = capsys.readouterr()
  return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_eval_of_a_run_defaults_to_its_seq_len(run, capsys):
  _, _, out, data, lengths = run
  assert (lengths > 65).sum() > RECORDS // 2  # the HF default --seq-len 64 would leave them out
  assert lengths.max() <= SEQ + 1
  got, err = _eval(capsys, out, "--data", data)
  assert got["examples"] == RECORDS and got["examples_left_out"] == 0, got
  assert "windows" not in got and "left out" not in err
  assert got == _eval(capsys, out, "--data", data, "--seq-len", str(SEQ))[0]


@pytest.mark.parametrize("seq_len", [64, 90])
def test_eval_says_the_examples_it_leaves_out(run, capsys, seq_len):
  _, _, out, data, lengths = run
  longer = int((lengths > seq_len + 1).sum())
  got, err = _eval(capsys, out, "--data", data, "--seq-len", str(seq_len))
  assert got["examples"] == RECORDS - longer and got["examples_left_out"] == longer
  said = [line for line in err.splitlines() if "left out" in line]
  assert len(said) == 1, err
  assert (
    f"{longer} of {RECORDS} examples left out: {longer} longer than --seq-len {seq_len}"
    in (said[0])
  )
  assert f"--seq-len {lengths.max() - 1} to score them all" in said[0]
  # truncated instead: those left out are only those with no target left, and said so
  truncate = ("--long-examples", "truncate")
  got, err = _eval(capsys, out, "--data", data, "--seq-len", str(seq_len), *truncate)
  assert got["examples"] + got["examples_left_out"] == RECORDS
  assert got["examples"] > RECORDS - longer
  said = [line for line in err.splitlines() if "left out" in line]
  assert len(said) == (1 if got["examples_left_out"] else 0), err
  assert all("no target within --seq-len" in line and "truncate" not in line for line in said)


def test_eval_refuses_a_seq_len_past_the_models_positions(run, capsys):
  _, base, out, data, _ = run
  for source in (base, out):  # an HF directory, and a run started from it
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
      main(["eval", source, "--data", data, "--seq-len", str(POSITIONS + 1), *FLAGS])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert f"--seq-len {POSITIONS + 1} is longer than the {POSITIONS} positions" in err[0]
    assert f"pass --seq-len {POSITIONS} or less" in err[0]
  _eval(capsys, base, "--data", data, "--seq-len", str(POSITIONS))  # the limit itself is scored


def test_eval_pack_scores_the_same(run, capsys):
  _, _, out, data, _ = run
  plain, _ = _eval(capsys, out, "--data", data)
  packed, _ = _eval(capsys, out, "--data", data, "--pack")
  assert {k: packed[k] for k in ("tokens", "examples", "examples_left_out")} == {
    k: plain[k] for k in ("tokens", "examples", "examples_left_out")
  }
  assert packed["loss"] == pytest.approx(plain["loss"], rel=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eval_of_overflowing_weights_is_refused_not_nan(run, capsys, dtype):
  tmp, _, _, data, _ = run
  source = _model(tmp, f"overflow-{dtype}", lm_head_scale=3e38)
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    main(
      ["eval", source, "--json", "--data", data, "--seq-len", str(SEQ), *FLAGS, "--dtype", dtype]
    )
  captured = capsys.readouterr()
  err = captured.err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1, err
  assert ("the loss is nan" in err[0] or "the loss is inf" in err[0]) and "overflow" in err[0]
  assert "NaN" not in captured.out and "Infinity" not in captured.out


def test_a_perplexity_past_a_float_is_null_in_strict_json(run, capsys):
  tmp, _, _, data, _ = run
  source = _model(tmp, "huge-loss", lm_head_scale=1e6)
  got, err = _eval(capsys, source, "--data", data, "--seq-len", str(SEQ))
  assert got["loss"] > 710 and got["perplexity"] is None, got
  assert "perplexity exp(loss) overflows a float" in err
  capsys.readouterr()
  main(["eval", source, "--data", data, "--seq-len", str(SEQ), *FLAGS])
  assert "perplexity inf" in capsys.readouterr().out


def test_the_closing_line_names_eval_every_when_it_was_set():
  rows = [{"step": s, "loss": 1.0, "tokens_per_s": 10.0} for s in (4, 5, 6)]
  line = summary(rows, 0, "metrics.jsonl", 6, "ckpt", eval_every=10)
  assert "no eval (--eval-every)" not in line
  assert "no eval in steps 4-6 (--eval-every 10: the next at step 10)" in line
  assert "no eval (--eval-every)" in summary(rows, 0, "metrics.jsonl", 6, "ckpt")
