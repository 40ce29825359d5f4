"""What a strategy costs, in wings: planner/ (the analytic planner: `plan`, `probe`, `train
--strategy auto`), gpu/ (GPU targets compiled for without one, XLA's estimate of the step),
hlo/ (reading compiled HLO) and inspect/ (`paro-jax inspect`)."""
