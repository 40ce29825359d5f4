import datetime
import json
import os
import platform

import jax

from experiments.pages import machine_line, utc_now, write_page


def test_machine_line_names_cores_python_and_jax():
  line = machine_line()
  assert f"{os.cpu_count()} cores" in line
  assert f"python {platform.python_version()}" in line
  assert line.endswith(f"jax {jax.__version__}")


def test_utc_now_is_utc_to_the_second():
  stamp = datetime.datetime.fromisoformat(utc_now())
  assert stamp.utcoffset() == datetime.timedelta(0) and stamp.microsecond == 0
  assert abs(datetime.datetime.now(datetime.timezone.utc) - stamp) < datetime.timedelta(minutes=1)


def test_write_page_writes_the_record_and_the_page(tmp_path):
  out = tmp_path / "new" / "folder"
  write_page(str(out), {"a": [1, 2]}, "r.json", "# title\n", "README.md")
  assert json.loads((out / "r.json").read_text()) == {"a": [1, 2]}
  assert (out / "README.md").read_text() == "# title\n"
