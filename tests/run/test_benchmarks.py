"""`paro-jax eval --tasks`: lm-eval-harness's local tasks of tests/fixtures/lm_eval_task/ on the
tiny chat_llama, on a 2x4 mesh, against lm-eval's own HF backend (torch, fp32) on the same model
and tasks: live where torch and transformers are installed, else the numbers
tests/fixtures/make_lm_eval_reference.py committed. Equal accuracies and generated texts, each
request's log-likelihood within 1e-4 and the same greedy flags. No download: the datasets are
local JSON files, read with HF_DATASETS_OFFLINE=1. The log-likelihoods are
paro_jax/core/forward.py's `row_scores`; the generations core/decode.py's."""

import importlib.util
import json
import os
import sys

import pytest

from paro_jax.cli import main
from paro_jax.data.config import DataConfig
from paro_jax.run.benchmarks import (
  LM_EVAL_INSTALL,
  benchmark_model,
  evaluate_tasks,
  require_lm_eval,
)
from paro_jax.run.config import EvalConfig

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
REPO = os.path.dirname(os.path.dirname(FIXTURES))
TOLERANCE = 1e-4  # fp32 sums of a few dozen log-probabilities, torch's and XLA's


def load_make():
  path = os.path.join(FIXTURES, "make_lm_eval_reference.py")
  spec = importlib.util.spec_from_file_location("make_lm_eval_reference", path)
  make = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make)
  return make


MAKE = load_make()


def task_config(**kw) -> EvalConfig:
  given = dict(
    source=MAKE.MODEL,
    tasks=",".join(MAKE.TASKS),
    include_path=MAKE.TASK_DIR,
    seq_len=MAKE.MAX_LENGTH,
    batch_size=8,  # a row per device (lm-eval's HF backend runs 4 at a time: the same scores)
    mesh=(2, 4),
    dtype="fp32",  # the reference's
  )
  return EvalConfig(**{**given, **kw})


def reference() -> dict:
  """lm-eval's HF backend's: live where it can run (torch, transformers and accelerate, its `hf`
  extra's), else the committed numbers."""
  if all(importlib.util.find_spec(m) for m in ("torch", "transformers", "accelerate")):
    return MAKE.reference()
  with open(MAKE.EXPECTED) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
  """(ours, the reference's) metrics and responses; the tasks' data read offline, from the
  repository root (their data_files' paths are relative to it)."""
  try:
    require_lm_eval()
  except ValueError:
    pytest.skip(f"lm-eval is not installed: {LM_EVAL_INSTALL}")
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
    mp.chdir(REPO)
    cfg = task_config()
    ours = MAKE.responses(evaluate_tasks(benchmark_model(cfg), cfg, log_samples=True))
    return ours, reference()


def test_accuracy_equals_lm_evals_hf_backend(scored):
  ours, ref = scored
  for task, metric in (
    ("paro_choices", "acc,none"),
    ("paro_choices", "acc_norm,none"),
    ("paro_completions", "exact_match,none"),
  ):
    assert ours["metrics"][task][metric] == ref["metrics"][task][metric], (task, metric)
    assert ours["metrics"][task]["sample_len"] == ref["metrics"][task]["sample_len"]


def test_each_choice_log_likelihood_and_greedy_flag(scored):
  ours, ref = scored
  for doc, (mine, theirs) in enumerate(
    zip(ours["responses"]["paro_choices"], ref["responses"]["paro_choices"], strict=True)
  ):
    assert len(mine) == len(theirs)
    for (logp, greedy), (ref_logp, ref_greedy) in zip(mine, theirs):
      assert abs(logp - ref_logp) < TOLERANCE, (doc, logp, ref_logp)
      assert greedy == ref_greedy, doc


def test_rolling_log_likelihoods_over_windows(scored):
  # with max_length 32 the first text is several windows: their sums must agree too
  ours, ref = scored
  mine = [r[0] for r in ours["responses"]["paro_texts"]]
  theirs = [r[0] for r in ref["responses"]["paro_texts"]]
  assert mine == pytest.approx(theirs, abs=TOLERANCE)
  for metric in ("byte_perplexity,none", "bits_per_byte,none"):
    got, want = ours["metrics"]["paro_texts"][metric], ref["metrics"]["paro_texts"][metric]
    assert got == pytest.approx(want, rel=1e-5), metric


def test_generated_texts_cut_at_the_first_stop_string(scored):
  ours, ref = scored
  mine = ours["responses"]["paro_completions"]
  assert mine == ref["responses"]["paro_completions"]
  assert all("." not in text and "\n" not in text for [text] in mine)  # until: [".", "\n"]


@pytest.mark.parametrize(
  "kw, says",
  [
    (dict(tasks=None, limit=2), "--limit is an option of --tasks"),
    (dict(tasks=None, include_path="d"), "--include-path is an option of --tasks"),
    (dict(tasks=None, num_fewshot=1), "--num-fewshot is an option of --tasks"),
    (dict(tasks=" , "), "--tasks names no task"),
    (dict(limit=0), "--limit must be >= 1"),
    (dict(num_fewshot=-1), "--num-fewshot must be >= 0"),
  ],
)
def test_refused_combinations(kw, says):
  with pytest.raises(ValueError, match=says):
    task_config(**kw)


def test_tasks_refuse_data_options():
  with pytest.raises(
    ValueError, match="--data is for scoring --data.*drop --data, or drop --tasks"
  ):
    task_config(data=DataConfig(paths=("x.txt",)))
  with pytest.raises(ValueError, match="--pack is for scoring --data"):
    task_config(data=DataConfig(pack=True))


def test_missing_lm_eval_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
  with pytest.raises(ValueError, match=r"not installed: pip install 'paro-jax\[lm-eval\]'"):
    require_lm_eval()


def test_unknown_task_is_one_line(scored, monkeypatch):
  monkeypatch.chdir(REPO)
  with pytest.raises(ValueError, match="--tasks no_such_task: no such lm-eval task"):
    evaluate_tasks(None, task_config(tasks="no_such_task"))


@pytest.mark.parametrize(
  "flags, says",
  [
    (["--limit", "2"], "--limit is an option of --tasks: pass --tasks NAMES, or drop --limit"),
    (["--tasks", "paro_choices", "--data", "x.txt"], "--data is for scoring --data"),
  ],
)
def test_cli_refuses_in_one_line(flags, says, capsys):
  with pytest.raises(SystemExit) as exit_:
    main(["eval", MAKE.MODEL, *flags])
  assert exit_.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and says in err[0], err


def test_cli_prints_lm_evals_results_as_json(scored, monkeypatch, capsys):
  # the first document of the multiple-choice task through `paro-jax eval --tasks ... --json`:
  # its accuracy is whether the reference's likeliest choice is the answer
  _, ref = scored
  monkeypatch.chdir(REPO)
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  flags = ["--tasks", "paro_choices", "--include-path", MAKE.TASK_DIR, "--limit", "1"]
  flags += ["--seq-len", "32", "--batch-size", "8", "--mesh", "2x4", "--dtype", "fp32", "--json"]
  main(["eval", MAKE.MODEL, *flags])
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  with open(os.path.join(MAKE.TASK_DIR, "choices.jsonl")) as f:
    answer = json.loads(f.readline())["answer"]
  scores = [logp for logp, _ in ref["responses"]["paro_choices"][0]]
  likeliest = max(range(len(scores)), key=scores.__getitem__)
  assert printed["results"]["paro_choices"]["acc,none"] == float(likeliest == answer)
  assert printed["n-shot"] == {"paro_choices": 0}
