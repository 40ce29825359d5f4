"""`GenerateConfig`: what `paro-jax generate` samples (run/generate.py) and from what, its flags
built from these fields by run/generate_command.py. No jax: the CLI builds its parser first."""

from __future__ import annotations

import dataclasses
import math

from paro_jax.core.config import LoraOptions, StepConfig, option, option_like


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
  """SOURCE, the prompts, how each next token is chosen, and the strategy, mesh and dtype that
  hold the weights (none of which changes greedy tokens beyond rounding)."""

  source: str = option(  # the command's positional argument
    help="a run directory (train's --out: its newest intact checkpoint) or an HF model directory"
  )
  prompt: tuple[str, ...] = option(  # None from argparse's append: none given
    None,
    "a prompt's text, tokenized as transformers does (the tokenizer's special tokens added); "
    "repeat for several prompts, decoded together in one batch",
    action="append",
    metavar="TEXT",
  )
  prompts: str | None = option(
    None,
    "a file of prompts: one per line (empty lines skipped), or, for a .jsonl file, one chat "
    'per line ({"messages": [...]}) rendered with the chat template and its generation prompt',
    metavar="FILE",
  )
  max_new_tokens: int = option(64, "new tokens per prompt, at most (default %(default)s)")
  temperature: float = option(0.0, "0: greedy (the default); else sample from logits/temperature")
  top_k: int = option(0, "sample from the top-k likeliest tokens only (0: all)")
  top_p: float = option(
    1.0, "sample from the likeliest tokens whose probabilities reach top-p (1: all)"
  )
  seed: int = option(0, "the sampling's random seed: the same tokens for the same seed")
  ignore_eos: bool = option(
    False, "generate exactly --max-new-tokens, past the stop tokens (end of turn, eos)"
  )
  tokenizer: str | None = option(
    None,
    "an HF tokenizer.json (or its model's directory), or 'bytes'; default: the run's, else "
    "the tokenizer.json of the model's HF directory",
    metavar="TOKENIZER_JSON",
  )
  chat_template: str | None = option(
    None,
    "a jinja2 chat template for --prompts chats (default: the run's, else its HF directory's)",
    metavar="FILE",
  )
  strategy: str = option_like(StepConfig, "strategy")
  mesh: tuple[int, int] | None = option_like(StepConfig, "mesh")
  dtype: str = option_like(StepConfig, "dtype")
  collectives: str = option_like(StepConfig, "collectives")
  as_json: bool = option(
    False,
    "print one JSON object per prompt: the prompt (its text, or its chat's messages), the new "
    "token ids (ids, a stop token included) and their text",
    flag="--json",
  )

  def __post_init__(self):
    object.__setattr__(self, "prompt", tuple(self.prompt or ()))
    if self.max_new_tokens < 1:
      raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
    if not (self.temperature >= 0 and math.isfinite(self.temperature)):
      raise ValueError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"--top-k must be >= 0 (0: every token), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"--top-p must be in (0, 1] (1: every token), got {self.top_p}")
    if self.temperature == 0 and (self.top_k or self.top_p < 1):
      raise ValueError(
        "--top-k and --top-p shape sampling, and --temperature 0 (the default) is greedy: pass "
        "--temperature above 0 (1: the model's own distribution)"
      )
    if not self.prompt and self.prompts is None:
      raise ValueError("no prompt: pass --prompt TEXT (repeatable) or --prompts FILE")

  def step(self, lora: LoraOptions) -> StepConfig:
    """The step whose engine holds the weights (core/factory.py), with the source's adapters;
    its attention is written out, as decoding's is (models/llama.py `Llama.decode`)."""
    names = ("strategy", "mesh", "dtype", "collectives")
    return StepConfig(**{n: getattr(self, n) for n in names}, attention="xla", lora=lora)
