"""What a run of `paro-jax train` says (process 0): the line at its start, the line when it
stops or finishes, and where its newest good checkpoint is."""

from __future__ import annotations

import statistics

import jax

from paro_jax.core.engine import Engine
from paro_jax.run.checkpoint import Checkpointer
from paro_jax.run.config import RunConfig
from paro_jax.run.setup import model_name


def banner(cfg: RunConfig, engine: Engine, need: dict) -> str:
  """The run's first line: the model, strategy, mesh, batch, precision, wire formats and the
  memory estimate `need` (run/fit.py run_memory: what `paro-jax plan` prints for it)."""
  n_params, n_trained = engine.model.param_count(), engine.model.trainable_count()
  lora = engine.model.lora
  what = (
    f"LoRA rank {lora.rank} on {','.join(lora.targets)}: {n_trained / 1e6:.3f}M of "
    f"{n_params / 1e6:.2f}M params trained"
    if lora
    else f"{n_params / 1e6:.2f}M params"
  )
  mib = 2**20
  return (
    f"paro-jax: {model_name(cfg)} ({what}), strategy "
    f"{engine.strategy} on mesh {engine.inter}x{engine.intra} ({jax.device_count()} "
    f"{jax.devices()[0].platform} devices), A={cfg.micro_batches}, batch "
    f"{cfg.batch_size}x{cfg.seq_len}, tokenizer {cfg.data.tokenizer or 'bytes'}, {cfg.dtype}, "
    f"collectives={engine.collectives}, {_wire(cfg, engine)}, grads in "
    f"{cfg.wire.grad_dtype}; memory {need['total'] / mib:.2f} MiB/device (model states "
    f"{need['model_states']['total'] / mib:.2f}, activations "
    f"{need['activations']['total'] / mib:.2f}; the planner's estimate)"
  )


# --outer-state in the banner: where the outer weights live, and what a round sends for it.
OUTER_STATE_WORDS = {
  "G": "over all devices, the round gathers them",
  "I": "a copy per node, the round all-reduces the pseudo-gradient alone",
}


def _wire(cfg: RunConfig, engine: Engine) -> str:
  """What crosses nodes: the step's wire formats, or with the outer loop its syncs."""
  o = cfg.outer
  if o.sync is not None:
    state = engine.outer.state  # --outer-state auto as resolved
    stagger = ""
    if o.fragments > 1:
      stagger = f" in {o.fragments} fragments, one every {o.sync // o.fragments} steps"
    if o.delay:
      stagger += f", each applied {o.delay} step(s) late"
    if o.mix:
      stagger += f", restarts mixing {o.mix:g} of the groups' own weights"
    return (
      f"outer sync every {o.sync} steps{stagger} (outer lr {o.lr:g}, Nesterov momentum "
      f"{o.momentum:g}, outer state at {state}: {OUTER_STATE_WORDS[state]}; "
      f"no collective across nodes inside a step), pseudo-gradient on the wire "
      f"{cfg.wire.inter_grads} (error feedback {engine.feedback_note})"
    )
  return (
    f"inter wire params={cfg.wire.inter_params} (delta {engine.param_delta_note}) grads="
    f"{cfg.wire.inter_grads} (error feedback {engine.feedback_note})"
  )


def stop_line(saved: int | None, ckpt: Checkpointer) -> str:
  """What a stopped run leaves, and how to continue it."""
  if saved is None:
    return "\nparo-jax: stopped before any step finished; nothing was saved"
  return (
    f"\nparo-jax: stopped; checkpoint step {saved} is in {ckpt.directory}: continue "
    f"with the same command and --resume"
  )


def good_line(good: int | None, ckpt: Checkpointer) -> str:
  """Where the newest checkpoint saved before a divergence is."""
  if good is None:
    return "no checkpoint was saved before it"
  return f"the newest checkpoint before it is step {good} in {ckpt.directory}"


def no_eval(rows, eval_every: int) -> str:
  """Why a run's last line has no eval loss: --eval-every was not set, or no step of this run
  was one of its multiples."""
  if not eval_every:
    return "no eval (--eval-every)"
  first, last = rows[0]["step"], rows[-1]["step"]
  due = -(-first // eval_every) * eval_every  # the first multiple of it from this run's first step
  return f"no eval in steps {first}-{last} (--eval-every {eval_every}: the next at step {due})"


def summary(rows, skipped, metrics_path, saved, directory, eval_every: int = 0) -> str:
  """The last line of a run: final loss, eval loss (`eval_every`: --eval-every), median
  tokens/s, where things are."""
  if not rows:
    return f"paro-jax: nothing to do; checkpoint step {saved} is in {directory}"
  last = rows[-1]
  evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
  timed = [r["tokens_per_s"] for r in rows[1:]] or [last["tokens_per_s"]]  # the first: compile
  parts = [
    f"step {last['step']}: loss {last['loss']:.4f}",
    f"eval loss {evals[-1]:.4f}" if evals else no_eval(rows, eval_every),
    f"median {statistics.median(timed):.0f} tokens/s",
  ]
  if skipped:
    parts.append(f"{skipped} non-finite steps skipped")
  return f"paro-jax: done, {', '.join(parts)}; wrote {metrics_path} and " + (
    f"checkpoint step {saved} in {directory}" if saved is not None else "no checkpoint"
  )
