"""The training loop behind `paro-jax train`.

The run is set up by run/setup.py (engine, data, the state it starts from), each finished step is
booked by run/bookkeeping.py (metrics rows and their sinks, non-finite and out-of-band streaks,
checkpoints), run/profiling.py traces a window of steps (--profile-steps), signals and the other
processes stop it through run/stopping.py, and run/reporting.py says what happened.
Here: the order of those, and the loop.
"""

from __future__ import annotations

import os

import jax

from paro_jax.cluster import watch
from paro_jax.core.state import TrainState
from paro_jax.core.engine import Engine
from paro_jax.core.run_lock import RunLock
from paro_jax.run import reporting
from paro_jax.run.bookkeeping import Bookkeeper
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.run.config import RunConfig
from paro_jax.data.bins import DataChanged
from paro_jax.data.streams import Batches
from paro_jax.data.examples import ExampleBatches
from paro_jax.run.fit import run_memory
from paro_jax.run.profiling import StepProfiler
from paro_jax.run.setup import build, place_batch, starting_point, with_tokenizer
from paro_jax.run.stopping import Interrupted, StopSignals, StopVote


def train(cfg: RunConfig) -> str:
  """Train and write RUN/metrics.jsonl and RUN/checkpoints; returns the metrics path."""
  engine, batches, eval_batches = build(cfg)
  # the tokenizer its data is read with (build's), as the banner and its checkpoints name it
  cfg = with_tokenizer(cfg, engine.model.cfg.vocab)
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
      # The estimate build() checked: analysis/planner/memory.py's, as `paro-jax plan` prints it.
      gpu = jax.devices()[0].platform != "cpu"
      need = run_memory(cfg, engine.model, engine.strategy, engine.inter, engine.intra, gpu)
      print(reporting.banner(cfg, engine, need), flush=True)
      if isinstance(batches, ExampleBatches):  # how the examples are laid out, which left out
        print(batches.describe(engine.model.attention), flush=True)
        if batches.note:
          print(batches.note, flush=True)
    ckpt = Checkpointer(os.path.join(cfg.out, CHECKPOINTS), cfg.checkpoints.keep)
    stop.ckpt = ckpt
    # chat records: the template they are rendered with, recorded in every checkpoint
    template = batches.examples.chat_template if isinstance(batches, ExampleBatches) else None
    try:
      cfg, state, rows, data_files = starting_point(cfg, engine, ckpt, main, template)
    except BaseException:
      ckpt.close()
      raise
    # One fixed eval batch, placed once: eval losses are comparable across steps and runs.
    eval_batch = place_batch(engine, eval_batches, 0) if eval_batches else None
    profiler = StepProfiler(cfg.profile, cfg.out, int(state.step))
    with Bookkeeper(cfg, engine, ckpt, int(state.step), rows, main, data_files, template) as book:
      try:
        _run(cfg, engine, batches, eval_batch, state, book, stop, profiler)
      finally:
        profiler.stop()  # a run that ended inside the window: the steps traced so far
    if stop.stopping:
      if main:
        print(reporting.stop_line(book.saved, ckpt), flush=True)
      raise Interrupted(stop.signum)
    if main:
      line = reporting.summary(
        book.rows, book.bad_total, book.path, book.saved, ckpt.directory, cfg.eval.every
      )
      print(line, flush=True)
      if getattr(batches, "note", None):  # the examples left out, again at the end
        print(batches.note, flush=True)
    return book.path


def _run(
  cfg: RunConfig,
  engine: Engine,
  batches: Batches,
  eval_batch: jax.Array | None,
  state: TrainState,
  book: Bookkeeper,
  stop: StopSignals,
  profiler: StepProfiler,
) -> None:
  """The steps from `state` to the last, or to a stop; the last finished step checkpointed."""
  start, pending = int(state.step), None
  vote = StopVote() if jax.process_count() > 1 else None
  try:
    book.bar.set_postfix_str("compiling the training step", refresh=True)
    for step in range(start, cfg.optimizer.steps):
      if vote is None and stop.stopping:
        break
      asked = vote(stop.stopping) if vote else None
      with profiler.step(step + 1):
        state, metrics = engine.train_step(state, place_batch(engine, batches, step))
      profiler.after(step + 1, metrics)
      stop.dispatched += 1
      # Read the previous step's metrics only after the next step is dispatched, so the host
      # never stalls the device.
      if pending is not None:
        book.record(*pending)
      if asked is not None and int(asked):  # some process was asked to stop: all stop here
        stop.agreed()
      if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
        # Dispatched before the next step takes (donates) the state; read with the metrics.
        metrics = {**metrics, "eval_loss": engine.eval_loss(state, eval_batch)}
      pending = (step + 1, metrics)
      if cfg.checkpoints.every and (step + 1) % cfg.checkpoints.every == 0:
        book.record(*pending)  # every checkpointed step has its metrics row, and is finite
        pending = None
        book.save(state)  # asynchronous: returns once the arrays are copied off the device
      if asked is not None and int(asked):
        break
    if vote is None and stop.stopping and stop.dispatched_at_signal == 0:
      pending = None  # stopped during the first compile: nothing was asked for
    if pending is not None:
      book.record(*pending)
      pending = None
    if not stop.stopping or stop.dispatched_at_signal:
      book.save(state, why=": stopping" if stop.stopping else "")
    book.ckpt.close()
  except KeyboardInterrupt:
    # Raised where the signal handler is not installed (another thread, several processes):
    # log the finished step, checkpoint it (unless it is the start), let the writes complete.
    if pending is not None:
      book.record(*pending)
    if not any(x.is_deleted() for x in jax.tree.leaves(state)) and int(state.step) > start:
      book.save(state)
    book.ckpt.close()
    book.bar.close()
    if book.main:
      print(reporting.stop_line(book.saved, book.ckpt), flush=True)
    raise
  except DataChanged as e:
    # A data file shrank under the run (data/bins.py): the steps done are sound, saved as on a
    # stop (one process: with several, saving needs all of them, and the others are waiting in
    # a collective for this one). The line says where to continue from.
    if pending is not None:
      book.record(*pending)
    intact = not any(x.is_deleted() for x in jax.tree.leaves(state))
    if jax.process_count() == 1 and intact and int(state.step) > start:
      book.save(state)
    book.ckpt.close()
    book.bar.close()
    saved = book.saved
    kept = f"checkpoint step {saved} is in {book.ckpt.directory}" if saved is not None else None
    raise DataChanged(
      f"{e}; {kept or 'no checkpoint was saved'}: restore the file (or prepare the data "
      f"again) and run the same command" + (" with --resume" if kept else "")
    ) from None
  except BaseException as e:
    try:
      book.ckpt.close()  # lets a save in flight complete; the newest checkpoint stays as it is
    finally:
      book.bar.close()
    if jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
      # A collective failed: another process is gone (SIGKILL, a lost node). Its task's line
      # from srun names it; this one says which step the run got to.
      raise watch.peer_lost(e, jax.process_index(), jax.process_count()) from None
    raise
