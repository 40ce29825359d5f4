"""Where each step's metrics row goes besides OUT/metrics.jsonl: TensorBoard event files in
OUT/tensorboard/ (tensorboardX; on by default), a Weights & Biases run (--wandb PROJECT) and an
MLflow run (--mlflow URI). Only process 0 opens them (run/bookkeeping.py).

A sink that cannot be opened or written (its library missing, a bad URI, no network) is one
warning line and is dropped; metrics.jsonl and the other sinks go on. A resumed run continues the
same curves without a step twice: TensorBoard's readers drop the events of the earlier files from
the first step the resumed run writes (tensorboardX's `purge_step`); the W&B and MLflow runs of
OUT/sinks.json are continued when they hold no step after the checkpoint, else a new run is
started and given the kept rows first (neither service lets a logged step be replaced). No jax.
"""

from __future__ import annotations

import json
import os
import time
import warnings

TENSORBOARD = "tensorboard"  # OUT/tensorboard/: `tensorboard --logdir OUT`
RUN_IDS = "sinks.json"  # OUT/sinks.json: the W&B and MLflow runs this directory logs to
MLFLOW_EXPERIMENT = "paro-jax"
# Figures of a row that are the run's speed and memory, not its learning (TensorBoard's "perf"
# section); "eval_<x>" is "eval/<x>", the rest "train/<x>".
PERF = ("step_time_s", "tokens_per_s", "mfu", "peak_memory_gib")


def scalars(row: dict) -> dict[str, float]:
  """The figures of a metrics row by their sinks' names (`train/loss`, `eval/loss`,
  `perf/mfu`); the step and the flags (`skipped`, `out_of_band`) are no figures."""
  out = {}
  for key, value in row.items():
    if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
      continue
    if key.startswith("eval_"):
      out[f"eval/{key[len('eval_') :]}"] = float(value)
    else:
      out[f"{'perf' if key in PERF else 'train'}/{key}"] = float(value)
  return out


class TensorBoardSink:
  """tensorboardX's event-file writer, written in the step's own thread: its SummaryWriter
  writes from a thread of its own, which, when the disk fills, dies with a traceback and leaves
  the run's exit another (its queue closed under it); here a failed write is the sink's warning
  line like any other."""

  name = "TensorBoard"
  FLUSH_SECONDS = 10

  def __init__(self, out: str, start: int):
    # dependencies, but a missing one is a warning
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.summary import scalar

    self.event, self.scalar = Event, scalar
    logdir = os.path.join(out, TENSORBOARD)
    os.makedirs(logdir, exist_ok=True)
    self.writer = EventsWriter(os.path.join(logdir, "events"))
    # A SessionLog.START at step start + 1 (what SummaryWriter's purge_step writes):
    # TensorBoard's readers drop the earlier files' events from that step on (a resume's redone
    # steps, or a whole earlier run when start is 0).
    self.writer.write_event(Event(step=start + 1, file_version="brain.Event:2"))
    self.writer.write_event(Event(step=start + 1, session_log=SessionLog(status=SessionLog.START)))
    self.writer.flush()
    self.flushed = time.monotonic()

  def write(self, step: int, values: dict[str, float]) -> None:
    now = time.time()
    for tag, value in values.items():
      self.writer.write_event(self.event(wall_time=now, step=step, summary=self.scalar(tag, value)))
    if time.monotonic() - self.flushed >= self.FLUSH_SECONDS:
      self.writer.flush()
      self.flushed = time.monotonic()

  def close(self) -> None:
    self.writer.close()


class WandbSink:
  name = "W&B"

  def __init__(self, project: str, out: str, run_id: str | None, params: dict):
    import wandb  # optional (the sinks extra), and seconds to import

    # console="off": W&B would otherwise wrap stdout and stderr (the progress bar, the run's
    # one-line errors); quiet: its banner lines say nothing the run's own do not.
    self.run = wandb.init(
      project=project,
      dir=out,
      id=run_id,
      resume="allow" if run_id else None,
      name=os.path.basename(os.path.abspath(out)),
      config=params,
      settings=wandb.Settings(console="off", quiet=True),
    )
    self.id = self.run.id

  def write(self, step: int, values: dict[str, float]) -> None:
    self.run.log(values, step=step)

  def close(self) -> None:
    self.run.finish()


class MlflowSink:
  name = "MLflow"

  def __init__(self, uri: str, out: str, run_id: str | None, params: dict):
    # A server that does not answer would hold the run for minutes of MLflow's default retries
    # (7, with backoff): a few quick tries, then the warning line. The user's settings win.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    if uri.startswith("file:") or "://" not in uri:
      # MLflow 3 refuses its file store unless asked: --mlflow file:///DIR is asking for it.
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    # optional (the sinks extra); after the environment above, which MLflow reads
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    self.metric = Metric
    self.client = MlflowClient(tracking_uri=uri)
    if run_id is None:
      found = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
      experiment = (
        found.experiment_id if found else self.client.create_experiment(MLFLOW_EXPERIMENT)
      )
      run_name = os.path.basename(os.path.abspath(out))
      run_id = self.client.create_run(experiment, run_name=run_name).info.run_id
      listed = [Param(k, str(v)) for k, v in params.items()]
      for i in range(0, len(listed), 100):  # MLflow takes at most 100 params per batch
        self.client.log_batch(run_id, params=listed[i : i + 100])
    else:
      self.client.update_run(run_id, status="RUNNING")
    self.id = run_id

  def write(self, step: int, values: dict[str, float]) -> None:
    stamp = int(time.time() * 1000)
    metrics = [self.metric(tag, value, stamp, step) for tag, value in values.items()]
    self.client.log_batch(self.id, metrics=metrics)

  def close(self) -> None:
    self.client.set_terminated(self.id)


class Sinks:
  """The open sinks of a run (process 0's); `write` gives each the figures of a row.

  `start` is the step the run starts from, `kept` the rows of a resumed run up to it (from
  metrics.jsonl), `logged_to` the last step the directory's metrics.jsonl held before this run
  (None: none, or unreadable), `params` the run's options by path (the W&B config, MLflow params).
  """

  def __init__(
    self,
    opts,
    out: str,
    start: int,
    kept: list[dict],
    logged_to: int | None,
    params: dict,
  ):
    self.out, self.sinks = out, []
    if opts.tensorboard:
      self._open(
        lambda: TensorBoardSink(out, start),
        "TensorBoard",
        "pip install tensorboardX, or pass --no-tensorboard",
      )
    ids = _read_ids(out) if start else {}
    # A W&B or MLflow run that holds steps after the checkpoint cannot take them again: a new one.
    continues = logged_to is not None and logged_to <= start
    for key, target, make, install in (
      ("wandb", opts.wandb, WandbSink, "pip install wandb"),
      ("mlflow", opts.mlflow, MlflowSink, "pip install mlflow-skinny"),
    ):
      if target is None:
        continue
      old = ids.get(key, {})
      run_id = old.get("id") if continues and old.get("target") == target else None
      sink = self._open(lambda: make(target, out, run_id, params), make.name, install)
      if sink is not None:
        ids[key] = {"target": target, "id": sink.id}
        if run_id is None:  # a new run: the curve so far first
          for row in kept:
            self._write(sink, row)
    if opts.wandb or opts.mlflow:
      with open(os.path.join(out, RUN_IDS), "w") as f:
        json.dump(ids, f, indent=1)

  def write(self, row: dict) -> None:
    """The figures of a finished step's row, to every sink still open."""
    for sink in list(self.sinks):
      self._write(sink, row)

  def close(self) -> None:
    for sink in self.sinks:
      try:
        sink.close()
      except Exception as e:  # the rows are written; only the closing failed
        _warn(f"{sink.name}: could not close ({_reason(e)}); metrics.jsonl has every row")
    self.sinks = []

  def _open(self, make, name: str, install: str):
    try:
      sink = make()
    except ImportError as e:
      _warn(f"{name} is off: {e.name or e} is not installed ({install})")
      return None
    except Exception as e:
      _warn(f"{name} is off: could not open it ({_reason(e)}); the run goes on without it")
      return None
    self.sinks.append(sink)
    return sink

  def _write(self, sink, row: dict) -> None:
    try:
      sink.write(row["step"], scalars(row))
    except Exception as e:
      self.sinks.remove(sink)
      _warn(
        f"{sink.name} is off from step {row['step']}: {_reason(e)}; the run goes on, "
        f"metrics.jsonl has every row"
      )
      try:
        sink.close()
      except Exception:  # already failing: the line above said so
        pass


def _read_ids(out: str) -> dict:
  """OUT/sinks.json: the W&B and MLflow runs the directory logged to ({} if none or unreadable:
  new runs are started)."""
  try:
    with open(os.path.join(out, RUN_IDS)) as f:
      ids = json.load(f)
  except (OSError, ValueError):
    return {}
  return ids if isinstance(ids, dict) else {}


def _reason(e: Exception) -> str:
  return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _warn(text: str) -> None:
  warnings.warn(text, stacklevel=3)
