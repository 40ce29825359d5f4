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

  from models.hf_config import config_to_hf
  from models.presets import get_config

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
  from models.presets import get_config

  full = 4 * get_config("tiny").param_count()  # fp32 bytes of every parameter
  # per rank: FSDP2 full shard holds half (dim-0 shards, padded to equal size); HSDP on 2 nodes
  # of 1 device shards over 1 (a replica per node) and DDP replicates: the whole model
  want = full / 2 if peer == "full_shard" else full
  for s in states:
    assert want <= s["params"] <= want * 1.01, (s, want)
    assert s["grads"] == s["params"] and s["opt"] >= 2 * s["params"], s  # AdamW's two moments


def _schedule(t: int, steps: int, peak: float, warmup: int, end: float) -> float:
  """Linear warm-up from 0 over `warmup` updates, then cosine decay to `end` at update `steps`
  (the first update is t = 0), written out here apart from the peer's optax schedule."""
  if t < warmup:
    return peak * t / warmup
  return end + (peak - end) * 0.5 * (1 + np.cos(np.pi * (t - warmup) / (steps - warmup)))


TRAIN = ["--schedule", "train", "--warmup", "2", "--lr", "3e-3", "--eval-batches", "2"]
TRAIN_STEPS = 5


def test_train_schedule_and_eval_equal_a_plain_loop(tmp_path):
  """`--schedule train --eval-batches K` (what experiments/outer_vs_paro.py runs): HSDP's losses
  and its held-out loss equal one process's loop with `train`'s optimizer settings (AdamW with
  betas 0.9/0.95, weight decay 0.1 on matrices, the warm-up and cosine schedule above, clipping
  at global norm 1) and the eval split's batches."""
  from transformers import LlamaConfig as HFConfig
  from transformers import LlamaForCausalLM

  from models.hf_config import config_to_hf
  from models.presets import get_config
  from paro_jax.data.config import DataConfig
  from paro_jax.data.streams import Batches, load_tokens, split_eval

  err = io.StringIO()
  argv = ["python", "-m", "experiments.bench.torch_peer", "--peer", "hsdp", *ARGS, *TRAIN]
  code = launch(
    [*argv, "--steps", str(TRAIN_STEPS), "--out", str(tmp_path)],
    nodes=2, devices_per_node=1, shaped=False, stdout=io.StringIO(), stderr=err,
  )  # fmt: skip
  assert code == 0, err.getvalue()[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

  args = torch_peer.parse_args([*ARGS, *TRAIN, "--peer", "hsdp", "--out", "unused"])
  torch.manual_seed(args.seed)
  model = LlamaForCausalLM(HFConfig(**config_to_hf(get_config(args.model))))
  matrices = [p for p in model.parameters() if p.ndim == 2]
  vectors = [p for p in model.parameters() if p.ndim == 1]
  groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
  optim = torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), eps=1e-8)
  data = DataConfig()
  tokens, held_out = split_eval(load_tokens(data, get_config(args.model).vocab), data.eval_fraction)
  batches = Batches(tokens, args.micro_batches, args.batch_size, args.seq_len, args.seed)
  loss_of = lambda x: torch.nn.functional.cross_entropy(
    model(input_ids=x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten()
  )
  losses = []
  for t in range(TRAIN_STEPS):
    total = 0.0
    for x in torch.from_numpy(batches(t)).long():
      loss = loss_of(x)
      (loss / args.micro_batches).backward()
      total += loss.item() / args.micro_batches
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for group in optim.param_groups:
      group["lr"] = _schedule(t, TRAIN_STEPS, 3e-3, 2, 3e-4)
    optim.step()
    optim.zero_grad()
    losses.append(total)
  with torch.no_grad():
    held = Batches(held_out, 2, args.batch_size, args.seq_len, args.seed)
    want = np.mean([loss_of(x).item() for x in torch.from_numpy(held(0)).long()])
  np.testing.assert_allclose([r["loss"] for r in rows], losses, rtol=2e-5)
  assert "eval_loss" in rows[-1] and all("eval_loss" not in r for r in rows[:-1])
  np.testing.assert_allclose(rows[-1]["eval_loss"], want, rtol=2e-5)
  assert losses[-1] < losses[0]  # it trained
