"""`paro-jax export` (paro_jax/run/export.py) and `eval` of a run under what users do to it: the
source directory moved away, an adapter for a Hub model, a shard size in bytes, an --out that is
a mount point (paro_jax/run/publish.py), a run still saving (checkpoints rotated away while
they are read).

The run is a LoRA chat fine-tune of tests/fixtures/chat_llama made a base model (its end of text,
296, as eos everywhere; the chat template ends each answer with <|eot_id|>, 299), saving at each
of its two steps.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
import types

import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from paro_jax.cli import main
from paro_jax.data.tokenizers import HFTokenizer
from paro_jax.run import checkpoint_restore
from paro_jax.run.checkpoint import CHECKPOINTS, Checkpointer
from paro_jax.run.stops import GENERATION_CONFIG
from tests.run.test_sft import CHAT_MODEL, FP32, chat_records, write_jsonl
from tests.fast_compile import FAST_COMPILE

EOS, BOS = 296, 295
FLAGS = ["--mesh", "2x4", "--batch-size", "8", "--seq-len", "128", *FP32]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _base_model(target):
  """chat_llama as a base model ships: its end of text (not <|eot_id|>) as eos, everywhere."""
  shutil.copytree(CHAT_MODEL, target)
  for name, key, value in (
    ("generation_config.json", "eos_token_id", EOS),
    ("config.json", "eos_token_id", EOS),
    ("tokenizer_config.json", "eos_token", "<|end_of_text|>"),
  ):
    with open(target / name) as f:
      fields = json.load(f)
    fields[key] = value
    with open(target / name, "w") as f:
      json.dump(fields, f, indent=2)
  return str(target)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("export-inputs")
  base = _base_model(tmp / "base")
  data = write_jsonl(tmp / "chat.jsonl", chat_records(n=16))
  out = str(tmp / "run")
  main(  # --keep-base: its export is shown with the source directory gone
    ["train", "--init-from", base, "--lora-rank", "4", "--steps", "2", "--warmup", "0"]
    + ["--keep-base", "--lr", "1e-3", "--checkpoint-every", "1", "--keep", "2"]
    + ["--data", data, "--out", out]
    + FLAGS
  )
  return tmp, base, out, data


def _lines(capsys, argv):
  """(exit code, stdout lines, stderr lines) of `paro-jax ARGV`."""
  capsys.readouterr()
  code = 0
  try:
    main(argv)
  except SystemExit as e:
    code = e.code
  captured = capsys.readouterr()
  return code, captured.out.strip().splitlines(), captured.err.strip().splitlines()


def test_the_checkpoints_record_the_end_of_turn(run):
  _, _, out, _ = run
  eot = HFTokenizer(os.path.join(CHAT_MODEL, "tokenizer.json")).token_id("<|eot_id|>")
  ckpt = Checkpointer(os.path.join(out, CHECKPOINTS), read_only=True)
  try:
    assert ckpt.newest_meta().end_of_turn == eot == 299
  finally:
    ckpt.close()


def test_an_export_whose_source_is_gone_still_stops_at_the_end_of_turn(run, tmp_path, capsys):
  _, base, out, _ = run
  os.rename(base, base + ".moved")
  try:
    code, said, err = _lines(capsys, ["export", out, "--out", str(tmp_path / "hf")])
  finally:
    os.rename(base + ".moved", base)
  assert code == 0 and len(said) == 1 and not err, (said, err)
  with open(tmp_path / "hf" / GENERATION_CONFIG) as f:
    assert json.load(f) == {"bos_token_id": BOS, "eos_token_id": [EOS, 299]}
  assert "generation_config.json: eos_token_id [296, 299]" in said[0]
  # what it could not copy, in its one line
  assert "could not copy the tokenizer files" in said[0] and f"{base}/tokenizer.json" in said[0]
  assert f"{base}/generation_config.json ({base}, the run's --init-from, is gone)" in said[0]
  assert not any(n.startswith("tokenizer") for n in os.listdir(tmp_path / "hf"))


def test_an_adapter_names_its_base_and_says_peft_uses_the_bases_stops(run, tmp_path, capsys):
  _, base, out, _ = run
  hub = "meta-llama/Llama-3.2-1B"
  code, said, _ = _lines(
    capsys, ["export", out, "--out", str(tmp_path / "a"), "--adapter", "--base-model", hub]
  )
  assert code == 0 and len(said) == 1
  with open(tmp_path / "a" / "adapter_config.json") as f:
    assert json.load(f)["base_model_name_or_path"] == hub
  assert f"base_model_name_or_path {hub} (--base-model)" in said[0]
  assert "peft generates with the base model's generation_config.json" in said[0]
  assert "eos_token_id=[296, 299]" in said[0]
  # by default the local path, and the line says how to name a Hub id
  code, said, _ = _lines(capsys, ["export", out, "--out", str(tmp_path / "b"), "--adapter"])
  with open(tmp_path / "b" / "adapter_config.json") as f:
    assert json.load(f)["base_model_name_or_path"] == os.path.abspath(base)
  assert "--base-model NAME for a Hub id" in said[0]
  code, said, err = _lines(
    capsys, ["export", out, "--out", str(tmp_path / "c"), "--base-model", hub]
  )
  assert code == 2 and "error: --base-model" in err[-1] and "pass it with --adapter" in err[-1]
  assert not (tmp_path / "c").exists()


def test_a_shard_size_in_bytes_is_taken(run, tmp_path, capsys):
  _, _, out, _ = run
  code, said, _ = _lines(
    capsys, ["export", out, "--out", str(tmp_path / "hf")] + ["--max-shard-size", "1000"]
  )
  assert code == 0 and "shards" in said[0]
  with open(tmp_path / "hf" / "model.safetensors.index.json") as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
  for shard in shards:  # at most the size, or one tensor larger than it alone
    held = load_file(tmp_path / "hf" / shard)
    assert sum(w.nbytes for w in held.values()) <= 1000 or len(held) == 1


@pytest.mark.parametrize("size", ["0", "-1", "5 parsecs", "1.5XB", "", "nan", "GB"])
def test_a_bad_shard_size_is_refused_before_the_restore(run, tmp_path, capsys, monkeypatch, size):
  _, _, out, _ = run

  def restored(*_args, **_kwargs):
    raise AssertionError("the checkpoint was restored before --max-shard-size was read")

  monkeypatch.setattr("paro_jax.run.export.export_run", restored)
  argv = ["export", out, "--out", str(tmp_path / "hf"), "--max-shard-size", size]
  code, _, err = _lines(capsys, argv)
  assert code == 2 and len(err) == 1 and f"--max-shard-size {size!r} is not a size" in err[0], err


def _mount(monkeypatch, mount):
  """`mount` behaves as a mount point: it cannot be removed or renamed over (EBUSY), and no
  rename crosses its boundary (EXDEV), as the kernel does."""
  mount = os.path.abspath(mount)
  inside = lambda p: os.path.abspath(p) == mount or os.path.abspath(p).startswith(mount + os.sep)  # noqa: E731
  real_rename, real_replace, real_rmdir = os.rename, os.replace, os.rmdir

  def moved(real):
    def move(src, dst, *args, **kwargs):
      if os.path.abspath(dst) == mount or os.path.abspath(src) == mount:
        raise OSError(errno.EBUSY, "Device or resource busy", dst)
      if inside(src) != inside(dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", dst)
      return real(src, dst, *args, **kwargs)

    return move

  def rmdir(path, *args, **kwargs):
    if os.path.abspath(path) == mount:
      raise OSError(errno.EBUSY, "Device or resource busy", path)
    return real_rmdir(path, *args, **kwargs)

  monkeypatch.setattr(os, "rename", moved(real_rename))
  monkeypatch.setattr(os, "replace", moved(real_replace))
  monkeypatch.setattr(os, "rmdir", rmdir)


def test_export_onto_a_mount_point(run, tmp_path, capsys, monkeypatch):
  _, _, out, _ = run
  reference = tmp_path / "reference"
  assert _lines(capsys, ["export", out, "--out", str(reference)])[0] == 0
  mount = tmp_path / "mnt"
  mount.mkdir()
  _mount(monkeypatch, mount)
  for extra in ([], ["--overwrite"]):  # empty (a fresh mount), then over the first export
    code, said, err = _lines(capsys, ["export", out, "--out", str(mount), *extra])
    assert code == 0, err
    assert sorted(os.listdir(mount)) == sorted(os.listdir(reference))  # no partial left
    assert sorted(os.listdir(tmp_path)) == ["mnt", "reference"]  # none beside it
    for name in os.listdir(reference):
      assert (mount / name).read_bytes() == (reference / name).read_bytes(), name


def _rotate_on_first_call(monkeypatch, target, name, directory, newer):
  """Patch `target.name` so that its first call first rotates: the checkpoint `newer` (held
  aside) completes and every older step is deleted, as a run saving with --keep 1 does."""
  real, calls = getattr(target, name), []

  def rotating(*args, **kwargs):
    if not calls:
      calls.append(1)
      os.rename(directory / f".held-{newer}", directory / str(newer))
      for step in os.listdir(directory):
        if step.isdigit() and int(step) < newer:
          shutil.rmtree(directory / step)
    return real(*args, **kwargs)

  monkeypatch.setattr(target, name, rotating)
  return calls


@pytest.mark.parametrize("command", ["export", "eval"])
@pytest.mark.parametrize(
  "when", ["listing the steps", "reading the metadata", "reading the arrays"]
)
def test_a_checkpoint_rotated_away_while_read_is_not_damaged(
  run, tmp_path, capsys, monkeypatch, command, when
):
  _, _, out, data = run
  copy = tmp_path / "run"
  shutil.copytree(out, copy)
  directory = copy / CHECKPOINTS
  os.rename(directory / "2", directory / ".held-2")  # step 1 is the newest, until it is rotated
  if when == "listing the steps":  # orbax reads each listed step's files as it lists them
    # (a property: its getter is patched through a holder)
    holder = types.SimpleNamespace(get=ocp.step.Metadata.commit_timestamp.fget)
    calls = _rotate_on_first_call(monkeypatch, holder, "get", directory, 2)
    monkeypatch.setattr(ocp.step.Metadata, "commit_timestamp", property(lambda m: holder.get(m)))
  elif when == "reading the metadata":
    calls = _rotate_on_first_call(monkeypatch, Checkpointer, "read_meta", directory, 2)
  else:
    calls = _rotate_on_first_call(monkeypatch, checkpoint_restore, "local_verdict", directory, 2)
  if command == "export":
    argv = ["export", str(copy), "--out", str(tmp_path / "hf")]
  else:
    argv = ["eval", str(copy), "--data", data, "--json", *FLAGS]
  code, said, err = _lines(capsys, argv)
  assert calls and sorted(os.listdir(directory)) == ["2"]  # it was rotated
  assert code == 0 and not any("damaged" in line or "restore" in line for line in err), err
  if command == "export":
    assert "wrote checkpoint step 2" in said[0]
  else:
    assert json.loads(said[-1])["examples"] == 16


def test_export_and_eval_of_a_run_still_saving(tmp_path, capsys):
  """A real run saving every step with --keep 1, exported and scored while it runs."""
  out = tmp_path / "run"
  text = str(tmp_path / "text.txt")
  with open(text, "w") as f:
    f.write("the harbour master kept a logbook every morning. " * 20)
  env = {**os.environ, "XLA_FLAGS": FAST_COMPILE}  # the CLI adds its device count
  cmd = [sys.executable, "-m", "paro_jax", "train", "--model", "test", "--mesh", "1x2"]
  cmd += ["--batch-size", "2", "--seq-len", "16", "--dtype", "fp32", "--warmup", "1"]
  cmd += ["--steps", "100000", "--checkpoint-every", "1", "--keep", "1", "--out", str(out)]
  log = open(tmp_path / "train.err", "w")  # noqa: SIM115 - closed below
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
  try:
    directory = out / CHECKPOINTS
    while not (directory.is_dir() and any(n.isdigit() for n in os.listdir(directory))):
      assert proc.poll() is None, (tmp_path / "train.err").read_text()[-3000:]
      time.sleep(0.2)
    results = []
    for i in range(6):
      argv = ["export", str(out), "--out", str(tmp_path / f"hf{i}")]
      if i % 2:
        argv = ["eval", str(out), "--json", "--mesh", "2x4", "--batch-size", "8", "--data", text]
      results.append(_lines(capsys, argv))
    assert proc.poll() is None  # still saving throughout
  finally:
    proc.terminate()
    proc.wait(timeout=120)
    log.close()
  for code, said, err in results:
    assert code == 0 and not any("damaged" in line for line in err), err
    assert said and ("wrote checkpoint step" in said[0] or json.loads(said[-1])["loss"] > 0)
