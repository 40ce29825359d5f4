"""`paro-jax generate` (run/generate.py, core/decode.py) against transformers' greedy `generate`:
token for token on a tied-embedding Llama, a grouped-query Llama, the chat fixture (chats
rendered with its template), Mistral's sliding window and Qwen2's biases, the prompts decoded
together in one left-padded batch on a 2x4 mesh, each compared with transformers' tokens of it
alone (tests/fixtures/make_generate.py wrote them into generate_expected.json; where torch is
installed they are made live instead). Then: a batch gives each prompt's tokens alone, a stop
token stops and --ignore-eos does not, a seed's samples repeat, top-k 1 is greedy, and a run
directory (a LoRA fine-tune) on 2x4 decodes what a single-device loop recomputing the whole
sequence does."""

import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import Llama
from paro_jax import cli
from paro_jax.cli import main
from paro_jax.core.config import make_config
from paro_jax.core.decode import Decoder, Sampling, generate_ids
from paro_jax.run.config import RunConfig
from paro_jax.run.generate import run_generate, stop_ids
from paro_jax.run.generate_config import GenerateConfig
from paro_jax.data.prompts import chat_template, prompt_ids, prompt_tokenizer
from paro_jax.run.source import open_source, source_engine
from paro_jax.run.train import train
from tests.run.test_sft import chat_records, write_jsonl

pytestmark = pytest.mark.usefixtures("compilation_cache")

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
EXPECTED = json.load(open(os.path.join(FIXTURES, "generate_expected.json")))
CASES = [k for k, v in EXPECTED.items() if isinstance(v, dict)]
N = EXPECTED["max_new_tokens"]
GQA = os.path.join(FIXTURES, EXPECTED["gqa"]["directory"])
HAS_TORCH = importlib.util.find_spec("torch") is not None


def config(source, texts=(), **kw):
  """GenerateConfig of SOURCE with the --prompt `texts` (and `kw`: --prompts, ...), greedy."""
  values = {"source": source, "prompt": tuple(texts), "strategy": "IIG", "mesh": (2, 4)}
  return make_config(GenerateConfig, {**values, "dtype": "fp32", "max_new_tokens": N, **kw})


def generated(case, tmp_path):
  """paro-jax's completions of the case's prompts (chats through a .jsonl --prompts file)."""
  entry = EXPECTED[case]
  prompts = [r["prompt"] for r in entry["rows"]]
  directory = os.path.join(FIXTURES, entry["directory"])
  if isinstance(prompts[0], str):
    return run_generate(config(directory, prompts))
  path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in prompts])
  return run_generate(config(directory, prompts=path))


def reference_rows(case):
  """transformers' greedy tokens of the case: made live where torch is installed (by the fixture
  script's own function), else those it committed."""
  if not HAS_TORCH:
    return EXPECTED[case]["rows"]
  path = os.path.join(FIXTURES, "make_generate.py")
  spec = importlib.util.spec_from_file_location("make_generate", path)
  make = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make)
  directory, prompts = make.CASES[case]
  return make.greedy_rows(os.path.join(FIXTURES, directory), prompts)


@pytest.mark.parametrize("case", CASES)
def test_greedy_equals_transformers(case, tmp_path, capsys):
  rows = reference_rows(case)
  got = generated(case, tmp_path)
  assert [r["ids"] for r in got] == [r["ids"] for r in rows]
  printed = capsys.readouterr().out
  assert printed == "".join(r["text"] + "\n" for r in got)
  # the prompts' own ids are transformers' (a text's with the BOS, a chat's through its template)
  source = open_source(os.path.join(FIXTURES, EXPECTED[case]["directory"]))
  tok = prompt_tokenizer(None, None, source.hf_dir, source.config.vocab)
  ids = prompt_ids([r["prompt"] for r in rows], tok, lambda: chat_template(None, None, tok))
  assert [list(map(int, i)) for i in ids] == [r["prompt_ids"] for r in rows]


@pytest.fixture(scope="module")
def gqa():
  """The grouped-query fixture on 2x4 at P, greedy, and its prompts' ids."""
  engine, params = source_engine(open_source(GQA), config(GQA, ["x"]))
  ids = [np.asarray(r["prompt_ids"], np.int32) for r in EXPECTED["gqa"]["rows"]]
  return engine, params, ids


def test_a_batch_gives_each_prompt_its_tokens_alone(gqa):
  engine, params, ids = gqa
  decoder = Decoder(engine, Sampling())
  longest, short = ids[0], ids[1]  # 19 and 7 tokens: the short one left-padded by 12
  together = generate_ids(decoder, params, [longest, short], N, set())
  assert together[0] == generate_ids(decoder, params, [longest], N, set())[0]
  assert together[1] == generate_ids(decoder, params, [short], N, set())[0]
  assert together == [r["ids"] for r in EXPECTED["gqa"]["rows"][:2]]


def test_a_stop_token_stops_its_row_only(gqa):
  engine, params, ids = gqa
  decoder = Decoder(engine, Sampling())
  greedy = generate_ids(decoder, params, ids, N, set())
  stop = greedy[0][2]  # 165 of [48, 249, 165, 48, ...], seen there first
  got = generate_ids(decoder, params, ids, N, {stop})
  for row, want in zip(got, greedy):
    cut = want.index(stop) + 1 if stop in want else N
    assert row == want[:cut]
  assert len(got[0]) == 3 and got[0][-1] == stop  # kept, as transformers keeps its eos


def test_sampling_repeats_with_its_seed_and_top_k_1_is_greedy(gqa):
  engine, params, ids = gqa
  greedy = generate_ids(Decoder(engine, Sampling()), params, ids, N, set())
  sampled = Decoder(engine, Sampling(temperature=1.0))
  first = generate_ids(sampled, params, ids, N, set(), seed=3)
  assert generate_ids(sampled, params, ids, N, set(), seed=3) == first
  assert generate_ids(sampled, params, ids, N, set(), seed=4) != first
  assert first != greedy
  top1 = Decoder(engine, Sampling(temperature=0.7, top_k=1))
  assert generate_ids(top1, params, ids, N, set(), seed=5) == greedy
  nucleus = Decoder(engine, Sampling(temperature=1.0, top_p=1e-6))  # the likeliest token only
  assert generate_ids(nucleus, params, ids, N, set(), seed=5) == greedy


def test_the_models_eos_stops_and_ignore_eos_goes_on(tmp_path, capsys):
  """An HF directory whose generation_config.json names, as its eos, the third greedy token."""
  row = EXPECTED["gqa"]["rows"][1]
  model = tmp_path / "model"
  shutil.copytree(GQA, model)
  generation = json.loads((model / "generation_config.json").read_text())
  (model / "generation_config.json").write_text(
    json.dumps({**generation, "eos_token_id": [row["ids"][2]]})
  )
  got = run_generate(config(str(model), [row["prompt"]], as_json=True))
  cut = row["ids"].index(row["ids"][2]) + 1
  assert got[0]["ids"] == row["ids"][:cut]
  assert json.loads(capsys.readouterr().out) == got[0]
  ignoring = run_generate(config(str(model), [row["prompt"]], ignore_eos=True))
  assert ignoring[0]["ids"] == row["ids"] and len(ignoring[0]["ids"]) == N


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
  """A LoRA chat fine-tune of the chat fixture: three steps (the first's learning rate is 0, the
  warmup's start), IIG on 2x4, fp32; its frozen base read from the fixture."""
  tmp = tmp_path_factory.mktemp("generate_run")
  cfg = {
    "init_from": os.path.join(FIXTURES, "chat_llama"),
    "strategy": "IIG",
    "mesh": (2, 4),
    "batch_size": 8,
    "seq_len": 64,
    "dtype": "fp32",
    "lora.rank": 4,
    "optimizer.lr": 3e-2,
    "optimizer.steps": 3,
    "optimizer.warmup": 1,
    "data.paths": (write_jsonl(tmp / "chats.jsonl", chat_records(16)),),
    "out": str(tmp / "run"),
  }
  train(make_config(RunConfig, cfg))
  return str(tmp / "run"), tmp


def recomputed_greedy(model, params, prompt, n):
  """Greedy tokens from one device, the whole sequence recomputed for each (no cache, no mesh):
  one program, the sequence right-padded (a causal model's logits do not see later tokens)."""
  full = jax.jit(model.apply)
  seq = [int(t) for t in prompt]
  padded = np.zeros((1, len(seq) + n), np.int32)
  for _ in range(n):
    padded[0, : len(seq)] = seq
    seq.append(int(jnp.argmax(full(params, jnp.asarray(padded))[0, len(seq) - 1])))
  return seq[len(prompt) :]


def test_a_run_directory_decodes_as_one_device_recomputing(chat_run):
  run, tmp = chat_run
  chats = [
    [{"role": "system", "content": "Reverse the words."}, {"role": "user", "content": w}]
    for w in ("wind tide boats", "the harbour master kept a logbook")
  ]
  path = write_jsonl(tmp / "prompts.jsonl", [{"messages": m} for m in chats])
  got = run_generate(config(run, prompts=path, ignore_eos=True))
  source = open_source(run)
  assert source.lora is not None and source.lora.rank == 4
  engine, params = source_engine(source, config(run, ["x"]))
  tok = prompt_tokenizer(None, source.tokenizer, source.hf_dir, source.config.vocab)
  assert 299 in stop_ids(source, tok)  # the run's end of turn, <|eot_id|>
  ids = prompt_ids(chats, tok, lambda: chat_template(None, source.chat_template, tok))
  host = jax.device_get(params)
  model = Llama(source.config, lora=source.lora)  # the adapters beside their base weights
  assert [r["ids"] for r in got] == [recomputed_greedy(model, host, p, N) for p in ids]
  base = run_generate(config(os.path.join(FIXTURES, "chat_llama"), prompts=path, ignore_eos=True))
  assert [r["ids"] for r in base] != [r["ids"] for r in got]  # the run's weights, not the base's


BAD = [
  ("unknown-source", ["{t}/nothing", "--prompt", "hi"], "is neither a run directory"),
  ("no-prompt", ["{gqa}"], "no prompt: pass --prompt TEXT"),
  (
    "too-long",
    ["{gqa}", "--prompt", "A radio", "--max-new-tokens", "8186"],
    "prompt 1 is 7 tokens: with --max-new-tokens 8186 more that is over the 8192 positions",
  ),
  ("no-tokenizer", ["{t}/bare", "--prompt", "hi"], "no tokenizer for the prompts"),
  ("top-k-greedy", ["{gqa}", "--prompt", "hi", "--top-k", "5"], "pass --temperature above 0"),
  ("temperature", ["{gqa}", "--prompt", "hi", "--temperature", "-1"], "--temperature must be"),
  ("new-zero", ["{gqa}", "--prompt", "hi", "--max-new-tokens", "0"], "must be >= 1, got 0"),
  ("prompts-missing", ["{gqa}", "--prompts", "{t}/none.txt"], "does not exist"),
  ("prompts-bad-line", ["{gqa}", "--prompts", "{t}/bad.jsonl"], "line 2 is not JSON"),
  ("empty-prompt", ["{gqa}", "--prompt", "", "--tokenizer", "bytes"], "prompt 1 is empty"),
]


@pytest.mark.parametrize("argv,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line(argv, message, tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(cli, "provide_cpu_devices", lambda n: None)  # this process has its 8
  (tmp_path / "bare").mkdir()
  shutil.copy(os.path.join(GQA, "config.json"), tmp_path / "bare")
  (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{x\n')
  args = [a.format(t=tmp_path, gqa=GQA) for a in argv]
  with pytest.raises(SystemExit) as e:
    main(["generate", *args])
  assert e.value.code == 2
  err = capsys.readouterr().err
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("paro-jax: error: "), err
  assert message.format(t=tmp_path) in lines[0], lines[0]
