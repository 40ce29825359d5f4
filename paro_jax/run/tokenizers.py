"""Tokenizers of `--data` text: bytes (vocabulary 256, no special tokens), or an HF
`tokenizer.json` through the `tokenizers` package (`pip install -e ".[hf]"`); the check that a
tokenizer's ids fit the model's vocabulary."""

from __future__ import annotations

import os

import numpy as np

from paro_jax.run.config import DataConfig

BYTE_VOCAB = 256


class ByteTokenizer:
  vocab_size = BYTE_VOCAB

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

  def encode_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(the bytes, the character span each byte belongs to)."""
    spans = [(i, i + 1) for i, c in enumerate(text) for _ in range(len(c.encode("utf-8")))]
    return self.encode(text), spans

  def token_id(self, token: str) -> int | None:
    return None  # no special tokens in 256 bytes


class HFTokenizer:
  """An HF `tokenizer.json` through the `tokenizers` package."""

  def __init__(self, path: str):
    try:
      import tokenizers  # optional: only for HF tokenizer files
    except ImportError as e:
      raise ValueError(
        f'--tokenizer {path} needs the `tokenizers` package: pip install -e ".[hf]"'
      ) from e
    if os.path.isdir(path):  # an HF model directory: its tokenizer.json
      inside = os.path.join(path, "tokenizer.json")
      if not os.path.isfile(inside):
        raise FileNotFoundError(
          f"--tokenizer {path} is a directory without a tokenizer.json: pass the tokenizer.json "
          f"of an HF model (or its directory), or leave --tokenizer out for byte-level tokens"
        )
      path = inside
    if not os.path.isfile(path):
      raise FileNotFoundError(
        f"tokenizer file {path!r} does not exist: pass --tokenizer with an "
        f"HF tokenizer.json, or leave it out for byte-level tokens"
      )
    self.path = path
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a bare Exception
      why = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise ValueError(
        f"--tokenizer {path} is not a valid HF tokenizer.json ({why}): pass the tokenizer.json "
        f"of an HF model, or leave --tokenizer out for byte-level tokens"
      ) from None
    # Ids need not be contiguous (a tokenizer.json may number its tokens with gaps): the largest
    # id + 1 is what a model's embedding must hold.
    ids = self._tok.get_vocab(with_added_tokens=True).values()
    self.vocab_size = max(
      self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1
    )

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text).ids, dtype=np.uint32)

  def encode_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(the ids without the special tokens the post-processor adds, each one's character span
    in `text`): as transformers tokenizes a rendered chat."""
    encoding = self._tok.encode(text, add_special_tokens=False)
    return np.asarray(encoding.ids, dtype=np.uint32), encoding.offsets

  def token_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)


def make_tokenizer(cfg: DataConfig):
  return HFTokenizer(cfg.tokenizer) if cfg.tokenizer else ByteTokenizer()


def check_vocab(vocab_size: int, model_vocab: int, what: str) -> None:
  if vocab_size > model_vocab:
    raise ValueError(
      f"{what} has a vocabulary of {vocab_size}, more than the model's {model_vocab}:"
      f" use a model with vocab >= {vocab_size}, or a smaller tokenizer"
    )
