"""The gpu_estimates page's prose: what the compiles showed beyond its tables, each checked as it
says (see docs/gpu.md), and the hand-run example it quotes."""

# What holds the pick's communication back in XLA's schedule (read from the scheduled HLO of
# NNI: each backward layer body starts its layer's inter-node all-reduce and waits for it).
EXPOSED_WHY = (
  "each layer's gradient sync (a reduce-scatter in the node, issued one layer ahead, then an "
  "all-reduce across nodes of the node's 1/8 shard, 50.6 MB for a 7b layer) starts once the "
  "layer's gradient is final and is waited for at the end of the next layer's backward. At 100 "
  "Gbit/s per node that all-reduce takes 24.9 ms in XLA's model against about 4 ms of one "
  "layer's backward compute: the link, not the schedule, holds it back; no order of the same "
  "collectives could hide more than the last micro-batch's backward compute (about 0.12 s), "
  "because the gradients are final only there."
)
# The day the stored steps were recomputed with the link shared (link.link_shared), by
# `--report-only`, nothing recompiled.
RESCORED = "2026-11-27"
# `inspect --target` on a mesh of 4 GPUs per node, outside the grid (the GPU step's example), run by
# hand on RESCORED at commit b19fd4d (70 s): the step with the link shared, set by the link;
# the composed figure by hand after the est-roofline merge, the same day.
INSPECT_EXAMPLE = (
  "The same estimate from `paro-jax inspect --target h100 --model 7b --mesh 2x4 --strategy IIG "
  "--collectives xla --micro-batches 2 --batch-size 8 --seq-len 2048 --inter-bandwidth 100gbit` "
  "(" + RESCORED + ", compiled then): step 1,305.13 ms = compute 484.11 ms + exposed "
  "communication 821.02 ms, set by the inter-node link: the link floor is 1,078.15 ms (3.37 GB "
  "per GPU at its 3.125 GB/s share), of which the entry's collectives take 592.43 ms against "
  "its 307.87 ms in XLA's schedule and the backward layer body's 485.72 ms against its "
  "329.31 ms; XLA's schedule alone 864.16 ms. Since then the scheduled step is composed from "
  "the kernels at the efficiencies one H100 measured (docs/gpu.md): the same command gives "
  "1,333.50 ms with the link shared (828.22 ms as scheduled); the grid's programs, compiled "
  "before, carry XLA's schedule."
)
# The cells whose pick's exposed communication the page breaks down.
EXPOSED_CELLS = ("7b 4x8 100gbit A=1", "7b 4x8 100gbit A=8")
# What the compiles showed beyond the tables (checked as each says; see docs/gpu.md).
NOTES = [
  "",
  "How the estimate is composed and what it gets wrong:",
  "",
  "- Computations XLA does not cost (a layer body without an async collective: the forward "
  "of every strategy with replicated parameters) are charged their roofline scaled by XLA's "
  "costs over the loop bodies it costed. Scaled over all costed computations instead (the "
  "first composition, whose cells were compiled again), the entry's head matmul, which "
  "XLA's model prices untuned at 44 ms "
  "(81x its 0.54 ms roofline; 7b, 2 x 8, in every strategy), inflated them: NNI's forward "
  "layer body on 7b 2 x 8 was charged 2.06 ms, now 1.47 ms. XLA's own per-kernel costs of "
  "the same kernels where it does cost them (`--xla_dump_latency_hiding_schedule`: each "
  "instruction's simulated start and end) give 1.53 ms for that body (11 of its 18 kernels "
  "found in the backward body; the other 7 at the scaled roofline): the roofline part is "
  "within about 5% of XLA's own figures there, where it was 35% above.",
  "- With A > 1 the head matmul sits in the micro-batch loop's body, which XLA costs only for "
  "strategies with a collective in it (INI, III, IIG: the embedding's and head's gathers); "
  "the others get the scaled roofline for it. 7b 4 x 8, A=8: XLA prices INI's head matmuls "
  "at 55.5 ms per micro-batch (44.0 + 5.8 + 5.7 ms, against 1.6 ms of roofline; "
  "schedule dump), 7 x 53.9 ms = 0.38 s of INI's 2.80 s against NNI's 2.42 s: without "
  "that price the two tie. Cells with A=8 order INI, III and IIG behind NNI by this.",
  "- XLA (jaxlib 0.10.2) prices an all-reduce as one ring pass ((n-1)/n of the buffer per "
  "GPU over its NIC share): NNI's inter-node all-reduce of a layer's 1/8 gradient shard "
  "(50.6 MB over 4 nodes at 100 Gbit/s) costs 24.7 ms there, 0.75 x 50.6 MB / 1.5625 GB/s x "
  "1.025 = 24.9 ms. A ring all-reduce sends twice that (reduce-scatter, then all-gather; "
  "later XLA multiplies by two rounds, `NumRounds` in `sol_gpu_cost_model.cc`). The planner "
  "charges the two passes, so strategies that sync by an all-reduce (the `N`/`I` gradients "
  "with an inter-node sync: NNI, INI, III, NII) are cheaper in this XLA's estimate, relative "
  "to the others, than on the wire.",
  "- XLA's model prices each async collective as if it had the link to itself, and "
  "paro_jax's GPU flags (paro_jax/core/xla_flags.py) let up to 4 be in flight at once, so a "
  "program that splits its traffic into several collectives in flight together gets up to 4x "
  "the link in the estimate. `jit-hsdp`'s gradient sync is, per layer, 7 all-reduces of the "
  "full gradients over all GPUs (XLA's partitioner reduces the whole gradient, then keeps the "
  "node's shard): on the wire 1.29x the inter-node bytes of NNI's (a reduce-scatter in the "
  "node, then an all-reduce of 1/8 across nodes), but 4 at a time in the estimate. The column "
  "`best jit, XLA's default flags` compiles the baselines as a plain-jit user gets them (one "
  "collective in flight); there the same 7 all-reduces queue.",
  "- `ring` is paro_jax's flat ring of collective-permutes, which XLA prices step by step "
  "(each step its own transfer and latency); `xla` is NCCL's one-level ring over all GPUs, "
  "the paper's Ring; `hring` and `horing` are paro_jax's two-level rings (horing: the intra "
  "and inter steps in flight together on two streams).",
  "",
  "Compile time (where it goes, and what was tried; 7b 4 x 8, A=8, IIG, 100 Gbit/s, profiled "
  "with cProfile and XLA's VLOG timers): 25 s in all, of which tracing and lowering 7.5 s and "
  "XLA 13.5 s; inside XLA the HLO passes and the scheduling take 1.3 s and the code generation "
  "(LLVM IR emission, Triton, ptxas) the rest, which the estimate does not need but no option "
  "of this jaxlib skips. `--xla_gpu_disable_gpuasm_optimizations`, "
  "`--xla_llvm_disable_expensive_passes` and `--xla_backend_optimization_level=0` left the "
  "estimate identical (2.92958706 s) and gained nothing measurable (17.2 s and 20.7 s, within "
  "the load's noise); `--xla_gpu_enable_triton_gemm=false` changes the estimate by -1.6%, so "
  "it was not used. A compile takes 12-30 s on a quiet machine; this grid ran beside other "
  "jobs (load average 15-21 on 2 cores), at 15-90 s a compile, so the later cells compile 8 "
  "of the 14 strategies (NNI, INI, III, IIG, NIG, IGG, NGG, GGG: the top, the middle and the "
  "bottom of the full cells; for 65b IIG, IGG, GIG and GGG, the ones that fit) and their "
  "Spearman and XLA's best are over those.",
]
