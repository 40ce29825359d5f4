"""experiments/ stays curated: no module past MAX_LINES (split it by concern, as
experiments/gpu_estimates.py is split into its cell and page modules)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 500


def test_no_experiment_module_is_longer_than_max_lines():
  long = {
    str(p.relative_to(ROOT)): n
    for p in sorted((ROOT / "experiments").glob("**/*.py"))
    if (n := len(p.read_text().splitlines())) > MAX_LINES
  }
  assert not long, f"split these by concern (over {MAX_LINES} lines): {long}"
