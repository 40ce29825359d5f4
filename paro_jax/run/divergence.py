"""The divergence guard of `paro-jax train`: a loss or gradient norm that leaves its running band.

After the fashion of LLM Foundry's loss-spike callback (a window of recent losses, an outlier
multiplier, a patience, a loss cap) and Megatron-LM's check for spiky losses: a step is *out of
band* when its loss or gradient norm is not finite, its loss is above the cap (a multiple of
ln(vocab), the loss of a uniform guess: a model that does worse has lost what it learned), or its
loss or gradient norm is more than a factor above the mean of the previous `window` in-band steps.
Out-of-band steps never enter the band, so a run that keeps diverging does not drag its band up.
`patience` out-of-band steps in a row stop the run (mode `stop`) or warn (mode `warn`).

The defaults come from measured healthy runs (experiments/results/divergence_band/, by a script
retired at commit 8ebf865; docs/failures.md states them).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from paro_jax.core.config import option

MODES = ("off", "warn", "stop")
CAP_TIMES_UNIFORM = 2.0  # the default cap: this many times ln(vocab), a uniform guess's loss


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """The guard's settings: `paro-jax train --divergence-*` (the run config's group `guard`)."""

  mode: str = option(
    "stop",
    "stop the run, warn once, or only check NaN/Inf (default %(default)s)",
    flag="--divergence-guard",
    choices=MODES,
  )
  window: int = option(  # the band: the mean of this many previous in-band steps
    20,
    "the band: the mean of the previous N in-band steps (default %(default)s)",
    flag="--divergence-window",
    metavar="N",
  )
  min_history: int = 5  # in-band steps seen before the band is used (the cap applies at once)
  loss_factor: float = option(  # out of band: loss > loss_factor x the band's mean loss
    1.5,
    "out of band: loss above X times its band (default %(default)g)",
    flag="--divergence-loss-factor",
    metavar="X",
  )
  grad_factor: float = option(  # out of band: grad norm > grad_factor x the band's mean norm
    10.0,
    "out of band: gradient norm above X times its band (default %(default)g)",
    flag="--divergence-grad-factor",
    metavar="X",
  )
  patience: int = option(  # out-of-band steps in a row that stop (or warn about) the run
    3,
    "stop after N out-of-band steps in a row (default %(default)s)",
    flag="--divergence-patience",
    metavar="N",
  )
  loss_cap: float = option(  # out of band above this loss; 0: cap_times_uniform x ln(vocab)
    0.0,
    f"out of band: loss above L (default %(default)g: {CAP_TIMES_UNIFORM:g} x ln(vocab), twice "
    f"the loss of a uniform guess)",
    flag="--divergence-loss-cap",
    metavar="L",
  )
  cap_times_uniform: float = CAP_TIMES_UNIFORM

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"--divergence-guard must be one of {', '.join(MODES)}, got {self.mode!r}")
    for name in ("window", "patience"):
      if getattr(self, name) < 1:
        raise ValueError(f"--divergence-{name} must be >= 1, got {getattr(self, name)}")
    for name in ("loss_factor", "grad_factor"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value > 1):
        raise ValueError(
          f"--divergence-{name.replace('_', '-')} must be a finite number above 1 (a step is out "
          f"of band above this multiple of its band), got {value}"
        )
    if not (math.isfinite(self.loss_cap) and self.loss_cap >= 0):
      raise ValueError(
        f"--divergence-loss-cap must be >= 0 (0: {self.cap_times_uniform:g} x ln(vocab)), got "
        f"{self.loss_cap}"
      )


class DivergenceGuard:
  """Feed it every step's (loss, grad norm); it says which are out of band and since when."""

  def __init__(self, cfg: GuardConfig, vocab: int):
    self.cfg = cfg
    self.cap = cfg.loss_cap or cfg.cap_times_uniform * math.log(vocab)
    self._cap_why = (
      f"--divergence-loss-cap {cfg.loss_cap:g}"
      if cfg.loss_cap
      else f"{cfg.cap_times_uniform:g} x ln(vocab {vocab}), the loss of a uniform guess"
    )
    self.losses: deque[float] = deque(maxlen=cfg.window)
    self.norms: deque[float] = deque(maxlen=cfg.window)
    self.streak = 0  # out-of-band steps in a row, up to the newest
    self.first: int | None = None  # the first step of the current streak
    self.first_why: str | None = None  # and why it was out of band

  def seed(self, loss: float, grad_norm: float) -> None:
    """A step of the run before a resume: part of the band, never judged again."""
    if math.isfinite(loss) and math.isfinite(grad_norm) and loss <= self.cap:
      self.losses.append(loss)
      self.norms.append(grad_norm)

  def observe(self, step: int, loss: float, grad_norm: float) -> str | None:
    """Why step `step` is out of band (None: it is in band, and joins the band)."""
    why = self._judge(loss, grad_norm)
    if why is None:
      self.losses.append(loss)
      self.norms.append(grad_norm)
      self.streak, self.first, self.first_why = 0, None, None
      return None
    self.streak += 1
    if self.first is None:
      self.first, self.first_why = step, why
    return why

  @property
  def tripped(self) -> bool:
    return self.streak >= self.cfg.patience

  def _judge(self, loss: float, grad_norm: float) -> str | None:
    if not math.isfinite(loss):
      return f"loss {loss}"
    if not math.isfinite(grad_norm):
      return f"gradient norm {grad_norm}"
    if self.cfg.mode == "off":
      return None
    if loss > self.cap:
      return f"loss {loss:.4g} is above the loss cap {self.cap:.4g} ({self._cap_why})"
    if len(self.losses) < self.cfg.min_history:
      return None
    for name, value, past, factor, flag in (
      ("loss", loss, self.losses, self.cfg.loss_factor, "loss-factor"),
      ("gradient norm", grad_norm, self.norms, self.cfg.grad_factor, "grad-factor"),
    ):
      mean = sum(past) / len(past)
      if value > factor * mean:
        return (
          f"{name} {value:.4g} is above its band ({factor:g} x {mean:.4g}, the mean of the "
          f"previous {len(past)} in-band steps; --divergence-{flag})"
        )
    return None
