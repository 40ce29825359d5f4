"""HF LLaMA weights: logits against transformers' own, round trips, export and --init-from.

The reference is tests/fixtures/hf_tiny, written by transformers (tests/fixtures/make_hf_tiny.py):
no torch is needed here. With torch and transformers installed, the live test also loads our
export into transformers.LlamaForCausalLM. The Llama 3.x configurations (RoPE scalings, tied
embeddings, odd vocabularies) have their own fixtures and tests (tests/models/test_llama3.py,
tests/models/test_tied.py).
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paro_jax.hf.weights import WEIGHTS, load_hf, save_hf
from models.hf_config import config_to_hf, read_config
from models.llama import Llama
from models.loss import next_token_loss
from paro_jax import cli
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.run.setup import build
from paro_jax.run.train import train

FIXTURE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "hf_tiny"
)
REF = np.load(os.path.join(FIXTURE, "logits.npz"))


def our_logits(cfg, params, ids):
  return np.asarray(
    Llama(cfg, jnp.float32).apply(jax.tree.map(jnp.asarray, params), jnp.asarray(ids))
  )


def leaves_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def copy_fixture(tmp_path, name="hf"):
  out = tmp_path / name
  shutil.copytree(FIXTURE, out)
  os.remove(out / "logits.npz")
  return out


def edit_config(directory, **changes):
  path = directory / "config.json"
  hf = json.loads(path.read_text())
  hf.update(changes)
  path.write_text(json.dumps(hf))


# --- against transformers ----------------------------------------------------------------------
def test_fixture_logits_match_transformers():
  cfg, params = load_hf(FIXTURE)
  assert (cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp) == (
    256,
    32,
    2,
    4,
    2,
    16,
    64,
  )
  assert cfg.rope_theta == 1000.0 and cfg.norm_eps == 1e-5
  np.testing.assert_allclose(
    our_logits(cfg, params, REF["input_ids"]), REF["logits"], atol=1e-4, rtol=1e-4
  )


def test_live_transformers_loads_our_export(tmp_path):
  torch = pytest.importorskip(
    "torch", reason="torch not installed: live transformers check skipped"
  )
  transformers = pytest.importorskip(
    "transformers", reason="transformers not installed: live transformers check skipped"
  )
  cfg, params = load_hf(FIXTURE)
  # Perturbed, so the export is not just the fixture's own bytes.
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda w: w + 0.05 * rng.standard_normal(w.shape).astype(np.float32), params
  )
  save_hf(cfg, params, tmp_path / "out")
  model = transformers.LlamaForCausalLM.from_pretrained(
    tmp_path / "out", attn_implementation="eager"
  ).eval()
  with torch.no_grad():
    theirs = model(input_ids=torch.as_tensor(REF["input_ids"]).long()).logits.numpy()
  np.testing.assert_allclose(
    our_logits(cfg, params, REF["input_ids"]), theirs, atol=1e-4, rtol=1e-4
  )


# --- round trips -------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path):
  cfg, params = load_hf(FIXTURE)
  save_hf(cfg, params, tmp_path / "out")
  cfg2, params2 = load_hf(tmp_path / "out")
  assert cfg2 == cfg
  leaves_equal(params, params2)
  # model.safetensors is readable like config.json (safetensors itself creates it 0600).
  modes = [os.stat(tmp_path / "out" / n).st_mode & 0o777 for n in ("config.json", WEIGHTS)]
  assert modes[0] == modes[1], [oct(m) for m in modes]
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == ["LlamaForCausalLM"]
  assert written["tie_word_embeddings"] is False and written["head_dim"] == 16
  # The tensors are the fixture's, name for name, shape for shape, bit for bit.
  ours, theirs = (
    load_file(os.path.join(d, "model.safetensors")) for d in (tmp_path / "out", FIXTURE)
  )
  assert set(ours) == set(theirs)
  for name in theirs:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_sharded_and_bf16(tmp_path):
  import ml_dtypes

  out = copy_fixture(tmp_path)
  tensors = load_file(out / "model.safetensors")
  os.remove(out / "model.safetensors")
  names = sorted(tensors)
  shards = {
    "model-00001-of-00002.safetensors": names[::2],
    "model-00002-of-00002.safetensors": names[1::2],
  }
  for shard, members in shards.items():
    save_file({n: tensors[n].astype(ml_dtypes.bfloat16) for n in members}, out / shard)
  (out / "model.safetensors.index.json").write_text(
    json.dumps({"weight_map": {n: shard for shard, members in shards.items() for n in members}})
  )
  _, params = load_hf(out)
  _, exact = load_hf(FIXTURE)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(exact)):
    assert x.dtype == np.float32
    np.testing.assert_allclose(x, y, rtol=1e-2, atol=1e-2)
  os.remove(out / "model-00002-of-00002.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
    load_hf(out)


# --- bad inputs --------------------------------------------------------------------------------
def test_missing_directory_and_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_hf(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="no config.json"):
    load_hf(tmp_path)
  out = copy_fixture(tmp_path)
  os.remove(out / "model.safetensors")
  (out / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="neither model.safetensors.*pytorch_model.bin"):
    load_hf(out)


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "RoPE type 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "model_type 'mixtral'"),
    ({"architectures": ["MistralForCausalLM"]}, "supported are llama \\(LlamaForCausalLM\\)"),
    (
      {"head_dim": None, "num_attention_heads": 5, "num_key_value_heads": 5},
      "not a multiple of num_attention_heads",
    ),
    ({"num_key_value_heads": 3}, "multiple of kv_heads"),
  ],
)
def test_unsupported_config(tmp_path, changes, message):
  out = copy_fixture(tmp_path)
  edit_config(out, **changes)
  with pytest.raises(ValueError, match=f"unsupported HF config.*{message}"):
    read_config(out)


def test_tensor_mismatches_name_the_tensor(tmp_path):
  out = copy_fixture(tmp_path)
  edit_config(out, intermediate_size=48)
  with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(64, 32\)"):
    load_hf(out)
  edit_config(out, intermediate_size=64, num_hidden_layers=1)
  with pytest.raises(ValueError, match="unexpected tensor.*model.layers.1"):
    load_hf(out)
  edit_config(out, num_hidden_layers=3)
  with pytest.raises(ValueError, match="model.layers.2.self_attn.q_proj.weight is missing"):
    load_hf(out)


def test_save_checks_shapes(tmp_path):
  cfg, params = load_hf(FIXTURE)
  params["layers"]["attn"]["wo"] = params["layers"]["attn"]["wo"][:, :2]
  with pytest.raises(ValueError, match="layers/attn/wo has shape"):
    save_hf(cfg, params, tmp_path / "out")
  assert config_to_hf(cfg)["num_key_value_heads"] == 2


# --- training runs: export and --init-from -----------------------------------------------------
RUN = {
  "strategy": "IIG",
  "mesh": (2, 4),
  "batch_size": 8,
  "seq_len": 16,
  "dtype": "fp32",
  "optimizer.warmup": 1,
}


def test_export_round_trip(tmp_path):
  run = tmp_path / "run"
  run_cfg = make_config(RunConfig, {**RUN, "model": "test", "optimizer.steps": 2, "out": str(run)})
  train(run_cfg)
  cli.main(["export", "--run", str(run), "--out", str(tmp_path / "hf"), "--dtype", "fp32"])
  cfg, params = load_hf(tmp_path / "hf")
  # The checkpoint read back independently, with the run's own engine (not export's).
  engine = build(run_cfg)[0]
  ckpt = Checkpointer(os.path.join(run, CHECKPOINTS))
  state, meta = ckpt.restore(engine, "test")
  ckpt.close()
  assert meta.step == 2 and cfg == engine.model.cfg
  master = jax.tree.map(np.asarray, state.master)
  leaves_equal(params, master)
  # By default a run trained from scratch exports in bf16: the master weights rounded.
  cli.main(["export", str(run), "--out", str(tmp_path / "bf16")])
  _, rounded = load_hf(tmp_path / "bf16")
  import ml_dtypes

  leaves_equal(
    rounded, jax.tree.map(lambda w: w.astype(ml_dtypes.bfloat16).astype(np.float32), master)
  )


def test_export_errors(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["export", "--run", str(tmp_path / "missing"), "--out", str(tmp_path / "hf")])
  assert e.value.code == 2 and "no checkpoints/ directory" in capsys.readouterr().err


def test_init_from_fixture_trains(tmp_path):
  run = {**RUN, "model": "tiny", "init_from": FIXTURE, "optimizer.steps": 1}
  cfg = make_config(RunConfig, {**run, "out": str(tmp_path / "run")})
  engine, batches, _ = build(cfg)
  model_cfg, params = load_hf(FIXTURE)
  assert engine.model.cfg == model_cfg  # --model is ignored
  metrics = train(cfg)
  with open(metrics) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1]
  # Step 1's loss is the fixture's weights' loss on batch 0: the weights were loaded.
  tokens = batches(0)[0]
  want = next_token_loss(our_logits_jnp(model_cfg, params, tokens[:, :-1]), tokens[:, 1:])
  np.testing.assert_allclose(rows[0]["loss"], float(want), rtol=1e-4)
  ckpt = Checkpointer(os.path.join(tmp_path / "run", CHECKPOINTS))
  assert ckpt.read_meta(1).model_name == f"hf:{FIXTURE}"
  ckpt.close()


def our_logits_jnp(cfg, params, ids):
  return Llama(cfg, jnp.float32).apply(jax.tree.map(jnp.asarray, params), jnp.asarray(ids))


def test_export_of_an_init_from_run_keeps_the_source_and_its_config(tmp_path, capsys):
  run = tmp_path / "run"
  train(
    make_config(
      RunConfig,
      {**RUN, "model": "tiny", "init_from": FIXTURE, "optimizer.steps": 1, "out": str(run)},
    )
  )
  before = {name: os.path.getmtime(os.path.join(FIXTURE, name)) for name in os.listdir(FIXTURE)}
  # The directory the run started from is never overwritten, not even with --overwrite.
  with pytest.raises(SystemExit) as e:
    cli.main(["export", "--run", str(run), "--out", FIXTURE, "--overwrite"])
  assert e.value.code == 2 and "the HF directory the run started from" in capsys.readouterr().err
  assert before == {n: os.path.getmtime(os.path.join(FIXTURE, n)) for n in os.listdir(FIXTURE)}
  # Another non-empty directory needs --overwrite.
  out = tmp_path / "hf"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  with pytest.raises(SystemExit) as e:
    cli.main(["export", "--run", str(run), "--out", str(out)])
  assert e.value.code == 2 and "already exists and is not empty" in capsys.readouterr().err
  assert not (out / "config.json").exists()
  cli.main(["export", "--run", str(run), "--out", str(out), "--overwrite"])
  with open(os.path.join(FIXTURE, "config.json")) as f:
    source = json.load(f)
  with open(out / "config.json") as f:
    written = json.load(f)
  for key in ("bos_token_id", "eos_token_id", "max_position_embeddings"):
    assert written[key] == source[key], key
  assert written["dtype"] == written["torch_dtype"] == "float32"
  load_hf(out)  # and it loads


def test_model_from_an_hf_config_alone(tmp_path):
  """--model takes an HF config.json (or its directory): its shapes, trained from scratch. The
  benchmark's 3.03M-parameter model is one; its count from the shapes by hand."""
  from models.presets import get_config
  from paro_jax.core.config import parse_model
  from paro_jax.run.setup import build

  path = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "configs")
  path = os.path.join(path, "llama-3m.json")
  d, kv, ffn, vocab = 256, 4 * 32, 688, 256
  layer = d * d + 2 * d * kv + d * d + 3 * d * ffn + 2 * d
  assert get_config(path).param_count() == 2 * vocab * d + d + 4 * layer == 3_033_344
  shutil.copy(path, tmp_path / "config.json")
  assert get_config(str(tmp_path)) == get_config(path)
  engine = build(RunConfig(model=path, mesh=(2, 4), batch_size=8, seq_len=16))[0]
  assert engine.model.cfg == get_config(path)
  assert parse_model("TINY") == "tiny" and parse_model("Dir/Config.json") == "Dir/Config.json"
  with pytest.raises(ValueError, match="unknown model preset 'nope'.*HF LLaMA config.json"):
    get_config("nope")


def test_non_finite_init_weights_are_refused_as_loaded(tmp_path, capsys):
  """A NaN in a row the data rarely touches trained unseen and made every save refuse the state
  (losing the run); one used every step read as divergence after a compile and three steps.
  Both are one line naming the tensor, before anything compiles."""
  from safetensors.numpy import load_file, save_file  # the fixture's own format

  out = copy_fixture(tmp_path)
  tensors = load_file(out / "model.safetensors")
  tensors["model.embed_tokens.weight"][250, 3] = np.nan
  tensors["model.embed_tokens.weight"][251, 0] = np.inf
  save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(SystemExit) as e:
    cli.main(
      [
        "train",
        "--init-from",
        str(out),
        "--lr",
        "1e-5",
        "--mesh",
        "2x4",
        "--out",
        str(tmp_path / "run"),
      ]
    )  # a fine-tuning --lr: the default's warning would be a second line
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in lines[0], lines
  assert lines[0].endswith(
    "tensor model.embed_tokens.weight holds 1 NaN and 1 Inf values (the first at index "
    "(250, 3)): these weights are damaged; download or export them again"
  )
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # refused before any step
