"""The strategy benchmark's entry point: `python experiments/bench_strategies.py --help`.

The code is the package experiments/bench/ (experiments/bench/strategies.py is this command;
`python -m experiments.bench.strategies` is the same). This script stays for the commands
recorded in experiments/results/ and docs/, and the benchmark's children run through it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench.strategies import main  # noqa: E402

if __name__ == "__main__":
  main()
