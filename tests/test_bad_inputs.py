"""The bad-input sweep as tests: each input exits 2 with exactly one line on stderr,
`paro-jax: error: ...` naming the problem (and no traceback), before anything compiles.

The CLI runs in this process (the devices are conftest's 8 CPU devices); only the resume case
needs a checkpoint, written once for the module by a one-step run of the `test` model.
"""

import os

import numpy as np
import pytest

from paro_jax import cli
from paro_jax.cli import main
from tests.fast_compile import FAST_COMPILE

TRAIN = ["train", "--model", "test", "--steps", "1", "--warmup", "1", "--batch-size", "8"]
PLAN = ["plan", "--model", "tiny", "--nodes", "2"]
LAUNCH = ["launch", "--nodes", "2", "--devices-per-node", "2", "--loopback"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """Bad data files, an HF-less dir, a non-empty export target."""
  d = tmp_path_factory.mktemp("inputs")
  (d / "empty.txt").write_text("")
  (d / "short.txt").write_text("too short\n")
  rng = np.random.default_rng(0)
  (d / "garbage.txt").write_bytes(rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes())
  (d / "odd.bin").write_bytes(bytes(30_001))
  (d / "few.bin").write_bytes(bytes(100))  # 50 uint16 tokens
  (d / "bad.jsonl").write_text("not json\n")
  (d / "d.jsonl").write_text('{"text": "hi"}\n')
  (d / "dir").mkdir()
  (d / "full").mkdir()
  (d / "full" / "config.json").write_text("{}")
  (d / "a_file").write_text("x")
  (d / "sur.jsonl").write_text('{"text": "ok"}\n{"text": "a \\ud800 b"}\n')  # JSON's escape
  (d / "listcfg").mkdir()
  (d / "listcfg" / "config.json").write_text("[4096, 32]")
  _tokenizers(d)
  return d


def _tokenizers(d):
  """bpe.json, a small BPE (its end-of-sequence token </s> named by the tokenizer_config.json
  beside it); holes.json, the same with one id moved to 5000 (ids need not be contiguous: its
  vocabulary counts 52 entries, a model needs 5001 rows)."""
  import json

  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"])
  tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 5, trainer)
  tok.save(str(d / "bpe.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  spec = json.loads((d / "bpe.json").read_text())
  vocab = spec["model"]["vocab"]
  vocab[max(vocab, key=vocab.get)] = 5000
  (d / "holes.json").write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """A one-step run of the `test` model with its final checkpoint."""
  out = tmp_path_factory.mktemp("run") / "r"
  main([*TRAIN, "--mesh", "2x4", "--seq-len", "16", "--out", str(out)])
  assert os.path.isdir(out / "checkpoints" / "1")
  return out


def _cases():
  """(id, argv builder, text the line must contain); `f` is the files dir, `out` a fresh dir."""
  t = lambda *a: lambda f, out: [*TRAIN, "--out", out, *[x.format(f=f) for x in a]]
  p = lambda *a: lambda f, out: [*PLAN, *[x.format(f=f) for x in a]]
  return [
    # data
    ("missing-data", t("--data", "{f}/nope.txt"), "data file '{f}/nope.txt' does not exist"),
    ("empty-data", t("--data", "{f}/empty.txt"), "is empty"),
    ("binary-as-text", t("--data", "{f}/garbage.txt"), "is not UTF-8 text"),
    ("odd-size-bin", t("--data", "{f}/odd.bin"), "30001 bytes is not a whole number of uint16"),
    ("short-text", t("--data", "{f}/short.txt"), "fewer than one sequence of 65"),
    ("short-bin", t("--data", "{f}/few.bin"), "the corpus has 50 tokens, fewer than one"),
    ("not-jsonl", t("--data", "{f}/bad.jsonl"), "bad.jsonl:1: not a JSON object"),
    ("no-field", t("--data", "{f}/d.jsonl", "--text-field", "body"), "has no 'body' field"),
    ("data-dir", t("--data", "{f}/dir"), "is a directory: pass its files"),
    ("glob-no-match", t("--data", "{f}/*.xyz"), "matches no file"),
    ("missing-tokenizer", t("--tokenizer", "{f}/tok.json"), "tokenizer file"),
    ("missing-init-from", t("--init-from", "{f}/nope"), "HF model directory"),
    ("out-is-a-file", t("--out", "{f}/a_file"), "is a file: pass a directory for the run"),
    ("resume-nothing", t("--resume"), "no checkpoint in"),
    (
      "lone-surrogate",  # JSON allows "\ud800"; no UTF-8 encodes it
      t("--data", "{f}/sur.jsonl"),
      "sur.jsonl:2: the 'text' field holds a lone surrogate ('\\ud800' at character 2)",
    ),
    (
      "lone-surrogate-hf",
      t("--data", "{f}/sur.jsonl", "--tokenizer", "{f}/bpe.json"),
      "sur.jsonl:2: the 'text' field holds a lone surrogate",
    ),
    ("tokenizer-dir", t("--tokenizer", "{f}/dir"), "is a directory without a tokenizer.json"),
    (
      "tokenizer-id-holes",  # before compiling, not as NaN three steps in
      t("--tokenizer", "{f}/holes.json"),
      "has a vocabulary of 5001, more than the model's 256",
    ),
    ("seed-huge", t("--seed", str(2**64)), f"--seed must be in [0, 2**63), got {2**64}"),
    ("seed-negative", t("--seed", "-1"), "--seed must be in [0, 2**63), got -1"),
    ("config-list", t("--init-from", "{f}/listcfg"), "unsupported HF config: a JSON list"),
    ("model-config-list", t("--model", "{f}/listcfg"), "unsupported HF config: a JSON list"),
    # models, meshes and strategies
    ("unknown-model", t("--model", "70b"), "unknown model preset '70b'"),
    ("missing-model-json", t("--model", "{f}/cfg.json"), "cfg.json does not exist"),
    (
      "mesh-too-big",  # (a CLI process of its own would make the 9 devices; this one has 8)
      t("--mesh", "3x3", "--batch-size", "18"),
      "mesh 3x3 needs 9 devices but 8 are available",
    ),
    ("mesh-splits-no-batch", t("--mesh", "3x3"), "--batch-size 8 is not divisible by the 9"),
    ("mesh-zero", t("--mesh", "0x4"), "bad --mesh '0x4'"),
    ("mesh-garbled", t("--mesh", "2by4"), "bad --mesh '2by4'"),
    ("mesh-huge", t("--mesh", "1000x1000"), "asks for 1000000 devices per process"),
    ("batch-indivisible", t("--mesh", "2x4", "--batch-size", "12"), "not divisible by the 8"),
    ("invalid-strategy", t("--strategy", "GNI"), "invalid strategy 'GNI'"),
    ("unknown-strategy", t("--strategy", "IXG"), "unknown strategy 'IXG'"),
    ("cudnn-on-cpu", t("--attention", "cudnn"), "--attention cudnn needs NVIDIA GPUs"),
    ("lora-targets", t("--lora-rank", "4", "--lora-targets", "wx"), "unknown LoRA targets"),
    # zero and negative counts
    ("steps-zero", t("--steps", "0"), "--steps must be >= 1, got 0"),
    ("steps-negative", t("--steps", "-3"), "--steps must be >= 1, got -3"),
    ("batch-zero", t("--batch-size", "0"), "--batch-size must be >= 1, got 0"),
    ("seq-negative", t("--seq-len", "-5"), "--seq-len must be >= 1, got -5"),
    ("micro-batches-zero", t("--micro-batches", "0"), "--micro-batches must be >= 1, got 0"),
    ("keep-zero", t("--keep", "0"), "--keep must be >= 1, got 0"),
    ("bad-steps-zero", t("--max-bad-steps", "0"), "--max-bad-steps must be >= 1, got 0"),
    ("warmup-negative", t("--warmup", "-1"), "--warmup must be >= 0, got -1"),
    ("lr-zero", t("--lr", "0"), "--lr must be a positive finite number"),
    ("lr-nan", t("--lr", "nan"), "--lr must be a positive finite number, got nan"),
    ("lora-rank-negative", t("--lora-rank", "-1"), "--lora-rank must be >= 0"),
    ("int8-block-zero", t("--int8-block", "0"), "--int8-block must be a positive integer"),
    ("progress-negative", t("--progress-timeout", "-1"), "--progress-timeout must be >= 0"),
    ("eval-fraction", t("--eval-fraction", "1"), "--eval-fraction must be in [0, 1)"),
    # the same wording in inspect and plan
    ("inspect-seq-zero", lambda f, o: ["inspect", "--seq-len", "0"], "--seq-len must be >= 1"),
    ("plan-seq-zero", p("--seq-len", "0"), "--seq-len must be >= 1, got 0"),
    ("plan-micro-batches", p("--micro-batches", "0"), "--micro-batches must be >= 1, got 0"),
    ("plan-nodes-zero", p("--nodes", "0"), "--nodes and --devices-per-node must be >= 1"),
    ("plan-devices-neg", p("--devices-per-node", "-1"), "got 2 and -1"),
    ("plan-mfu", p("--mfu", "0"), "--mfu must be in (0, 1], got 0.0"),
    ("plan-unknown-model", p("--model", "70b"), "unknown model preset '70b'"),
    ("plan-memory", p("--device-memory", "lots"), "bad --device-memory 'lots'"),
    ("plan-model-file", p("--model", "{f}/a_file"), "a_file is not a .json file nor a directory"),
    (
      "inspect-bandwidth-without-target",
      lambda f, o: ["inspect", "--inter-bandwidth", "100gbit"],
      "--inter-bandwidth sets the link of XLA's step-time estimate, made only for a GPU compile",
    ),
    # export, launch, the other commands
    (
      "export-non-empty",
      lambda f, o: ["export", str(f / "dir"), "--out", str(f / "full")],
      "already exists and is not empty",
    ),
    ("export-no-run", lambda f, o: ["export", o, "--out", f"{o}-hf"], "has no checkpoints/"),
    ("launch-bad-command", lambda f, o: [*LAUNCH, "--", "bogus"], "put the train command"),
    (
      "launch-bad-train-flag",
      lambda f, o: [*LAUNCH, "--", "train", "--bogus"],
      "the per-node command after --: unrecognized arguments: --bogus",
    ),
    ("launch-no-nodes", lambda f, o: [*LAUNCH[:2], "0", *LAUNCH[3:], "--", "train"], ">= 1"),
    (
      "launch-bandwidth",
      lambda f, o: [*LAUNCH, "--inter-bandwidth", "fast", "--", "train"],
      "'fast'",
    ),
    ("plot-no-metrics", lambda f, o: ["plot", str(f / "dir")], "metrics.jsonl does not exist"),
    (
      "prepare-missing-input",
      lambda f, o: ["prepare-data", str(f / "nope.txt"), "--out", o],
      "does not exist: pass existing text or .jsonl files",
    ),
    (
      "prepare-shard-zero",
      lambda f, o: ["prepare-data", str(f / "d.jsonl"), "--out", o, "--shard-tokens", "0"],
      "--shard-tokens must be >= 1, got 0",
    ),
  ]


CASES = _cases()


def _one_line(capsys, argv) -> str:
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2, argv
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("paro-jax: error: "), err
  return lines[0]


@pytest.mark.parametrize("build,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(files, tmp_path, capsys, monkeypatch, build, message):
  monkeypatch.setattr(cli, "provide_cpu_devices", lambda n: None)  # this process has its 8
  line = _one_line(capsys, [str(a) for a in build(files, str(tmp_path / "run"))])
  assert message.format(f=files) in line, line


def test_resume_with_another_model_is_one_line(trained_run, capsys):
  line = _one_line(capsys, [*TRAIN, "--model", "tiny", "--resume", "--out", str(trained_run)])
  assert "tiny" in line and "test" in line, line


def test_a_second_run_on_a_used_out_is_one_line(trained_run, capsys):
  line = _one_line(capsys, [*TRAIN, "--mesh", "2x4", "--out", str(trained_run)])
  assert "already holds checkpoints" in line and "--resume" in line, line


@pytest.fixture
def small_tmpfs(tmp_path):
  """A 256 KiB tmpfs (as root), too small for a checkpoint of the `test` model."""
  import shutil
  import subprocess

  if os.geteuid() != 0 or shutil.which("mount") is None:
    pytest.skip("mounting a small tmpfs needs root and mount(8): the full-disk case is not run")
  where = tmp_path / "small"
  where.mkdir()
  done = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
    capture_output=True,
    text=True,
  )
  if done.returncode:
    pytest.skip(f"could not mount a tmpfs ({done.stderr.strip()}): the full-disk case is not run")
  yield where
  subprocess.run(["umount", str(where)], capture_output=True)


def test_first_save_on_a_full_disk_is_one_line(small_tmpfs):
  """The final (first) checkpoint does not fit: one error line saying so and what is lost; none
  of the asyncio tracebacks of the checkpoint writer's threads."""
  import subprocess
  import sys

  # As a user runs it: the CLI picks the platform (conftest's JAX_PLATFORMS would let JAX's
  # CUDA plugin, where installed, log its cudart lines).
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["XLA_FLAGS"] = FAST_COMPILE  # the CLI adds its device count
  argv = [*TRAIN, "--mesh", "1x2", "--seq-len", "16", "--out", str(small_tmpfs / "run")]
  proc = subprocess.run(
    [sys.executable, "-m", "paro_jax", *argv],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("paro-jax: error: the disk is full"), lines[:20]
  assert "could not write checkpoint" in lines[0] and "no earlier checkpoint" in lines[0]


def test_prepare_data_on_a_full_disk_is_one_line(small_tmpfs, tmp_path, capsys):
  """Shards that do not fit: `the disk is full`, naming the directory and the fix (not numpy's
  byte counts), and nothing left there."""
  (tmp_path / "big.txt").write_text("a line of text\n" * 70_000)  # 1 MB of shards
  out = small_tmpfs / "shards"
  with pytest.raises(SystemExit) as e:
    main(["prepare-data", str(tmp_path / "big.txt"), "--out", str(out)])
  assert e.value.code == 2
  err = capsys.readouterr().err.replace("\r", "\n")
  lines = [x for x in err.splitlines() if x.strip() and not x.startswith("prepare-data:")]  # bar
  assert lines == [
    f"paro-jax: error: the disk is full: could not write the shards into {out}; nothing was "
    f"published there (the partial shards were removed). Free space on the disk holding {out}, "
    f"or pass another --out"
  ], err
  assert not out.exists()  # it made the directory: a failed run leaves none


def test_export_on_a_full_disk_is_one_line_and_blocks_no_retry(trained_run, small_tmpfs, capsys):
  """The HF model does not fit: one line (it exited 1 printing nothing), nothing left where it
  was written (config.json alone blocked a retry without --overwrite); once there is room the
  same command works; --overwrite replaces the model's files and keeps the others."""
  filler = small_tmpfs / "filler"
  filler.write_bytes(bytes(200 * 1024))  # 56 KiB left, less than the `test` model's 142 KB
  out = small_tmpfs / "hf"
  line = _one_line(capsys, ["export", str(trained_run), "--out", str(out), "--dtype", "fp32"])
  assert line == (
    f"paro-jax: error: the disk is full: could not write the HF model to {out}; --out is as it "
    f"was (nothing was written there): free space on the disk holding {out}, or pass another --out"
  )
  assert os.listdir(small_tmpfs) == ["filler"]  # no partial output, hidden or not
  filler.unlink()
  main(["export", str(trained_run), "--out", str(out), "--dtype", "fp32"])
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  (out / "tokenizer.json").write_text("{}")
  (out / "model.safetensors").write_bytes(b"old")
  main(["export", str(trained_run), "--out", str(out), "--overwrite", "--dtype", "fp32"])
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
  assert (out / "model.safetensors").stat().st_size > 100_000
  assert sorted(os.listdir(small_tmpfs)) == ["hf"]
