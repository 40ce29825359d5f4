"""The stop tokens of a chat fine-tune: the special token its chat template ends an assistant's
turn with (`<|eot_id|>`, `<|im_end|>`), recorded in the run's checkpoints when it trains
(RunMeta.end_of_turn), and the eos_token_id of the generation_config.json its export writes with
it (a base model's lists only its end of text). Recorded, the export does not depend on the
directory the run started from, nor its tokenizer, still being there."""

from __future__ import annotations

import json
import os

from models.hf_config import CONFIG
from paro_jax.data.chat import ChatTemplate, special_tokens
from paro_jax.data.instruct import end_of_turn, tokenizer_directory
from paro_jax.data.tokenizers import BYTES, HFTokenizer

GENERATION_CONFIG = "generation_config.json"


def end_of_turn_id(template: str | None, tokenizer: str | None) -> int | None:
  """The end-of-turn token of `template` (the text a run's chat records were rendered with) as
  `tokenizer` (the run's tokenizer.json, or its directory) reads it; None without a template, a
  tokenizer that is still there, or such a token."""
  if template is None or tokenizer in (None, BYTES) or not os.path.exists(tokenizer):
    return None
  directory = tokenizer_directory(tokenizer)
  chat = ChatTemplate(template, special_tokens(directory), "the run's chat template")
  return end_of_turn(chat, HFTokenizer(tokenizer))


def stop_at_end_of_turn(directory: str, eot: int | None) -> list[int]:
  """Add `eot` to the eos_token_id of generation_config.json in `directory` (an export being
  written); where none was copied, one is written from config.json's bos and eos ids and it.
  Returns the eos_token_id written, [] where nothing was (no `eot`, or it was there already)."""
  if eot is None:
    return []
  path = os.path.join(directory, GENERATION_CONFIG)
  if os.path.isfile(path):
    with open(path) as f:
      generation = json.load(f)
  elif os.path.isfile(os.path.join(directory, CONFIG)):  # the source's is gone, or it had none
    with open(os.path.join(directory, CONFIG)) as f:
      model = json.load(f)
    generation = {k: model[k] for k in ("bos_token_id", "eos_token_id") if model.get(k) is not None}
  else:  # an adapter: generation is the base model's
    return []
  eos = generation.get("eos_token_id")
  stops = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
  if eot in stops and os.path.isfile(path):
    return []
  generation["eos_token_id"] = stops + [eot] if eot not in stops else stops
  generation.pop("_from_model_config", None)  # no longer config.json's: transformers keeps it
  with open(path, "w") as f:
    json.dump(generation, f, indent=2)
    f.write("\n")
  return generation["eos_token_id"]


def generation_stops(directory: str | None) -> list[int]:
  """The ids generation stops at in an HF directory (None: none): the eos_token_id of its
  generation_config.json, else of its config.json, as transformers' generate reads them."""
  for name in (GENERATION_CONFIG, CONFIG):
    path = os.path.join(directory, name) if directory else ""
    if os.path.isfile(path):
      with open(path) as f:
        eos = json.load(f).get("eos_token_id")
      if eos is not None:
        return list(eos) if isinstance(eos, list) else [eos]
  return []
