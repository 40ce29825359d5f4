"""Regenerate (or check) the sample outputs shown in README.md and docs/.

A sample is a fenced block whose first line is `$ paro-jax ...` (continued over lines ending in
`\\`); the rest of the block is what that command prints. This script runs each command with the
current code and writes its output into the block, or with `--check` reports every block whose
output differs and exits 1. Only commands whose output depends on the code alone (no timing, no
measurement) may be shown this way: `inspect` (a compile from abstract shapes) and `plan`
(formulas). tests/test_docs.py runs `--check`.

    python tests/docs_samples.py            # rewrite the samples in place
    python tests/docs_samples.py --check    # exit 1 naming each stale sample
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
# Subcommands whose output is a pure function of the code and the arguments.
DETERMINISTIC = ("plan", "inspect")
FENCE = re.compile(r"^```[^\n]*\n(\$ paro-jax .*?)^```\n", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Sample:
  path: str
  command: str  # as shown, continuation lines included
  output: str  # the block after the command
  start: int  # offsets of the block's body in the file
  end: int

  @property
  def argv(self) -> list[str]:
    return shlex.split(self.command[2:].replace("\\\n", " "))


def find_samples(text: str, path: str = "") -> list[Sample]:
  """Every `$ paro-jax ...` block of a markdown text."""
  samples = []
  for m in FENCE.finditer(text):
    body = m.group(1)
    lines = body.splitlines(keepends=True)
    n = 1
    while lines[n - 1].rstrip("\n").endswith("\\"):
      n += 1
    command = "".join(lines[:n]).rstrip("\n")
    samples.append(Sample(path, command, "".join(lines[n:]), m.start(1), m.end(1)))
  return samples


def run_sample(sample: Sample) -> str:
  argv = sample.argv
  if argv[1] not in DETERMINISTIC:
    raise ValueError(
      f"{sample.path}: `{argv[0]} {argv[1]}` prints timings or measurements; show only "
      f"{'/'.join(DETERMINISTIC)} samples as `$ paro-jax ...` blocks"
    )
  # As a user runs it: the tests' XLA_FLAGS (fewer LLVM passes, forced devices) left out.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  # The samples are of the CPU program; naming the platform also keeps out the line that says
  # which one a machine without an NVIDIA driver falls to (it differs between machines).
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run(
    [sys.executable, "-m", "paro_jax", *argv[1:]],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  if done.returncode != 0:
    raise RuntimeError(f"{sample.path}: `{sample.command}` failed:\n{done.stderr[-3000:]}")
  return done.stdout


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="report stale samples, change nothing")
  args = parser.parse_args(argv)
  stale = []
  for path in DOCS:
    text = (ROOT / path).read_text()
    new = text
    for sample in reversed(find_samples(text, path)):  # from the end: offsets stay valid
      output = run_sample(sample)
      if output != sample.output:
        stale.append(f"{path}: `{sample.command.splitlines()[0]}`")
        new = new[: sample.start] + sample.command + "\n" + output + new[sample.end :]
    if new != text and not args.check:
      (ROOT / path).write_text(new)
  for line in stale:
    print(("stale: " if args.check else "rewrote: ") + line)
  if stale and args.check:
    print("run `python tests/docs_samples.py` and review the diff", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
