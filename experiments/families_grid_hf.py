"""transformers' side of experiments/families_grid.py, run by a python with torch and transformers
(and peft for an adapter); it imports nothing of this repository.

  python experiments/families_grid_hf.py JOBS.json OUT.json

JOBS.json is a list of {"cell", "export", "windows"[, "base", "adapter", "ids"]}: each exported
directory is loaded as tests/hf/test_families.py loads it (fp32, eager attention) and scored by
cross-entropy per window of the `windows` .npy (N x L+1 token ids), the mean over windows; where
an adapter is named, peft loads it onto `base` and its logits on the `ids` .npy are compared with
the merged export's (and with the base's, to show the adapter moved them). OUT.json holds one
record per cell, with the versions of the libraries.
"""

import json
import sys

import numpy as np
import torch
import transformers


def load(directory: str):
  return transformers.AutoModelForCausalLM.from_pretrained(
    directory, dtype=torch.float32, attn_implementation="eager"
  ).eval()


def window_losses(model, tokens_NxL1: np.ndarray) -> np.ndarray:
  tokens = torch.as_tensor(tokens_NxL1).long()
  with torch.no_grad():
    logits = model(input_ids=tokens[:, :-1]).logits.float()
  ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
  return ce.mean(dim=1).numpy()


def adapter_differences(base: str, adapter: str, merged, ids: np.ndarray) -> dict:
  """Max |logit| differences of peft's adapted base against the merged export and the base."""
  import peft

  tokens = torch.as_tensor(ids).long()
  with torch.no_grad():
    plain = load(base)(input_ids=tokens).logits
    adapted = peft.PeftModel.from_pretrained(load(base), adapter).eval()
    theirs = adapted(input_ids=tokens).logits
    ours = merged(input_ids=tokens).logits
  return {
    "peft_max_abs_logit_diff": float((theirs - ours).abs().max()),
    "peft_moved_from_base": float((theirs - plain).abs().max()),
    "peft": peft.__version__,
  }


def main(jobs_path: str, out_path: str) -> None:
  with open(jobs_path) as f:
    jobs = json.load(f)
  out = {"torch": torch.__version__, "transformers": transformers.__version__, "cells": {}}
  for job in jobs:
    model = load(job["export"])
    losses = window_losses(model, np.load(job["windows"]))
    record = {
      "class": type(model).__name__,
      "loss": float(losses.mean()),
      "windows": int(losses.size),
    }
    if job.get("adapter"):
      record.update(adapter_differences(job["base"], job["adapter"], model, np.load(job["ids"])))
    out["cells"][job["cell"]] = record
    print(f"families_grid_hf: {job['cell']}: {record}", flush=True)
  with open(out_path, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main(*sys.argv[1:])
