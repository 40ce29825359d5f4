"""Chat records rendered and tokenized as transformers does, and the assistant's tokens found.

The references are transformers' own (tests/fixtures/make_chat.py wrote them into
tests/fixtures/chat/expected.json): `apply_chat_template(tokenize=True)`'s ids with the tiny
chat_llama tokenizer under three templates, Llama 3's among them, and transformers'
`assistant_masks` where a template marks the assistant's text with {% generation %} blocks. Llama
3's template has none: paro-jax finds its assistant tokens by rendering prefixes, and must find
exactly those transformers marks in the same template written with generation blocks. Where
transformers is installed the same is checked against it live.
"""

import datetime
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from paro_jax.data.chat import ChatTemplate, load_chat_template
from paro_jax.data.tokenizers import HFTokenizer
from paro_jax.data.instruct import CHAT, Encoder

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
MODEL = os.path.join(FIXTURES, "chat_llama")
CHAT_DIR = os.path.join(FIXTURES, "chat")
with open(os.path.join(CHAT_DIR, "expected.json")) as _f:
  EXPECTED = json.load(_f)
CHATS = EXPECTED["chats"]
TEMPLATES = {  # template -> (--chat-template, the template whose transformers masks are its own)
  "llama3": (None, "llama3_generation"),  # the model's own (tokenizer_config.json)
  "llama3_generation": ("llama3_generation.jinja", "llama3_generation"),
  "chatml_generation": ("chatml_generation.jinja", "chatml_generation"),
}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def encoder(name: str) -> Encoder:
  file, _ = TEMPLATES[name]
  template = os.path.join(CHAT_DIR, file) if file else None
  return Encoder(CHAT, HFTokenizer(os.path.join(MODEL, "tokenizer.json")), MODEL, template)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tokens_and_masks_equal_transformers(name):
  enc = encoder(name)
  masks_of = TEMPLATES[name][1]
  for i, chat in enumerate(CHATS):
    tokens, mask = enc(f"chat {i}", {"messages": chat})
    assert tokens.tolist() == EXPECTED[name][i]["ids"], f"chat {i}"
    assert EXPECTED[masks_of][i]["ids"] == EXPECTED[name][i]["ids"]
    assert mask.tolist() == EXPECTED[masks_of][i]["mask"], f"chat {i}"


def test_the_masks_cover_each_answer_and_its_end_of_turn():
  """What the masks say, read back: the assistant's text and <|eot_id|>, nothing else."""
  tok = HFTokenizer(os.path.join(MODEL, "tokenizer.json"))
  eot = tok.token_id("<|eot_id|>")
  tokens, mask = encoder("llama3")("chat 1", {"messages": CHATS[1]})
  marked = tokens[mask == 1]
  assert (marked == eot).sum() == 2  # each of the two answers ends with its own
  text = tok._tok.decode(marked.tolist(), skip_special_tokens=True)
  assert text == "Because a book does not forget.A radio forgets: été, naïve, 1987."


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed: live check skipped")
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_live_transformers(name):
  """The committed references are transformers' today, and so are paro-jax's tokens."""
  import transformers

  fast = transformers.AutoTokenizer.from_pretrained(MODEL)
  file, masks_of = TEMPLATES[name]
  source = None
  if file:
    with open(os.path.join(CHAT_DIR, file)) as f:
      source = f.read()
  for i, chat in enumerate(CHATS):
    out = fast.apply_chat_template(chat, chat_template=source, tokenize=True, return_dict=True)
    assert list(out["input_ids"]) == EXPECTED[name][i]["ids"]
    assert encoder(name)(f"chat {i}", {"messages": chat})[0].tolist() == out["input_ids"]


def test_a_template_that_rewrites_earlier_turns_is_refused():
  """Its assistant tokens cannot be found by prefixes: one line, with the fix."""
  enc = Encoder(
    CHAT,
    HFTokenizer(os.path.join(MODEL, "tokenizer.json")),
    MODEL,
    os.path.join(CHAT_DIR, "rewrites_history.jinja"),
  )
  enc("one answer", {"messages": CHATS[0]})  # one answer: rendered the same
  with pytest.raises(ValueError, match=r"^chat 1: the chat template of .*rewrites_history") as e:
    enc("chat 1", {"messages": CHATS[1]})
  assert "{% generation %}" in str(e.value) and "\n" not in str(e.value)


def test_raise_exception_is_one_line_naming_the_record():
  enc = encoder("chatml_generation")
  with pytest.raises(ValueError, match=r"^data.jsonl:3: the chat template .* Unknown role: tool$"):
    enc("data.jsonl:3", {"messages": [{"role": "tool", "content": "x"}]})


def test_a_model_without_a_template_needs_the_flag(tmp_path):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(MODEL, name), tmp_path)
  with open(tmp_path / "tokenizer_config.json") as f:
    cfg = json.load(f)
  del cfg["chat_template"]
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError, match="has no chat template .* pass --chat-template FILE$"):
    load_chat_template(None, str(tmp_path))
  # chat_template.jinja (transformers 5's file) is the model's template
  shutil.copy(os.path.join(CHAT_DIR, "chatml_generation.jinja"), tmp_path / "chat_template.jinja")
  assert load_chat_template(None, str(tmp_path)).tracks_generation


def test_named_templates_take_the_default(tmp_path):
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"chat_template": [{"name": "tool_use", "template": "T"}]}, f)
  with pytest.raises(ValueError, match=r"chat templates \['tool_use'\] and no 'default'"):
    load_chat_template(None, str(tmp_path))
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"chat_template": [{"name": "default", "template": "D{{ bos_token }}"}]}, f)
  assert load_chat_template(None, str(tmp_path)).render([]) == "D"


def test_the_environment_is_transformers():
  """strftime_now, loop controls, namespace, tojson without HTML escaping, trim_blocks."""
  source = (
    "{{ strftime_now('%Y') }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    "{{ m.content | tojson }}{% endfor %}|{% set ns = namespace(n=1) %}{{ ns.n }}\n"
    "{% if true %}\n  x\n{% endif %}\n"
  )
  out = ChatTemplate(source, {}, "test").render([{"content": "<a&b>"}, {"content": "no"}])
  assert out == f'{datetime.date.today().year}|"<a&b>"|1\n  x\n'


def test_masks_are_tokens_not_characters():
  """A token is the assistant's when it overlaps an assistant span (transformers' rule)."""
  from paro_jax.data.chat import token_mask

  assert token_mask([(0, 2), (2, 5), (5, 6), (6, 9)], [(3, 6)]).tolist() == [0, 1, 1, 0]
  assert np.sum(token_mask([(0, 1)], [])) == 0
