"""experiments/bench/torch_peer.py: every PyTorch peer trains as a plain single-process loop does.

Needs the [bench] extra (torch, transformers); skipped without it. Two emulated nodes of one
device each, on loopback (the link is not what is checked here).
"""

import io
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from experiments.bench import torch_peer  # noqa: E402
from paro_jax.cluster.launch import launch  # noqa: E402

ARGS = ["--model", "tiny", "--micro-batches", "2", "--batch-size", "4", "--seq-len", "16"]
STEPS = 3


def _reference_losses():
  """The same model, batches and AdamW in one process, on the whole batch."""
  from paro_jax.data.config import DataConfig
  from paro_jax.data.streams import Batches, load_tokens, split_eval

  args = torch_peer.parse_args([*ARGS, "--peer", "full_shard", "--out", "unused"])
  torch.manual_seed(args.seed)
  from transformers import LlamaConfig as HFConfig
  from transformers import LlamaForCausalLM

  from models.config import config_to_hf, get_config

  model = LlamaForCausalLM(HFConfig(**config_to_hf(get_config(args.model))))
  optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
  data = DataConfig()
  tokens, _ = split_eval(load_tokens(data, get_config(args.model).vocab), data.eval_fraction)
  batches = Batches(tokens, args.micro_batches, args.batch_size, args.seq_len, args.seed)
  losses = []
  for step in range(STEPS):
    x_all = torch.from_numpy(batches(step)).long()
    total = 0.0
    for x in x_all:
      logits = model(input_ids=x[:, :-1]).logits
      loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
      (loss / args.micro_batches).backward()
      total += loss.item() / args.micro_batches
    optim.step()
    optim.zero_grad()
    losses.append(total)
  return losses


@pytest.fixture(scope="module")
def reference():
  return _reference_losses()


# Every peer as the benchmark runs it by default (`--remat full`: each decoder layer checkpointed,
# which recomputes and so must not change the numbers), and without checkpointing once.
@pytest.mark.parametrize(
  "peer,remat", [(p, "full") for p in torch_peer.PEERS] + [("full_shard", "none")]
)
def test_peer_equals_single_process(tmp_path, reference, peer, remat):
  err = io.StringIO()
  argv = ["python", "-m", "experiments.bench.torch_peer", "--peer", peer, "--remat", remat, *ARGS]
  code = launch(
    [*argv, "--steps", str(STEPS), "--out", str(tmp_path)],
    nodes=2,
    devices_per_node=1,
    shaped=False,
    stdout=io.StringIO(),
    stderr=err,
  )
  assert code == 0, err.getvalue()[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3]
  np.testing.assert_allclose([r["loss"] for r in rows], reference, rtol=2e-5)
  states = json.loads((tmp_path / "peer.json").read_text())["state_bytes"]
  from models.config import get_config

  full = 4 * get_config("tiny").param_count()  # fp32 bytes of every parameter
  # per rank: FSDP2 full shard holds half (dim-0 shards, padded to equal size); HSDP on 2 nodes
  # of 1 device shards over 1 (a replica per node) and DDP replicates: the whole model
  want = full / 2 if peer == "full_shard" else full
  for s in states:
    assert want <= s["params"] <= want * 1.01, (s, want)
    assert s["grads"] == s["params"] and s["opt"] >= 2 * s["params"], s  # AdamW's two moments
