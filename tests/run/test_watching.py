"""Watching a run. The metrics sinks (paro_jax/run/sinks.py): what TensorBoard's own event
reader, MLflow's file store and W&B's offline run hold equals metrics.jsonl, row for row, across
a resume that redoes steps the first run had logged; a sink that fails is one warning line and
the run goes on. The profiler trace (paro_jax/run/profiling.py): the window's steps, and the
step's collectives by name."""

import collections
import gzip
import json
import math
import os
import shutil
import sys

import numpy as np
import pytest

from paro_jax.analysis.hlo.collectives import parse_collectives
from paro_jax.analysis.inspect.abstract import compile_step
from paro_jax.core.config import make_config
from paro_jax.run import profiling, sinks
from paro_jax.run.config import ProfileOptions, RunConfig, SinkOptions
from paro_jax.run.metrics import read_rows
from paro_jax.run.setup import build
from paro_jax.run.train import train
from tests.run.tiny_run import RUN as TINY_RUN

event_accumulator = pytest.importorskip(
  "tensorboard.backend.event_processing.event_accumulator",
  reason="TensorBoard's event reader (pip install tensorboard)",
)
pytestmark = pytest.mark.usefixtures("compilation_cache")
RUN = {**TINY_RUN, "checkpoints.every": 2, "eval.every": 2}


def _installed(name):
  import importlib.util

  return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  """6 steps with every sink there is (steps 3 and 4 traced), then steps 3-6 again from the
  checkpoint of step 2: the first run's rows of steps 3-6 (their timings differ) must be gone
  from every sink."""
  out = tmp_path_factory.mktemp("sinks") / "run"
  store = tmp_path_factory.mktemp("mlruns")
  extra = {}
  if _installed("mlflow"):
    extra["sinks.mlflow"] = f"file://{store}"
  if _installed("wandb"):
    extra["sinks.wandb"] = "paro-jax-test"
  old = os.environ.get("WANDB_MODE")
  os.environ["WANDB_MODE"] = "offline"
  try:
    traced = {"profile.steps": "3:5"}  # the first run only
    train(make_config(RunConfig, {**RUN, **extra, **traced, "out": str(out)}))
    first = read_rows(out / "metrics.jsonl")
    shutil.rmtree(out / "checkpoints" / "6")
    shutil.rmtree(out / "checkpoints" / "4")
    train(make_config(RunConfig, {**RUN, **extra, "out": str(out), "checkpoints.resume": True}))
  finally:
    if old is None:
      os.environ.pop("WANDB_MODE")
    else:
      os.environ["WANDB_MODE"] = old
  return out, first, read_rows(out / "metrics.jsonl")


def _expected(rows):
  """{tag: [(step, value)]} of metrics.jsonl's rows, by the sinks' names."""
  out = {}
  for row in rows:
    for tag, value in sinks.scalars(row).items():
      out.setdefault(tag, []).append((row["step"], value))
  return out


def test_resume_redoes_steps_with_other_figures(resumed):
  _, first, rows = resumed
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert [r["step_time_s"] for r in rows[2:]] != [r["step_time_s"] for r in first[2:]]
  assert {"train/loss", "train/grad_norm", "train/lr", "eval/loss", "perf/tokens_per_s"} <= set(
    _expected(rows)
  )
  assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 6]
  # lr: the step's update's rate, by the schedule written out (2 steps of linear warmup to
  # 3e-3, cosine to a tenth of it at step 6)
  peak, end = RunConfig().optimizer.lr, RunConfig().optimizer.lr / 10
  cosine = lambda c: end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (c - 2) / 4))  # noqa: E731
  expected_lr = [peak * c / 2 if c < 2 else cosine(c) for c in range(6)]
  np.testing.assert_allclose([r["lr"] for r in rows], expected_lr, rtol=1e-6)


def test_tensorboard_scalars_equal_metrics_rows(resumed):
  out, _, rows = resumed
  expected, written = _expected(rows), _tensorboard(out)
  assert sorted(written) == sorted(expected)
  for tag, points in expected.items():
    # each step once, in order; event files hold float32
    assert written[tag] == [(s, np.float32(v)) for s, v in points], tag


@pytest.mark.skipif(not _installed("mlflow"), reason="MLflow (pip install mlflow-skinny)")
def test_mlflow_file_store_run_equals_metrics_rows(resumed):
  from mlflow.tracking import MlflowClient

  out, _, rows = resumed
  ids = json.loads((out / sinks.RUN_IDS).read_text())
  client = MlflowClient(tracking_uri=ids["mlflow"]["target"])
  run_id = ids["mlflow"]["id"]
  # the first run logged steps 3-6 the resume redid: a new run, given steps 1-2 first
  experiment = client.get_experiment_by_name(sinks.MLFLOW_EXPERIMENT).experiment_id
  assert len(client.search_runs([experiment])) == 2
  for tag, points in _expected(rows).items():
    history = sorted(client.get_metric_history(run_id, tag), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == points, tag
  assert client.get_run(run_id).data.params["optimizer.lr"] == str(RunConfig().optimizer.lr)


@pytest.mark.skipif(not _installed("wandb"), reason="W&B (pip install wandb)")
def test_wandb_offline_runs_hold_metrics_rows(resumed):
  """The resume redid logged steps: a new W&B run, given steps 1-2 first, holds every row."""
  out, _, rows = resumed
  ids = json.loads((out / sinks.RUN_IDS).read_text())
  assert len(list((out / "wandb").glob("offline-run-*"))) == 2
  (log,) = (out / "wandb").glob(f"offline-run-*-{ids['wandb']['id']}/run-*.wandb")
  history = _wandb_history(log)
  assert [h["_step"] for h in history] == [r["step"] for r in rows]
  for tag, points in _expected(rows).items():
    assert [(h["_step"], h[tag]) for h in history if tag in h] == points, tag


def _wandb_history(path):
  """The history records of a W&B offline run's .wandb file: LevelDB's log format (32 KiB
  blocks of chunks, each headed by a CRC, a length and a kind) after W&B's 7-byte header, each
  record a wandb_internal_pb2.Record."""
  from wandb.proto import wandb_internal_pb2

  data = path.read_bytes()
  assert data[:4] == b":W&B"
  pos, records, pending = 7, [], b""
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
      pos += 32768 - pos % 32768
      continue
    length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
    pending += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # a FULL record, or the LAST chunk of one
      records.append(pending)
      pending = b""
  history = []
  for raw in records:
    record = wandb_internal_pb2.Record()
    record.ParseFromString(raw)
    if record.WhichOneof("record_type") == "history":
      items = record.history.item
      history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
  return history


@pytest.mark.skipif(not _installed("mlflow"), reason="MLflow (pip install mlflow-skinny)")
def test_a_sink_that_cannot_open_is_one_warning_and_the_others_go_on(tmp_path):
  opts = SinkOptions(mlflow="nosuchscheme://nowhere")
  with pytest.warns(UserWarning, match="MLflow is off: could not open it") as caught:
    opened = sinks.Sinks(opts, str(tmp_path), 0, [], None, {})
  assert len(caught) == 1
  rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2)]
  for row in rows:
    opened.write(row)
  opened.close()
  assert _tensorboard(tmp_path) == {"train/loss": [(1, np.float32(1.0)), (2, np.float32(0.5))]}


def test_a_sink_that_fails_mid_run_is_dropped_with_one_warning(tmp_path, monkeypatch):
  opened = sinks.Sinks(SinkOptions(), str(tmp_path), 0, [], None, {})
  opened.write({"step": 1, "loss": 2.0})

  def full_disk(*_):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(sinks.TensorBoardSink, "write", full_disk)
  with pytest.warns(UserWarning, match="TensorBoard is off from step 2: OSError") as caught:
    opened.write({"step": 2, "loss": 1.0})
    opened.write({"step": 3, "loss": 0.5})  # dropped: no second line
  assert len(caught) == 1 and opened.sinks == []
  opened.close()


def _tensorboard(out):
  """{tag: [(step, value)]} as TensorBoard's own reader gives them from OUT/tensorboard."""
  reader = event_accumulator.EventAccumulator(
    str(out / sinks.TENSORBOARD), size_guidance={event_accumulator.SCALARS: 0}
  )
  reader.Reload()
  return {t: [(e.step, e.value) for e in reader.Scalars(t)] for t in reader.Tags()["scalars"]}


def test_a_missing_library_is_one_warning_naming_the_install(tmp_path, monkeypatch):
  for name in [n for n in sys.modules if n.split(".")[0] == "tensorboardX"] + ["tensorboardX"]:
    monkeypatch.setitem(sys.modules, name, None)  # import tensorboardX(.x): ImportError
  with pytest.warns(UserWarning, match="TensorBoard is off: .*pip install tensorboardX"):
    opened = sinks.Sinks(SinkOptions(), str(tmp_path), 0, [], None, {})
  assert opened.sinks == []
  opened.write({"step": 1, "loss": 1.0})  # nothing to write to: no error
  opened.close()


def test_profile_traces_the_window_and_names_the_collectives(resumed, tmp_path):
  """The trace holds steps 3 and 4 (the window 3:5) and, on each of the 8 devices, each
  collective of the step as compiled from abstract inputs (XLA's HLO, parsed by
  analysis/hlo/collectives.py): by its instruction name, as many times as the step runs it."""
  out = resumed[0]
  (session,) = (out / profiling.PROFILE / "plugins" / "profile").iterdir()
  assert list(session.glob("*.xplane.pb")) and (session / "perfetto_trace.json.gz").exists()
  (trace,) = session.glob("*.trace.json.gz")
  events = json.load(gzip.open(trace))["traceEvents"]
  steps = [int(e["args"]["step_num"]) for e in events if e.get("name") == "train"]
  assert steps == [3, 4]
  names = collections.Counter(e.get("name") for e in events)
  engine = build(make_config(RunConfig, {**RUN, "out": str(tmp_path)}))[0]
  compiled = compile_step(engine, RUN["batch_size"], RUN["seq_len"])
  collectives = parse_collectives(compiled.as_text())
  assert {c.kind for c in collectives} >= {"all-gather", "reduce-scatter"}  # IIG on 2x4
  traced = {c.name: names[c.name] for c in collectives}  # XLA:CPU names a thunk by its instruction
  assert traced == {c.name: 2 * 8 * c.count for c in collectives}


@pytest.mark.parametrize("steps", ["5:3", "0:2", "3", "a:b", "3:3"])
def test_a_bad_profile_window_is_one_line_naming_the_form(steps):
  with pytest.raises(ValueError, match=r"--profile-steps .*pass A:B with 1 <= A < B"):
    ProfileOptions(steps=steps)


def test_a_profile_process_the_run_lacks_is_refused():
  with pytest.raises(ValueError, match=r"--profile-process 1: the run has 1 process\(es\)"):
    profiling.StepProfiler(ProfileOptions(steps="2:3", process=1), "unused", 0)
