"""The training loop behind `paro-jax train`: data, engine, progress, metrics, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings

import jax
import jax.numpy as jnp
from tqdm import tqdm

from models.hf import load_hf, read_config
from models.llama import Llama, LoraConfig, get_config
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer, RunMeta
from paro_jax.analysis.costs import model_state_bytes
from paro_jax.run.data import Batches, DataConfig, load_tokens, split_eval
from paro_jax.core.engine import DTYPES, Engine, OptimConfig, TrainState
from paro_jax.core.compress import WireConfig
from paro_jax.core.mesh import make_mesh
from paro_jax.core.names import DEFAULT_INT8_BLOCK, GRAD_DTYPES
from paro_jax.analysis.hardware import mfu
from paro_jax.core.strategy import parse_strategy

METRICS = "metrics.jsonl"


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
  inter_params: str = "same"  # wire precision across nodes (core/compress.py)
  inter_grads: str = "same"
  int8_block: int = DEFAULT_INT8_BLOCK
  grad_dtype: str = "compute"  # gradient accumulation / boundary reduction: compute or fp32
  remat: str = "full"  # models/llama.py REMAT_POLICIES
  steps: int = 50
  seed: int = 0
  lr: float = 3e-3
  warmup: int = 10
  data: tuple[str, ...] = ()  # files and globs (a str is one path); empty: built-in corpus
  text_field: str = "text"
  tokenizer: str | None = None
  bin_dtype: str | None = None
  eval_fraction: float = 0.01
  eval_every: int = 0  # 0: no eval
  out: str = "runs/latest"
  checkpoint_every: int = 0  # 0: only at the end (and on Ctrl-C)
  keep: int = 3  # checkpoints kept
  resume: bool = False  # continue from the newest checkpoint in out/checkpoints
  init_from: str | None = None  # an HF LLaMA directory: the model (`model` is ignored) and,
  # in a fresh run, the starting weights
  lora_rank: int = 0  # > 0: train LoRA adapters of this rank only (models/llama.py LoraConfig)
  lora_alpha: float = 16.0
  lora_targets: str = "wq,wv"

  def __post_init__(self):
    if self.dtype not in DTYPES:
      raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
    for name in ("micro_batches", "batch_size", "seq_len", "steps", "keep"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
    if isinstance(self.data, str):
      object.__setattr__(self, "data", (self.data,))
    for name in ("checkpoint_every", "eval_every"):
      if getattr(self, name) < 0:
        raise ValueError(
          f"{name.replace('_', '-')} must be >= 0 (0: off), got {getattr(self, name)}"
        )
    self.wire()  # its checks
    if self.grad_dtype not in GRAD_DTYPES:
      raise ValueError(f"unknown grad dtype {self.grad_dtype!r}; choose one of {GRAD_DTYPES}")
    self.data_config()  # its checks
    self.lora()  # its checks

  def wire(self) -> WireConfig:
    return WireConfig(self.inter_params, self.inter_grads, self.int8_block)

  def lora(self) -> LoraConfig | None:
    return LoraConfig.from_flags(self.lora_rank, self.lora_alpha, self.lora_targets)

  def data_config(self) -> DataConfig:
    return DataConfig(
      paths=tuple(self.data),
      text_field=self.text_field,
      tokenizer=self.tokenizer,
      bin_dtype=self.bin_dtype,
      eval_fraction=self.eval_fraction,
    )

  def data_position(self) -> dict:
    """Besides (seed, step), what the batch of a step depends on."""
    return {
      **dataclasses.asdict(self.data_config()),
      "micro_batches": self.micro_batches,
      "batch_size": self.batch_size,
      "seq_len": self.seq_len,
    }


def build(cfg: RunConfig):
  """Model, engine and batches for a run; every bad input fails here, before any compile."""
  auto = cfg.strategy.strip().lower() == "auto"
  strategy = None if auto else parse_strategy(cfg.strategy)
  model_cfg = read_config(cfg.init_from) if cfg.init_from else get_config(cfg.model)
  mesh = make_mesh(*cfg.mesh) if cfg.mesh else make_mesh()
  model = Llama(model_cfg, DTYPES[cfg.dtype], cfg.remat, cfg.lora())
  if auto:  # probe this mesh and take the planner's pick (paro_jax/analysis/planner.py)
    from paro_jax.analysis.probe import auto_strategy

    name, why = auto_strategy(
      mesh,
      model_cfg,
      cfg.micro_batches,
      cfg.batch_size,
      cfg.seq_len,
      jnp.dtype(DTYPES[cfg.dtype]).itemsize,
      model.param_count(),
      model.trainable_count(),
      cfg.collectives,
      cfg.remat != "none",
    )
    if jax.process_index() == 0:
      print(f"paro-jax: --strategy auto picked {name}: {why}", flush=True)
    strategy = parse_strategy(name)
  tokens, eval_tokens = split_eval(
    load_tokens(cfg.data_config(), model_cfg.vocab), cfg.eval_fraction
  )
  optim = OptimConfig(learning_rate=cfg.lr, warmup_steps=cfg.warmup, total_steps=cfg.steps)
  engine = Engine(
    model,
    strategy,
    mesh,
    optim,
    micro_batches=cfg.micro_batches,
    collectives=cfg.collectives,
    wire=cfg.wire(),
    grad_dtype=cfg.grad_dtype,
  )
  engine.check_batch_size(cfg.batch_size)
  batches = Batches(tokens, cfg.micro_batches, cfg.batch_size, cfg.seq_len, cfg.seed)
  eval_batches = None
  if cfg.eval_every:
    eval_batches = Batches(
      eval_tokens,
      cfg.micro_batches,
      cfg.batch_size,
      cfg.seq_len,
      cfg.seed,
      what=f"the eval split (the last {cfg.eval_fraction:g} of the tokens)",
    )
  return engine, batches, eval_batches


def place_batch(engine: Engine, batches: Batches, step: int) -> jax.Array:
  """Batch `step` on the mesh; with several processes each reads and places only its rows."""
  if jax.process_count() == 1:
    return engine.shard_batch(batches(step))
  rows = batches.process_rows(jax.process_index(), jax.process_count())
  return engine.shard_local_batch(batches(step, rows), batches.shape)


def model_name(cfg: RunConfig) -> str:
  """The preset, or `hf:DIR` for a run started from HF weights."""
  return f"hf:{cfg.init_from}" if cfg.init_from else cfg.model


def run_meta(cfg: RunConfig, engine: Engine, step: int) -> RunMeta:
  return RunMeta(
    step=step,
    seed=cfg.seed,
    model_name=model_name(cfg),
    model_config=dataclasses.asdict(engine.model.cfg),
    strategy=str(engine.strategy),
    mesh=(engine.inter, engine.intra),
    dtype=cfg.dtype,
    data=cfg.data_position(),
    lora=dataclasses.asdict(engine.model.lora) if engine.model.lora else None,
  )


def start_state(cfg: RunConfig, engine: Engine, ckpt: Checkpointer) -> TrainState:
  """A fresh state (random, or --init-from's weights), or with --resume the newest checkpoint
  placed for this engine."""
  if not cfg.resume:
    if ckpt.steps():
      raise ValueError(
        f"{ckpt.directory} already holds checkpoints (steps {ckpt.steps()}): pass "
        f"--resume to continue that run, or another --out to start a new one"
      )
    if cfg.init_from:
      _, params = load_hf(cfg.init_from)  # its config is the engine's (build read it)
      # With LoRA: the HF weights are the frozen base; the adapters start fresh (B = 0).
      params = engine.model.with_adapters(params, jax.random.key(cfg.seed))
      return engine.state_from_params(params)
    return engine.init_state(jax.random.key(cfg.seed))
  state, meta = ckpt.restore(engine, model_name(cfg))
  was = {"seed": meta.seed, **meta.data}
  now = json.loads(json.dumps({"seed": cfg.seed, **cfg.data_position()}))  # tuples as lists
  for key in was:
    if was[key] != now[key]:
      warnings.warn(
        f"resuming with {key}={now[key]!r}, but the checkpoint was trained with "
        f"{was[key]!r}: the batches after step {meta.step} differ from an "
        f"uninterrupted run's",
        stacklevel=2,
      )
  print(
    f"paro-jax: resumed from {ckpt.directory}/{meta.step} (saved by strategy {meta.strategy} "
    f"on mesh {meta.mesh[0]}x{meta.mesh[1]})",
    flush=True,
  )
  return state


def kept_rows(metrics_path: str, upto: int) -> list[str]:
  """The metrics rows of steps <= upto: a resumed run redoes (and rewrites) the later ones."""
  if not os.path.exists(metrics_path):
    return []
  with open(metrics_path) as f:
    return [line for line in f if line.strip() and json.loads(line)["step"] <= upto]


def train(cfg: RunConfig) -> str:
  """Train and write RUN/metrics.jsonl and RUN/checkpoints; returns the metrics path."""
  engine, batches, eval_batches = build(cfg)
  model_cfg, inter, intra = engine.model.cfg, engine.inter, engine.intra
  n_params, n_trained = engine.model.param_count(), engine.model.trainable_count()
  itemsize = jnp.dtype(engine.compute_dtype).itemsize
  grad_itemsize = jnp.dtype(engine.grad_dtype).itemsize
  mem = model_state_bytes(
    engine.strategy, n_params, n_trained, inter, intra, itemsize, grad_itemsize
  )
  main = jax.process_index() == 0  # with several processes only process 0 logs and writes
  if main:
    lora = engine.model.lora
    what = (
      f"LoRA rank {lora.rank} on {','.join(lora.targets)}: {n_trained / 1e6:.3f}M of "
      f"{n_params / 1e6:.2f}M params trained"
      if lora
      else f"{n_params / 1e6:.2f}M params"
    )
    print(
      f"paro-jax: {model_name(cfg)} ({what}), strategy "
      f"{engine.strategy} on mesh {inter}x{intra} ({jax.device_count()} "
      f"{jax.devices()[0].platform} devices), A={cfg.micro_batches}, batch "
      f"{cfg.batch_size}x{cfg.seq_len}, {cfg.dtype}, collectives={cfg.collectives}, inter "
      f"wire params={cfg.inter_params} grads={cfg.inter_grads}, grads in {cfg.grad_dtype}; model "
      f"states {mem['total'] / 2**20:.2f} MiB/device",
      flush=True,
    )

  os.makedirs(cfg.out, exist_ok=True)
  ckpt = Checkpointer(os.path.join(cfg.out, CHECKPOINTS), cfg.keep)
  state = start_state(cfg, engine, ckpt)
  start = int(state.step)
  metrics_path = os.path.join(cfg.out, METRICS)
  rows = kept_rows(metrics_path, start) if main else []
  tokens_per_step = cfg.micro_batches * cfg.batch_size * cfg.seq_len
  flops_per_step = model_cfg.flops_per_token(cfg.seq_len) * tokens_per_step
  device_kind = jax.devices()[0].device_kind
  # One fixed eval batch, placed once: eval losses are comparable across steps and runs.
  eval_batch = place_batch(engine, eval_batches, 0) if eval_batches else None
  bar = tqdm(
    total=cfg.steps,
    initial=min(start, cfg.steps),
    desc=str(engine.strategy),
    unit="step",
    dynamic_ncols=True,
    disable=None if main else True,
  )
  last_time = time.perf_counter()
  saved = start if cfg.resume else None

  def save(state):
    nonlocal saved
    step = int(state.step)
    if step != saved:
      ckpt.save(state, run_meta(cfg, engine, step))
      saved = step

  with open(metrics_path if main else os.devnull, "w") as log:
    log.writelines(rows)
    log.flush()

    def record(step, metrics):
      nonlocal last_time
      jax.block_until_ready(metrics)
      now = time.perf_counter()
      row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
      # The first step of a process includes compilation; later ones are pure step time.
      row["step_time_s"] = now - last_time
      row["tokens_per_s"] = tokens_per_step / row["step_time_s"]
      util = mfu(flops_per_step, row["step_time_s"], jax.device_count(), device_kind)
      if util is not None:
        row["mfu"] = util
      last_time = now
      log.write(json.dumps(row) + "\n")
      log.flush()
      bar.set_postfix(
        loss=f"{row['loss']:.3f}",
        tok_s=f"{row['tokens_per_s']:.0f}",
        step=f"{row['step_time_s'] * 1e3:.0f}ms",
        mfu="n/a" if util is None else f"{util:.1%}",
        **({"eval": f"{row['eval_loss']:.3f}"} if "eval_loss" in row else {}),
      )
      bar.update(1)
      if bar.disable and main:  # no terminal: one line per step instead of a bar
        print(json.dumps(row), flush=True)

    pending = None
    try:
      for step in range(start, cfg.steps):
        state, metrics = engine.train_step(state, place_batch(engine, batches, step))
        # Read the previous step's metrics only after the next step is dispatched, so the host
        # never stalls the device.
        if pending is not None:
          record(*pending)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
          # Dispatched before the next step takes (donates) the state; read with the metrics.
          metrics = {**metrics, "eval_loss": engine.eval_loss(state, eval_batch)}
        pending = (step + 1, metrics)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
          save(state)  # asynchronous: returns once the arrays are copied off the device
      if pending is not None:
        record(*pending)
      save(state)
      ckpt.close()
    except KeyboardInterrupt:
      # Stop cleanly: log the finished step, checkpoint it, let the writes complete.
      if pending is not None:
        record(*pending)
      if not any(x.is_deleted() for x in jax.tree.leaves(state)):
        save(state)
      ckpt.close()
      bar.close()
      if main and saved is not None:
        print(
          f"\nparo-jax: stopped; checkpoint step {saved} is in {ckpt.directory}: continue "
          f"with the same command and --resume",
          flush=True,
        )
      raise
  bar.close()
  if main:
    print(
      f"paro-jax: wrote {metrics_path} and checkpoint step {saved} in {ckpt.directory}", flush=True
    )
  return metrics_path
