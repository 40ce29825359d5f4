"""Instruction fine-tuning end to end: prompt-completion and chat records, loss on the targets only.

The prompts are random bytes and every completion is the same short string: once trained, the
completion is certain and its loss near zero, while the prompts stay unpredictable. The loss the
run reports is then checked by hand: each record's targets are its completion's bytes (counted
from the string, not by the loader), scored by the model on the record alone.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paro_jax.hf.weights import load_hf
from models.llama import Llama
from models.presets import get_config
from paro_jax.cli import main
from paro_jax.data.tokenizers import ByteTokenizer, HFTokenizer
from paro_jax.data.examples import ExampleBatches, from_encoded, select
from paro_jax.data.instruct import CHAT, PROMPT_COMPLETION, Encoder

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
CHAT_MODEL = os.path.join(FIXTURES, "chat_llama")
COMPLETION = " -> done."
PROMPT_BYTES, RECORDS, SEQ = 24, 128, 40
FP32 = ["--dtype", "fp32"]


def random_records(seed=0):
  rng = np.random.default_rng(seed)
  alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?", np.uint8)
  return [
    {"prompt": rng.choice(alphabet, PROMPT_BYTES).tobytes().decode(), "completion": COMPLETION}
    for _ in range(RECORDS)
  ]


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("sft")
  data = write_jsonl(tmp / "pc.jsonl", random_records())
  out = str(tmp / "run")
  main(
    ["train", "--model", "tiny", "--strategy", "IIG", "--mesh", "2x4", "--batch-size", "16"]
    + ["--seq-len", str(SEQ), "--steps", "50", *FP32, "--data", data, "--out", out]
    + ["--eval-every", "50", "--eval-fraction", "0.125"]
  )
  rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
  return data, out, rows


def test_the_completion_is_learned(trained):
  _, _, rows = trained
  # 16 rows of one record each, its targets the completion's 9 bytes (no EOS at byte level)
  assert all(r["targets"] == 16 * len(COMPLETION.encode()) for r in rows)
  assert rows[0]["loss"] > 3.0
  assert rows[-1]["loss"] < 0.05 and rows[-1]["eval_loss"] < 0.05


def test_eval_equals_a_hand_count_over_completion_tokens(trained, capsys):
  data, out, _ = trained
  capsys.readouterr()
  main(["eval", out, "--data", data, "--seq-len", str(SEQ), "--batch-size", "8", "--json"] + FP32)
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  main(["export", out, "--out", os.path.join(out, "hf"), "--dtype", "fp32"])
  cfg, params = load_hf(os.path.join(out, "hf"))
  model = Llama(cfg, jnp.float32)
  # every record alone, prompt then completion bytes (all of one length: one batch)
  rows = [(r["prompt"] + r["completion"]).encode() for r in random_records()]
  tokens = jnp.asarray(np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), -1), jnp.int32)
  logp = jax.nn.log_softmax(model.apply(params, tokens[:, :-1]))
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  completion = nll[:, PROMPT_BYTES - 1 :]  # the predictions of the completion's bytes
  assert result["tokens"] == RECORDS * len(COMPLETION.encode()) == completion.size
  assert result["examples"] == RECORDS and result["examples_left_out"] == 0
  np.testing.assert_allclose(result["loss"], float(jnp.mean(completion)), rtol=2e-5)
  # the prompts' bytes were never targets: they stay near chance
  assert result["loss"] < 0.05


@pytest.mark.parametrize("fmt", [PROMPT_COMPLETION, CHAT])
def test_packed_and_unpacked_give_the_same_per_example_losses(fmt):
  """The same model, fp32: each example's loss packed beside others equals its loss alone."""
  if fmt == CHAT:
    rows = [
      {
        "messages": [
          {"role": "user", "content": r["prompt"]},
          {"role": "assistant", "content": "ok"},
        ]
      }
      for r in random_records()[:24]
    ]
    encoder = Encoder(CHAT, HFTokenizer(os.path.join(CHAT_MODEL, "tokenizer.json")), CHAT_MODEL)
    model_cfg, params = load_hf(CHAT_MODEL)
    seq = 96
  else:
    rows, encoder, seq = random_records()[:24], Encoder(PROMPT_COMPLETION, ByteTokenizer()), SEQ * 3
    model_cfg = get_config("tiny")
    params = Llama(model_cfg).init(jax.random.key(0))
  ex = from_encoded(encoder(f"record {i}", r) for i, r in enumerate(rows))
  sel = select(ex, seq, "drop")
  assert len(sel) == len(rows)
  model = Llama(model_cfg, jnp.float32)
  forward = {  # alone in its row (right-padded, no segments) or packed
    False: jax.jit(lambda t, s: model.apply(params, t)),
    True: jax.jit(lambda t, s: model.apply(params, t, segments_BxL=s)),
  }
  per_example = {}
  for pack in (False, True):
    batches = ExampleBatches(ex, sel, 1, 4, seq, seed=0, pack=pack, shuffle=False)
    rows_n = batches.rows_per_epoch()
    assert (rows_n < len(rows)) == pack
    losses = {}
    for r in range(rows_n):
      tokens, weights, segments = batches.row(r)
      logits = forward[pack](jnp.asarray(tokens[None, :-1]), jnp.asarray(segments[None]))
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[0]), tokens[1:, None], -1)[:, 0]
      for k, pos in enumerate(batches.row_examples(r), 1):
        here = (segments == k) & (weights == 1) if pack else weights == 1
        losses[pos] = float(jnp.sum(jnp.where(here, nll, 0.0)) / here.sum())
    per_example[pack] = losses
  assert sorted(per_example[True]) == sorted(per_example[False]) == list(range(len(rows)))
  for pos in range(len(rows)):
    np.testing.assert_allclose(per_example[True][pos], per_example[False][pos], rtol=1e-5)


def chat_records(n=64, seed=1):
  rng = np.random.default_rng(seed)
  words = "the harbour master kept a logbook every morning wind tide boats".split()
  out = []
  for _ in range(n):
    question = " ".join(rng.choice(words, int(rng.integers(3, 8))))
    out.append(
      {
        "messages": [
          {"role": "system", "content": "Reverse the words."},
          {"role": "user", "content": question},
          {"role": "assistant", "content": " ".join(reversed(question.split()))},
        ]
      }
    )
  return out


def test_lora_with_ing_on_chat_data_end_to_end(tmp_path, capsys):
  """The PEFT case: chat JSONL, LoRA adapters on an HF model, ING on 2x4, packed; the run's loss
  is over the assistant tokens only, eval scores them, export writes the merged model."""
  data = write_jsonl(tmp_path / "chat.jsonl", chat_records())
  out, tok = str(tmp_path / "run"), os.path.join(CHAT_MODEL, "tokenizer.json")
  common = ["--data", data, "--tokenizer", tok, "--seq-len", "128", "--batch-size", "8", *FP32]
  main(
    ["train", "--init-from", CHAT_MODEL, "--lora-rank", "4", "--strategy", "ING", "--mesh", "2x4"]
    + ["--pack", "--steps", "8", "--warmup", "2", "--lr", "1e-2", "--out", out, *common]
  )
  banner = capsys.readouterr().out
  assert "LoRA rank 4" in banner and "strategy ING" in banner and "packed" in banner
  rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
  assert rows[-1]["loss"] < rows[0]["loss"]
  # the targets of a step: the assistant tokens of the examples its rows hold, each with its
  # <|eot_id|>; the system and user turns are context (most of a row's tokens)
  assert all(0 < r["targets"] < 8 * 128 / 4 for r in rows), [r["targets"] for r in rows]
  scores = {}
  for source in (CHAT_MODEL, out):
    main(["eval", source, "--json", "--mesh", "2x4", *common])
    scores[source] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert scores[out]["tokens"] == scores[CHAT_MODEL]["tokens"] and scores[out]["examples"] == 64
  assert scores[out]["loss"] < scores[CHAT_MODEL]["loss"]  # the adapters learned
  main(["export", out, "--out", str(tmp_path / "hf")])
  # the directory's own template: the copied tokenizer_config.json gives it, no file is added;
  # its generation_config.json already stops at <|eot_id|>: copied as it is
  assert not os.path.exists(tmp_path / "hf" / "chat_template.jinja")
  with open(os.path.join(CHAT_MODEL, "generation_config.json"), "rb") as f:
    assert (tmp_path / "hf" / "generation_config.json").read_bytes() == f.read()
  main(["eval", str(tmp_path / "hf"), "--json", "--mesh", "2x4", *common])
  merged = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert merged["loss"] == pytest.approx(scores[out]["loss"], rel=1e-5)


@pytest.mark.parametrize("source", ["jsonl", "shards"])
def test_resume_on_instruction_data_is_exact(tmp_path, source):
  """Packed prompt-completion examples, read from JSONL or from prepare-data's shards (with their
  masks and example starts): stopped after step 2 and resumed, steps 3-4 have the losses and
  target counts of the run never stopped."""
  data = write_jsonl(tmp_path / "pc.jsonl", random_records(seed=3))
  if source == "shards":
    main(["prepare-data", data, "--out", str(tmp_path / "shards")])
    data = str(tmp_path / "shards" / "*.bin")
  flags = ["train", "--model", "test", "--strategy", "IIG", "--mesh", "2x4", "--batch-size", "8"]
  flags += ["--seq-len", str(SEQ), "--steps", "4", "--warmup", "1", *FP32, "--data", data]
  flags += ["--pack", "--micro-batches", "2", "--checkpoint-every", "2"]
  straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
  main([*flags, "--out", straight])
  shutil.copytree(straight, stopped)
  shutil.rmtree(os.path.join(stopped, "checkpoints", "4"))
  main([*flags, "--out", stopped, "--resume"])
  rows = lambda out: [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]  # noqa: E731
  want, got = rows(straight), rows(stopped)
  assert [r["step"] for r in got] == [1, 2, 3, 4]
  assert [r["targets"] for r in got] == [r["targets"] for r in want]
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=0, atol=1e-6)
