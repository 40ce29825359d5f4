"""The analytic planner: `paro-jax plan`, `paro-jax probe` and `train --strategy auto`."""
