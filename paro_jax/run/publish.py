"""An export's files written into a hidden directory and moved into place once complete
(`publish`), so that a failed export (a full disk, Ctrl-C) leaves its --out as it was
(paro_jax/run/export.py's docstring says how)."""

from __future__ import annotations

import errno
import glob
import os
import shutil

from safetensors import SafetensorError

from paro_jax.data.prepare import pid_alive

EXPORT_PARTIAL = (
  ".partial-"  # the hidden directory an export is written into, inside an existing --out
)


def remove_stale(stem: str) -> None:
  """Remove the partial directories `STEM<pid>` of exports that were killed (-9)."""
  for stale in glob.glob(glob.escape(stem) + "*"):
    pid = stale[len(stem) :]
    if pid.isdigit() and not pid_alive(int(pid)):
      shutil.rmtree(stale, ignore_errors=True)


def _move(src: str, dst: str) -> None:
  """Move the file `src` over `dst` atomically; across filesystems (EXDEV: a link in --out to
  another disk) by a copy beside `dst` renamed over it."""
  try:
    os.replace(src, dst)
  except OSError as e:
    if e.errno != errno.EXDEV:
      raise
    beside = os.path.join(
      os.path.dirname(dst), f"{EXPORT_PARTIAL}{os.getpid()}-{os.path.basename(dst)}"
    )
    try:
      shutil.copyfile(src, beside)
      shutil.copymode(src, beside)
      os.replace(beside, dst)
    finally:
      if os.path.exists(beside):
        os.remove(beside)


def publish(write, out: str) -> list[str]:
  """`write(directory)` into a hidden directory, then into place (module docstring): a new `out`
  is `.NAME.partial-PID` beside it renamed; an existing directory gets `.partial-PID` made inside
  it and each file moved in (replaced), its other files kept. Returns the names written."""
  out = os.path.abspath(out)
  into = os.path.isdir(out)  # a mount point, or a link to another disk, is written in place
  if into:
    stem = os.path.join(out, EXPORT_PARTIAL)
  else:
    parent, name = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    stem = os.path.join(parent, f".{name}{EXPORT_PARTIAL}")
  remove_stale(stem)
  partial = f"{stem}{os.getpid()}"
  try:
    write(partial)
    names = sorted(os.listdir(partial))
    if into:
      for file in names:
        _move(os.path.join(partial, file), os.path.join(out, file))
      # The weights of an earlier export in another layout would be read instead of these
      # (a single model.safetensors before the shards' index): gone.
      for file in glob.glob(os.path.join(glob.escape(out), "*.safetensors*")):
        if os.path.basename(file) not in names:
          os.remove(file)
    else:
      os.rename(partial, out)
  except (OSError, SafetensorError) as e:
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "os error 28" in str(e)
    what = "the disk is full" if full else " ".join(str(e).split())
    fix = f"free space on the disk holding {out}" if full else "fix that"
    raise ValueError(
      f"{what}: could not write the HF model to {out}; --out is as it was (nothing was "
      f"written there): {fix}, or pass another --out"
    ) from None
  finally:
    shutil.rmtree(partial, ignore_errors=True)
  return names
