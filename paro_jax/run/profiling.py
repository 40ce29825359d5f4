"""`--profile-steps A:B`: a jax.profiler trace of the steps A to B-1 (numbered as metrics.jsonl's
`step`) into OUT/profile/, on every process or on `--profile-process N`'s alone.

jax writes OUT/profile/plugins/profile/<time>/: HOST.xplane.pb (TensorBoard's profile tab, XProf)
and HOST.trace.json.gz, and perfetto_trace.json.gz (ui.perfetto.dev). Each traced step is a
`StepTraceAnnotation` ("train", its step number): the profile tools' step boundaries. With
several processes each writes under OUT/profile/process<I>/ (processes of one host would
otherwise share a file name). docs/training.md says how to read the collectives' overlap in it.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import jax
from tqdm import tqdm

from paro_jax.run.config import ProfileOptions

PROFILE = "profile"  # OUT/profile/: `tensorboard --logdir OUT` (profile tab), or xprof OUT/profile


class StepProfiler:
  """The trace of a run's window of steps: `step(n)` around dispatching step n, `after(n, out)`
  once it is dispatched (at the window's last step it waits for `out`, then writes the trace),
  `stop()` when the run ends early (the steps traced so far are written)."""

  def __init__(self, opts: ProfileOptions, out: str, start: int):
    window = opts.window()
    index, count = jax.process_index(), jax.process_count()
    if opts.process is not None and opts.process >= count:
      raise ValueError(
        f"--profile-process {opts.process}: the run has {count} process(es), numbered "
        f"0-{count - 1}: pass one of them, or leave it out to trace on every process"
      )
    self.on = window is not None and opts.process in (None, index)
    self.first, self.end = window or (0, 0)
    self.directory = os.path.join(out, PROFILE, f"process{index}" if count > 1 else "")
    self.tracing = False
    if self.on and self.end - 1 <= start:
      self.on = False
      warnings.warn(
        f"--profile-steps {opts.steps}: the run resumes after step {start}, past them: no "
        f"trace (pass a later window)",
        stacklevel=2,
      )

  @contextlib.contextmanager
  def step(self, number: int):
    """Dispatching step `number`: the trace starts at the window's first step (or the first step
    a resumed run takes in it), and each traced step is annotated with its number."""
    if self.on and not self.tracing and self.first <= number < self.end:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.tracing = True
    if not self.tracing:
      yield
      return
    with jax.profiler.StepTraceAnnotation("train", step_num=number):
      yield

  def after(self, number: int, outputs) -> None:
    """Step `number` is dispatched: at the window's last, wait for it (its `outputs`) and write."""
    if self.tracing and number >= self.end - 1:
      jax.block_until_ready(outputs)
      self.stop()
      self.on = False

  def stop(self) -> None:
    """Write the trace of the steps traced so far (a run that ends inside the window)."""
    if not self.tracing:
      return
    self.tracing = False
    jax.profiler.stop_trace()
    tqdm.write(
      f"paro-jax: profiler trace of steps {self.first}-{self.end - 1} in {self.directory}: "
      f"tensorboard --logdir {self.directory} (profile tab), or its perfetto_trace.json.gz in "
      f"ui.perfetto.dev"
    )
