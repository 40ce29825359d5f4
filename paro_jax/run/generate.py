"""`paro-jax generate SOURCE`: completions of prompts by a run's newest checkpoint or an HF model.

SOURCE is read as `paro-jax eval` reads it (run/source.py): a run directory's newest intact
checkpoint, weights only, or an HF directory streamed in; the weights sit at the strategy's P
placement on --mesh, each layer's gathered before use (core/decode.py). The prompts
(data/prompts.py) are decoded together, left-padded to the longest: a prefill of the prompts,
then one token per step from the KV cache; greedy unless --temperature is above 0. A completion
ends at a stop token (the run's end of turn, the eos_token_id of the model's
generation_config.json: run/stops.py), which it keeps, or after --max-new-tokens;
--ignore-eos makes it --max-new-tokens long.
"""

from __future__ import annotations

import json

import jax

from paro_jax.core.decode import Decoder, Sampling, generate_ids
from paro_jax.run.generate_config import GenerateConfig
from paro_jax.data.prompts import chat_template, prompt_ids, prompt_tokenizer, read_prompts
from paro_jax.run.source import Source, open_source, source_engine
from paro_jax.run.stops import end_of_turn_id, generation_stops


def stop_ids(source: Source, tokenizer) -> set[int]:
  """The tokens a completion stops at: the model's eos ids and the run's end of turn."""
  stops = set(generation_stops(source.hf_dir))
  eot = end_of_turn_id(source.chat_template, getattr(tokenizer, "path", None))
  return stops | ({eot} if eot is not None else set())


def check_lengths(prompts, ids, cfg: GenerateConfig, source: Source) -> None:
  """Each prompt has tokens and, with --max-new-tokens after it, fits the model's positions."""
  limit = source.max_positions
  for i, row in enumerate(ids):
    if len(row) == 0:
      raise ValueError(f"prompt {i + 1} is empty (no tokens): give it some text")
    if limit and len(row) + cfg.max_new_tokens > limit:
      room = limit - len(row)
      fix = f"pass --max-new-tokens {room} or less, or " if room >= 1 else ""
      raise ValueError(
        f"prompt {i + 1} is {len(row)} tokens: with --max-new-tokens {cfg.max_new_tokens} more "
        f"that is over the {limit} positions of {source.path}'s model (max_position_embeddings "
        f"in its config.json): {fix}shorten the prompt"
      )
    if row.max(initial=0) >= source.config.vocab:
      raise ValueError(
        f"prompt {i + 1} has token {int(row.max())}, beyond the model's vocabulary of "
        f"{source.config.vocab}: pass --tokenizer with the model's own tokenizer.json"
      )


def run_generate(cfg: GenerateConfig) -> list[dict]:
  """`paro-jax generate`: each prompt's completion, printed; returned as the --json objects."""
  if jax.process_count() > 1:  # the host reads every row's tokens each step (core/decode.py)
    raise ValueError(
      f"paro-jax generate runs in one process, and this is process {jax.process_index()} of "
      f"{jax.process_count()}: run it outside a multi-process job, on one host's devices"
    )
  source = open_source(cfg.source)
  prompts = read_prompts(cfg.prompt, cfg.prompts)
  tokenizer = prompt_tokenizer(cfg.tokenizer, source.tokenizer, source.hf_dir, source.config.vocab)
  template_of = lambda: chat_template(cfg.chat_template, source.chat_template, tokenizer)
  ids = prompt_ids(prompts, tokenizer, template_of)
  check_lengths(prompts, ids, cfg, source)
  stops = set() if cfg.ignore_eos else stop_ids(source, tokenizer)
  engine, params = source_engine(source, cfg)
  decoder = Decoder(engine, Sampling(cfg.temperature, cfg.top_k, cfg.top_p))
  new = generate_ids(decoder, params, ids, cfg.max_new_tokens, stops, cfg.seed)
  results = [
    {"prompt": p, "ids": row, "text": tokenizer.decode(row)} for p, row in zip(prompts, new)
  ]
  if jax.process_index() == 0:
    for result in results:
      if cfg.as_json:
        print(json.dumps(result, ensure_ascii=False), flush=True)
      else:
        print(result["text"], flush=True)
  return results
