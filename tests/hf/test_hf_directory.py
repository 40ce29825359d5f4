"""The HF directory as one unit, in and out: a run from --init-from DIR reads its data with DIR's
tokenizer, ends each document with its end-of-sequence token, and exports a directory that
transformers (AutoModelForCausalLM, AutoTokenizer) and peft load as they load DIR.

The references are tests/fixtures/hf_llama (six tiny Llamas saved by transformers, with their
tokenizers and transformers' token stream of text.txt: its encoding, then the end-of-sequence id):
for each, 20 steps under IIG on 2x4 from DIR with no --tokenizer, then `paro-jax eval` of the
export equals `paro-jax eval` of the run; with torch and transformers installed, transformers
scores the export as `paro-jax eval` scores the run, and peft loads the LoRA adapter export onto
DIR with the merged export's logits.
"""

import json
import os
import shutil
import warnings

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from paro_jax import cli
from paro_jax.core.config import make_config
from paro_jax.data.config import DataConfig
from paro_jax.run.config import RunConfig
from paro_jax.data.streams import load_tokens
from paro_jax.data.prepare import prepare_data
from paro_jax.run.setup import build, with_tokenizer
from paro_jax.data.tokenizers import tokenizer_identity
from paro_jax.run.train import train

pytestmark = pytest.mark.usefixtures("compilation_cache")
tokenizers = pytest.importorskip(
  "tokenizers", reason="tokenizers (a core dependency) is not installed"
)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
HF = os.path.join(FIXTURES, "hf_llama")
TEXT = os.path.join(HF, "text.txt")
with open(os.path.join(HF, "losses.json")) as _f:
  REF = json.load(_f)
VARIANTS = sorted(k for k in os.listdir(HF) if os.path.isdir(os.path.join(HF, k)))
SEQ, BATCH, STEPS = 16, 8, 20
RUN = {
  "strategy": "IIG",
  "mesh": (2, 4),
  "batch_size": BATCH,
  "seq_len": SEQ,
  "dtype": "fp32",
  "optimizer.steps": STEPS,
  "optimizer.lr": 1e-3,
  "optimizer.warmup": 2,
}
EVAL = ["--seq-len", str(SEQ), "--batch-size", str(BATCH), "--dtype", "fp32"]
EVAL += ["--mesh", "2x4", "--strategy", "IIG", "--json"]


def hf_config(directory) -> dict:
  with open(os.path.join(directory, "config.json")) as f:
    return json.load(f)


def evaluate(capsys, source, *flags) -> dict:
  capsys.readouterr()
  cli.main(["eval", str(source), "--data", TEXT, *EVAL, *flags])
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def export(run, out, *flags):
  cli.main(["export", str(run), "--out", str(out), *flags])
  return out


def dtypes(directory) -> set:
  found = set()
  for name in os.listdir(directory):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(directory, name), framework="numpy") as f:
        found |= {f.get_slice(k).get_dtype() for k in f.keys()}
  return found


def weight_bytes(directory) -> tuple[int, int]:
  """(the tensors' bytes, the files' bytes) of the safetensors in `directory`."""
  files = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors")]
  data = sum(w.nbytes for f in files for w in load_file(f).values())
  return data, sum(os.path.getsize(f) for f in files)


# --- document boundaries ------------------------------------------------------------------------
RECORDS = ["The first record, short.", "And a second one: a little longer than the first."]


@pytest.mark.parametrize("variant", ["llama3_gqa", "llama2_mha"])
def test_each_record_is_a_document(tmp_path, variant):
  """A two-record JSONL: each record's encoding with the beginning-of-sequence token (the
  post-processor's), then the end-of-sequence token; the ids counted here with `tokenizers`
  alone and config.json's bos/eos ids, independently of the loader. prepare-data writes the
  same stream, for records and for a text file (one document)."""
  directory = os.path.join(HF, variant)
  data = tmp_path / "two.jsonl"
  data.write_text("".join(json.dumps({"text": r}) + "\n" for r in RECORDS))
  tok = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
  bos, eos = hf_config(directory)["bos_token_id"], hf_config(directory)["eos_token_id"]
  plain = [tok.encode(r, add_special_tokens=False).ids for r in RECORDS]
  want = [i for ids in plain for i in [bos, *ids, eos]]
  got = load_tokens(DataConfig(paths=(str(data),), tokenizer=directory), 288)
  assert len(got) == sum(len(ids) for ids in plain) + 2 * len(RECORDS)
  np.testing.assert_array_equal(got, want)
  prepare_data([str(data)], str(tmp_path / "shards"), tokenizer=directory, progress=False)
  np.testing.assert_array_equal(shard(tmp_path / "shards"), want)
  # A text file is one document: as transformers made the fixture's stream of text.txt.
  got = load_tokens(DataConfig(paths=(TEXT,), tokenizer=directory), 288)
  np.testing.assert_array_equal(got, REF[variant]["token_ids"])
  prepare_data([TEXT], str(tmp_path / "text"), tokenizer=directory, progress=False, block=256)
  tokens = shard(tmp_path / "text")  # in blocks of lines, still one document
  assert tokens[0] == bos and tokens[-1] == eos and np.isin(tokens, [bos, eos]).sum() == 2
  assert os.path.getsize(TEXT) > 4 * 256  # (several blocks)


def shard(directory) -> np.ndarray:
  """The tokens of prepare-data's one shard in `directory`."""
  return np.fromfile(directory / "shard-00000.bin", np.uint16)


def test_byte_level_documents_are_their_bytes(tmp_path):
  data = tmp_path / "two.jsonl"
  data.write_text("".join(json.dumps({"text": r}) + "\n" for r in RECORDS))
  got = load_tokens(DataConfig(paths=(str(data),), tokenizer="bytes"), 256)
  np.testing.assert_array_equal(got, np.frombuffer("".join(RECORDS).encode(), np.uint8))


# --- the tokenizer of the directory, and the refusals -------------------------------------------
def run_config(out, **changes):
  return make_config(RunConfig, {**RUN, "out": str(out), **changes})


def test_init_from_reads_with_the_directory_tokenizer(tmp_path):
  directory = os.path.join(HF, "llama3_gqa")
  cfg = with_tokenizer(run_config(tmp_path, init_from=directory, **{"data.paths": (TEXT,)}))
  assert cfg.data.tokenizer == os.path.join(directory, "tokenizer.json")
  named = os.path.join(HF, "llama2_mha", "tokenizer.json")  # --tokenizer wins
  changes = {"init_from": directory, "data.paths": (TEXT,), "data.tokenizer": named}
  assert with_tokenizer(run_config(tmp_path, **changes)).data.tokenizer == named


def one_line(capsys, argv) -> str:
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("paro-jax: error:")]
  assert e.value.code == 2 and len(lines) == 1
  return lines[0]


def test_text_as_bytes_into_a_larger_vocabulary_is_refused(tmp_path, capsys):
  bare = tmp_path / "no_tokenizer"
  shutil.copytree(os.path.join(HF, "llama3_gqa"), bare)
  os.remove(bare / "tokenizer.json")
  train_ = ["train", "--init-from", str(bare), "--data", TEXT, "--mesh", "2x4", "--steps", "1"]
  line = one_line(capsys, [*train_, "--out", str(tmp_path / "run")])
  assert "the model's vocabulary is 288, not the 256 bytes" in line
  assert f"{bare} has no tokenizer.json" in line and "--tokenizer bytes" in line
  assert not (tmp_path / "run").exists()
  # asked for by name: accepted (the bytes fit the 288 rows)
  changes = {"init_from": str(bare), "data.paths": (TEXT,), "data.tokenizer": "bytes"}
  assert with_tokenizer(run_config(tmp_path, **changes)).data.tokenizer == "bytes"
  line = one_line(capsys, ["eval", str(bare), "--data", TEXT, "--mesh", "2x4"])
  assert "--tokenizer bytes" in line
  # The built-in corpus is bytes: not read as the directory's tokens.
  line = one_line(capsys, ["eval", os.path.join(HF, "llama3_gqa"), "--mesh", "2x4"])
  assert "the built-in corpus (no --data) is bytes" in line and "pass --data" in line


def test_the_default_lr_of_a_fine_tune_is_warned_of(tmp_path):
  """build() warns, once every input is checked: a bad one is its one error line alone."""
  given = {"init_from": os.path.join(HF, "llama3_gqa"), "data.paths": (TEXT,), "mesh": (2, 4)}
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    build(make_config(RunConfig, {"out": str(tmp_path), **given}))
    build(make_config(RunConfig, {"out": str(tmp_path), **given, "optimizer.lr": 2e-5}))
    build(make_config(RunConfig, {"out": str(tmp_path), "model": "test", "mesh": (2, 4)}))
  lines = [str(w.message) for w in seen if "--lr" in str(w.message)]
  assert len(lines) == 1 and "\n" not in lines[0]
  assert lines[0].startswith("--lr 0.003 is the default for training small models from scratch")
  assert "2e-5" in lines[0] and "3e-4" in lines[0] and "docs/hf_and_lora.md" in lines[0]


def test_a_tokenizer_is_the_same_wherever_it_lies(tmp_path):
  shutil.copytree(os.path.join(HF, "llama3_gqa"), tmp_path / "copy")
  same = tokenizer_identity(os.path.join(HF, "llama3_gqa", "tokenizer.json"))
  assert tokenizer_identity(str(tmp_path / "copy")) == same
  assert tokenizer_identity(os.path.join(HF, "llama2_mha", "tokenizer.json")) != same
  assert tokenizer_identity(None) == tokenizer_identity("bytes") == "bytes"


# --- 20 steps from each directory, exported ------------------------------------------------------
@pytest.fixture(scope="module")
def journeys(tmp_path_factory):
  """{variant: (run, fp32 export, default export)}: 20 steps under IIG on 2x4 from the fixture,
  on text.txt with no --tokenizer; exported in fp32 and in the default dtype."""
  root = tmp_path_factory.mktemp("journeys")
  done = {}
  for variant in VARIANTS:
    run = root / variant
    train(run_config(run, init_from=os.path.join(HF, variant), **{"data.paths": (TEXT,)}))
    fp32 = export(run, root / f"{variant}-fp32", "--dtype", "fp32")
    default = export(run, root / f"{variant}-default")
    done[variant] = run, fp32, default
  return done


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_export_scores_as_the_run(journeys, capsys, variant):
  run, fp32, default = journeys[variant]
  ours = evaluate(capsys, run)
  # The run read text.txt with the directory's tokenizer: the stream transformers made.
  windows = len(REF[variant]["token_ids"]) // (SEQ + 1)
  assert ours["windows"] == windows and ours["tokens"] == windows * SEQ
  assert evaluate(capsys, fp32)["loss"] == pytest.approx(ours["loss"], rel=1e-6)
  # The default dtype is the source's: bf16 (half the bytes) where the fixture is bf16.
  source = os.path.join(HF, variant)
  assert dtypes(default) == dtypes(source) and dtypes(fp32) == {"F32"}
  if dtypes(source) == {"BF16"}:
    (half, half_file), (full, full_file) = weight_bytes(default), weight_bytes(fp32)
    assert 2 * half == full and half_file == pytest.approx(full_file / 2, rel=0.03)
    assert evaluate(capsys, default)["loss"] == pytest.approx(ours["loss"], rel=1e-2)
  # The source's config fields are kept; the tokenizer and generation config travel along.
  written, given = hf_config(default), hf_config(source)
  for key in ("bos_token_id", "eos_token_id", "max_position_embeddings", "tie_word_embeddings"):
    assert written[key] == given[key], key
  for key in ("rope_parameters", "rope_scaling"):
    if key in given:
      assert written[key] == given[key], key
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    with open(os.path.join(source, name), "rb") as a, open(os.path.join(default, name), "rb") as b:
      assert a.read() == b.read(), name


def test_resuming_with_another_tokenizer_is_refused(journeys, tmp_path, capsys):
  run = tmp_path / "run"
  shutil.copytree(journeys["llama3_gqa"][0], run)
  resume = ["train", "--init-from", os.path.join(HF, "llama3_gqa"), "--data", TEXT]
  resume += ["--mesh", "2x4", "--steps", "21", "--resume", "--out", str(run), "--lr", "1e-3"]
  trained = os.path.join(HF, "llama3_gqa", "tokenizer.json")
  for other in (os.path.join(HF, "llama2_mha", "tokenizer.json"), "bytes"):
    line = one_line(capsys, [*resume, "--tokenizer", other])
    assert f"resuming with tokenizer {other}, but checkpoint step {STEPS} was trained" in line
    assert f"with tokenizer {trained}" in line and f"pass --tokenizer {trained}" in line
  assert sorted(os.listdir(run / "checkpoints")) == [str(STEPS)]


def test_a_model_config_run_exports_the_config_fields(tmp_path, capsys):
  """--model config.json trains from scratch; its export keeps the file's bos/eos ids and
  positions, in bf16, with the --tokenizer it trained with."""
  source = os.path.join(HF, "llama3_gqa")
  run = tmp_path / "run"
  changes = {"model": os.path.join(source, "config.json"), "optimizer.steps": 1}
  changes["optimizer.warmup"] = 0
  changes["data.tokenizer"] = os.path.join(source, "tokenizer.json")
  train(run_config(run, **{"data.paths": (TEXT,)}, **changes))
  out = export(run, tmp_path / "hf")
  written, given = hf_config(out), hf_config(source)
  for key in ("bos_token_id", "eos_token_id", "max_position_embeddings"):
    assert written[key] == given[key], key
  assert dtypes(out) == {"BF16"} and written["dtype"] == "bfloat16"
  assert "the model in bf16 (trained from scratch)" in capsys.readouterr().out
  assert sorted(n for n in os.listdir(out) if n.startswith("tokenizer")) == [
    "tokenizer.json",
    "tokenizer_config.json",
  ]


def test_shards_above_the_size_and_export_refusals(journeys, tmp_path, capsys):
  run = journeys["llama3_gqa"][0]
  out = export(run, tmp_path / "sharded", "--dtype", "fp32", "--max-shard-size", "20KB")
  with open(out / "model.safetensors.index.json") as f:
    index = json.load(f)
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  tensors = {}
  for shard in shards:
    held = load_file(out / shard)
    # at most the size, or one tensor larger than it alone (huggingface_hub's rule)
    assert sum(w.nbytes for w in held.values()) <= 20_000 or len(held) == 1
    tensors.update(held)
  assert index["metadata"]["total_size"] == sum(w.nbytes for w in tensors.values())
  assert set(index["weight_map"]) == set(tensors)
  single = load_file(journeys["llama3_gqa"][1] / "model.safetensors")
  assert set(single) == set(tensors)
  for name, w in single.items():
    np.testing.assert_array_equal(tensors[name], w, err_msg=name)
  # --overwrite into the sharded export: the single file replaces the shards, not beside them
  export(run, out, "--dtype", "fp32", "--overwrite")
  assert sorted(n for n in os.listdir(out) if "safetensors" in n) == ["model.safetensors"]
  line = one_line(capsys, ["export", str(run), "--out", str(tmp_path / "x"), "--adapter"])
  assert "has no LoRA adapters" in line and "without --adapter" in line
  argv = ["export", str(run), "--out", str(tmp_path / "y"), "--max-shard-size", "5 parsecs"]
  assert "--max-shard-size '5 parsecs'" in one_line(capsys, argv)
  assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# --- LoRA: the PEFT adapter ----------------------------------------------------------------------
LORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": "wq,wv,wo,w_down"}


@pytest.fixture(scope="module")
def lora_exports(tmp_path_factory):
  """A LoRA run from llama3_gqa (fp32), exported merged and as a PEFT adapter, in fp32."""
  root = tmp_path_factory.mktemp("lora")
  source = os.path.join(HF, "llama3_gqa")
  run = root / "run"
  changes = {**LORA, "strategy": "ING", "optimizer.steps": 3, "optimizer.lr": 3e-2}
  train(run_config(run, init_from=source, **{"data.paths": (TEXT,)}, **changes))
  merged = export(run, root / "merged", "--dtype", "fp32")
  adapter = export(run, root / "adapter", "--dtype", "fp32", "--adapter")
  return source, run, merged, adapter


def test_the_adapter_is_the_merged_export_minus_the_base(lora_exports):
  """PEFT's formula applied to the adapter file by hand: base + (alpha / r) lora_B @ lora_A is
  the merged export, tensor for tensor; the untouched weights are the base's bit for bit."""
  from paro_jax.hf.weights import load_hf
  from paro_jax.hf.peft import load_adapter

  source, run, merged, adapter = lora_exports
  with open(adapter / "adapter_config.json") as f:
    config = json.load(f)
  assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
  assert config["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
  assert config["base_model_name_or_path"] == os.path.abspath(source)
  tensors = load_file(adapter / "adapter_model.safetensors")
  base = load_file(os.path.join(source, "model.safetensors"))
  out = load_file(merged / "model.safetensors")
  hf = hf_config(source)
  shapes = {
    "self_attn.q_proj": (hf["num_attention_heads"] * hf["head_dim"], hf["hidden_size"]),
    "self_attn.v_proj": (hf["num_key_value_heads"] * hf["head_dim"], hf["hidden_size"]),
    "self_attn.o_proj": (hf["hidden_size"], hf["num_attention_heads"] * hf["head_dim"]),
    "mlp.down_proj": (hf["hidden_size"], hf["intermediate_size"]),
  }
  assert len(tensors) == 2 * len(shapes) * hf["num_hidden_layers"]
  for layer in range(hf["num_hidden_layers"]):
    for module, (n_out, n_in) in shapes.items():
      name = f"base_model.model.model.layers.{layer}.{module}"
      a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
      assert a.shape == (4, n_in) and b.shape == (n_out, 4)
      assert np.abs(b).max() > 0  # trained
      weight = f"model.layers.{layer}.{module}.weight"
      np.testing.assert_allclose(out[weight], base[weight] + 2.0 * b @ a, atol=2e-6)
  for weight in set(base) - {f"model.layers.{i}.{m}.weight" for i in range(2) for m in shapes}:
    np.testing.assert_array_equal(out[weight], base[weight], err_msg=weight)
  # and our own reading of the adapter file gives the run's adapters back
  cfg, _ = load_hf(source)
  lora, leaves = load_adapter(str(adapter), cfg)
  assert (lora.rank, lora.alpha, set(lora.targets)) == (4, 8.0, {"wq", "wv", "wo", "w_down"})
  name = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
  np.testing.assert_array_equal(leaves["layers"]["attn"]["wq_lora_a"][1], tensors[name].T)


# --- live: transformers and peft -----------------------------------------------------------------
def _live():
  torch = pytest.importorskip("torch", reason="torch not installed: live check skipped")
  transformers = pytest.importorskip("transformers", reason="transformers not installed")
  return torch, transformers


@pytest.mark.parametrize("variant", VARIANTS)
def test_live_transformers_scores_the_export_as_eval_scores_the_run(journeys, capsys, variant):
  torch, transformers = _live()
  run, fp32, default = journeys[variant]
  ids = REF[variant]["token_ids"]  # transformers' stream of text.txt (the fixture's script)
  n = len(ids) // (SEQ + 1)
  windows = torch.tensor(ids[: n * (SEQ + 1)]).reshape(n, SEQ + 1)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    fp32, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  with torch.no_grad():
    logits = model(input_ids=windows[:, :-1]).logits.float()
  loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:]).item()
  assert loss == pytest.approx(evaluate(capsys, run)["loss"], rel=1e-4)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(default)
  assert loaded.dtype == {"BF16": torch.bfloat16, "F32": torch.float32}[dtypes(default).pop()]
  source = transformers.AutoTokenizer.from_pretrained(os.path.join(HF, variant))
  exported = transformers.AutoTokenizer.from_pretrained(default)
  with open(TEXT, encoding="utf-8") as f:
    text = f.read()
  assert exported(text).input_ids == source(text).input_ids
  assert (exported.bos_token, exported.eos_token) == (source.bos_token, source.eos_token)


def test_live_peft_loads_the_adapter_with_the_merged_logits(lora_exports):
  torch, transformers = _live()
  peft = pytest.importorskip("peft", reason="peft not installed: live adapter check skipped")
  source, _, merged, adapter = lora_exports
  ids = torch.tensor(REF["llama3_gqa"]["token_ids"][:64]).reshape(2, 32)
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
    d, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  with torch.no_grad():
    plain = load(source)(input_ids=ids).logits
    adapted = peft.PeftModel.from_pretrained(load(source), adapter).eval()
    theirs, ours = adapted(input_ids=ids).logits, load(merged)(input_ids=ids).logits
  assert (theirs - plain).abs().max() > 1e-3  # the adapter changes the model
  torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
