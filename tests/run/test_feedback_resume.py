"""Error feedback across checkpoints: the residual is saved with the state, so a run resumed
with it continues exactly; a checkpoint whose residual does not fit the resuming run (none saved,
or another strategy) restarts it at zero and says so."""

import shutil

import numpy as np
import pytest

from paro_jax.run.checkpoint import Checkpointer
from paro_jax.core.config import make_config
from paro_jax.run.config import RunConfig
from paro_jax.run.train import train
from tests.run.tiny_run import RUN as TINY_RUN, losses

RUN = {**TINY_RUN, "wire.inter_params": "int8", "wire.inter_grads": "int8", "checkpoints.every": 2}
pytestmark = pytest.mark.usefixtures("compilation_cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  out = tmp_path_factory.mktemp("ef-straight")
  train(make_config(RunConfig, {**RUN, "out": str(out)}))
  return out


def test_resume_with_error_feedback_equals_uninterrupted(straight, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(straight, out)
  shutil.rmtree(out / "checkpoints" / "6")
  shutil.rmtree(out / "checkpoints" / "4")
  train(make_config(RunConfig, {**RUN, "out": str(out), "checkpoints.resume": True}))
  steps, resumed = losses(out)
  assert steps == [1, 2, 3, 4, 5, 6]
  assert resumed == losses(straight)[1]  # bit for bit


def test_resume_without_the_residual_differs_and_says_so(straight, tmp_path):
  """Resuming at step 2 a run saved with --no-error-feedback (the same two first steps: the
  residual starts at zero): the checkpoint has no residual, the run's restarts at zero (a
  warning), and its later losses are not the uninterrupted run's: the saved residual is what
  made the resume above exact."""
  out = tmp_path / "run"
  train(make_config(RunConfig, {**RUN, "out": str(out), "error_feedback": False}))
  shutil.rmtree(out / "checkpoints" / "6")
  shutil.rmtree(out / "checkpoints" / "4")
  assert Checkpointer(out / "checkpoints").steps() == [2]
  with pytest.warns(UserWarning, match="has no error-feedback residual: this run's starts at 0"):
    train(make_config(RunConfig, {**RUN, "out": str(out), "checkpoints.resume": True}))
  steps, resumed = losses(out)
  assert steps == [1, 2, 3, 4, 5, 6]
  expected = losses(straight)[1]
  assert resumed[:2] == expected[:2]
  np.testing.assert_allclose(resumed[2:], expected[2:], rtol=2e-2)
  assert resumed[2:] != expected[2:]
