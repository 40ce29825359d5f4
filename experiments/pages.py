"""A results page of an experiment: the date and the machine line it states, and its two files
(the JSON record and the page a reader opens).

Imports no jax (the version comes from the installed package's metadata), so an orchestrator that
runs jax only in its children can call it too.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform


def utc_now() -> str:
  """The time now in UTC, to the second (ISO 8601)."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine_line() -> str:
  """`host: processor, N cores, python X, jax Y`: the machine a results page was measured on."""
  return (
    f"{platform.node() or 'this machine'}: {platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} cores, python {platform.python_version()}, "
    f"jax {importlib.metadata.version('jax')}"
  )


def write_page(out: str, record: dict, json_name: str, text: str, page_name: str) -> None:
  """OUT/json_name (`record`, indented) and OUT/page_name (`text`), creating OUT."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, json_name), "w") as f:
    json.dump(record, f, indent=1)
  with open(os.path.join(out, page_name), "w") as f:
    f.write(text)
