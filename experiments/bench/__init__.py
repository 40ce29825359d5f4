"""The strategy benchmark on the emulated cluster and the planner's validation against it.

Entry points: `python experiments/bench_strategies.py` (= `python -m experiments.bench.strategies`)
and `python experiments/validate_planner.py` (= `python -m experiments.bench.validate`).

The benchmark:
- strategies.py: its command line; runs every (regime, configuration, A) and writes the results;
- configs.py: a configuration (kind paro/jit/torch, name, collectives) and its label; the run list
  (--strategies, --collectives-for, --baselines);
- calibration.py: FLOP/s of a virtual device (a jax child) and the link rate of each regime;
- traffic.py: compiled HLO traffic and memory of each configuration beside the formula (a jax
  child, through paro_jax.analysis.inspect.inspector), hlo.json;
- runs.py: one configuration launched on the emulated cluster, the wire bytes tc counts per
  step, the row (`--resume` reuses it); where torch peers plug in (torch_row);
- baselines.py: the plain-jit baselines jit-fsdp and jit-hsdp (a jax child under the launcher);
- child.py: starting a jax child from the orchestrator, and setting jax up in one;
- report.py: comparisons per row, the summary, strategies.md and strategies.png;
- estimates.py: the time a full benchmark would take.

The validation:
- validate.py: its command line;
- cluster_model.py: the planner configured for the emulated cluster, its constants fitted;
- judge.py: rank correlation, the pick against the best (re-measured), noise, the goal;
- results.py: strategies.json files merged, step times per (regime, A);
- stats.py: ranks, Pearson, Spearman, NNLS, geometric mean, the noise ceiling of Spearman;
- validate_report.py: validate.md and validate.png.
"""
