"""Multi-process runs: jax.distributed set-up and the emulated-cluster launcher."""
