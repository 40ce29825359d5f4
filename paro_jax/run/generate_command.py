"""`paro-jax generate SOURCE`: its flags (built from `GenerateConfig`'s fields) and its entry,
run once the entry point has set up the devices (paro_jax/run/generate.py samples)."""

from __future__ import annotations

from paro_jax.core.config import options
from paro_jax.core.flags import Invocation, add_options, config_of
from paro_jax.run.generate_config import GenerateConfig


def add_parser(sub) -> None:
  gen = sub.add_parser(
    "generate",
    help="complete prompts with a run's newest checkpoint or an HF model (greedy or sampled)",
    description="The completions of prompts by SOURCE, decoded together with a KV cache: "
    "greedy by default, sampled with --temperature (--top-k, --top-p, --seed); each ends at a "
    "stop token (the run's end of turn, the model's eos) or after --max-new-tokens. Prints the "
    "text of each completion, or with --json one object per prompt.",
  )
  fields = dict(options(GenerateConfig))
  gen.add_argument("source", metavar="SOURCE", help=fields["source"].metadata["help"])
  add_options(gen, GenerateConfig, "prompt", "prompts", "tokenizer", "chat_template")
  sampling = gen.add_argument_group("decoding")
  add_options(sampling, GenerateConfig, "max_new_tokens", "temperature", "top_k", "top_p")
  add_options(sampling, GenerateConfig, "seed", "ignore_eos")
  add_options(gen, GenerateConfig, "strategy", "mesh", "dtype", "collectives", "as_json")


def main(args, inv: Invocation) -> None:
  from paro_jax.run.generate import run_generate  # imports jax: after the device flag is set

  run_generate(config_of(args, GenerateConfig, mesh=inv.mesh))
