"""A long record is tokenized in windows (data/tokenizers.py HFTokenizer.encode_offsets), in
memory bounded by a window, to exactly the tokens and spans the tokenizer gives the whole text
(the reference: `tokenizers` on the whole text at once)."""

import json
import os

import numpy as np
import pytest

from paro_jax.data import tokenizers as tokenizers_module
from paro_jax.data.tokenizers import WINDOW, HFTokenizer

tokenizers = pytest.importorskip("tokenizers")

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
TOKENIZER = os.path.join(FIXTURES, "chat_llama", "tokenizer.json")


def _long_text(chars, seed=0):
  """Words, numbers, runs of spaces and newlines, punctuation, accents and emoji (characters
  outside the BMP: spans count characters, not bytes)."""
  rng = np.random.default_rng(seed)
  pieces = ["the", "harbour", "Master", "42", "1999", "café", "naïve", "🌊", "—", "don't", "x"]
  pieces += ["  ", "\n", "\n\n", "\t", " , ", "...", "  \n  "]
  out, n = [], 0
  while n < chars:
    p = pieces[rng.integers(len(pieces))] + (" " if rng.random() < 0.6 else "")
    out.append(p)
    n += len(p)
  return "".join(out)[:chars]


class _Recording:
  """A tokenizer that records the length of each text it is given."""

  def __init__(self, tok):
    self._tok, self.lengths = tok, []

  def encode(self, text, **kw):
    self.lengths.append(len(text))
    return self._tok.encode(text, **kw)

  def __getattr__(self, name):
    return getattr(self._tok, name)


def _whole(tok, text):
  enc = tok._tok.encode(text, add_special_tokens=False)
  return np.asarray(enc.ids, np.uint32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)


@pytest.mark.parametrize("chars", [2 * WINDOW + 1, 5 * WINDOW + 12345])
def test_windows_give_the_tokens_of_the_whole_text(chars):
  tok = HFTokenizer(TOKENIZER)
  text = _long_text(chars)
  want_ids, want_spans = _whole(tok, text)
  tok._tok = recording = _Recording(tok._tok)
  ids, spans = tok.encode_offsets(text)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(spans, want_spans)
  assert max(recording.lengths) <= WINDOW  # never the whole text at once
  # with the post-processor's tokens (the reference: the whole text with them); a document adds
  # the end of sequence
  reference = recording._tok.encode(text)
  np.testing.assert_array_equal(tok.encode(text), reference.ids)
  before, after = tok.document_ends()
  np.testing.assert_array_equal(tok.document(text), [*before, *want_ids, *after])


def test_a_tokenizer_whose_windows_differ_takes_the_whole_text(tmp_path):
  """A Metaspace tokenizer prepends '▁' to each text it is given (Llama 2's): windows would not
  join, so the text is tokenized whole, the same tokens as ever."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
  trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"])
  tok.train_from_iterator([_long_text(5000, seed=1)], trainer)
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  hf = HFTokenizer(str(tmp_path / "tokenizer.json"))
  text = _long_text(3 * WINDOW)
  want_ids, want_spans = _whole(hf, text)
  hf._tok = recording = _Recording(hf._tok)
  ids, spans = hf.encode_offsets(text)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(spans, want_spans)
  assert recording.lengths[-1] == len(text)  # tokenized whole


def test_one_piece_longer_than_a_window():
  tok = HFTokenizer(TOKENIZER)
  for text in ("a" * (3 * WINDOW), "x " * WINDOW + "b" * (2 * WINDOW) + " y" * 10):
    want_ids, want_spans = _whole(tok, text)
    ids, spans = tok.encode_offsets(text)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(spans, want_spans)


def test_byte_spans_are_characters():
  tok = tokenizers_module.ByteTokenizer()
  text = "aé🌊b"
  ids, spans = tok.encode_offsets(text)
  want = [(i, i + 1) for i, c in enumerate(text) for _ in range(len(c.encode("utf-8")))]
  assert ids.tolist() == list(text.encode()) and spans.tolist() == [list(s) for s in want]


def test_a_long_chat_keeps_its_ids_and_mask_not_its_spans():
  """The assistant mask is taken a piece at a time (data/instruct.py): each piece is at most a
  window's tokens, and the ids and mask are those of the whole text (the reference: `tokenizers`
  on the whole rendered text, and the mask rule on its spans)."""
  from paro_jax.data.chat import token_mask

  tok = HFTokenizer(TOKENIZER)
  text = _long_text(4 * WINDOW + 77, seed=2)
  spans = [(10, WINDOW + 5), (2 * WINDOW - 3, 2 * WINDOW + 9), (3 * WINDOW, len(text))]
  want_ids, want_spans = _whole(tok, text)
  sizes = []

  def per_piece(ids, offsets):
    sizes.append(len(ids))
    return ids, token_mask(offsets, spans)

  ids, mask = tok.encode_pieces(text, per_piece)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(mask, token_mask(want_spans, spans))
  assert ids.dtype == np.uint32 and 0 < mask.sum() < len(mask)
  # pieces of at most a window's characters, a quarter of the text: never the whole text's spans
  assert len(sizes) > 2 and max(sizes) <= len(want_ids) // 3
