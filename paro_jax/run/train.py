"""The training loop behind `paro-jax train`: data, engine, progress, metrics, checkpoints."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import math
import os
import signal
import statistics
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from models.hf import load_hf, read_config
from models.llama import Llama, get_config, resolve_attention
from paro_jax.cluster import watch
from paro_jax.run.checkpoint import CHECKPOINTS, CheckpointError, Checkpointer, RunMeta
from paro_jax.run.config import RunConfig  # noqa: F401 - also imported from here
from paro_jax.run.divergence import DivergenceGuard
from paro_jax.run.fit import check_fits
from paro_jax.analysis.costs import model_state_bytes
from paro_jax.run.metrics import dump_row, read_rows
from paro_jax.run.data import Batches, DataChanged, expand_paths, load_tokens, split_eval
from paro_jax.run.examples import ExampleBatches
from paro_jax.run.instruct import TEXT
from paro_jax.run.sources import data_format, hf_directory, instruction_batches
from paro_jax.core.engine import DTYPES, Engine, OptimConfig, TrainState
from paro_jax.core.mesh import make_mesh
from paro_jax.core import collectives as comm
from paro_jax.core.names import AUTO_COLLECTIVES
from paro_jax.analysis.hardware import mfu
from paro_jax.analysis.auto import auto_strategy
from paro_jax.core.strategy import parse_strategy

METRICS = "metrics.jsonl"
LOCK = ".paro-jax.lock"  # held (flock) by the process-0 of the run using the directory


def build(cfg: RunConfig):
  """Model, engine and batches for a run; every bad input fails here, before any compile."""
  auto = cfg.strategy.strip().lower() == "auto"
  strategy = None if auto else parse_strategy(cfg.strategy)
  model_cfg = read_config(cfg.init_from) if cfg.init_from else get_config(cfg.model)
  mesh = make_mesh(*cfg.mesh) if cfg.mesh else make_mesh()
  platform, processes = jax.devices()[0].platform, jax.process_count()
  attention, why = resolve_attention(cfg.attention, platform, DTYPES[cfg.dtype], model_cfg.head_dim)
  if cfg.attention == "auto" and platform != "cpu" and jax.process_index() == 0:
    print(f"paro-jax: --attention {why}: {attention}", flush=True)
  model = Llama(model_cfg, DTYPES[cfg.dtype], cfg.remat, cfg.lora(), attention)
  collectives, _ = comm.resolve(cfg.collectives, platform, processes)
  if auto:  # probe this mesh, plan, and on H100/H200 check by XLA's estimate (analysis/auto.py)
    name, why, table = auto_strategy(
      mesh,
      cfg,
      model_cfg,
      model.param_count(),
      model.trainable_count(),
      collectives,
      attention,
      cfg.compile_top,
    )
    if jax.process_index() == 0:
      if table:
        print(table, flush=True)
      print(f"paro-jax: --strategy auto picked {name}: {why}", flush=True)
    strategy = parse_strategy(name)
  check_fits(cfg, model, strategy, *mesh.devices.shape, attention, jax.local_devices())
  collectives, why = comm.resolve(cfg.collectives, platform, processes, strategy)
  if cfg.collectives == AUTO_COLLECTIVES and jax.process_index() == 0:
    print(f"paro-jax: --collectives {why}: {collectives}", flush=True)
  data = cfg.data_config()
  files = expand_paths(data.paths) if data.paths else []
  fmt = data_format(files, data.text_field, data.data_format)
  if fmt != TEXT:  # instruction data: examples with loss masks (run/examples.py)
    batches, eval_batches, dropped = instruction_batches(
      data,
      files,
      fmt,
      hf_directory(data, cfg.init_from),
      model_cfg.vocab,
      cfg.micro_batches,
      cfg.batch_size,
      cfg.seq_len,
      cfg.seed,
      cfg.micro_batches * cfg.eval_batches if cfg.eval_every else None,
    )
    batches.note = dropped
  else:
    tokens, eval_tokens = split_eval(load_tokens(data, model_cfg.vocab), cfg.eval_fraction)
    batches = Batches(tokens, cfg.micro_batches, cfg.batch_size, cfg.seq_len, cfg.seed)
    eval_batches = None
    if cfg.eval_every:
      # --eval-batches K: one eval batch of K step batches, so one program scores them all (K
      # programs in flight at once can deadlock XLA:CPU's collectives).
      eval_batches = Batches(
        eval_tokens,
        cfg.micro_batches * cfg.eval_batches,
        cfg.batch_size,
        cfg.seq_len,
        cfg.seed,
        what=f"the eval split (the last {cfg.eval_fraction:g} of the tokens)",
      )
  optim = OptimConfig(learning_rate=cfg.lr, warmup_steps=cfg.warmup, total_steps=cfg.steps)
  engine = Engine(
    model,
    strategy,
    mesh,
    optim,
    micro_batches=cfg.micro_batches,
    collectives=collectives,
    wire=cfg.wire(),
    grad_dtype=cfg.grad_dtype,
    error_feedback=cfg.error_feedback,
    param_delta=cfg.param_delta,
  )
  engine.check_batch_size(cfg.batch_size)
  return engine, batches, eval_batches


def place_batch(engine: Engine, batches: Batches, step: int) -> jax.Array:
  """Batch `step` on the mesh; with several processes each reads and places only its rows.
  The eval batches may hold more micro-batches than a step."""
  other = batches.shape[0] != engine.micro_batches
  if jax.process_count() == 1:
    return engine.shard_batch(batches(step), any_micro_batches=other)
  rows = batches.process_rows(jax.process_index(), jax.process_count())
  return engine.shard_local_batch(batches(step, rows), batches.shape, any_micro_batches=other)


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
    train=schedule_of(cfg),
  )


def schedule_of(cfg: RunConfig) -> dict:
  """What the learning-rate schedule depends on."""
  return {"steps": cfg.steps, "lr": cfg.lr, "warmup": cfg.warmup}


def start_state(cfg: RunConfig, engine: Engine, ckpt: Checkpointer) -> TrainState:
  """A fresh state (random, or --init-from's weights), or with --resume the newest intact
  checkpoint placed for this engine."""
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
  state, meta = ckpt.restore(engine, model_name(cfg), set_aside=True)
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
  if meta.train is not None and meta.train != schedule_of(cfg):
    changed = [k for k in ("steps", "lr", "warmup") if meta.train.get(k) != schedule_of(cfg)[k]]
    warnings.warn(
      f"resuming with {' '.join(f'--{k} {schedule_of(cfg)[k]:g}' for k in changed)}, but the "
      f"checkpoint (step {meta.step}) was trained with "
      f"{' '.join(f'--{k} {meta.train[k]:g}' for k in changed)}: the learning-rate schedule "
      f"changed from step {meta.step} on",
      stacklevel=2,
    )
  print(
    f"paro-jax: resumed from {ckpt.directory}/{meta.step} (saved by strategy {meta.strategy} "
    f"on mesh {meta.mesh[0]}x{meta.mesh[1]})",
    flush=True,
  )
  return state


def _set_aside_metrics(metrics_path: str) -> None:
  """Rename the metrics of a run that saved no checkpoint to metrics.unsaved-<n>.jsonl."""
  stem, n = metrics_path[: -len(".jsonl")], 1
  while os.path.exists(f"{stem}.unsaved-{n}.jsonl"):
    n += 1
  os.rename(metrics_path, f"{stem}.unsaved-{n}.jsonl")
  print(
    f"paro-jax: {os.path.dirname(metrics_path) or '.'} holds the metrics of a run that stopped "
    f"before its first checkpoint: kept as {stem}.unsaved-{n}.jsonl; starting from step 0",
    flush=True,
  )


def kept_rows(metrics_path: str, upto: int) -> list[str]:
  """The metrics rows of steps <= upto: a resumed run redoes (and rewrites) the later ones."""
  if not os.path.exists(metrics_path):
    return []
  return [dump_row(r) for r in read_rows(metrics_path) if r["step"] <= upto]


class NonFiniteSteps(ValueError):
  """Too many consecutive steps with a non-finite loss or gradient norm."""


class Diverged(ValueError):
  """The divergence guard stopped the run: too many steps in a row out of their band."""


class Interrupted(KeyboardInterrupt):
  """The run was stopped by a signal (SIGINT, SIGTERM) after checkpointing."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class StopSignals:
  """The first SIGINT or SIGTERM asks the loop to stop at the next step boundary (it then logs
  and checkpoints the finished step and exits); a second one exits at once, without waiting for
  the checkpoint (a checkpoint is only ever listed once complete).

  Only in the main thread. With several processes, the processes agree each step on whether any
  of them was asked to stop (`StopVote`), so they all stop after the same step and save it
  together."""

  def __init__(self):
    self.signum: int | None = None
    self.dispatched = 0  # train_step calls returned (the first one includes the compile)
    self.dispatched_at_signal = 0
    self.ckpt: Checkpointer | None = None  # the run's, once opened: what a stop interrupts
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    if self.signum is not None:
      # Stopped: what is left (the checkpointer's close, jax.distributed's shutdown at exit) can
      # wait on the other processes, and a signal then (srun's SIGTERM once another task has
      # exited 143) must still end this one with 128 + the signal, as documented, not by the
      # signal's default action ("Terminated"): the handler stays.
      return
    for sig, old in self._old.items():
      signal.signal(sig, old)

  def _handle(self, signum, frame):
    if self.signum is not None:
      os.write(2, f"\nparo-jax: stopped at once; {self._interrupted()}\n".encode())
      os._exit(128 + signum)
    self.signum, self.dispatched_at_signal = signum, self.dispatched
    what = (
      "stopping at a step all processes agree on and checkpointing it"
      if jax.process_count() > 1
      else "stopping before the first step (no checkpoint)"
      if self.dispatched == 0
      else "stopping after this step and checkpointing it"
    )
    name = signal.Signals(signum).name
    os.write(2, f"\nparo-jax: {name}: {what}; send it again to stop at once\n".encode())

  def _interrupted(self) -> str:
    """What stopping at once leaves behind."""
    step = self.ckpt.writing() if self.ckpt is not None else None
    if step is not None:
      return f"checkpoint step {step} was being written and is not kept (the previous one is)"
    when = " during the first compile" if self.dispatched == 0 else ""
    return f"no checkpoint was being written{when}"


class StopVote:
  """With several processes: whether any process was asked to stop, the same answer on all.

  A one-int all-reduce (max) over every device, dispatched at each step like the step itself; its
  result is read after the previous step's metrics were, so the host waits for nothing new."""

  def __init__(self):
    mesh = Mesh(np.array(jax.devices()), ("all",))
    self.sharding = NamedSharding(mesh, PartitionSpec("all"))
    self.local = jax.local_device_count()
    self.reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def __call__(self, flag: bool) -> jax.Array:
    local = np.full((self.local,), int(flag), np.int32)
    return self.reduce(jax.make_array_from_process_local_data(self.sharding, local))


class RunLock:
  """An exclusive lock on a run directory while a run writes it (process 0 only)."""

  def __init__(self, out: str, main: bool):
    self.path, self.main, self.fd = os.path.join(out, LOCK), main, None

  def __enter__(self):
    if not self.main:
      return self
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.read(fd, 100).decode(errors="replace").strip() or "another process"
      os.close(fd)
      raise ValueError(
        f"{os.path.dirname(self.path)} is in use by another run ({holder}): wait for it to "
        f"finish, stop it, or pass another --out"
      ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode())
    self.fd = fd
    return self

  def __exit__(self, *exc):
    if self.fd is not None:
      os.close(self.fd)  # releases the lock
      self.fd = None


def train(cfg: RunConfig) -> str:
  """Train and write RUN/metrics.jsonl and RUN/checkpoints; returns the metrics path."""
  engine, batches, eval_batches = build(cfg)
  inter, intra = engine.inter, engine.intra
  n_params, n_trained = engine.model.param_count(), engine.model.trainable_count()
  itemsize = jnp.dtype(engine.compute_dtype).itemsize
  grad_itemsize = jnp.dtype(engine.grad_dtype).itemsize
  mem = model_state_bytes(
    engine.strategy,
    n_params,
    n_trained,
    inter,
    intra,
    itemsize,
    grad_itemsize,
    residual_bytes=4 * engine.residual_size,
    reference_bytes=engine.reference_bytes,
  )
  main = jax.process_index() == 0  # with several processes only process 0 logs and writes
  processes = jax.process_count()
  who = f"process {jax.process_index()} of {processes}: " if processes > 1 else ""
  if cfg.progress_timeout:
    watch.Watchdog(cfg.progress_timeout, who=who).start()
  os.makedirs(cfg.out, exist_ok=True)
  # Signals are taken over before anything is read or compiled: a stop before the first step
  # finishes leaves no checkpoint (and an empty metrics.jsonl).
  with RunLock(cfg.out, main), StopSignals() as stop:
    # The banner comes once the signals are taken over: a stop sent after it is always seen.
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
        f"{cfg.batch_size}x{cfg.seq_len}, {cfg.dtype}, collectives={engine.collectives}, inter "
        f"wire params={cfg.inter_params} (delta {engine.param_delta_note}) grads="
        f"{cfg.inter_grads} (error feedback {engine.feedback_note}), grads in {cfg.grad_dtype}; "
        f"model states {mem['total'] / 2**20:.2f} MiB/device",
        flush=True,
      )
      if isinstance(batches, ExampleBatches):
        print(batches.describe(engine.model.attention), flush=True)
        if batches.note:
          print(batches.note, flush=True)
    return _train_locked(cfg, engine, batches, eval_batches, main, stop)


def _train_locked(cfg, engine, batches, eval_batches, main, stop) -> str:
  model_cfg = engine.model.cfg
  metrics_path = os.path.join(cfg.out, METRICS)
  ckpt = Checkpointer(os.path.join(cfg.out, CHECKPOINTS), cfg.keep)
  stop.ckpt = ckpt
  try:
    written = os.path.exists(metrics_path) and os.path.getsize(metrics_path)
    if not ckpt.steps() and (written or not main):
      # A run that stopped before its first checkpoint: nothing to resume; its metrics are
      # set aside (not deleted) and the run starts over, with or without --resume. (Process 0
      # decides: the others follow, or it fails alone.)
      cfg = dataclasses.replace(cfg, resume=False)
      if main:
        _set_aside_metrics(metrics_path)
    state = start_state(cfg, engine, ckpt)
  except BaseException:
    ckpt.close()
    raise
  start = int(state.step)
  rows = kept_rows(metrics_path, start) if main and cfg.resume else []
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
  bad = {"total": 0, "streak": 0}  # steps with a non-finite loss or gradient norm (skipped)
  done = []  # this process's rows (for the summary)
  guard = DivergenceGuard(cfg.guard(), model_cfg.vocab)
  for line in rows:  # the band of the run so far
    old = json.loads(line)
    guard.seed(old["loss"], old["grad_norm"])
  # The newest checkpoint whose weights the next step found in band (its loss and gradient
  # norm are those of the checkpoint's weights): kept by --keep, and where a stop points. The
  # checkpoint a run resumes from counts as good.
  good = {"step": saved, "candidate": saved}
  if saved is not None:
    ckpt.protect(saved)

  def save(state, why=""):
    nonlocal saved
    step = int(state.step)
    if step == saved:
      return
    if bad["streak"]:  # the weights did not take this step: keep the newest good checkpoint
      if main:
        bar.write(f"paro-jax: step {step} was non-finite (skipped): no checkpoint of it{why}")
      return
    if guard.streak and cfg.divergence_guard == "stop":
      if main:
        bar.write(f"paro-jax: step {step} is out of its band: no checkpoint of it{why}")
      return
    ckpt.save(state, run_meta(cfg, engine, step))
    saved = good["candidate"] = step

  def record(step, metrics):
    nonlocal last_time
    jax.block_until_ready(metrics)
    now = time.perf_counter()
    # targets: the target tokens the step's loss is the mean over (all but each row's first
    # token of a token stream; instruction data's completion or assistant tokens)
    row = {"step": step, **{k: int(v) if k == "targets" else float(v) for k, v in metrics.items()}}
    watch.finished(step)
    # The first step of a process includes compilation; later ones are pure step time.
    row["step_time_s"] = now - last_time
    row["tokens_per_s"] = tokens_per_step / row["step_time_s"]
    util = mfu(flops_per_step, row["step_time_s"], jax.device_count(), device_kind)
    if util is not None:
      row["mfu"] = util
    last_time = now
    skipped = not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]))
    bad["streak"] = bad["streak"] + 1 if skipped else 0
    bad["total"] += skipped
    if skipped:
      row["skipped"] = True  # the weights and optimizer state were left as they were
    out_of_band = guard.observe(step, row["loss"], row["grad_norm"])
    if out_of_band is None and good["candidate"] == step - 1:
      good["step"] = step - 1  # this step's loss and norm are the checkpoint's weights'
      ckpt.protect(good["step"])
    elif out_of_band is not None and not skipped:
      row["out_of_band"] = True
      if cfg.divergence_guard == "warn" and guard.streak == guard.cfg.patience and main:
        warnings.warn(
          f"training may diverge: step {guard.first}: {guard.first_why}, and {guard.streak} "
          f"steps in a row out of band since; {_good_line(good['step'], ckpt)}",
          stacklevel=2,
        )
    done.append(row)
    line = dump_row(row)
    _append(log, [line], metrics_path, saved, ckpt)
    fmt = lambda v, spec: "nan" if not math.isfinite(v) else format(v, spec)  # noqa: E731
    bar.set_postfix(
      loss=fmt(row["loss"], ".3f"),
      tok_s=f"{row['tokens_per_s']:.0f}",
      step=f"{row['step_time_s'] * 1e3:.0f}ms",
      mfu="n/a" if util is None else f"{util:.1%}",
      **({"eval": fmt(row["eval_loss"], ".3f")} if "eval_loss" in row else {}),
      **({"skipped": bad["total"]} if bad["total"] else {}),
    )
    bar.update(1)
    if bar.disable and main:  # no terminal: one line per step instead of a bar
      print(line, end="", flush=True)
    if bad["streak"] >= cfg.max_bad_steps:
      raise NonFiniteSteps(
        f"step {step}: loss {row['loss']}, gradient norm {row['grad_norm']}: "
        f"{bad['streak']} non-finite steps in a row (steps {step - bad['streak'] + 1}-{step}; "
        f"--max-bad-steps {cfg.max_bad_steps}). They did not change the weights; first sign of "
        f"divergence: step {guard.first} ({guard.first_why}); {_keep_good(good['step'], ckpt)}. "
        f"Lower --lr or check the data"
      )
    if guard.tripped and cfg.divergence_guard == "stop":
      raise Diverged(
        f"training diverged at step {guard.first}: {guard.first_why}; {guard.streak} steps in a "
        f"row out of band (steps {guard.first}-{step}; --divergence-patience "
        f"{guard.cfg.patience}); {_keep_good(good['step'], ckpt)}. Lower --lr, or pass "
        f"--divergence-guard warn (or off) to train on regardless"
      )

  pending = None
  vote = StopVote() if jax.process_count() > 1 else None
  with open(metrics_path if main else os.devnull, "w") as log:
    _append(log, rows, metrics_path, saved, ckpt)
    try:
      bar.set_postfix_str("compiling the training step", refresh=True)
      for step in range(start, cfg.steps):
        if vote is None and stop.signum is not None:
          break
        asked = vote(stop.signum is not None) if vote else None
        state, metrics = engine.train_step(state, place_batch(engine, batches, step))
        stop.dispatched += 1
        # Read the previous step's metrics only after the next step is dispatched, so the host
        # never stalls the device.
        if pending is not None:
          record(*pending)
        if asked is not None and int(asked):  # some process was asked to stop: all stop here
          stop.signum = stop.signum or signal.SIGINT
          stop.dispatched_at_signal = stop.dispatched
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
          # Dispatched before the next step takes (donates) the state; read with the metrics.
          metrics = {**metrics, "eval_loss": engine.eval_loss(state, eval_batch)}
        pending = (step + 1, metrics)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
          record(*pending)  # every checkpointed step has its metrics row, and is finite
          pending = None
          save(state)  # asynchronous: returns once the arrays are copied off the device
        if asked is not None and int(asked):
          break
      if vote is None and stop.signum is not None and stop.dispatched_at_signal == 0:
        pending = None  # stopped during the first compile: nothing was asked for
      if pending is not None:
        record(*pending)
        pending = None
      if stop.signum is None or stop.dispatched_at_signal:
        save(state, why=": stopping" if stop.signum is not None else "")
      ckpt.close()
    except KeyboardInterrupt:
      # Raised where the signal handler is not installed (another thread, several processes):
      # log the finished step, checkpoint it (unless it is the start), let the writes complete.
      if pending is not None:
        record(*pending)
      if not any(x.is_deleted() for x in jax.tree.leaves(state)) and int(state.step) > start:
        save(state)
      ckpt.close()
      bar.close()
      _stopped(main, saved, ckpt)
      raise
    except DataChanged as e:
      # A data file shrank under the run (run/data.py): the steps done are sound, saved as on a
      # stop (one process: with several, saving needs all of them, and the others are waiting in
      # a collective for this one). The line says where to continue from.
      if pending is not None:
        record(*pending)
      intact = not any(x.is_deleted() for x in jax.tree.leaves(state))
      if jax.process_count() == 1 and intact and int(state.step) > start:
        save(state)
      ckpt.close()
      bar.close()
      kept = f"checkpoint step {saved} is in {ckpt.directory}" if saved is not None else None
      raise DataChanged(
        f"{e}; {kept or 'no checkpoint was saved'}: restore the file (or prepare the data "
        f"again) and run the same command" + (" with --resume" if kept else "")
      ) from None
    except BaseException as e:
      try:
        ckpt.close()  # lets a save in flight complete; the newest checkpoint stays as it is
      finally:
        bar.close()
      if jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
        # A collective failed: another process is gone (SIGKILL, a lost node). Its task's line
        # from srun names it; this one says which step the run got to.
        raise watch.peer_lost(e, jax.process_index(), jax.process_count()) from None
      raise
  bar.close()
  if stop.signum is not None:
    _stopped(main, saved, ckpt)
    raise Interrupted(stop.signum)
  if main:
    print(_summary(done, bad["total"], metrics_path, saved, ckpt.directory), flush=True)
    if getattr(batches, "note", None):  # the examples left out, again at the end
      print(batches.note, flush=True)
  return metrics_path


def _append(log, lines: list[str], path: str, saved: int | None, ckpt: Checkpointer) -> None:
  """Write metrics rows; a full disk (the checkpoints may have filled it) is one clear line."""
  try:
    log.writelines(lines)
    log.flush()
  except OSError as e:
    kept = (
      f"checkpoint step {saved} in {ckpt.directory} is intact; the steps after it are not saved"
      if saved is not None
      else "no checkpoint was saved"
    )
    what = "the disk is full" if e.errno == errno.ENOSPC else e.strerror or str(e)
    raise CheckpointError(
      e.errno,
      f"{what}: could not write {path}; {kept}. Free space on its disk or pass another --out",
    ) from None


def _good_line(good: int | None, ckpt: Checkpointer) -> str:
  if good is None:
    return "no checkpoint was saved before it"
  return f"the newest checkpoint before it is step {good} in {ckpt.directory}"


def _keep_good(good: int | None, ckpt: Checkpointer) -> str:
  """Set aside the checkpoints newer than `good` (saved after divergence began) and say where
  the run continues from."""
  ckpt.wait()
  later = [s for s in ckpt.steps() if good is None or s > good]
  moved = ckpt.set_aside(later, "diverged") if later else ""
  if good is None:
    return f"no checkpoint was saved before it{moved}: the same command starts over"
  return (
    f"the newest checkpoint before it is step {good} in {ckpt.directory}{moved}: continue from "
    f"it with the same command and --resume"
  )


def _stopped(main: bool, saved: int | None, ckpt: Checkpointer) -> None:
  if not main:
    return
  if saved is None:
    print("\nparo-jax: stopped before any step finished; nothing was saved", flush=True)
  else:
    print(
      f"\nparo-jax: stopped; checkpoint step {saved} is in {ckpt.directory}: continue "
      f"with the same command and --resume",
      flush=True,
    )


def _summary(rows, skipped, metrics_path, saved, directory) -> str:
  """The last line of a run: final loss, eval loss, median tokens/s, where things are."""
  if not rows:
    return f"paro-jax: nothing to do; checkpoint step {saved} is in {directory}"
  last = rows[-1]
  evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
  timed = [r["tokens_per_s"] for r in rows[1:]] or [last["tokens_per_s"]]  # the first: compile
  parts = [
    f"step {last['step']}: loss {last['loss']:.4f}",
    f"eval loss {evals[-1]:.4f}" if evals else "no eval (--eval-every)",
    f"median {statistics.median(timed):.0f} tokens/s",
  ]
  if skipped:
    parts.append(f"{skipped} non-finite steps skipped")
  return f"paro-jax: done, {', '.join(parts)}; wrote {metrics_path} and " + (
    f"checkpoint step {saved} in {directory}" if saved is not None else "no checkpoint"
  )
