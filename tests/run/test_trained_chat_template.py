"""The chat template a run trained with travels with it: its checkpoints record the text, `eval`
of the run renders chat records with it, `export` ships it as chat_template.jinja, and a resume
with another one is said.

The run trains on chat records with `--chat-template` naming tests/fixtures/chat/
chatml_generation.jinja (ChatML's layout with Llama 3's tokens, its answers in generation
blocks), a format other than the one in the model directory's tokenizer_config.json: before the
template was recorded, `eval RUN` rendered with the directory's template and the export shipped
the directory's, so the shipped model was prompted in a format it never saw. A chat fine-tune of
a base model (end of text as its eos) also ships the end of turn as a stop token.
"""

import json
import os
import shutil

import pytest

from paro_jax.cli import main
from paro_jax.data.chat import CHAT_TEMPLATE_FILE, ChatTemplate, find_template, special_tokens
from paro_jax.run.source import open_source
from paro_jax.data.example_shards import read_examples
from paro_jax.data.instruct import end_of_turn
from paro_jax.data.tokenizers import HFTokenizer
from tests.run.test_sft import CHAT_MODEL, FIXTURES, FP32, chat_records, write_jsonl

CHATML = os.path.join(FIXTURES, "chat", "chatml_generation.jinja")


def _text(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("template")
  data = write_jsonl(tmp / "chat.jsonl", chat_records())
  out = str(tmp / "run")
  common = ["--data", data, "--seq-len", "128", "--batch-size", "8", "--mesh", "2x4", *FP32]
  main(
    ["train", "--init-from", CHAT_MODEL, "--strategy", "IIG", "--steps", "2", "--warmup", "1"]
    + ["--lr", "1e-3", "--checkpoint-every", "1", "--chat-template", CHATML, "--out", out]
    + common
  )
  return tmp, out, common


def _eval(source, common, capsys, *extra):
  main(["eval", source, "--json", *common, *extra])
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_checkpoints_record_the_template(run):
  _, out, _ = run
  assert _text(CHATML) != find_template(CHAT_MODEL)  # two formats, so the check can fail
  assert open_source(out).chat_template == _text(CHATML)


def test_eval_of_the_run_renders_with_its_template(run, capsys):
  _, out, common = run
  own = _eval(out, common, capsys)
  assert own == _eval(out, common, capsys, "--chat-template", CHATML)
  # the directory's template renders other text: another loss, so the choice is seen
  directory = run[0] / "directory.jinja"
  directory.write_text(find_template(CHAT_MODEL), encoding="utf-8")
  other = _eval(out, common, capsys, "--chat-template", str(directory))
  assert other["loss"] != own["loss"]


def test_export_ships_the_template_it_trained_with(run, capsys):
  tmp, out, _ = run
  target = tmp / "hf"
  main(["export", out, "--out", str(target)])
  assert "chat_template.jinja: the chat template the run trained with" in capsys.readouterr().out
  assert _text(target / CHAT_TEMPLATE_FILE) == _text(CHATML)
  # the tokenizer files are copied as they are; the file is what transformers takes first
  source_config = os.path.join(CHAT_MODEL, "tokenizer_config.json")
  assert _text(target / "tokenizer_config.json") == _text(source_config)
  assert find_template(str(target)) == _text(CHATML)


def test_transformers_loads_the_shipped_template(run, capsys):
  """Live where transformers is installed (the hf-test extra): AutoTokenizer of the export has
  the run's template, not the tokenizer_config.json's."""
  transformers = pytest.importorskip("transformers")
  tmp, out, _ = run
  target = tmp / "hf-live"
  main(["export", out, "--out", str(target)])
  capsys.readouterr()
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(target))
  assert tokenizer.chat_template == _text(CHATML)


def test_a_resume_with_another_template_is_said(run, capsys):
  tmp, out, common = run
  resumed = tmp / "resumed"
  shutil.copytree(os.path.join(out, "checkpoints"), resumed / "checkpoints")
  flags = ["train", "--init-from", CHAT_MODEL, "--strategy", "IIG", "--steps", "3", "--warmup"]
  flags += ["1", "--lr", "1e-3", "--out", str(resumed), "--resume", *common]
  capsys.readouterr()
  main(flags)  # no --chat-template: the directory's, not the one it trained with
  err = capsys.readouterr().err
  said = [line for line in err.splitlines() if "chat template" in line]
  assert len(said) == 1 and "another chat template (the model directory's)" in said[0], err
  assert "chat_template=" not in err  # said once, by content, not again by its path
  assert open_source(str(resumed)).chat_template == find_template(CHAT_MODEL)


def test_prepared_shards_carry_their_template(tmp_path, capsys):
  data = write_jsonl(tmp_path / "chat.jsonl", chat_records(n=8))
  tok = os.path.join(CHAT_MODEL, "tokenizer.json")
  for name, template in (("a", CHATML), ("b", None)):
    extra = ["--chat-template", template] if template else []
    main(["prepare-data", data, "--tokenizer", tok, "--out", str(tmp_path / name), *extra])
  with open(tmp_path / "a" / "meta.json") as f:
    assert json.load(f)["chat_template"] == _text(CHATML)
  a = sorted(str(p) for p in (tmp_path / "a").glob("shard-*.bin"))
  b = sorted(str(p) for p in (tmp_path / "b").glob("shard-*.bin"))
  assert read_examples(a).chat_template == _text(CHATML)
  assert read_examples(b).chat_template == find_template(CHAT_MODEL)
  with pytest.raises(ValueError, match="prepared with different chat templates"):
    read_examples(a + b)
  # --chat-template with shards: used only where it is the template they were rendered with
  train = ["train", "--init-from", CHAT_MODEL, "--steps", "1", "--seq-len", "128", "--mesh", "2x4"]
  for shards, template, refused in ((a, CHATML, False), (b, CHATML, True)):
    flags = [*train, "--data", *shards, "--chat-template", template, "--out", str(tmp_path / "r")]
    if refused:
      with pytest.raises(SystemExit):
        main(flags)
      err = capsys.readouterr().err
      assert "the prepared shards were rendered with another chat template" in err, err
    else:
      main([*flags, "--lr", "1e-3", "--batch-size", "8", *FP32])


def test_end_of_turn_is_the_special_token_closing_an_answer():
  chat_llama = HFTokenizer(os.path.join(CHAT_MODEL, "tokenizer.json"))
  tokens = special_tokens(CHAT_MODEL)
  llama3 = ChatTemplate(find_template(CHAT_MODEL), tokens, "chat_llama")
  assert end_of_turn(llama3, chat_llama) == chat_llama.token_id("<|eot_id|>") == 299
  # the other layout closes its answers with <|eot_id|> too
  assert end_of_turn(ChatTemplate(_text(CHATML), tokens, "generation blocks"), chat_llama) == 299
  # a tokenizer for which <|eot_id|> is text, not a special token: no stop is added
  plain = os.path.join(FIXTURES, "hf_llama", "llama32_tied")
  assert "<|eot_id|>" in _text(os.path.join(FIXTURES, "chat", "llama3.jinja"))
  llama3_text = ChatTemplate(_text(os.path.join(FIXTURES, "chat", "llama3.jinja")), {}, "llama3")
  assert end_of_turn(llama3_text, HFTokenizer(os.path.join(plain, "tokenizer.json"))) is None


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
  """chat_llama as a base model ships: its end of text (not <|eot_id|>) as eos, everywhere."""
  base = tmp_path_factory.mktemp("base") / "model"
  shutil.copytree(CHAT_MODEL, base)
  for name, key, value in (
    ("generation_config.json", "eos_token_id", 296),
    ("config.json", "eos_token_id", 296),
    ("tokenizer_config.json", "eos_token", "<|end_of_text|>"),
  ):
    with open(base / name) as f:
      fields = json.load(f)
    fields[key] = value
    with open(base / name, "w") as f:
      json.dump(fields, f, indent=2)
  return base


def test_a_chat_fine_tune_of_a_base_model_stops_at_its_end_of_turn(base_model, tmp_path, capsys):
  data = write_jsonl(tmp_path / "chat.jsonl", chat_records())
  out = str(tmp_path / "run")
  main(
    ["train", "--init-from", str(base_model), "--strategy", "IIG", "--mesh", "2x4", "--steps"]
    + ["1", "--lr", "1e-3", "--seq-len", "128", "--batch-size", "8", "--data", data, *FP32]
    + ["--out", out]
  )
  generation = {}
  for name, flags in (("hf", []), ("no-generation-config", [])):
    target = tmp_path / name
    if name == "no-generation-config":  # a source without one: written from config.json's ids
      os.remove(base_model / "generation_config.json")
    capsys.readouterr()
    main(["export", out, "--out", str(target), *flags])
    assert "generation_config.json: eos_token_id [296, 299]" in capsys.readouterr().out
    with open(target / "generation_config.json") as f:
      generation[name] = json.load(f)
  assert generation["hf"]["eos_token_id"] == [296, 299]
  assert "_from_model_config" not in generation["hf"]  # the file's own now
  assert generation["no-generation-config"] == {"bos_token_id": 295, "eos_token_id": [296, 299]}
  transformers = pytest.importorskip("transformers")
  loaded = transformers.GenerationConfig.from_pretrained(str(tmp_path / "hf"))
  assert loaded.eos_token_id == [296, 299]
