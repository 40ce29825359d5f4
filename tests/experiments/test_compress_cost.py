"""experiments/compress_cost.py: the wire formats' encode and decode, timed where it runs."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "compress_cost.py")


def _wire(fmt: str, n: int) -> int:
  # int8: one byte a value and a 4-byte fp32 scale per block of 32 (the last one short); bf16: 2
  return n + -(-n // 32) * 4 if fmt == "int8" else 2 * n


def test_times_each_format_and_counts_its_bytes(tmp_path):
  env = {**os.environ, "PYTHONPATH": REPO}
  env.pop("XLA_FLAGS", None)
  p = subprocess.run(
    [sys.executable, SCRIPT, "--sizes", "1000,4099", "--reps", "2", "--per", "x=1e-3",
     "--out", str(tmp_path)],
    capture_output=True, text=True, env=env, timeout=300,
  )  # fmt: skip
  assert p.returncode == 0, p.stderr[-2000:]
  rows = json.loads((tmp_path / "compress_cost.json").read_text())["rows"]
  # bf16 on the wire of a bf16 tensor is the tensor itself: not timed
  assert {(r["format"], r["dtype"], r["elements"]) for r in rows} == {
    (f, d, n)
    for n in (1000, 4099)
    for f, d in (("int8", "bfloat16"), ("int8", "float32"), ("bf16", "float32"))
  }
  for r in rows:
    assert r["wire_bytes"] == _wire(r["format"], r["elements"])
    assert r["encode_s"] > 0 and r["decode_s"] > 0
  assert "| int8 | float32 | 4,099 |" in (tmp_path / "README.md").read_text()


def test_results_page_counts_the_wire_bytes():
  page = os.path.join(REPO, "experiments", "results", "compress_cost", "compress_cost.json")
  with open(page) as f:
    rows = json.load(f)["rows"]
  assert rows and all(r["wire_bytes"] == _wire(r["format"], r["elements"]) for r in rows)
