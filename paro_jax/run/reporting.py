"""What a run of `paro-jax train` says when it stops or finishes (process 0)."""

from __future__ import annotations

import statistics

from paro_jax.run.checkpoint import Checkpointer


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
