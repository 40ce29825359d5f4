"""The one voice of `paro-jax`: every warning and error as one line on stderr, the rest in a log.

The terminal gets `paro-jax: warning: ...` and `paro-jax: error: ...`, one line each, from
`warning` and `error` here, and Python warnings of the project pass through them too (`install`
hooks `warnings.showwarning`: no file, line or source echo). Third-party output that is noise to a
user (absl and orbax log records, the asyncio "Event loop is closed" tracebacks of a checkpoint
writer that hit a full disk, jax's plugin discovery) is kept out of the terminal; its full text,
with the full text of every project line, goes to a log file in the run directory (`set_log_dir`:
`OUT/paro-jax.log`), written only once that directory exists (a bad flag creates nothing).
Imports no jax.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import sys
import threading
import traceback
import warnings

PROG = "paro-jax"
LOG_NAME = "paro-jax.log"
MAX_PENDING = 2000  # log entries held while no run directory exists

# Third-party text that says nothing the project's own line does not (kept in the log only):
# orbax's note on a step without metadata (a resume that works), futures refused while Python
# exits, the asyncio loop a failed background write calls back into, jax's plugin discovery.
NOISE = (
  "Metadata file does not exist",
  "cannot schedule new futures after interpreter shutdown",
  "Event loop is closed",
  "No space left on device",
  "Jax plugin configuration error",
)
# Object reprs that third-party errors embed: TensorStore's bound pybind11 method (whole, or cut
# short by the message that quotes it, with its "See full TensorStore details:" lead), addresses.
_REPRS = re.compile(
  r"(See full TensorStore details: )?<bound method pybind11_detail_function_record[\w.<>]*"
  r"(?: of <[^>]*>)?>?"
  r"|<[\w.]+ object at 0x[0-9a-fA-F]+>"
)
_PROJECT = tuple(
  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
  for d in ("paro_jax", "models")
)


def one_line(text) -> str:
  """`text` on one line: whitespace runs (newlines included) as one space, object reprs gone."""
  return " ".join(_REPRS.sub("", str(text)).split())


def shown(path) -> str:
  """`path` as a message shows it: as it is, or quoted with its escapes (repr) where it holds a
  character that would not print as itself (a newline would split a one-line message)."""
  path = os.fsdecode(path)
  return path if path.isprintable() else repr(path)


class _Log:
  """Full texts, buffered until the run directory exists, then appended to its log file."""

  def __init__(self):
    self.pending: list[str] = []
    self.directory: str | None = None
    self.name = LOG_NAME
    self.lock = threading.Lock()

  @property
  def path(self) -> str | None:
    return os.path.join(self.directory, self.name) if self.directory else None

  def write(self, text: str) -> None:
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    with self.lock:
      self.pending.append(f"{stamp} {text.rstrip()}\n")
      del self.pending[:-MAX_PENDING]  # no run directory (plan, inspect): the newest only
    self.flush()

  def flush(self) -> None:
    with self.lock:
      if not (self.pending and self.directory and os.path.isdir(self.directory)):
        return
      try:  # opened per write: records may come after logging's shutdown closed its handlers
        with open(self.path, "a", encoding="utf-8") as f:
          f.writelines(self.pending)
        self.pending.clear()
      except OSError:  # a full disk: the project's own line says so; the log waits
        pass


_LOG = _Log()
atexit.register(_LOG.flush)


def set_log_dir(directory: str | None, name: str = LOG_NAME) -> None:
  """Keep the full texts in `directory`/`name` from now on (once the directory exists)."""
  _LOG.directory = os.path.abspath(directory) if directory else None
  _LOG.name = name
  _LOG.flush()


def log_path() -> str | None:
  """The log file, or None while there is none (no run directory, or not created yet)."""
  _LOG.flush()
  return _LOG.path if _LOG.path and os.path.exists(_LOG.path) else None


def log(text: str) -> None:
  """Into the log file only."""
  _LOG.write(text)


def note(text: str, file=None) -> None:
  """`paro-jax: text` on stdout (or `file`): what the run does, not a problem."""
  print(f"{PROG}: {one_line(text)}", file=file or sys.stdout, flush=True)


def warning(text) -> None:
  _say("warning", text)


def error(text) -> None:
  _say("error", text)


def _say(kind: str, text) -> None:
  sys.stderr.write(line(kind, text) + "\n")
  sys.stderr.flush()


def line(kind: str, text) -> str:
  """`paro-jax: KIND: text` on one line (logged in full), for a caller with its own stream."""
  log(f"{kind}: {text}")
  return f"{PROG}: {kind}: {one_line(text)}"


def is_noise(text: str) -> bool:
  return any(n in text for n in NOISE)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
  """warnings.showwarning: the project's warnings as one line, the others into the log."""
  if category is UserWarning and os.path.abspath(filename).startswith(_PROJECT):
    warning(message)
  else:
    log(f"{category.__name__} at {filename}:{lineno}: {message}")


class _Handler(logging.Handler):
  """The root logger's only handler: third-party records into the log file; an ERROR that is
  not known noise also as one warning line (what happened, where the full text is)."""

  def emit(self, record: logging.LogRecord) -> None:
    try:
      text = self.format(record)
    except Exception:  # noqa: BLE001 - a record that cannot format must not stop the run
      text = str(record.msg)
    log(f"{record.levelname} {record.name}: {text}")
    if record.levelno < logging.ERROR or is_noise(text) or "orbax" in record.pathname:
      return  # orbax's failed writes reach the user as the Checkpointer's own error
    where = f" (full text in {log_path()})" if log_path() else ""
    sys.stderr.write(
      f"{PROG}: warning: {record.name}: {one_line(record.getMessage()).split(' Traceback')[0]}"
      f"{where}\n"
    )


def _excepthook(kind, value, tb) -> None:
  """An exception that ends the program: as Python shows it (an uncaught exception of the
  project is a bug, and its traceback is what to report), but one that only repeats known noise
  (a full disk under a library's frames) as one error line: never silent, it ends the run."""
  text = "".join(traceback.format_exception(kind, value, tb))
  log(f"uncaught exception:\n{text}")
  if not is_noise(text):
    sys.__excepthook__(kind, value, tb)
    return
  where = log_path()
  error(f"{kind.__name__}: {value}" + (f" (the traceback is in {where})" if where else ""))


def _thread_excepthook(args) -> None:
  """Exceptions that reach the top of another thread (orbax's and TensorStore's writers): noise
  into the log; the main thread reports what the failure means for the run."""
  if args.exc_type is SystemExit:
    return
  text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
  log(f"uncaught exception in thread {getattr(args.thread, 'name', '?')}:\n{text}")
  if not is_noise(text):
    sys.__excepthook__(args.exc_type, args.exc_value, args.exc_traceback)


def _unraisablehook(u) -> None:
  """Exceptions Python cannot raise (in callbacks from C++ threads: TensorStore's writes calling
  into an asyncio loop orbax already closed, after a failed save): noise into the log."""
  text = "".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback))
  log(f"unraisable exception ({u.err_msg or ''} {u.object!r}):\n{text}")
  if not is_noise(text):
    sys.__unraisablehook__(u)


def install():
  """Route Python warnings, logging and uncaught exceptions through this module (idempotent).
  Returns a function that puts back what was there (for callers of the CLI inside Python)."""
  root = logging.getLogger()
  saved = (
    warnings.showwarning,
    sys.excepthook,
    sys.unraisablehook,
    threading.excepthook,
    list(root.handlers),
    root.level,
  )

  def restore() -> None:
    warnings.showwarning, sys.excepthook, sys.unraisablehook, threading.excepthook = saved[:4]
    root.handlers[:] = saved[4]
    root.setLevel(saved[5])
    set_log_dir(None)

  warnings.showwarning = _show_warning
  if not any(isinstance(h, _Handler) for h in root.handlers):
    for h in list(root.handlers):  # e.g. a basicConfig's stderr handler
      if getattr(h, "stream", None) in (sys.stderr, sys.__stderr__):
        root.removeHandler(h)
    root.addHandler(_Handler())
  if root.level > logging.INFO:
    root.setLevel(logging.INFO)  # orbax's progress notes belong in the log
  for name in ("absl",):
    logging.getLogger(name).propagate = True
  sys.excepthook = _excepthook
  sys.unraisablehook = _unraisablehook
  threading.excepthook = _thread_excepthook
  return restore
