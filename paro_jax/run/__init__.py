"""Training runs: the loop, stopping, bookkeeping, checkpoints, eval, export, plots, the
single-device reference. The data they read is paro_jax/data/'s; the HF files they write,
paro_jax/hf/'s."""
