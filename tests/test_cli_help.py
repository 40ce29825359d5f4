"""The --help of train, inspect and plan, as a user reads it, is the one recorded in
tests/fixtures/cli_help/ (one file per command): reorganising the configs the flags are built
from must not change a flag, its order, its default or its help. A flag changed on purpose:
regenerate its command's file with `COLUMNS=100 paro-jax train --help` (inspect, plan) and
review the diff."""

import pathlib

import pytest

from paro_jax import cli

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "cli_help"


@pytest.mark.parametrize("command", ["train", "inspect", "plan"])
def test_help_is_the_recorded_one(command, monkeypatch):
  monkeypatch.setenv("COLUMNS", "100")  # argparse wraps at the terminal's width
  sub = cli.build_parser()._subparsers._group_actions[0].choices[command]
  assert sub.format_help() == (FIXTURES / f"{command}.txt").read_text()
