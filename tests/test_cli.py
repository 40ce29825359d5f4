import json
import os
import subprocess
import sys

import numpy as np
import pytest

from paro_jax.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_quick_start_run(tmp_path):
  """The README's training command in a fresh process: the CLI provides the 8 CPU devices itself,
  the run writes one metrics row per step, and the loss falls clearly over 50 steps."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = tmp_path / "run"
  cmd = [
    sys.executable,
    "-m",
    "paro_jax",
    "train",
    "--model",
    "tiny",
    "--strategy",
    "IIG",
    "--mesh",
    "2x4",
    "--micro-batches",
    "2",
    "--batch-size",
    "16",
    "--seq-len",
    "64",
    "--steps",
    "50",
    "--seed",
    "0",
    "--out",
    str(out),
  ]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "mesh 2x4 (8 cpu devices)" in proc.stdout
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 51))
  assert all({"loss", "tokens_per_s", "grad_norm"} <= r.keys() for r in rows)
  first, last = rows[0]["loss"], np.mean([r["loss"] for r in rows[-5:]])
  assert first > 5.0 and last < first - 1.5, (first, last)


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--strategy", "GNI"], "invalid strategy 'GNI'"),
    (["--strategy", "IXG"], "unknown strategy 'IXG'"),
    (["--mesh", "3x3", "--batch-size", "18"], "mesh 3x3 needs 9 devices but 8 are available"),
    (["--mesh", "2by4"], "bad --mesh '2by4'"),
    (["--data", "/nonexistent/corpus.txt"], "data file '/nonexistent/corpus.txt' does not exist"),
    (["--batch-size", "12"], "--batch-size 12 is not divisible by the 8 devices of --mesh 2x4"),
    (["--attention", "cudnn"], "--attention cudnn needs NVIDIA GPUs (this run is on cpu)"),
  ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    main(["train", "--steps", "1", "--out", str(tmp_path), "--mesh", "2x4", *argv])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_help_lists_every_alias_and_names_ignore_case(capsys):
  from paro_jax.core.strategy import ALIASES

  with pytest.raises(SystemExit):
    main(["train", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert all(f"{k}={v}" in text for k, v in ALIASES.items())
  assert "--max-bad-steps N" in text and "(default 3)" in text
  main(["plan", "--nodes", "2", "--devices-per-node", "8", "--gpu", "H100", "--json"])
  assert json.loads(capsys.readouterr().out)["inputs"]["gpu"] == "H100 SXM 80GB"


def _one_line_error(capsys, argv, monkeypatch=None):
  """Run the CLI in-process; it must exit 2 with exactly one line `paro-jax: error: ...`."""
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("paro-jax: error:")]
  assert len(lines) == 1 and "Traceback" not in err, err
  return lines[0]


TRAIN = ["train", "--model", "test", "--steps", "1", "--warmup", "1", "--batch-size", "8"]


def test_bad_data_is_one_line(tmp_path, capsys):
  """A JSONL `text` that is a number or null, a directory as --data, binary garbage as text, a
  malformed tokenizer file: each one line naming the file and the fix."""
  out = ["--out", str(tmp_path / "run")]
  for value, shown in (("5", "5 (int)"), ("null", "null (NoneType)")):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"text": %s}\n' % value)
    line = _one_line_error(capsys, [*TRAIN, "--data", str(tmp_path / "d.jsonl"), *out])
    assert f"d.jsonl:2: the 'text' field is {shown}, not text: fix or drop that record" in line
  (tmp_path / "texts").mkdir()
  line = _one_line_error(capsys, [*TRAIN, "--data", str(tmp_path / "texts"), *out])
  assert "is a directory: pass its files, e.g. --data '" in line and "texts/*.txt'" in line
  rng = np.random.default_rng(0)
  (tmp_path / "garbage.txt").write_bytes(rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes())
  line = _one_line_error(capsys, [*TRAIN, "--data", str(tmp_path / "garbage.txt"), *out])
  assert "garbage.txt is not UTF-8 text (byte 0x" in line and "named *.bin" in line
  (tmp_path / "ctrl.txt").write_bytes(bytes(range(1, 32)) * 100 + b"some text")
  line = _one_line_error(capsys, [*TRAIN, "--data", str(tmp_path / "ctrl.txt"), *out])
  assert "ctrl.txt is mostly not printable text" in line
  (tmp_path / "ok.txt").write_text("héllo wörld, plain text\n" * 100)
  pytest.importorskip("tokenizers")
  (tmp_path / "tok.json").write_text('{"model": garbage')
  line = _one_line_error(
    capsys,
    [*TRAIN, "--data", str(tmp_path / "ok.txt"), "--tokenizer", str(tmp_path / "tok.json"), *out],
  )
  assert "tok.json is not a valid HF tokenizer.json (" in line and "leave --tokenizer out" in line


def test_text_check_accepts_text_cut_mid_character(tmp_path):
  from paro_jax.data.config import DataConfig
  from paro_jax.data.streams import load_tokens, TEXT_SAMPLE

  text = ("ü" * (TEXT_SAMPLE // 2 + 7)).encode()  # the sample ends inside a 2-byte character
  (tmp_path / "u.txt").write_bytes(text)
  assert load_tokens(DataConfig(paths=(str(tmp_path / "u.txt"),)), 256).size == len(text)


def test_corrupt_safetensors_is_one_line(tmp_path, capsys):
  import json as _json

  from models.hf_config import config_to_hf
  from models.presets import get_config

  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text(_json.dumps(config_to_hf(get_config("test"))))
  (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage" + bytes(99))
  line = _one_line_error(capsys, [*TRAIN, "--init-from", str(hf), "--out", str(tmp_path / "r")])
  assert "model.safetensors is not a readable safetensors file (" in line
  assert "damaged or incomplete; download or export it again" in line


def test_bad_shapes_and_meshes_are_one_line(capsys, monkeypatch):
  """inspect --batch-size 12 on 2x4, --seq-len 0, --mesh 1000x1000 (refused before XLA would
  start a million devices), launch of too many nodes."""
  from paro_jax import cli

  monkeypatch.setattr(cli, "provide_cpu_devices", lambda n: None)  # this process has its 8
  line = _one_line_error(
    capsys, ["inspect", "--model", "test", "--mesh", "2x4", "--batch-size", "12"]
  )
  assert "--batch-size 12 is not divisible by the 8 devices of --mesh 2x4" in line
  line = _one_line_error(capsys, ["inspect", "--model", "test", "--seq-len", "0"])
  assert "--seq-len must be >= 1, got 0" in line
  for cmd in (["inspect"], TRAIN):
    line = _one_line_error(capsys, [*cmd, "--mesh", "1000x1000"])
    assert "--mesh 1000x1000 asks for 1000000 devices per process; at most 1024" in line
  line = _one_line_error(
    capsys, ["launch", "--nodes", "1000", "--devices-per-node", "2", "--", "train"]
  )
  assert "one machine emulates at most 64 nodes" in line


def _options(parser):
  import argparse

  for action in parser._actions:
    if action.option_strings and not isinstance(action, argparse._HelpAction):
      yield action


def test_help_shows_every_default_and_no_internal_remarks():
  """`--help` of every subcommand: each option with a default states it, once; the top-level
  description is for the user (not the module's docstring)."""
  from paro_jax.cli import DESCRIPTION, build_parser

  parser = build_parser()
  top = parser.format_help()
  assert DESCRIPTION.split(".")[0] in top.replace("\n", " ").replace("  ", " ")
  assert "before jax starts" not in top
  subs = parser._subparsers._group_actions[0].choices
  assert set(subs) == {
    "train",
    "eval",
    "generate",
    "inspect",
    "plot",
    "export",
    "launch",
    "plan",
    "probe",
    "prepare-data",
  }
  for name, sub in subs.items():
    text = " ".join(sub.format_help().split())
    assert "%(default)" not in text and "Ψ" not in text
    for action in _options(sub):
      assert action.help, (name, action.option_strings)  # argparse shows no default without
      if action.required or action.default is None or action.default is False:
        continue
      if action.default is True and action.nargs == 0:  # --no-X: its default is not giving it
        continue
      formatter = sub._get_formatter()
      shown = formatter._get_help_string(action) % {"default": action.default}
      assert shown.lower().count("default") == 1, (name, action.option_strings, shown)
      assert " ".join(shown.split()) in text, (name, shown)  # it reaches --help
  train_help = " ".join(subs["train"].format_help().split())
  assert "--steps STEPS optimizer steps of the whole run (default: 50)" in train_help
  assert "--seq-len SEQ_LEN tokens per sequence (default: 64)" in train_help
  assert "--seed SEED of the initial weights and the batches (default: 0)" in train_help


def test_names_compare_case_insensitively():
  from paro_jax.analysis.gpu.targets import check_target
  from paro_jax.cli import build_parser

  p = build_parser()
  args = p.parse_args(
    ["train", "--model", "TINY", "--dtype", "FP32", "--collectives", "HRing", "--remat", "Full"]
    + ["--bin-dtype", "UINT32", "--strategy", "iig"]
  )
  bin_dtype = vars(args)["data.bin_dtype"]  # the flag's dest is its option's path
  assert (args.model, args.dtype, args.collectives, args.remat, bin_dtype) == (
    "tiny",
    "fp32",
    "hring",
    "full",
    "uint32",
  )
  args = p.parse_args(["plan", "--model", "7B", "--nodes", "2", "--devices-per-node", "8"])
  assert args.model == "7b"
  args = p.parse_args(["plan", "--nodes", "2", "--devices-per-node", "8", "--dtype", "BF16"])
  assert args.dtype == "bf16"
  assert p.parse_args(["inspect", "--collectives", "XLA"]).collectives == "xla"
  assert check_target("H100") == "h100"
