"""The planner validation's entry point: `python experiments/validate_planner.py --help`.

The code is experiments/bench/validate.py (`python -m experiments.bench.validate` is the same);
this script stays for the commands recorded in experiments/results/ and docs/.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench.validate import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
