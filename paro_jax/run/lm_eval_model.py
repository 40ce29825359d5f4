"""lm-eval-harness's model interface (`lm_eval.api.model.TemplateLM`) over a paro-jax model at
its strategy's P placement: what `paro-jax eval --tasks` hands `lm_eval.simple_evaluate`
(run/benchmarks.py).

Every request is read as lm-eval's own HF backend (`lm_eval/models/huggingface.py`) reads it,
so that a task scores the same here and there:
- text is encoded with the tokenizer's special tokens (none where it starts with the
  beginning-of-sequence text), a (context, continuation) pair together and split at the
  context's length (`TemplateLM._encode_pair`); an empty context is the bos token (else eos);
- loglikelihood: context + continuation, left-truncated to max_length + 1 tokens, one row each,
  right-padded; the continuation's summed log-probabilities and whether each of its tokens is
  the argmax (core/forward.py `row_scores`);
- loglikelihood_rolling: lm-eval's disjoint windows of max_length tokens, scored as above;
- generate_until: the context left-truncated to max_length - max_gen_toks, decoded with the KV
  cache (core/decode.py) until a stop token or max_gen_toks, its text cut at the first `until`
  string (the eos text among them, as lm-eval adds it).
"""

from __future__ import annotations

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
  handle_stop_sequences,
  normalize_gen_kwargs,
  postprocess_generated_text,
)

from paro_jax.core.batch import Batch
from paro_jax.core.decode import Decoder, Sampling, generate_ids
from paro_jax.data.chat import special_tokens
from paro_jax.data.instruct import tokenizer_directory

MAX_GEN_TOKS = 256  # lm-eval's HF backend's default where a task names none
MIN_WIDTH = 16  # the narrowest padded row: rows are padded to powers of two (few compiles)
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")


class ParoLM(TemplateLM):
  """A paro-jax model (an engine and its weights at the P placement) as lm-eval's model."""

  def __init__(self, engine, params, tokenizer, max_length: int, batch_size: int, stops: set[int]):
    super().__init__()
    self.engine, self.params, self.tokenizer = engine, params, tokenizer
    self.max_length, self.batch_size, self.stops = max_length, batch_size, stops
    named = special_tokens(tokenizer_directory(tokenizer.path))
    self.bos_text = named.get("bos_token")
    self.bos_id = tokenizer.token_id(self.bos_text) if self.bos_text else None
    self.eos_text = named.get("eos_token")
    self.eos_id = tokenizer.token_id(self.eos_text) if self.eos_text else None
    if self.eos_id is None:
      raise ValueError(
        f"tokenizer {tokenizer.path} names no end-of-sequence token (eos_token in the "
        f"tokenizer_config.json beside it), which lm-eval's tasks need: pass --tokenizer with an "
        f"HF model's tokenizer.json and its tokenizer_config.json"
      )
    self._decoders = {}

  @property
  def eot_token_id(self) -> int:
    return self.eos_id

  @property
  def prefix_token_id(self) -> int:
    return self.bos_id if self.bos_id is not None else self.eos_id

  @property
  def tokenizer_name(self) -> str:
    return self.tokenizer.path

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    if add_special_tokens is None:  # a text that starts with bos gets no second one
      add_special_tokens = not (self.bos_text and string.startswith(self.bos_text))
    ids = self.tokenizer.encode(string) if add_special_tokens else self.tokenizer.ids(string)
    return [int(i) for i in ids]

  def _loglikelihood_tokens(self, requests, **_progress):  # lm-eval's disable_tqdm: no bars
    """(summed log-probability, greedy) of each (key, context ids, continuation ids)."""
    rows = []
    for _, context, continuation in requests:
      if not context or not continuation or len(continuation) > self.max_length:
        raise ValueError(
          f"an lm-eval request has {len(context)} context and {len(continuation)} continuation "
          f"tokens: it needs both, the continuation at most the --seq-len {self.max_length}"
        )
      rows.append(((context + continuation)[-(self.max_length + 1) :], len(continuation)))
    # Longest first, so that a batch's rows are padded to about their own length.
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    out = [None] * len(rows)
    for lo in range(0, len(order), self.batch_size):
      chunk = order[lo : lo + self.batch_size]
      scores = self._score_rows([rows[i] for i in chunk])
      for i, score in zip(chunk, scores):
        out[i] = score
    for (key, _, _), answer in zip(requests, out):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, answer)
    return out

  def _score_rows(self, rows) -> list[tuple[float, bool]]:
    """One batch of (tokens, continuation length) rows, right-padded to a power of two."""
    longest = max(len(tokens) for tokens, _ in rows) - 1
    width = min(max(MIN_WIDTH, 1 << (longest - 1).bit_length()), self.max_length)
    tokens = np.zeros((1, self.batch_size, width + 1), np.int32)
    weights = np.zeros((1, self.batch_size, width), np.int32)
    for b, (row, continued) in enumerate(rows):
      tokens[0, b, : len(row)] = row
      weights[0, b, len(row) - 1 - continued : len(row) - 1] = 1
    placed = self.engine.shard_batch(Batch(tokens, weights), any_micro_batches=True)
    logp, greedy = self.engine.forward.row_scores(self.params, placed)
    logp, greedy = np.asarray(logp)[0], np.asarray(greedy)[0]
    return [(float(logp[b]), bool(greedy[b])) for b in range(len(rows))]

  def loglikelihood_rolling(self, requests, **_progress) -> list[float]:
    windows, counts = [], []
    for (text,) in (request.args for request in requests):
      rolling = lm_utils.get_rolling_token_windows(
        token_list=self.tok_encode(text),
        prefix_token=self.prefix_token_id,
        max_seq_len=self.max_length,
        context_len=1,
      )
      mine = [(None, *lm_utils.make_disjoint_window(w)) for w in rolling]
      windows.extend(mine)
      counts.append(len(mine))
    scores = self._loglikelihood_tokens(windows)
    out, at = [], 0
    for request, count in zip(requests, counts):
      total = sum(logp for logp, _ in scores[at : at + count])
      at += count
      out.append(total)
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return out

  def generate_until(self, requests, **_progress) -> list[str]:
    out = [None] * len(requests)
    groups = {}  # the requests of each set of generation arguments, in order
    for i, (_, gen_kwargs) in enumerate(request.args for request in requests):
      groups.setdefault(repr(sorted(gen_kwargs.items())), []).append(i)
    for indices in groups.values():
      gen_kwargs = requests[indices[0]].args[1]
      kwargs = normalize_gen_kwargs(dict(gen_kwargs), MAX_GEN_TOKS)
      until = handle_stop_sequences(kwargs.pop("until", None), eos=self.eos_text)
      max_gen = kwargs.pop("max_gen_toks")
      decoder = self._decoder(kwargs)
      room = self.max_length - max_gen
      if room < 1:
        raise ValueError(
          f"a task asks for {max_gen} new tokens (max_gen_toks), not fewer than the --seq-len "
          f"{self.max_length} that holds the context too: pass a larger --seq-len"
        )
      for lo in range(0, len(indices), self.batch_size):
        chunk = indices[lo : lo + self.batch_size]
        ids = [np.asarray(self.tok_encode(requests[i].args[0])[-room:], np.int32) for i in chunk]
        new = generate_ids(decoder, self.params, ids, max_gen, self.stops)
        for i, row in zip(chunk, new):
          text = postprocess_generated_text(self.tokenizer.decode(row), until, None)
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out

  def _decoder(self, kwargs: dict) -> Decoder:
    """The decoder of a task's sampling arguments (greedy unless do_sample)."""
    unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
    if unknown:
      raise ValueError(
        f"a task's generation_kwargs has {', '.join(unknown)}, which paro-jax's decoding does "
        f"not take (it takes until, max_gen_toks, {', '.join(SAMPLING_KEYS)}): drop them from "
        f"the task's YAML"
      )
    sampling = Sampling()
    if kwargs.get("do_sample"):
      sampling = Sampling(
        float(kwargs.get("temperature") or 1.0),
        int(kwargs.get("top_k") or 0),
        float(kwargs.get("top_p") or 1.0),
      )
    if sampling not in self._decoders:
      self._decoders[sampling] = Decoder(self.engine, sampling)
    return self._decoders[sampling]
