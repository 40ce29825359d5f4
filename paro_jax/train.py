"""The training loop behind `paro-jax train`: data, engine, progress, metrics.jsonl."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

from models.llama import Llama, get_config
from paro_jax.costs import model_state_bytes
from paro_jax.data import BYTE_VOCAB, Batches, default_corpus, load_text_bytes
from paro_jax.engine import DTYPES, Engine, OptimConfig
from paro_jax.mesh import make_mesh
from paro_jax.strategy import parse_strategy


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: str = "tiny"
  strategy: str = "IIG"
  mesh: tuple[int, int] | None = None  # (inter, intra); None: one group per process
  micro_batches: int = 1
  batch_size: int = 16
  seq_len: int = 64
  dtype: str = "bf16"
  collectives: str = "xla"
  steps: int = 50
  seed: int = 0
  lr: float = 3e-3
  warmup: int = 10
  data: str | None = None
  out: str = "runs/latest"

  def __post_init__(self):
    if self.dtype not in DTYPES:
      raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
    for name in ("micro_batches", "batch_size", "seq_len", "steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def build(cfg: RunConfig):
  """Model, engine and batches for a run; every bad input fails here, before any compile."""
  strategy = parse_strategy(cfg.strategy)
  model_cfg = get_config(cfg.model)
  mesh = make_mesh(*cfg.mesh) if cfg.mesh else make_mesh()
  tokens = load_text_bytes(cfg.data) if cfg.data else default_corpus()
  if model_cfg.vocab < BYTE_VOCAB:
    raise ValueError(f"model {cfg.model} has a vocabulary of {model_cfg.vocab}, smaller than the "
                     f"byte tokenizer's {BYTE_VOCAB}")
  optim = OptimConfig(learning_rate=cfg.lr, warmup_steps=cfg.warmup, total_steps=cfg.steps)
  engine = Engine(Llama(model_cfg, DTYPES[cfg.dtype]), strategy, mesh, optim,
                  micro_batches=cfg.micro_batches, collectives=cfg.collectives)
  engine.check_batch_size(cfg.batch_size)
  batches = Batches(tokens, cfg.micro_batches, cfg.batch_size, cfg.seq_len, cfg.seed)
  return engine, batches


def train(cfg: RunConfig) -> str:
  """Train and write RUN/metrics.jsonl; returns its path."""
  engine, batches = build(cfg)
  model_cfg, inter, intra = engine.model.cfg, engine.inter, engine.intra
  n_params = model_cfg.param_count()
  itemsize = jnp.dtype(engine.compute_dtype).itemsize
  mem = model_state_bytes(engine.strategy, n_params, n_params, inter, intra, itemsize, itemsize)
  print(f"paro-jax: {cfg.model} ({n_params / 1e6:.2f}M params), strategy {engine.strategy} on "
        f"mesh {inter}x{intra} ({jax.device_count()} {jax.devices()[0].platform} devices), "
        f"A={cfg.micro_batches}, batch {cfg.batch_size}x{cfg.seq_len}, {cfg.dtype}, "
        f"collectives={cfg.collectives}; model states {mem['total'] / 2**20:.2f} MiB/device",
        flush=True)

  os.makedirs(cfg.out, exist_ok=True)
  tokens_per_step = cfg.micro_batches * cfg.batch_size * cfg.seq_len
  state = engine.init_state(jax.random.key(cfg.seed))
  metrics_path = os.path.join(cfg.out, "metrics.jsonl")
  bar = tqdm(total=cfg.steps, desc=str(engine.strategy), unit="step", dynamic_ncols=True,
             disable=None)
  last_time = time.perf_counter()
  with open(metrics_path, "w") as log:

    def record(step, metrics):
      nonlocal last_time
      jax.block_until_ready(metrics)
      now = time.perf_counter()
      row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
      # Step 1's time includes compilation; later ones are pure step time.
      row["step_time_s"] = now - last_time
      row["tokens_per_s"] = tokens_per_step / row["step_time_s"]
      last_time = now
      log.write(json.dumps(row) + "\n")
      log.flush()
      bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
      bar.update(1)
      if bar.disable:  # no terminal: one line per step instead of a bar
        print(json.dumps(row), flush=True)

    pending = None
    for step in range(cfg.steps):
      state, metrics = engine.train_step(state, engine.shard_batch(batches(step)))
      # Read the previous step's metrics only after the next step is dispatched, so the host
      # never stalls the device.
      if pending is not None:
        record(*pending)
      pending = (step + 1, metrics)
    record(*pending)
  bar.close()
  print(f"paro-jax: wrote {metrics_path}", flush=True)
  return metrics_path
