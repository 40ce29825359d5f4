"""Tokenizers of `--data` text: bytes (vocabulary 256, no special tokens), or an HF
`tokenizer.json` through the `tokenizers` package (a dependency); which one a run
uses (`resolve_tokenizer`: --tokenizer, else the model's HF directory's); the check that a
tokenizer's ids fit the model's vocabulary.

A document (a text file, a JSONL or Parquet record) is tokenized with the special tokens the
tokenizer's post-processor adds (Llama's beginning-of-sequence token) and ends with its
end-of-sequence token (`eos_token` of tokenizer_config.json beside tokenizer.json), so that the
documents of a token stream are told apart. Bytes have no such tokens: byte-level documents are
concatenated as they are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from paro_jax.data.bins import META, SHARD
from paro_jax.data.chat import special_tokens
from paro_jax.data.config import DataConfig

BYTE_VOCAB = 256
BYTES = "bytes"  # --tokenizer bytes: byte-level tokens, asked for by name
TOKENIZER_FILE = "tokenizer.json"  # an HF model directory's
WINDOW = 1 << 16  # characters of a long text tokenized at once (HFTokenizer.encode_offsets)
MARGIN = 1 << 10  # characters at a window's end whose tokens may depend on the text after it


class ByteTokenizer:
  vocab_size = BYTE_VOCAB
  name = BYTES

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

  def document(self, text: str) -> np.ndarray:
    """A document's tokens: its bytes (no special tokens exist in 256 bytes)."""
    return self.encode(text)

  def document_ends(self) -> tuple[list[int], list[int]]:
    return [], []

  def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes, the character span each byte belongs to: (n, 2) int32)."""
    raw = self.encode(text)
    dtype = np.int32 if len(raw) < 2**31 else np.int64
    char = np.cumsum((raw & 0xC0) != 0x80, dtype=dtype) - 1  # UTF-8's first bytes start one
    return raw, np.stack([char, char + 1], axis=1)

  def encode_pieces(self, text: str, per_piece) -> tuple[np.ndarray, ...]:
    """`per_piece(ids, spans)` of the whole text (one piece: HFTokenizer.encode_pieces)."""
    raw, spans = self.encode_offsets(text)
    return per_piece(raw.astype(np.uint32), spans)

  def token_id(self, token: str) -> int | None:
    return None  # no special tokens in 256 bytes

  def special_ids(self) -> set[int]:
    return set()

  def decode(self, ids) -> str:
    """The text of `ids` (bytes that are no UTF-8 shown as U+FFFD)."""
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
  """An HF `tokenizer.json` through the `tokenizers` package."""

  def __init__(self, path: str):
    try:
      import tokenizers  # a dependency: imported when a tokenizer is read
    except ImportError as e:
      raise ValueError(
        f"--tokenizer {path} needs the `tokenizers` package, a dependency of paro-jax that is "
        f"not installed: install paro-jax again (from a checkout: pip install -e .)"
      ) from e
    if os.path.isdir(path):  # an HF model directory: its tokenizer.json
      inside = os.path.join(path, TOKENIZER_FILE)
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
    self.path = self.name = path
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
    self._ends = None

  def encode(self, text: str) -> np.ndarray:
    """`text`'s ids with the special tokens the post-processor adds."""
    before, after = self._post_processed()
    return _joined(before, self.ids(text), after)

  def document(self, text: str) -> np.ndarray:
    """A document's tokens: `text` through the tokenizer's post-processor (which adds the
    beginning-of-sequence token where the tokenizer does), then the end-of-sequence token."""
    before, end = self.document_ends()
    return _joined(before, self.ids(text), end)

  def ids(self, text: str) -> np.ndarray:
    """`text`'s ids (uint32) without the special tokens the post-processor adds; its spans are
    not kept (4 bytes a token)."""
    return self.encode_pieces(text, lambda ids, _: (ids,))[0]

  def _post_processed(self) -> tuple[list[int], list[int]]:
    """(the ids the post-processor adds before a text, those after it)."""
    probe = self._tok.encode("x")  # one ordinary token between the added ones
    special = probe.special_tokens_mask
    text = [i for i, s in enumerate(special) if not s]
    lo, hi = (text[0], text[-1] + 1) if text else (len(special), len(special))
    return probe.ids[:lo], probe.ids[hi:]

  def document_ends(self) -> tuple[list[int], list[int]]:
    """(the ids before a document's text, those after it): what the post-processor adds on
    either side, then the end-of-sequence token unless the post-processor already ends with it.
    For a document tokenized in pieces (prepare-data's blocks of lines)."""
    if self._ends is None:
      before, after = self._post_processed()
      eos = special_tokens(os.path.dirname(self.path)).get("eos_token")
      eos_id = self._tok.token_to_id(eos) if eos else None
      if eos_id is None:
        raise ValueError(
          f"tokenizer {self.path} names no end-of-sequence token (eos_token in a "
          f"tokenizer_config.json beside it that the tokenizer knows), so its documents cannot "
          f"be told apart: use the tokenizer.json of an HF model directory, with its "
          f"tokenizer_config.json"
        )
      self._ends = (before, after if after[-1:] == [eos_id] else [*after, eos_id])
    return self._ends

  def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(the ids without the special tokens the post-processor adds, each one's character span
    in `text`, (n, 2) int32): as transformers tokenizes a rendered chat."""
    return self.encode_pieces(text, lambda ids, spans: (ids, spans))

  def encode_pieces(self, text: str, per_piece) -> tuple[np.ndarray, ...]:
    """The arrays `per_piece(ids, spans)` gives for each piece of `text`'s tokens (ids without
    the special tokens the post-processor adds, uint32; their character spans in `text`, (n, 2)
    int32), each joined over the pieces: what a caller keeps of the tokens (their ids alone, or
    with their assistant mask), in memory bounded by a window, not the whole text's spans.

    A long text is tokenized a window of `WINDOW` characters at a time (the tokenizer's own
    encoding holds a few hundred bytes per token): each window is cut at a token that starts
    half-way in, and the next window starts there; the two windows' tokens must be the same
    (ids and spans) from the cut to near the first one's end, which shows that the tokens do not
    depend on the text beyond (as a pre-tokenizer's pieces do not). Where they differ (a
    tokenizer that prepends to each text it is given, a piece longer than a window), the text is
    tokenized whole, as before: the same tokens, in more memory."""
    if len(text) <= 2 * WINDOW:
      return per_piece(*self._window(text, 0, len(text)))
    kept, pos = [], 0
    here = self._window(text, 0, WINDOW)
    while pos + WINDOW < len(text):
      k = int(np.searchsorted(here[1][:, 0], pos + WINDOW // 2))
      if not 0 < k < len(here[0]):
        return per_piece(*self._window(text, 0, len(text)))
      cut = int(here[1][k, 0])
      after = self._window(text, cut, min(len(text), cut + WINDOW))
      m = int(np.searchsorted(here[1][k:, 1], pos + WINDOW - MARGIN, side="right"))
      if m == 0 or not all(np.array_equal(a[k : k + m], b[:m]) for a, b in zip(here, after)):
        return per_piece(*self._window(text, 0, len(text)))
      kept.append(per_piece(here[0][:k].copy(), here[1][:k].copy()))  # not views of `here`
      pos, here = cut, after
    kept.append(per_piece(*here))
    columns = [list(column) for column in zip(*kept)]
    del kept, here
    return tuple(_concatenated(column) for column in columns)

  def _window(self, text: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    encoding = self._tok.encode(text[start:stop], add_special_tokens=False)
    dtype = np.int32 if len(text) < 2**31 else np.int64  # 8 bytes a token, not 16
    spans = np.asarray(encoding.offsets, dtype=dtype).reshape(-1, 2) + dtype(start)
    return np.asarray(encoding.ids, dtype=np.uint32), spans

  def token_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def special_ids(self) -> set[int]:
    """The ids of the tokenizer's added special tokens (`<|eot_id|>`, `<|im_end|>`, ...)."""
    return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

  def decode(self, ids) -> str:
    """The text of `ids` without the special tokens (a stop token, the template's markers)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def make_tokenizer(cfg: DataConfig):
  return HFTokenizer(cfg.tokenizer) if cfg.tokenizer not in (None, BYTES) else ByteTokenizer()


def resolve_tokenizer(
  data: DataConfig, hf_dir: str | None, model_vocab: int, files: list[str]
) -> DataConfig:
  """`data` with the tokenizer the run uses: --tokenizer's (a tokenizer.json, or `bytes`), else
  the tokenizer.json of the model's HF directory `hf_dir`, else bytes. Text as bytes for a model
  whose vocabulary is not the 256 bytes is refused unless asked for (`--tokenizer bytes`), and
  so are prepare-data shards made with another tokenizer than the run's
  (`check_shards_tokenizer`)."""
  if data.tokenizer is not None:
    check_shards_tokenizer(files, data.tokenizer, model_vocab)
    return data
  if hf_dir and os.path.isfile(os.path.join(hf_dir, TOKENIZER_FILE)):
    check_shards_tokenizer(files, os.path.join(hf_dir, TOKENIZER_FILE), model_vocab)
    return dataclasses.replace(data, tokenizer=os.path.join(hf_dir, TOKENIZER_FILE))
  text = not files or any(not path.endswith(".bin") for path in files)
  if text and model_vocab != BYTE_VOCAB:
    where = f"{hf_dir} has no {TOKENIZER_FILE}" if hf_dir else "no --tokenizer was given"
    raise ValueError(
      f"--data is text and the model's vocabulary is {model_vocab}, not the {BYTE_VOCAB} bytes, "
      f"and {where}: pass --tokenizer with the model's tokenizer.json, or --tokenizer "
      f"{BYTES} to train on bytes anyway"
    )
  check_shards_tokenizer(files, None, model_vocab)
  return dataclasses.replace(data, tokenizer=BYTES)


def check_shards_tokenizer(files: list[str], tokenizer: str | None, model_vocab: int) -> None:
  """prepare-data shards among `files` must have been made with the run's tokenizer (a
  tokenizer.json or `bytes`; None: none given, where byte-level shards are refused for a model
  whose vocabulary is not the bytes). Their meta.json records it (by its identity; before that,
  by its path)."""
  for directory in sorted(
    {os.path.dirname(f) or "." for f in files if SHARD.fullmatch(os.path.basename(f))}
  ):
    try:
      with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
      name = meta["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
      continue  # no complete meta.json: refused when the shards are read (bins.check_shards)
    made = meta.get("tokenizer_identity") or tokenizer_identity(name)
    if tokenizer is None:
      if made == BYTES and model_vocab != BYTE_VOCAB:
        raise ValueError(
          f"{directory} holds shards of byte-level tokens ({META}), and the model's vocabulary "
          f"is {model_vocab}, not the {BYTE_VOCAB} bytes: prepare the data again with the "
          f"model's --tokenizer, or pass --tokenizer {BYTES} to train on bytes anyway"
        )
      continue
    if made != tokenizer_identity(tokenizer):
      raise ValueError(
        f"{directory} holds shards tokenized with {name} ({META}), but this run's tokenizer is "
        f"{tokenizer}: their token ids mean other text; prepare the data again with --tokenizer "
        f"{tokenizer}, or pass --tokenizer {name}"
      )


def tokenizer_identity(tokenizer: str | None) -> str:
  """What tells two tokenizers apart: `bytes`, or the SHA-256 of the tokenizer.json (wherever
  it lies: a copied model directory is the same tokenizer)."""
  if tokenizer in (None, BYTES):
    return BYTES
  path = tokenizer
  if os.path.isdir(path):
    path = os.path.join(path, TOKENIZER_FILE)
  try:
    with open(path, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()
  except OSError:
    return os.path.abspath(path)  # gone: its path is what is known of it


def check_resumed_tokenizer(was: dict, now: dict, step: int) -> None:
  """A resumed run must tokenize as its checkpoint did (`was` and `now`: RunMeta.data, the
  checkpoint's and this run's); a checkpoint from before the tokenizer's identity was recorded
  is compared by path (None was bytes)."""
  name = lambda d: d.get("tokenizer") or BYTES
  if "tokenizer_identity" in was:
    same = was["tokenizer_identity"] == now["tokenizer_identity"]
  else:
    same = os.path.abspath(name(was)) == os.path.abspath(name(now))
  if not same:
    raise ValueError(
      f"resuming with tokenizer {name(now)}, but checkpoint step {step} was trained with "
      f"tokenizer {name(was)}: its token ids mean other text; pass --tokenizer {name(was)}, or "
      f"start a new run with another --out"
    )


def check_vocab(vocab_size: int, model_vocab: int, what: str) -> None:
  if vocab_size > model_vocab:
    raise ValueError(
      f"{what} has a vocabulary of {vocab_size}, more than the model's {model_vocab}:"
      f" use a model with vocab >= {vocab_size}, or a smaller tokenizer"
    )


def _concatenated(arrays: list[np.ndarray]) -> np.ndarray:
  """np.concatenate of `arrays`, emptying the list as it copies (a long text's pieces are not
  held twice)."""
  out = np.empty((sum(len(a) for a in arrays), *arrays[0].shape[1:]), arrays[0].dtype)
  at = 0
  while arrays:
    piece = arrays.pop(0)
    out[at : at + len(piece)] = piece
    at += len(piece)
  return out


def _joined(before, ids: np.ndarray, after) -> np.ndarray:
  """`ids` between the special tokens `before` and `after` (lists of ids), uint32."""
  return np.concatenate([np.asarray(before, np.uint32), ids, np.asarray(after, np.uint32)])
