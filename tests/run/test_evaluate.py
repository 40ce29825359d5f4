"""`paro-jax eval` (paro_jax/run/evaluate.py): transformers' mean loss on the fixtures' windows,
whatever the batch and mesh.

tests/fixtures/hf_llama holds six tiny Llamas saved by transformers, one per configuration users
bring, with transformers' fp32 loss of each window of SEQ_LEN + 1 tokens of text.txt (consecutive,
non-overlapping from token 0, a partial window dropped): `paro-jax eval DIR --dtype fp32` must
give their mean within 1e-4 relative, at any batch size (the last batch padded, its empty rows not
counted) and on any mesh and strategy.
"""

import json
import os

import pytest

from paro_jax.cli import main

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
HF = os.path.join(FIXTURES, "hf_llama")
with open(os.path.join(HF, "losses.json")) as _f:
  REF = json.load(_f)
VARIANTS = sorted(k for k in os.listdir(HF) if os.path.isdir(os.path.join(HF, k)))


def evaluate(capsys, source, *flags):
  capsys.readouterr()
  main(["eval", source, "--json", *flags])
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mesh,strategy,batch", [("2x4", "IIG", "8"), ("1x8", "GGG", "16")])
def test_eval_equals_transformers(capsys, variant, mesh, strategy, batch):
  directory = os.path.join(HF, variant)
  ref = REF[variant]
  got = evaluate(
    capsys,
    directory,
    *(
      "--data",
      os.path.join(HF, "text.txt"),
      "--tokenizer",
      os.path.join(directory, "tokenizer.json"),
    ),
    *("--seq-len", str(ref["seq_len"]), "--dtype", "fp32", "--mesh", mesh),
    *("--strategy", strategy, "--batch-size", batch),
  )
  windows = len(ref["window_losses"])
  assert got["windows"] == windows and got["tokens"] == windows * ref["seq_len"]
  assert windows % int(batch)  # the last batch is padded
  assert got["loss"] == pytest.approx(ref["mean_loss"], rel=1e-4)
  assert got["perplexity"] == pytest.approx(2.718281828459045 ** ref["mean_loss"], rel=1e-4)


def test_eval_refuses_what_it_cannot_score(tmp_path, capsys):
  with pytest.raises(SystemExit):
    main(["eval", str(tmp_path), "--data", os.path.join(HF, "text.txt")])
  assert "is neither a run directory" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    main(
      ["eval", os.path.join(HF, "llama3_gqa"), "--data", os.path.join(HF, "text.txt")]
      + ["--seq-len", "4096"]
    )
  assert "fewer than one window of --seq-len 4096 + 1" in capsys.readouterr().err
