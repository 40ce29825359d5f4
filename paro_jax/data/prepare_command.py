"""`paro-jax prepare-data`: its flags and its entry (paro_jax/data/prepare.py tokenizes), with the
lines that say what was written or why nothing was."""

from __future__ import annotations

import os
import signal
import sys

from paro_jax.core.flags import add_options
from paro_jax.data.config import BIN_DTYPE_NAMES, DataConfig
from paro_jax import report


def add_parser(sub) -> None:
  prep = sub.add_parser(
    "prepare-data",
    help="tokenize text/JSONL/Parquet files into .bin shards for train --data 'OUT/*.bin'",
    description="Tokenize text, JSONL and Parquet files (byte-level, or an HF tokenizer.json) "
    "into .bin shards of token ids (instruction records: with their target masks), a block at a "
    "time (memory stays small whatever the data's size), with a progress bar. Train on them "
    "with --data 'OUT/*.bin': the shards are read window by window (os.pread), each process "
    "reading only the tokens of its rows. Two prepare-data runs into one --out are refused "
    "(a lock on it for the whole run); a failed or stopped run publishes nothing.",
  )
  prep.add_argument(
    "inputs", nargs="+", metavar="PATH", help="text / .jsonl / .parquet files and globs"
  )
  prep.add_argument("--out", required=True, metavar="DIR", help="directory for the shards")
  add_options(prep, DataConfig, "tokenizer", "text_field")  # as train reads them
  add_options(prep, DataConfig, "data_format", "chat_template")
  helps = {  # prepare-data has no --init-from: its defaults come from --tokenizer alone
    "tokenizer": "an HF tokenizer.json (or its model's directory), or 'bytes' (vocab 256); "
    "default: bytes (chat records need the model's: pass it)",
    "chat_template": "a jinja2 chat template for chat records (default: the one of "
    "--tokenizer's HF directory)",
  }
  for action in prep._actions:
    action.help = helps.get(action.dest, action.help)
  prep.add_argument(
    "--shard-tokens", type=int, default=100_000_000, metavar="N", help="token ids per shard"
  )
  prep.add_argument(
    "--bin-dtype",
    default=None,
    type=str.lower,
    choices=BIN_DTYPE_NAMES,
    help="token dtype (default: uint16, or uint32 when the tokenizer's vocab exceeds 65536)",
  )


def main(args, inv) -> None:
  from paro_jax.data.prepare import prepare_data  # numpy: not at the CLI's start

  try:
    meta = prepare_data(
      args.inputs,
      args.out,
      args.tokenizer,
      args.text_field,
      args.shard_tokens,
      args.bin_dtype,
      data_format=args.data_format,
      chat_template=args.chat_template,
    )
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (prepare.Stopped)
    name = signal.Signals(getattr(e, "signum", signal.SIGINT)).name
    out = report.shown(args.out)
    print(
      f"\nparo-jax: stopped by {name}: nothing was published in {out} (the partial shards were "
      f"removed): run the same command again",
      file=sys.stderr,
      flush=True,
    )
    raise
  if meta.get("dropped"):
    n = meta["dropped"]["no target"]
    print(f"paro-jax: {n} records with no target token left out (no completion or answer)")
  examples = f"{meta['examples']} {meta['format']} examples, " if "examples" in meta else ""
  print(
    f"paro-jax: wrote {examples}{meta['tokens']} tokens ({meta['dtype']}) in "
    f"{len(meta['shards'])} "
    f"shards to {report.shown(args.out)}: train with --data {shown_glob(args.out)} "
    f"--bin-dtype {meta['dtype']}"
  )


def shown_glob(out: str) -> str:
  """`'OUT/*.bin'` for the shell; where OUT would not print as itself (a newline splits the
  line), its repr, escapes and all."""
  pattern = os.path.join(out, "*.bin")
  return f"'{pattern}'" if pattern.isprintable() and "'" not in pattern else repr(pattern)
