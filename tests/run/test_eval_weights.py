"""`paro-jax eval` holds weights, not a training state (run/source.py `source_engine`): its
scores equal, exactly, those of the whole training state it built before (fp32 master and moments
from load_hf, or a full checkpoint restore, then the forward of `engine.params(state)`), for an
HF directory and for a LoRA run's checkpoint, in bf16; and what it holds is the parameters at P
in the compute dtype. transformers' own losses are tests/run/test_evaluate.py's."""

import os

import jax
import numpy as np
import pytest

from paro_jax.core.config import make_config
from paro_jax.hf.weights import load_hf
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.run.config import EvalConfig, RunConfig
from paro_jax.run.evaluate import score, window_batches
from paro_jax.run.source import open_source, source_engine
from paro_jax.run.setup import build
from paro_jax.run.train import train

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
HF = os.path.join(FIXTURES, "hf_llama")
TEXT = os.path.join(HF, "text.txt")


def windows(vocab):
  tokens = np.frombuffer(open(TEXT, "rb").read(), np.uint8).astype(np.int32) % vocab
  return list(window_batches(tokens, 16, 8))


def before(engine, source):
  """Today's eval before this change: a whole training state, then params(state) per batch."""
  if source.kind == "hf":
    return engine.state_from_params(load_hf(source.path)[1])
  ckpt = Checkpointer(os.path.join(source.path, CHECKPOINTS), read_only=True)
  try:
    return ckpt.restore(engine, source.model_name)[0]
  finally:
    ckpt.close()


def check_same_scores(source_dir, strategy, mesh):
  cfg = make_config(
    EvalConfig,
    {"source": source_dir, "strategy": strategy, "mesh": mesh, "batch_size": 8, "seq_len": 16},
  )
  source = open_source(source_dir)
  engine, params = source_engine(source, cfg)
  for keys, w in jax.tree_util.tree_leaves_with_path(params):
    assert w.dtype == engine.compute_dtype, keys
    assert w.sharding.spec == _at(engine.specs.params, keys), keys
  batches = windows(source.config.vocab)
  got = score(engine, params, batches)
  state = before(engine, source)
  want = score(engine, engine.params(state), batches)
  assert got == want
  return got


def _at(tree, keys):
  for k in keys:
    tree = tree[k.key]
  return tree


@pytest.mark.parametrize("strategy,mesh", [("GGG", (1, 8)), ("IIG", (2, 4))])
def test_hf_directory_scores_as_the_training_state_did(strategy, mesh):
  check_same_scores(os.path.join(HF, "llama3_gqa"), strategy, mesh)


def test_a_lora_run_scores_as_its_whole_checkpoint_did(tmp_path):
  run = tmp_path / "run"
  cfg = {
    "init_from": os.path.join(HF, "odd_vocab"),
    "strategy": "IIG",
    "mesh": (2, 4),
    "batch_size": 8,
    "seq_len": 16,
    "lora.rank": 4,
    "optimizer.lr": 3e-4,
    "optimizer.steps": 1,
    "optimizer.warmup": 1,
    "data.paths": (TEXT,),
    "out": str(run),
  }
  train(make_config(RunConfig, cfg))
  ckpt = Checkpointer(os.path.join(run, CHECKPOINTS), read_only=True)
  engine = build(make_config(RunConfig, cfg))[0]
  state, meta = ckpt.restore(engine, f"hf:{cfg['init_from']}", weights_only=True)
  ckpt.close()
  assert meta.step == 1 and state.opt_state is None and state.step is None
  check_same_scores(str(run), "GGG", (1, 8))
