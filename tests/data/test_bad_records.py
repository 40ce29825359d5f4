"""Bad instruction records and chat templates, in prepare-data, train and eval: each is one line
(`paro-jax: error: ...`, exit 2, no traceback) naming the record or file and the fix; content
given as a list of parts (OpenAI's message format) is trained on as its text, never as a repr.

The CLI runs in this process (conftest's 8 CPU devices); every error comes before anything
compiles. The model is the tiny chat_llama fixture (its tokenizer and Llama 3 chat template)."""

import json
import os

import numpy as np
import pytest

from paro_jax import cli
from paro_jax.cli import main
from paro_jax.data.chat import load_chat_template
from paro_jax.data.instruct import CHAT, Encoder
from paro_jax.data.tokenizers import HFTokenizer

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
MODEL = os.path.join(FIXTURES, "chat_llama")
TOKENIZER = os.path.join(MODEL, "tokenizer.json")
CHATML = os.path.join(FIXTURES, "chat", "chatml_generation.jinja")


def _chat(question="the tide", answer="tide the"):
  return {
    "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
  }


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("records")
  _write(d / "no_messages.jsonl", [_chat(), _chat(), {"text": "a later record of text"}])
  _write(d / "pc.jsonl", [{"prompt": "p", "completion": "c"}] * 3)
  _write(d / "pc_in_chat.jsonl", [_chat(), {"prompt": "p", "completion": "c"}])
  sur = _chat("a \ud800 b")  # json.dumps writes the lone surrogate as JSON's "\ud800" escape
  _write(d / "chat_surrogate.jsonl", [_chat(), sur])
  _write(d / "pc_surrogate.jsonl", [{"prompt": "p", "completion": "c \udfff"}])
  image = _chat()
  image["messages"][0]["content"] = [
    {"type": "text", "text": "what is it?"},
    {"type": "image_url", "image_url": {"url": "x.png"}},
  ]
  _write(d / "image.jsonl", [image])
  (d / "tpl_dir").mkdir()
  (d / "latin1.jinja").write_bytes("{# caf\xe9 #}{{ messages }}".encode("latin-1"))
  (d / "empty.jinja").write_text(" \n")
  return d


def _one_line(capsys, argv) -> str:
  with pytest.raises(SystemExit) as e:
    main([str(a) for a in argv])
  assert e.value.code == 2, argv
  err = capsys.readouterr().err.replace("\r", "\n")
  assert "Traceback" not in err, err
  lines = [x for x in err.splitlines() if x.strip() and not x.startswith("prepare-data:")]
  assert len(lines) == 1 and lines[0].startswith("paro-jax: error: "), err
  return lines[0]


def _commands(data, out, *extra):
  """The same data through prepare-data, train and eval (the chat_llama model's)."""
  common = ["--data", data, *extra]
  return {
    "prepare-data": ["prepare-data", data, "--out", out, "--tokenizer", TOKENIZER, *extra],
    "train": ["train", "--init-from", MODEL, "--steps", "1", "--warmup", "1", "--out", out]
    + ["--batch-size", "8", "--seq-len", "32", *common],
    "eval": ["eval", MODEL, "--batch-size", "8", "--seq-len", "32", *common],
  }


CASES = [  # (id, file, extra flags, what the line says)
  (
    "later-record-without-messages",
    "no_messages.jsonl",
    [],
    "no_messages.jsonl:3: the record has no 'messages' field (it has ['text']), and chat records "
    "each need 'messages' (a chat); it is a text record",
  ),
  (
    "chat-format-on-prompt-completion",
    "pc.jsonl",
    ["--data-format", "chat"],
    "pc.jsonl:1: the record has no 'messages' field (it has ['completion', 'prompt']), and chat "
    "records each need 'messages' (a chat); it is a prompt-completion record: pass records of "
    "one shape, with --data-format prompt-completion (or auto)",
  ),
  (
    "prompt-completion-format-on-chat",
    "no_messages.jsonl",
    ["--data-format", "prompt-completion"],
    "no_messages.jsonl:1: the record has no 'prompt' field (it has ['messages']), and "
    "prompt-completion records each need 'prompt' and 'completion'; it is a chat record",
  ),
  (
    "a-later-prompt-completion-record",
    "pc_in_chat.jsonl",
    [],
    "pc_in_chat.jsonl:2: the record has no 'messages'",
  ),
  (
    "surrogate-in-chat",
    "chat_surrogate.jsonl",
    [],
    "chat_surrogate.jsonl:2: the chat holds a lone surrogate ('\\ud800' at character",
  ),
  (
    "surrogate-in-completion",
    "pc_surrogate.jsonl",
    [],
    "pc_surrogate.jsonl:1: the 'completion' field holds a lone surrogate ('\\udfff' at "
    "character 2)",
  ),
  (
    "image-part",
    "image.jsonl",
    [],
    "image.jsonl:1: message 0 (user) has a 'image_url' part at content[1]; only text can be "
    "trained on",
  ),
  (
    "template-directory",
    "image.jsonl",
    ["--chat-template", "{d}/tpl_dir"],
    "tpl_dir is a directory: pass the template file",
  ),
  (
    "template-not-utf8",
    "no_messages.jsonl",
    ["--chat-template", "{d}/latin1.jinja"],
    "--chat-template {d}/latin1.jinja is not UTF-8 text (byte 0xe9 at offset 6): save it as UTF-8",
  ),
  (
    "template-empty",
    "no_messages.jsonl",
    ["--chat-template", "{d}/empty.jinja"],
    "the chat template of {d}/empty.jinja is empty: pass --chat-template FILE",
  ),
]


@pytest.mark.parametrize("command", ["prepare-data", "train", "eval"])
@pytest.mark.parametrize("name,file,extra,message", CASES, ids=[c[0] for c in CASES])
def test_bad_records_are_one_line(
  files, tmp_path, capsys, monkeypatch, command, name, file, extra, message
):
  monkeypatch.setattr(cli, "provide_cpu_devices", lambda n: None)  # this process has its 8
  extra = [x.format(d=files) for x in extra]
  argv = _commands(str(files / file), str(tmp_path / "out"), *extra)[command]
  line = _one_line(capsys, argv)
  assert message.format(d=files) in line, line
  assert not (tmp_path / "out").exists()  # a failed run leaves no directory it made


def test_a_binary_parquet_text_column_is_one_line(tmp_path, capsys):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  pq.write_table(
    pa.table({"text": pa.array([b"bytes, not text"], pa.binary())}), tmp_path / "b.parquet"
  )
  line = _one_line(capsys, ["prepare-data", tmp_path / "b.parquet", "--out", tmp_path / "out"])
  assert line == (
    f"paro-jax: error: {tmp_path}/b.parquet row 0: the 'text' field is b'bytes, not text' (bytes), "
    f"not text: fix or drop that record, or pass --text-field with the column that holds the "
    f"text; a Parquet column of binary type holds bytes: cast it to string"
  )


def test_chat_records_need_the_models_tokenizer(files, tmp_path, capsys):
  """prepare-data of chat records without --tokenizer writes no byte-level shards, and its
  line does not advise --chat-template (which alone would tokenize the chats as bytes)."""
  data = files / "image.jsonl"
  _write(data := tmp_path / "chat.jsonl", [_chat()] * 3)
  for extra in ([], ["--chat-template", CHATML]):
    line = _one_line(capsys, ["prepare-data", data, "--out", tmp_path / "out", *extra])
    assert (
      "no --tokenizer names them: pass --tokenizer with the tokenizer.json of the model" in line
    )
    assert not (tmp_path / "out").exists()
  # asked for by name, bytes it is
  main(
    ["prepare-data", str(data), "--out", str(tmp_path / "bytes"), "--tokenizer", "bytes"]
    + ["--chat-template", CHATML]
  )
  meta = json.loads((tmp_path / "bytes" / "meta.json").read_text())
  assert meta["tokenizer"] == "bytes" and meta["examples"] == 3


def test_no_hf_directory_names_the_flags_that_give_one():
  """Resuming a chat fine-tune without --init-from (and no --tokenizer): the line names the
  flags that give the model's tokenizer and template, not --chat-template FILE alone."""
  with pytest.raises(ValueError) as e:
    load_chat_template(None, None)
  assert (
    "pass --init-from with the model's HF directory, or --tokenizer with its tokenizer.json"
    in str(e.value)
  )
  assert "--chat-template FILE alone would tokenize the chats as bytes" in str(e.value)


CONTENTS = {  # the same chat's user content in the shapes OpenAI's message format allows
  "string": "what is the tide?",
  "parts": [{"type": "text", "text": "what is the tide?"}],
  "dict": {"type": "text", "text": "what is the tide?"},
  "two-parts": [{"type": "text", "text": "what is"}, {"type": "text", "text": "the tide?"}],
  "responses-api": [{"type": "input_text", "text": "what is the tide?"}],
  "strings": ["what is", "the tide?"],
}


@pytest.mark.parametrize("shape", sorted(CONTENTS))
@pytest.mark.parametrize("template", [None, CHATML])  # Llama 3's (no parts), ChatML's
def test_content_parts_are_trained_on_as_their_text(shape, template):
  """Content as text parts renders as its text (parts joined by newlines where the template takes
  strings), never as the list's repr; the tokens equal those of the same chat as strings."""
  enc = Encoder(CHAT, HFTokenizer(TOKENIZER), MODEL, template)
  assert not enc.template.takes_parts()
  want_text = "what is\nthe tide?" if shape in ("two-parts", "strings") else "what is the tide?"
  chat = {
    "messages": [
      {"role": "user", "content": CONTENTS[shape]},
      {"role": "assistant", "content": [{"type": "text", "text": "high"}]},
    ]
  }
  plain = {
    "messages": [{"role": "user", "content": want_text}, {"role": "assistant", "content": "high"}]
  }
  tokens, mask = enc("d.jsonl:1", chat)
  want_tokens, want_mask = enc("d.jsonl:1", plain)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_array_equal(mask, want_mask)


def test_a_template_that_iterates_parts_gets_them(tmp_path):
  """A template that renders each text part (as multimodal models' do) is given the parts."""
  (tmp_path / "parts.jinja").write_text(
    "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
  )
  enc = Encoder(CHAT, HFTokenizer(TOKENIZER), MODEL, str(tmp_path / "parts.jinja"))
  assert enc.template.takes_parts()
  chat = [
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
  ]
  assert enc.template.render(chat) == "<user>[a][b]</s>"
  tokens, _ = enc("d.jsonl:1", {"messages": [*chat, {"role": "assistant", "content": "c"}]})
  assert "[a][b]" in HFTokenizer(TOKENIZER)._tok.decode(tokens.tolist())


def test_a_garbled_parquet_page_names_the_file_and_row_group(tmp_path, capsys):
  """Bytes of the second row group's first page flipped, one at a time: wherever pyarrow itself
  cannot read the file (the reference), the line names the file, the row group and its rows,
  and the fix; among them, pyarrow's 'Corrupt snappy compressed data.' (which named nothing)."""
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  from paro_jax.data.records import read_records

  rows = [{"text": f"record {i} " + "lorem ipsum dolor sit amet " * 5} for i in range(200)]
  good = tmp_path / "good.parquet"
  pq.write_table(
    pa.Table.from_pylist(rows), good, row_group_size=100, compression="snappy", use_dictionary=False
  )
  page = pq.ParquetFile(good).metadata.row_group(1).column(0).data_page_offset
  bad, seen = tmp_path / "bad.parquet", set()
  for k in range(page, page + 25):
    raw = bytearray(good.read_bytes())
    raw[k] ^= 0xFF
    bad.write_bytes(bytes(raw))
    try:
      pq.read_table(bad)
    except Exception as e:  # noqa: BLE001 - what pyarrow says (the reference)
      seen.add(str(e).splitlines()[0])
    else:
      continue
    with pytest.raises(ValueError) as e:
      for _ in read_records(str(bad)):
        pass
    assert str(e.value).startswith(f"{bad}: row group 1 of 2 (rows 100-199) cannot be read (")
    assert str(e.value).endswith("): the file is damaged: download or write it again")
  assert "Corrupt snappy compressed data." in seen, seen
  # through the command: one line, nothing left
  raw = bytearray(good.read_bytes())
  raw[page + 18] ^= 0xFF
  bad.write_bytes(bytes(raw))
  line = _one_line(capsys, ["prepare-data", bad, "--out", tmp_path / "out"])
  assert f"{bad}: row group 1 of 2 (rows 100-199) cannot be read (" in line
  assert not (tmp_path / "out").exists()


def test_parquet_without_pyarrow_names_the_extra(tmp_path, capsys, monkeypatch):
  """pyarrow stays an extra (the hf one, pyproject.toml): without it a Parquet file is one line
  naming the install."""
  import sys
  import tomllib

  (tmp_path / "d.parquet").write_bytes(b"PAR1")
  monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
  line = _one_line(capsys, ["prepare-data", tmp_path / "d.parquet", "--out", tmp_path / "out"])
  assert line == (
    f"paro-jax: error: {tmp_path}/d.parquet: reading Parquet files needs pyarrow, the hf extra: "
    f"pip install 'paro-jax[hf]' (from a checkout: pip install -e \".[hf]\")"
  )
  with open(os.path.join(os.path.dirname(FIXTURES), "..", "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  assert [d.split(">")[0] for d in project["optional-dependencies"]["hf"]] == ["pyarrow"]
  core = {d.split(">")[0] for d in project["dependencies"]}
  assert {"tokenizers", "jinja2"} <= core  # chat templates and HF tokenizers need no extra
