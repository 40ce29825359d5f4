"""Training runs: the loop, data, checkpoints, export, plots, the single-device reference."""
