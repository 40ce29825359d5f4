"""The prompts of `paro-jax generate` as token ids: texts (--prompt, or the lines of --prompts
FILE) tokenized as transformers tokenizes a text, with the special tokens the tokenizer's
post-processor adds (Llama's beginning of text); chats (the lines of a .jsonl --prompts FILE,
each {"messages": [...]}) rendered with the chat template and its generation prompt, then
tokenized without added special tokens, as `apply_chat_template(add_generation_prompt=True)`
and as train renders chat records (data/instruct.py)."""

from __future__ import annotations

import json
import os

import numpy as np

from paro_jax import report
from paro_jax.data.chat import ChatTemplate, load_chat_template, normalize_messages, special_tokens
from paro_jax.data.chat import read_text, text_content
from paro_jax.data.instruct import tokenizer_directory
from paro_jax.data.tokenizers import BYTE_VOCAB, BYTES, TOKENIZER_FILE, ByteTokenizer, HFTokenizer

CHAT_SUFFIX = ".jsonl"  # a --prompts file of chats; any other: one text per line


def read_prompts(texts: tuple[str, ...], path: str | None) -> list:
  """The prompts, in order: the --prompt texts, then --prompts FILE's (texts, or chats: lists
  of messages)."""
  prompts = list(texts)
  if path is None:
    return prompts
  shown = report.shown(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--prompts {shown} does not exist: pass a file of prompts")
  lines = read_text(path, "--prompts").splitlines()
  if not path.endswith(CHAT_SUFFIX):
    return prompts + [line for line in lines if line.strip()]
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(
        f"--prompts {shown} line {n} is not JSON ({e.msg}): write one chat per line, "
        f'{{"messages": [{{"role": "user", "content": "..."}}]}} (or name the file other than '
        f"*{CHAT_SUFFIX} for one text prompt per line)"
      ) from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
      raise ValueError(
        f"--prompts {shown} line {n} has no 'messages' list of objects with a 'role' and a "
        f"'content': fix that line"
      )
    prompts.append(messages)
  if len(prompts) == len(texts):
    raise ValueError(f"--prompts {shown} holds no prompt: write one per line")
  return prompts


def prompt_tokenizer(given: str | None, recorded: str | None, hf_dir: str | None, vocab: int):
  """--tokenizer's, else the run's (as its checkpoints record it), else the tokenizer.json of
  the model's HF directory; bytes only where asked for or the model's vocabulary is the bytes."""
  path = given or recorded
  if path is None and hf_dir and os.path.isfile(os.path.join(hf_dir, TOKENIZER_FILE)):
    path = os.path.join(hf_dir, TOKENIZER_FILE)
  if path is None and vocab != BYTE_VOCAB:
    raise ValueError(
      f"no tokenizer for the prompts: the model's vocabulary is {vocab}, not the {BYTE_VOCAB} "
      f"bytes, and no tokenizer.json is beside it: pass --tokenizer with the model's "
      f"tokenizer.json"
    )
  return ByteTokenizer() if path in (None, BYTES) else HFTokenizer(path)


def chat_template(given: str | None, recorded: str | None, tokenizer) -> ChatTemplate:
  """--chat-template FILE, else the run's (the text its chat records were rendered with), else
  the one beside the tokenizer (the model's HF directory's)."""
  directory = tokenizer_directory(getattr(tokenizer, "path", None))
  if given is None and recorded is not None:
    where = "the run (the template its checkpoints record)"
    return ChatTemplate(recorded, special_tokens(directory), where)
  flags = "--chat-template FILE, or --tokenizer with the tokenizer.json of a model that has one"
  return load_chat_template(given, directory, flags)


def prompt_ids(prompts: list, tokenizer, template_of) -> list[np.ndarray]:
  """Each prompt's ids (int32); `template_of()` gives the chat template, asked only for chats."""
  out, template = [], None
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      out.append(np.asarray(tokenizer.encode(prompt), np.int32))
      continue
    template = template or template_of()
    where = f"prompt {i + 1}"
    messages = [text_content(where, j, m, template.takes_parts()) for j, m in enumerate(prompt)]
    try:
      text = template.render(normalize_messages(messages), add_generation_prompt=True)
    except Exception as e:  # jinja2's TemplateError (raise_exception), a template's own bug
      raise ValueError(
        f"{where}: the chat template of {template.where} refused the chat: {e}"
      ) from None
    out.append(np.asarray(tokenizer.encode_offsets(text)[0], np.int32))
  return out
