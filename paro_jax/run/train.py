"""The training loop behind `paro-jax train`: progress, metrics, checkpoints (the run is set up by
run/setup.py, stopped by run/stopping.py, reported by run/reporting.py)."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import signal
import time
import warnings

import jax
from tqdm import tqdm

from paro_jax.analysis.hardware import mfu
from paro_jax.cluster import watch
from paro_jax.run.checkpoint import CHECKPOINTS, CheckpointError, Checkpointer
from paro_jax.run.config import RunConfig
from paro_jax.run.divergence import DivergenceGuard
from paro_jax.run.fit import run_memory
from paro_jax.run.metrics import METRICS, dump_row
from paro_jax.run.reporting import _stopped, _summary
from paro_jax.run.setup import (
  _set_aside_metrics,
  build,
  kept_rows,
  model_name,
  place_batch,
  run_meta,
  start_state,
)
from paro_jax.run.stopping import (
  Diverged,
  Interrupted,
  NonFiniteSteps,
  RunLock,
  StopSignals,
  StopVote,
)


def train(cfg: RunConfig) -> str:
  """Train and write RUN/metrics.jsonl and RUN/checkpoints; returns the metrics path."""
  engine, batches, eval_batches = build(cfg)
  inter, intra = engine.inter, engine.intra
  n_params, n_trained = engine.model.param_count(), engine.model.trainable_count()
  platform = jax.devices()[0].platform
  # The estimate build() checked: analysis/memory.py's, as `paro-jax plan` prints it.
  need = run_memory(cfg, engine.model, engine.strategy, inter, intra, gpu=platform != "cpu")
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
        f"wire params={cfg.wire.inter_params} (delta {engine.param_delta_note}) grads="
        f"{cfg.wire.inter_grads} (error feedback {engine.feedback_note}), grads in "
        f"{cfg.wire.grad_dtype}; memory {need['total'] / 2**20:.2f} MiB/device (model states "
        f"{need['model_states']['total'] / 2**20:.2f}, activations "
        f"{need['activations']['total'] / 2**20:.2f}; the planner's estimate)",
        flush=True,
      )
    return _train_locked(cfg, engine, batches, eval_batches, main, stop)


def _train_locked(cfg, engine, batches, eval_batches, main, stop) -> str:
  model_cfg = engine.model.cfg
  metrics_path = os.path.join(cfg.out, METRICS)
  ckpt = Checkpointer(os.path.join(cfg.out, CHECKPOINTS), cfg.checkpoints.keep)
  stop.ckpt = ckpt
  try:
    written = os.path.exists(metrics_path) and os.path.getsize(metrics_path)
    if not ckpt.steps() and (written or not main):
      # A run that stopped before its first checkpoint: nothing to resume; its metrics are
      # set aside (not deleted) and the run starts over, with or without --resume. (Process 0
      # decides: the others follow, or it fails alone.)
      cfg = dataclasses.replace(cfg, checkpoints=dataclasses.replace(cfg.checkpoints, resume=False))
      if main:
        _set_aside_metrics(metrics_path)
    state = start_state(cfg, engine, ckpt)
  except BaseException:
    ckpt.close()
    raise
  start = int(state.step)
  rows = kept_rows(metrics_path, start) if main and cfg.checkpoints.resume else []
  tokens_per_step = cfg.micro_batches * cfg.batch_size * cfg.seq_len
  flops_per_step = model_cfg.flops_per_token(cfg.seq_len) * tokens_per_step
  device_kind = jax.devices()[0].device_kind
  # One fixed eval batch, placed once: eval losses are comparable across steps and runs.
  eval_batch = place_batch(engine, eval_batches, 0) if eval_batches else None
  bar = tqdm(
    total=cfg.optimizer.steps,
    initial=min(start, cfg.optimizer.steps),
    desc=str(engine.strategy),
    unit="step",
    dynamic_ncols=True,
    disable=None if main else True,
  )
  last_time = time.perf_counter()
  saved = start if cfg.checkpoints.resume else None
  bad = {"total": 0, "streak": 0}  # steps with a non-finite loss or gradient norm (skipped)
  done = []  # this process's rows (for the summary)
  guard = DivergenceGuard(cfg.guard, model_cfg.vocab)
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
    if guard.streak and cfg.guard.mode == "stop":
      if main:
        bar.write(f"paro-jax: step {step} is out of its band: no checkpoint of it{why}")
      return
    ckpt.save(state, run_meta(cfg, engine, step))
    saved = good["candidate"] = step

  def record(step, metrics):
    nonlocal last_time
    jax.block_until_ready(metrics)
    now = time.perf_counter()
    row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
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
      if cfg.guard.mode == "warn" and guard.streak == guard.cfg.patience and main:
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
    if guard.tripped and cfg.guard.mode == "stop":
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
      for step in range(start, cfg.optimizer.steps):
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
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
          # Dispatched before the next step takes (donates) the state; read with the metrics.
          metrics = {**metrics, "eval_loss": engine.eval_loss(state, eval_batch)}
        pending = (step + 1, metrics)
        if cfg.checkpoints.every and (step + 1) % cfg.checkpoints.every == 0:
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
