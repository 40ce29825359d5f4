"""What a run's data is, by content: recorded in every checkpoint and compared on `--resume`.

A resumed run's batches are those of the uninterrupted run only if it reads the same tokens. The
paths given to `--data` do not say that: a file can be appended to or replaced under its name, a
relative path can reach another file from another directory, a glob can match more shards; and
the same file can be named by another path. So each file the paths expand to (in the order the
run reads them) is recorded by its size and a hash of its first and last `EDGE` bytes (cheap for
a corpus of any size; a change of the same size inside a file that leaves both ends as they
were goes unseen), and the built-in corpus by a hash of all of it (it is the standard library of
the Python that runs: another Python is another corpus).
"""

from __future__ import annotations

import hashlib
import os

from paro_jax.data.config import DataConfig
from paro_jax.data.streams import default_corpus, expand_paths

EDGE = 1 << 16  # bytes hashed at each end of a file


def _edges(path: str, size: int) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    digest.update(f.read(EDGE))
    if size > EDGE:
      f.seek(max(EDGE, size - EDGE))
      digest.update(f.read(EDGE))
  return digest.hexdigest()[:16]


def data_fingerprint(data: DataConfig) -> dict:
  """{"files": [{"path", "size", "edges"}, ...]} of the files `data.paths` expand to, in order;
  {"corpus": hash} for the built-in corpus. `path` is for messages only: files are compared by
  size and edges."""
  if not data.paths:
    return {"corpus": hashlib.sha256(default_corpus().tobytes()).hexdigest()[:16]}
  files = []
  for path in expand_paths(data.paths):
    size = os.path.getsize(path)
    files.append({"path": path, "size": size, "edges": _edges(path, size)})
  return {"files": files}


def data_change(was: dict, now: dict) -> str | None:
  """What differs between the data a checkpoint was trained on (`was`) and this run's (`now`),
  in words; None when the contents are the same (whatever paths name them)."""
  if "corpus" in was or "corpus" in now:
    if was == now:
      return None
    if "corpus" in was and "corpus" in now:
      return "the built-in corpus (this Python's standard library) is another one"
    return (
      "the checkpoint was trained on the built-in corpus, this run reads --data"
      if "corpus" in was
      else "the checkpoint was trained on --data files, this run on the built-in corpus"
    )
  key = lambda f: (f["size"], f["edges"])  # noqa: E731
  old, new = was["files"], now["files"]
  if [key(f) for f in old] == [key(f) for f in new]:
    return None
  if len(old) != len(new):
    known = {key(f) for f in old}
    added = [f["path"] for f in new if key(f) not in known]
    still = {key(f) for f in new}
    gone = [f["path"] for f in old if key(f) not in still]
    files = lambda n: f"{n} file{'s' if n != 1 else ''}"  # noqa: E731
    what = f"--data now reads {files(len(new))}, the checkpoint's run read {files(len(old))}"
    if added:
      what += f" (new: {', '.join(added[:3])}{', ...' if len(added) > 3 else ''})"
    if gone:
      what += f" (gone: {', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''})"
    return what
  changes = []
  for a, b in zip(old, new):
    if key(a) == key(b):
      continue
    if a["size"] != b["size"]:
      grew = "grew" if b["size"] > a["size"] else "shrank"
      changes.append(f"{b['path']} {grew} from {a['size']} to {b['size']} bytes")
    else:
      changes.append(f"{b['path']} holds other content (same size, {a['size']} bytes)")
  return "; ".join(changes[:3]) + (
    f"; and {len(changes) - 3} more files" if len(changes) > 3 else ""
  )
