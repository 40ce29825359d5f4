"""LoRA adapters as PEFT writes them: `adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, directory)` loads onto the HF base model.

PEFT's LoRA adds (lora_alpha / r) * lora_B @ lora_A to a Linear's (out, in) weight, lora_A being
an (r, in) Linear weight and lora_B an (out, r) one (peft/tuners/lora/layer.py, `get_delta_weight`,
without rsLoRA or DoRA). Ours adds (alpha / rank) * A @ B to the (in, out) weight with A (in, rank)
and B (rank, out) (models/lora.py `lora_delta`), the heads flattened in HF's order
(paro_jax/hf/weights.py), so lora_A = A.T and lora_B = B.T. Tensor names are the ones PeftModel
saves for a LlamaForCausalLM: `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file, save_file

from models.config import LAYERS, LlamaConfig, LoraConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# our target -> (the module that owns it in our tree, HF's module path inside a layer)
MODULES = {
  "wq": ("attn", "self_attn.q_proj"),
  "wk": ("attn", "self_attn.k_proj"),
  "wv": ("attn", "self_attn.v_proj"),
  "wo": ("attn", "self_attn.o_proj"),
  "w_gate": ("mlp", "mlp.gate_proj"),
  "w_up": ("mlp", "mlp.up_proj"),
  "w_down": ("mlp", "mlp.down_proj"),
}
PREFIX = "base_model.model.model.layers"


def adapter_config(lora: LoraConfig, base_model: str | None) -> dict:
  """PEFT's adapter_config.json of our adapters (plain LoRA: no dropout, bias, rsLoRA, DoRA)."""
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model,
    "r": lora.rank,
    "lora_alpha": lora.alpha,
    "target_modules": sorted(MODULES[t][1].split(".")[-1] for t in lora.targets),
    "lora_dropout": 0.0,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "inference_mode": True,
    "modules_to_save": None,
  }


def adapter_tensors(cfg: LlamaConfig, lora: LoraConfig, params: dict, dtype=np.float32) -> dict:
  """PEFT's tensors of the adapters in `params` (our full tree, adapters included)."""
  tensors = {}
  for target in lora.targets:
    owner, module = MODULES[target]
    a = np.asarray(params[LAYERS][owner][f"{target}_lora_a"], np.float32)  # layers x in x r
    b = np.asarray(params[LAYERS][owner][f"{target}_lora_b"], np.float32)  # layers x r x out
    for i in range(cfg.layers):
      name = f"{PREFIX}.{i}.{module}"
      tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].T.astype(dtype))
      tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].T.astype(dtype))
  return tensors


def save_adapter(
  cfg: LlamaConfig,
  lora: LoraConfig,
  params: dict,
  directory: str,
  base_model: str | None,
  dtype=np.float32,
) -> None:
  """adapter_config.json and adapter_model.safetensors of the adapters in `params`."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
    json.dump(adapter_config(lora, base_model), f, indent=2)
    f.write("\n")
  path = os.path.join(directory, ADAPTER_WEIGHTS)
  save_file(adapter_tensors(cfg, lora, params, dtype), path, metadata={"format": "pt"})
  umask = os.umask(0)  # safetensors creates its file 0600: readable like the config beside it
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


def load_adapter(directory: str, cfg: LlamaConfig) -> tuple[LoraConfig, dict]:
  """(LoraConfig, our adapter leaves {layers: {attn|mlp: {wq_lora_a: ...}}}, fp32) of a PEFT
  LoRA adapter directory for a model of `cfg`: plain LoRA on our targets only."""
  with open(os.path.join(directory, ADAPTER_CONFIG)) as f:
    config = json.load(f)
  by_hf = {module.split(".")[-1]: target for target, (_, module) in MODULES.items()}
  targets = config.get("target_modules") or []
  unsupported = [
    key
    for key in ("use_rslora", "use_dora", "modules_to_save", "lora_bias")
    if config.get(key) not in (None, False)
  ]
  if config.get("peft_type") != "LORA" or unsupported or not set(targets) <= set(by_hf):
    raise ValueError(
      f"{directory}: only plain LoRA adapters on {', '.join(by_hf)} load here (peft_type "
      f"{config.get('peft_type')}, target_modules {targets}, {', '.join(unsupported) or 'no'} "
      f"extras)"
    )
  lora = LoraConfig(
    int(config["r"]), float(config["lora_alpha"]), tuple(by_hf[t] for t in sorted(targets))
  )
  tensors = load_file(os.path.join(directory, ADAPTER_WEIGHTS))
  tree: dict = {}
  for target in lora.targets:
    owner, module = MODULES[target]
    a, b = [], []
    for i in range(cfg.layers):
      name = f"{PREFIX}.{i}.{module}"
      a.append(np.asarray(tensors.pop(f"{name}.lora_A.weight"), np.float32).T)
      b.append(np.asarray(tensors.pop(f"{name}.lora_B.weight"), np.float32).T)
    tree.setdefault(owner, {})[f"{target}_lora_a"] = np.stack(a)
    tree[owner][f"{target}_lora_b"] = np.stack(b)
  if tensors:
    raise ValueError(f"{directory}: unexpected adapter tensor(s) {', '.join(sorted(tensors)[:4])}")
  return lora, {LAYERS: tree}
