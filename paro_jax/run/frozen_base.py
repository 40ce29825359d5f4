"""The frozen base of a LoRA run started from HF weights (--init-from), kept out of its
checkpoints: a checkpoint records the base's identity (`base_identity`: its directory and a
fingerprint of its weight files) and a restore reads the base again from there (`reimport_base`),
refusing a base that is gone or changed in one line (BaseChanged). `--keep-base` stores it.

The fingerprint is cheap for any size: per weight file, its name, its size in bytes and a SHA-256
of its safetensors header (every tensor's name, dtype, shape and offsets) and of SAMPLED_BLOCKS
blocks of SAMPLED_BYTES bytes spread evenly over its data (0.5 MiB read per file, whatever its
size: 15 MiB for the 30 files of a 140 GB 70B base). It refuses a base edited, replaced or
truncated before anything is read; an edit of the same size that misses every sampled block is
not seen by it. That one is seen after the import: the checksums of the re-imported arrays must
equal those the checkpoint recorded of the base it was trained on (every bit of every tensor:
run/checkpoint_content.py), which holds exactly.
"""

from __future__ import annotations

import hashlib
import os

import jax
import numpy as np

from paro_jax.core.state import TrainState
from paro_jax.hf.stream import import_hf
from paro_jax.hf.weights import weight_files
from paro_jax.run.checksums import state_checksums

SAMPLED_BLOCKS, SAMPLED_BYTES = 8, 64 * 1024


class BaseChanged(ValueError):
  """A LoRA checkpoint whose frozen base is gone or changed: refused, never skipped."""


def _file_fingerprint(path: str) -> dict:
  size = os.path.getsize(path)
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    head = f.read(8)
    header = int.from_bytes(head, "little") if len(head) == 8 else 0
    digest.update(head + f.read(min(header, size)))
    start = 8 + header
    span = max(size - start - SAMPLED_BYTES, 0)
    for i in range(SAMPLED_BLOCKS):
      f.seek(start + span * i // max(SAMPLED_BLOCKS - 1, 1))
      digest.update(f.read(SAMPLED_BYTES))
  return {"bytes": size, "sha256": digest.hexdigest()}


def base_identity(directory: str) -> dict:
  """The identity a LoRA checkpoint records of its frozen base: the directory (absolute) and
  its weight files' fingerprints."""
  directory = os.path.abspath(directory)
  return {
    "directory": directory,
    "files": {os.path.relpath(p, directory): _file_fingerprint(p) for p in weight_files(directory)},
  }


def _fix(where: str) -> str:
  return (
    f"restore the base it was trained on there, or train with --keep-base to store the base in "
    f"the checkpoints ({where} cannot be resumed or exported without it)"
  )


def check_base(recorded: dict, where: str) -> None:
  """Raise BaseChanged, naming the checkpoint `where` and the base's directory, if the base's
  weight files are gone or differ from the fingerprint `recorded` (base_identity's)."""
  directory = recorded["directory"]
  head = f"checkpoint {where} holds no frozen base: it is read from {directory}, which"
  if not os.path.isdir(directory):
    raise BaseChanged(f"{head} is gone; {_fix(where)}")
  try:
    now = base_identity(directory)["files"]
  except (OSError, ValueError) as e:
    raise BaseChanged(f"{head} cannot be read ({e}); {_fix(where)}") from None
  was = recorded["files"]
  changed = sorted(n for n in set(was) | set(now) if was.get(n) != now.get(n))
  if changed:
    name = changed[0]
    what = (
      "is missing"
      if name not in now
      else "is new"
      if name not in was
      else f"changed ({was[name]['bytes']} -> {now[name]['bytes']} bytes, content differs)"
    )
    raise BaseChanged(
      f"{head} changed since: {len(changed)} of its weight files differ (first: {name} {what}); "
      f"{_fix(where)}"
    )


def reimport_base(recorded: dict, engine, shardings, checksums: dict | None, where: str):
  """The frozen base read again from `recorded`'s directory at `shardings` (the engine's frozen
  placement), in the dtype it was saved in, checked against the checkpoint's `checksums` of it
  (its fingerprint is checked before, on every process: check_base)."""
  frozen = import_hf(
    recorded["directory"], engine.model.cfg, shardings, np.dtype(recorded["dtype"])
  )
  if checksums is not None:
    sums, _ = state_checksums(TrainState(None, None, None, frozen))
    bad = [k for k in sums if checksums.get(k) != sums[k]]
    if bad:
      raise BaseChanged(
        f"checkpoint {where} holds no frozen base: it is read from {recorded['directory']}, "
        f"whose weights differ from those it was trained on in {len(bad)} of {len(sums)} arrays "
        f"(first: {bad[0]}); {_fix(where)}"
      )
  return frozen


def frozen_dtype(frozen) -> str:
  return str(jax.tree.leaves(frozen)[0].dtype)
