"""Instruction data: records of a prompt and its completion, or of a chat, as tokens with a target
mask (the loss is on the completion's, the assistant's, tokens only).

Two shapes of record, in JSONL or Parquet, told apart by the first record's fields (`--data-format
auto`) or named by the flag:
- prompt-completion, `{"prompt": ..., "completion": ...}`: the prompt tokenized as a document
  (with the beginning-of-sequence token where the tokenizer's post-processor adds one), then the
  completion without special tokens and the end-of-sequence token (tokenizer_config.json's
  `eos_token` in the tokenizer's directory). The completion's tokens and that EOS are targets.
  Byte-level tokens have no EOS: the completion's bytes are the targets.
- chat, `{"messages": [{"role": ..., "content": ...}, ...]}`: rendered with the model's chat
  template and tokenized as transformers does (data/chat.py); the assistant's tokens, their
  end-of-turn token included, are targets.
A token's mask says whether it is a target: predicting it from the tokens before it counts in the
loss (the first token of an example is never one).
"""

from __future__ import annotations

import os

import numpy as np

from paro_jax.data.chat import (
  MODEL_FLAGS,
  load_chat_template,
  normalize_messages,
  special_tokens,
  text_content,
  token_mask,
)
from paro_jax.data.config import DATA_FORMATS
from paro_jax.data.records import check_surrogates, not_text
from paro_jax.data.tokenizers import BYTES, ByteTokenizer

TEXT, PROMPT_COMPLETION, CHAT = DATA_FORMATS[1:]


def record_format(record: dict, text_field: str) -> str | None:
  """The shape of a record by its fields: chat, prompt-completion, text; None if none fits."""
  if "messages" in record:
    return CHAT
  if "prompt" in record and "completion" in record:
    return PROMPT_COMPLETION
  return TEXT if text_field in record else None


def detect_format(where: str, record: dict, text_field: str) -> str:
  found = record_format(record, text_field)
  if found is None:
    raise ValueError(
      f"{where}: the record has no {text_field!r} field (it has {sorted(record)}): pass "
      f"--text-field with the field that holds the text, or records with 'prompt' and "
      f"'completion', or 'messages' (a chat)"
    )
  return found


def tokenizer_directory(tokenizer_path: str | None) -> str | None:
  """The HF directory a --tokenizer file lives in (its tokenizer_config.json, chat template)."""
  if not tokenizer_path or tokenizer_path == BYTES:
    return None
  return tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)


def end_of_turn(template, tokenizer) -> int | None:
  """The special token `template` (a ChatTemplate) closes an assistant's turn with, as
  `tokenizer` reads it (`<|eot_id|>` of Llama 3, `<|im_end|>` of ChatML): the first token after
  the answer in a rendered two-message chat, if it is one of the tokenizer's added special
  tokens; None otherwise (no such token, or a template that renders no such chat)."""
  answer = "Paris."
  chat = [{"role": "user", "content": "The capital of France?"}]
  chat.append({"role": "assistant", "content": answer})
  try:
    text, spans = template.render_with_spans(chat)
  except Exception:  # noqa: BLE001 - a template that wants other messages: no stop is known
    return None
  turn = text[spans[-1][0] : spans[-1][1]] if spans else ""
  at = turn.rfind(answer)
  if at < 0:
    return None
  ids, _ = tokenizer.encode_offsets(turn[at + len(answer) :])
  return int(ids[0]) if len(ids) and int(ids[0]) in tokenizer.special_ids() else None


class Encoder:
  """Records of one shape to (tokens, mask): `encoder(where, record)`. `directory`: the model's
  HF directory (chat template, special tokens); `chat_template`: --chat-template FILE;
  `template`: a ChatTemplate to use where no --chat-template is given (a run's own, in eval);
  `model_flags`: the command's flags that name the model's HF directory (for the line saying
  none did)."""

  def __init__(
    self,
    data_format: str,
    tokenizer,
    directory=None,
    chat_template=None,
    template=None,
    model_flags: str = MODEL_FLAGS,
  ):
    self.format, self.tokenizer = data_format, tokenizer
    self.eos = None
    if data_format == PROMPT_COMPLETION and not isinstance(tokenizer, ByteTokenizer):
      eos = special_tokens(directory).get("eos_token")
      self.eos = tokenizer.token_id(eos) if eos else None
      if self.eos is None:
        raise ValueError(
          f"prompt-completion records end each completion with the tokenizer's end-of-sequence "
          f"token, and {directory or 'the tokenizer'} names none (eos_token in "
          f"tokenizer_config.json beside tokenizer.json): use the tokenizer of an HF model"
        )
    self.template = None
    if data_format == CHAT:  # `template` (a ChatTemplate) unless --chat-template FILE names one
      use_given = template is not None and not chat_template
      self.template = (
        template if use_given else load_chat_template(chat_template, directory, model_flags)
      )

  def __call__(self, where: str, record: dict) -> tuple[np.ndarray, np.ndarray]:
    if self.format == PROMPT_COMPLETION:
      return self._prompt_completion(where, record)
    if self.format == CHAT:
      return self._chat(where, record)
    raise ValueError(f"{where}: {self.format} records are not instruction data")

  def _prompt_completion(self, where, record):
    texts = []
    for field in ("prompt", "completion"):
      if field not in record:
        raise _missing(where, record, field, PROMPT_COMPLETION)
      if not isinstance(record[field], str):
        raise not_text(where, field, record[field], "fix or drop that record")
      check_surrogates(where, f"the {field!r} field", record[field])
      texts.append(record[field])
    prompt = self.tokenizer.encode(texts[0])
    completion = self.tokenizer.encode_pieces(texts[1], lambda ids, _: (ids,))[0]
    end = [] if self.eos is None else [self.eos]
    tokens = np.concatenate([prompt, completion, end]).astype(np.uint32)
    mask = np.zeros(tokens.size, np.uint8)
    mask[prompt.size :] = 1
    return tokens, mask

  def _chat(self, where, record):
    if "messages" not in record:
      raise _missing(where, record, "messages", CHAT)
    messages = record["messages"]
    if not isinstance(messages, list) or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
      raise ValueError(
        f"{where}: 'messages' must be a list of objects with a 'role' and a 'content': fix or "
        f"drop that record"
      )
    parts = self.template.takes_parts()
    messages = [text_content(where, i, m, parts) for i, m in enumerate(messages)]
    try:
      text, spans = self.template.render_with_spans(normalize_messages(messages))
    except Exception as e:  # jinja2's TemplateError (raise_exception), a template's own bug
      if isinstance(e, ValueError) and "prefix by prefix" in str(e):
        raise ValueError(f"{where}: {e}") from None
      raise ValueError(
        f"{where}: the chat template of {self.template.where} refused the record: {e}"
      ) from None
    check_surrogates(where, "the chat", text)  # roles, reasoning: any field a template renders
    # the assistant mask of each piece of the tokens: their spans are not held for the whole text
    return self.tokenizer.encode_pieces(
      text, lambda ids, offsets: (ids, token_mask(offsets, spans))
    )


def _missing(where: str, record: dict, field: str, fmt: str) -> ValueError:
  """A record without a field its format needs: one line, saying which format it looks like
  (--data-format chat on prompt-completion records, a chat file with another record in it)."""
  looks = record_format(record, "text")
  hint = ""
  if looks not in (None, fmt):
    hint = (
      f"; it is a {looks} record: pass records of one shape, with --data-format {looks} (or "
      f"auto) for {looks} records"
    )
  need = "'prompt' and 'completion'" if fmt == PROMPT_COMPLETION else "'messages' (a chat)"
  return ValueError(
    f"{where}: the record has no {field!r} field (it has {sorted(record)}), and {fmt} records "
    f"each need {need}{hint}: fix or drop that record"
  )
