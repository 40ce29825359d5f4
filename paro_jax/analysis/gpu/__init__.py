"""GPU targets a step compiles for without a GPU, their peaks, and XLA's estimate of the step."""
