"""Chat templates, rendered as transformers renders them, and the assistant's spans in the text.

A model's chat template is the jinja2 template of its HF directory: `chat_template.jinja`, else
the `chat_template` of tokenizer_config.json (a string, or a list of named templates of which
"default" is taken), as transformers loads them; `--chat-template FILE` names another. It is
rendered in the environment transformers builds (utils/chat_template_utils.py,
`_compile_jinja_template`): jinja2's immutable sandbox with trim_blocks and lstrip_blocks, the loop
controls, `raise_exception`, `strftime_now`, its `tojson`, `dict` and `namespace`, the tokenizer's
special tokens (bos_token, eos_token, ...) as variables; then tokenized without adding special
tokens (`apply_chat_template(tokenize=True)`).

Which characters are the assistant's (the loss is on their tokens):
- a template with `{% generation %}` blocks: the text each block renders, as transformers'
  `return_assistant_tokens_mask` finds it;
- any other: what the template writes for an assistant message after the generation prompt,
  its end-of-turn token included, found by rendering prefixes of the conversation: for assistant
  message i, render(messages[:i], add_generation_prompt=True) and render(messages[:i+1]) must
  each be the start of render(messages); the span is the text between their ends. This needs a
  template that renders a conversation prefix by prefix (Llama 3's, ChatML's do); one that
  rewrites earlier turns (e.g. drops their reasoning) is refused naming the message, with the fix
  (a template with `{% generation %}` blocks).
A token is the assistant's when its characters overlap a span (transformers' rule).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import os
import re

import numpy as np

from paro_jax import report

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' name for it in an HF directory
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = (  # transformers' SPECIAL_TOKENS_ATTRIBUTES: variables of every template
  "bos_token",
  "eos_token",
  "unk_token",
  "sep_token",
  "pad_token",
  "cls_token",
  "mask_token",
)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def tokenizer_config(directory: str) -> dict:
  """tokenizer_config.json of an HF directory ({} if it has none)."""
  path = os.path.join(directory, TOKENIZER_CONFIG)
  if not os.path.isfile(path):
    return {}
  try:
    return json.loads(read_text(path, "the tokenizer config"))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno})") from None


def special_tokens(directory: str | None) -> dict[str, str]:
  """The named special tokens of an HF directory's tokenizer_config.json, as strings."""
  config = tokenizer_config(directory) if directory else {}
  out = {}
  for name in SPECIAL_TOKENS:
    value = config.get(name)
    if isinstance(value, dict):  # an AddedToken written out
      value = value.get("content")
    if isinstance(value, str):
      out[name] = value
  return out


def find_template(directory: str) -> str | None:
  """The chat template of an HF directory, as transformers loads it; None if it has none."""
  path = os.path.join(directory, CHAT_TEMPLATE_FILE)
  if os.path.isfile(path):
    return read_text(path, "the chat template")
  template = tokenizer_config(directory).get("chat_template")
  if isinstance(template, list):  # named templates
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if "default" not in named:
      raise ValueError(
        f"{os.path.join(directory, TOKENIZER_CONFIG)} has chat templates {sorted(named)} and no "
        f"'default': pass --chat-template FILE with the one to use"
      )
    template = named["default"]
  return template if isinstance(template, str) else None


def _environment():
  """transformers' jinja environment for chat templates (chat_template_utils.py)."""
  try:  # a dependency: imported when a template is read (not at the CLI's start)
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
  except ImportError:
    raise ValueError(
      "chat templates need jinja2, a dependency of paro-jax that is not installed: install "
      "paro-jax again (from a checkout: pip install -e .)"
    ) from None

  class AssistantTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records where each block's text lands."""

    tags = {"generation"}

    def __init__(self, environment):
      super().__init__(environment)
      environment.extend(activate_tracker=self.activate_tracker)
      self._tracking = contextvars.ContextVar("assistant_tracker", default=None)

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      call = self.call_method("_generation_support")
      return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, _context, caller):
      rv = caller()
      if (tracking := self._tracking.get()) is not None:
        blocks, spans = tracking
        start = len("".join(blocks))
        spans.append((start, start + len(rv)))
      return rv

    @contextlib.contextmanager
    def activate_tracker(self, blocks, spans):
      token = self._tracking.set((blocks, spans))
      try:
        yield
      finally:
        self._tracking.reset(token)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: no HTML escaping, json.dumps' options
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  def strftime_now(format):
    return datetime.datetime.now().strftime(format)

  class TemplateNamespace(jinja2.utils.Namespace):
    """Refuses underscore attributes, as transformers' does."""

    def __init__(*args, **kwargs):
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        TemplateNamespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      TemplateNamespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
          f"chat templates cannot store underscore attributes on a namespace: {name!r}"
        )

  class TemplateDict:
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals.update(
    raise_exception=raise_exception,
    strftime_now=strftime_now,
    dict=TemplateDict(),
    namespace=TemplateNamespace,
  )
  return env


class ChatTemplate:
  """A chat template with the tokenizer's special tokens; `where` names it in errors, `source`
  is its text (what a run records and its export ships)."""

  def __init__(self, source: str, tokens: dict[str, str], where: str):
    import jinja2  # a dependency (_environment says so when it is missing)

    self.source, self.where, self.tokens = source, where, dict(tokens)
    if not source.strip():  # it would render every chat as nothing: no record has a target
      raise ValueError(
        f"the chat template of {where} is empty: pass --chat-template FILE with a jinja2 chat "
        f"template (the model's chat_template.jinja)"
      )
    self._takes_parts = None
    try:
      self.template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template of {where} does not parse: {e} (line {e.lineno})")
    self.tracks_generation = bool(_GENERATION.search(source))

  def _variables(self, messages, add_generation_prompt: bool) -> dict:
    # as transformers passes them: no tools or documents, the special tokens
    return dict(
      messages=messages,
      tools=None,
      documents=None,
      add_generation_prompt=add_generation_prompt,
      **self.tokens,
    )

  def render(self, messages, add_generation_prompt: bool = False) -> str:
    return self.template.render(**self._variables(messages, add_generation_prompt))

  def takes_parts(self) -> bool:
    """Whether the template renders content given as a list of parts (OpenAI's
    `[{"type": "text", "text": ...}]`) by their text, as templates that iterate the parts do;
    one that does not would print the list's repr (found by rendering one such chat)."""
    if self._takes_parts is None:
      probe = "Pr0be text"
      part = [{"type": "text", "text": probe}]
      chat = [{"role": "user", "content": part}, {"role": "assistant", "content": part}]
      try:
        text = self.render(chat)
      except Exception:  # noqa: BLE001 - a template that refuses lists: give it strings
        text = ""
      self._takes_parts = text.count(probe) == 2 and "'type'" not in text
    return self._takes_parts

  def render_with_spans(self, messages) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the assistant's character spans in it), in order."""
    if self.tracks_generation:
      blocks, spans = [], []
      with self.template.environment.activate_tracker(blocks, spans):
        for block in self.template.generate(**self._variables(messages, False)):
          blocks.append(block)
      return "".join(blocks), [s for s in spans if s[1] > s[0]]
    text = self.render(messages)
    spans = []
    for i, message in enumerate(messages):
      if message.get("role") != "assistant":
        continue
      before = self.render(messages[:i], add_generation_prompt=True)
      through = self.render(messages[: i + 1])
      if not (text.startswith(through) and through.startswith(before)):
        raise ValueError(
          f"the chat template of {self.where} does not render conversations prefix by prefix "
          f"(message {i}, the assistant's, is not rendered the same within the whole "
          f"conversation), so its tokens cannot be found: pass --chat-template FILE with a "
          f"template that marks them with {{% generation %}} blocks"
        )
      if len(through) > len(before):
        spans.append((len(before), len(through)))
    return text, spans


def read_text(path: str, what: str) -> str:
  """The text of a UTF-8 file the data depends on (a chat template, a tokenizer config)."""
  with open(path, "rb") as f:
    raw = f.read()
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(
      f"{what} {report.shown(path)} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
      f"{e.start}): save it as UTF-8"
    ) from None


def read_template_file(chat_template: str) -> str:
  """The text of --chat-template FILE; a missing file, a directory, one not UTF-8: one line."""
  shown = report.shown(chat_template)
  if os.path.isdir(chat_template):
    raise IsADirectoryError(
      f"--chat-template {shown} is a directory: pass the template file in it (a jinja2 file, "
      f"such as an HF model's {CHAT_TEMPLATE_FILE})"
    )
  if not os.path.isfile(chat_template):
    raise FileNotFoundError(f"--chat-template {shown} does not exist: pass a file")
  return read_text(chat_template, "--chat-template")


MODEL_FLAGS = "--init-from with the model's HF directory, or --tokenizer with its tokenizer.json"


def load_chat_template(
  chat_template: str | None, directory: str | None, model_flags: str = MODEL_FLAGS
) -> ChatTemplate:
  """--chat-template FILE, else the chat template of the model's HF directory; its special
  tokens from the directory's tokenizer_config.json. None of either is one line: with no
  directory, the flags that name the model's (`model_flags`: the command's)."""
  tokens = special_tokens(directory)
  if chat_template:
    return ChatTemplate(read_template_file(chat_template), tokens, chat_template)
  source = find_template(directory) if directory else None
  if source is None and directory is None:  # the model's tokenizer is not known either
    raise ValueError(
      f"chat records are rendered with the model's chat template and tokenized with its "
      f"tokenizer, and no HF directory names them: pass {model_flags} (--chat-template FILE "
      f"alone would tokenize the chats as bytes: for a byte-level model only)"
    )
  if source is None:
    raise ValueError(
      f"chat records need a chat template and {directory} has no chat template "
      f"({CHAT_TEMPLATE_FILE}, or chat_template in {TOKENIZER_CONFIG}): pass --chat-template FILE"
    )
  return ChatTemplate(source, tokens, directory)


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for it


def normalize_messages(messages) -> list[dict]:
  """Messages as transformers hands them to a template: keys whose value is None dropped, a
  message's reasoning under both names templates read (`reasoning_content`, `thinking`)."""
  out = []
  for message in messages:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


TEXT_PARTS = ("text", "input_text", "output_text")  # OpenAI's chat and Responses formats


def text_content(where: str, i: int, message: dict, keep_parts: bool) -> dict:
  """`message` with its content as text: content given as a list of parts (OpenAI's format,
  `[{"type": "text", "text": ...}]`; a lone part as a dict; plain strings count as text parts)
  kept as text parts where the template renders them (`keep_parts`), else joined with newlines
  (as vLLM serves such content to a template that takes strings). A part that is not text (an
  image, audio) is refused: there is nothing to train it on."""
  content = message.get("content")
  if content is None or isinstance(content, str):
    return message
  parts = [content] if isinstance(content, dict) else content
  if not isinstance(parts, list):
    return message  # a number: str() is its text; anything else fails the rendered-text check
  texts = []
  for k, part in enumerate(parts):
    if isinstance(part, str):
      texts.append(part)
      continue
    kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
    text = part.get("text") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS or not isinstance(text, str):
      what = f"a {kind!r} part" if kind not in TEXT_PARTS else "a text part without text"
      raise ValueError(
        f"{where}: message {i} ({message['role']}) has {what} at content[{k}]; only text can be "
        f'trained on: give text content, or parts {{"type": "text", "text": ...}}, or drop that '
        f"record"
      )
    texts.append(text)
  if keep_parts:
    content = [{"type": "text", "text": t} for t in texts]
  else:
    content = "\n".join(texts)
  return {**message, "content": content}


def token_mask(offsets, spans) -> np.ndarray:
  """1 for each token (its character span `offsets[i]`, an (n, 2) array) overlapping an
  assistant span, else 0: transformers' rule (`apply_chat_template(return_assistant_tokens_mask=
  True)`): the first span ending after the token's start, if the token ends after it starts."""
  offsets = np.asarray(offsets).reshape(-1, 2)  # int32 spans stay int32 (8 bytes a token)
  if not spans:
    return np.zeros(len(offsets), np.uint8)
  starts, ends = np.asarray(spans, dtype=np.int64).T
  k = np.searchsorted(ends, offsets[:, 0], side="right")
  inside = k < len(ends)
  mask = np.zeros(len(offsets), bool)
  mask[inside] = offsets[inside, 1] > starts[k[inside]]
  return mask.astype(np.uint8)
