"""The per-step bookkeeping of a run of `paro-jax train`: each finished step's metrics row
(metrics.jsonl, the progress bar, from process 0 the sinks of run/sinks.py), the streak of
non-finite steps, the divergence band (run/divergence.py), which checkpoints to save, and which
one is the newest good one (kept by --keep, named when the run stops). The loop (run/train.py)
calls `record` for each finished step and `save` where it checkpoints; what it raises stops the
run.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import time
import warnings

import jax
import numpy as np
from tqdm import tqdm

from paro_jax.analysis.gpu.hardware import mfu
from paro_jax.cluster import watch
from paro_jax.core.state import TrainState
from paro_jax.core.engine import Engine
from paro_jax.run import reporting
from paro_jax.run.checkpoint import Checkpointer
from paro_jax.run.checkpoint_errors import CheckpointError
from paro_jax.run.config import RunConfig
from paro_jax.run.divergence import DivergenceGuard
from paro_jax.core.config import options, value_at
from paro_jax.run.metrics import METRICS, dump_row, read_rows
from paro_jax.run.setup import run_meta
from paro_jax.run.sinks import Sinks
from paro_jax.run.stopping import Diverged, NonFiniteSteps
from paro_jax.run.stops import end_of_turn_id


class Bookkeeper:
  """The state of a run between its steps, and what is done with each step's metrics.

  Opened with the metrics rows a resumed run keeps (`rows`, written first and seeding the band);
  `start` is the step the run starts from; `data_files` the data's fingerprint its checkpoints
  record. Only process 0 (`main`) writes and prints."""

  def __init__(
    self,
    cfg: RunConfig,
    engine: Engine,
    ckpt: Checkpointer,
    start: int,
    rows: list[str],
    main: bool,
    data_files: dict | None = None,
    chat_template: str | None = None,
  ):
    self.cfg, self.engine, self.ckpt, self.main = cfg, engine, ckpt, main
    self.data_files = data_files  # what the checkpoints record of the data (data/fingerprint.py)
    self.chat_template = chat_template  # the text the chat records were rendered with
    # the token ending an answer in that template: recorded, export needs no source directory
    self.end_of_turn = end_of_turn_id(chat_template, cfg.data.tokenizer)
    self.path = os.path.join(cfg.out, METRICS)
    self.tokens_per_step = cfg.micro_batches * cfg.batch_size * cfg.seq_len
    self.flops_per_step = engine.model.cfg.flops_per_token(cfg.seq_len) * self.tokens_per_step
    self.device_kind = jax.devices()[0].device_kind
    # The learning rate of each update (the engine's schedule, read once); a non-finite step
    # leaves Adam's count as it was, so the next one takes the same rate. A resumed run counts
    # its checkpoint's steps as updates (skipped steps before it are not known).
    lr_of = engine.optim.lr_schedule()
    self.lrs = np.asarray(jax.device_get(lr_of(np.arange(max(cfg.optimizer.steps, 1)))))
    self.updates = start
    self.bar = tqdm(
      total=cfg.optimizer.steps,
      initial=min(start, cfg.optimizer.steps),
      desc=str(engine.strategy),
      unit="step",
      dynamic_ncols=True,
      disable=None if main else True,
    )
    self.last_time = time.perf_counter()
    self.saved = start if cfg.checkpoints.resume else None  # the newest checkpoint of this run
    self.bad_streak = self.bad_total = 0  # steps with a non-finite loss or gradient norm
    self.rows: list[dict] = []  # this process's rows (for the summary)
    self.guard = DivergenceGuard(cfg.guard, engine.model.cfg.vocab)
    for line in rows:  # the band of the run so far
      old = json.loads(line)
      self.guard.seed(old["loss"], old["grad_norm"])
    # The newest checkpoint whose weights the next step found in band (its loss and gradient
    # norm are those of the checkpoint's weights): kept by --keep, and where a stop points. The
    # checkpoint a run resumes from counts as good.
    self.good = self.candidate = self.saved
    if self.saved is not None:
      ckpt.protect(self.saved)
    self.sinks = None
    if main:  # opened before metrics.jsonl is rewritten: it says what the sinks were given
      kept = [json.loads(line) for line in rows]
      logged_to = _last_step(self.path) if start else None
      params = {path: value_at(cfg, path) for path, _ in options(type(cfg))}
      self.sinks = Sinks(cfg.sinks, cfg.out, start, kept, logged_to, params)
    self.log = open(self.path if main else os.devnull, "w")  # noqa: SIM115 - closed by __exit__
    try:
      self._write(rows)
    except BaseException:
      self.__exit__()
      raise

  def __enter__(self):
    return self

  def __exit__(self, *_exc):
    self.log.close()
    self.bar.close()
    if self.sinks is not None:
      self.sinks.close()

  def save(self, state: TrainState, why: str = "") -> None:
    """Checkpoint `state` (asynchronously), unless it is saved already, its weights did not
    take the step (non-finite), or with `--divergence-guard stop` the step is out of band."""
    step = int(state.step)
    if step == self.saved:
      return
    if self.bad_streak:  # the weights did not take this step: keep the newest good checkpoint
      self._say(f"paro-jax: step {step} was non-finite (skipped): no checkpoint of it{why}")
      return
    if self.guard.streak and self.cfg.guard.mode == "stop":
      self._say(f"paro-jax: step {step} is out of its band: no checkpoint of it{why}")
      return
    meta = run_meta(self.cfg, self.engine, step, self.data_files, self.chat_template)
    self.ckpt.save(state, dataclasses.replace(meta, end_of_turn=self.end_of_turn))
    self.saved = self.candidate = step

  def record(self, step: int, metrics: dict) -> None:
    """The metrics of finished step `step` (reading them waits for it): its row, the streaks,
    the band, the good checkpoint; raises NonFiniteSteps or Diverged when the run must stop."""
    row = self._row(step, metrics)
    skipped = not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]))
    self.bad_streak = self.bad_streak + 1 if skipped else 0
    self.bad_total += skipped
    if skipped:
      row["skipped"] = True  # the weights and optimizer state were left as they were
    out_of_band = self.guard.observe(step, row["loss"], row["grad_norm"])
    if out_of_band is None and self.candidate == step - 1:
      self.good = step - 1  # this step's loss and norm are the checkpoint's weights'
      self.ckpt.protect(self.good)
    elif out_of_band is not None and not skipped:
      row["out_of_band"] = True
      self._warn_once_out_of_band()
    self.rows.append(row)
    line = dump_row(row)
    self._write([line])
    if self.sinks is not None:
      self.sinks.write(json.loads(line))  # as metrics.jsonl holds it (NaN: null, no figure)
    self._show(row, line)
    self._stop_if_diverged(step, row)

  def _row(self, step: int, metrics: dict) -> dict:
    jax.block_until_ready(metrics)
    now = time.perf_counter()
    # targets: the target tokens the step's loss is the mean over (all but each row's first
    # token of a token stream; instruction data's completion or assistant tokens)
    row = {"step": step, **{k: int(v) if k == "targets" else float(v) for k, v in metrics.items()}}
    row["lr"] = float(self.lrs[min(self.updates, len(self.lrs) - 1)])
    if math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]):
      self.updates += 1
    watch.finished(step)
    # The first step of a process includes compilation; later ones are pure step time.
    row["step_time_s"] = now - self.last_time
    row["tokens_per_s"] = self.tokens_per_step / row["step_time_s"]
    util = mfu(self.flops_per_step, row["step_time_s"], jax.device_count(), self.device_kind)
    if util is not None:
      row["mfu"] = util
    self.last_time = now
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    if all(p is not None for p in peaks):  # GPUs and TPUs; the CPU keeps no such count
      row["peak_memory_gib"] = max(peaks) / 2**30
    return row

  def _warn_once_out_of_band(self) -> None:
    guard = self.guard
    if self.cfg.guard.mode == "warn" and guard.streak == guard.cfg.patience and self.main:
      warnings.warn(
        f"training may diverge: step {guard.first}: {guard.first_why}, and {guard.streak} "
        f"steps in a row out of band since; {reporting.good_line(self.good, self.ckpt)}",
        stacklevel=3,
      )

  def _stop_if_diverged(self, step: int, row: dict) -> None:
    cfg, guard, streak = self.cfg, self.guard, self.bad_streak
    if streak >= cfg.max_bad_steps:
      raise NonFiniteSteps(
        f"step {step}: loss {row['loss']}, gradient norm {row['grad_norm']}: "
        f"{streak} non-finite steps in a row (steps {step - streak + 1}-{step}; "
        f"--max-bad-steps {cfg.max_bad_steps}). They did not change the weights; first sign of "
        f"divergence: step {guard.first} ({guard.first_why}); {self._keep_good()}. "
        f"Lower --lr or check the data"
      )
    if guard.tripped and cfg.guard.mode == "stop":
      raise Diverged(
        f"training diverged at step {guard.first}: {guard.first_why}; {guard.streak} steps in a "
        f"row out of band (steps {guard.first}-{step}; --divergence-patience "
        f"{guard.cfg.patience}); {self._keep_good()}. Lower --lr, or pass "
        f"--divergence-guard warn (or off) to train on regardless"
      )

  def _keep_good(self) -> str:
    """Set aside the checkpoints newer than the good one (saved after divergence began) and say
    where the run continues from."""
    good, ckpt = self.good, self.ckpt
    ckpt.wait()
    later = [s for s in ckpt.steps() if good is None or s > good]
    moved = ckpt.set_aside(later, "diverged") if later else ""
    if good is None:
      return f"no checkpoint was saved before it{moved}: the same command starts over"
    return (
      f"the newest checkpoint before it is step {good} in {ckpt.directory}{moved}: continue from "
      f"it with the same command and --resume"
    )

  def _show(self, row: dict, line: str) -> None:
    """The progress bar's figures, or without a terminal the row itself."""
    fmt = lambda v, spec: "nan" if not math.isfinite(v) else format(v, spec)  # noqa: E731
    util = row.get("mfu")
    self.bar.set_postfix(
      loss=fmt(row["loss"], ".3f"),
      tok_s=f"{row['tokens_per_s']:.0f}",
      step=f"{row['step_time_s'] * 1e3:.0f}ms",
      mfu="n/a" if util is None else f"{util:.1%}",
      **({"eval": fmt(row["eval_loss"], ".3f")} if "eval_loss" in row else {}),
      **({"skipped": self.bad_total} if self.bad_total else {}),
    )
    self.bar.update(1)
    if self.bar.disable and self.main:  # no terminal: one line per step instead of a bar
      print(line, end="", flush=True)

  def _say(self, text: str) -> None:
    if self.main:
      self.bar.write(text)

  def _write(self, lines: list[str]) -> None:
    """Write metrics rows; a full disk (the checkpoints may have filled it) is one clear line."""
    try:
      self.log.writelines(lines)
      self.log.flush()
    except OSError as e:
      kept = (
        f"checkpoint step {self.saved} in {self.ckpt.directory} is intact; the steps after it "
        f"are not saved"
        if self.saved is not None
        else "no checkpoint was saved"
      )
      what = "the disk is full" if e.errno == errno.ENOSPC else e.strerror or str(e)
      raise CheckpointError(
        e.errno,
        f"{what}: could not write {self.path}; {kept}. Free space on its disk or pass another "
        f"--out",
      ) from None


def _last_step(metrics_path: str) -> int | None:
  """The last step of the metrics.jsonl a resumed run is about to rewrite (None: unreadable)."""
  try:
    with warnings.catch_warnings():  # a truncated last line: said already when it was read
      warnings.simplefilter("ignore")
      rows = read_rows(metrics_path)
  except (OSError, ValueError):
    return None
  return rows[-1]["step"] if rows else 0
