"""XLA's own estimate of a GPU step's time, read from the compile for a target.

While it orders each computation that holds async collectives, XLA's latency-hiding scheduler
costs every instruction for the target: fusions and matmuls from its GPU performance model,
collectives from its network model (`SolLatencyEstimator`, Hopper and Blackwell only). It logs,
per computation and after scheduling, the simulated time (`Total cycles`, microseconds for this
estimator) and the part of it spent waiting on collectives (`Total wasted cycles`). No API of
the pinned jaxlib returns these figures, so they are read from that log (VLOG 1 of
`latency_hiding_scheduler`), which must be switched on before jax starts
(`prepare_environment`) and is captured from stderr while the step compiles (`captured_stderr`).

The step's time is composed from the scheduled program (`compose`): each computation that runs
as a sequence of its own (the entry, while bodies, called computations, conditional branches)
costs its kernels one after the other at the efficiencies one H100 reached (kernel_time.H100: each
kernel's FLOPs at the rate its operands run at, its bytes as far as it moves them), plus, where
XLA scheduled it, the time XLA's scheduler has it wait on collectives; times its executions per
step (the product of the enclosing loops' trip counts, peeled iterations being computations of
their own); plus the host's gap per step. Compute alone is the same sum without the waiting.
XLA's own cost of the kernels is not used (untuned, it prices the head's matmul many times its
roofline and cuDNN's attention at nothing); its composed figure is reported as `xla_step_s`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

from paro_jax.analysis.gpu import kernel_time, roofline
from paro_jax.analysis.hlo.collectives import computation_counts
from paro_jax.analysis.gpu.instruction_costs import overpriced
from paro_jax.analysis.gpu.link import BOUND_LINK, BOUND_SCHEDULE

STATS_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "latency_hiding_scheduler=1"}
NETWORK_FLAG = "--xla_gpu_analytical_latency_estimator_options"
XLA_DEFAULTS = "XLA's defaults for the rest (its network model's built-in NIC speed per GPU)"
SOURCE = (
  "the kernels at the efficiencies one H100 measured, with the waiting on collectives of XLA's "
  "latency-hiding scheduler (SolLatencyEstimator), composed over the loops"
)
ROOFLINE_SOURCE = (
  "the kernels at the efficiencies one H100 measured: no async collective, so nothing to wait on"
)
# An async collective: what makes XLA's latency-hiding scheduler order (and cost) a computation.
_ASYNC_COLLECTIVE = re.compile(
  r"\s(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all|async)-start\("
)
# What XLA's SoL cost model prices (sol_latency_estimator.cc: HasOnlySupportedCollectives);
# any other collective makes XLA fall back to fixed-size costs, which are not times.
UNSUPPORTED_OPS = ("collective-broadcast", "send", "recv", "ragged-all-to-all")
_STAT_RE = re.compile(r"latency_hiding_scheduler\.cc:\d+\]\s*(.*)$")
_INFO_RE = re.compile(r"^I\d{4} |^I0000 |^WARNING: All log messages before absl")


def network_options(inter_bits_per_s: float | None, gpus_per_node: int) -> str:
  """The value of NETWORK_FLAG for a node link of `inter_bits_per_s` shared by its GPUs.

  Despite its name, XLA's `nic_speed_gbps` is gigabytes per second per GPU
  (`SolGPUCostModel::TransferDuration` divides bytes by 1e9 x it; its ring model gives each GPU
  its own NIC): a node whose M GPUs share R bit/s is R / 8 / M / 1e9.
  """
  options = [f"gpus_per_node={gpus_per_node}"]
  if inter_bits_per_s is not None:
    options.insert(0, f"nic_speed_gbps={inter_bits_per_s / 8 / gpus_per_node / 1e9:.6g}")
  return ",".join(options)


def prepare_environment(inter_bits_per_s: float | None, gpus_per_node: int) -> None:
  """Before jax starts: switch the scheduler's statistics on and set XLA's network model.

  Both are read once, when XLA starts (the network options only from XLA_FLAGS), so a process
  that already imported jax cannot be changed: that is an error here, not a silent estimate
  for another network. A network option the user set in XLA_FLAGS is an error too.
  """
  if "jax" in sys.modules:
    raise RuntimeError(
      "the GPU step estimate must be set up before jax is imported (XLA reads its logging and "
      "network options once): call estimate.prepare_environment first"
    )
  if NETWORK_FLAG in os.environ.get("XLA_FLAGS", ""):
    raise ValueError(
      f"XLA_FLAGS already sets {NETWORK_FLAG}: remove it and give --inter-bandwidth instead"
    )
  os.environ.update(STATS_ENV)
  flag = f"{NETWORK_FLAG}={network_options(inter_bits_per_s, gpus_per_node)}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


@contextlib.contextmanager
def captured_stderr():
  """Collect what XLA writes to stderr (file descriptor 2) meanwhile; yields a list that holds
  the text afterwards. Lines other than the INFO logging switched on here are written back."""
  out: list[str] = []
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield out
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      text = tmp.read().decode(errors="replace")
      out.append(text)
      kept = [line for line in text.splitlines(keepends=True) if not _INFO_RE.match(line)]
      sys.stderr.write("".join(kept))


def parse_statistics(log: str) -> dict[str, dict[str, float]]:
  """computation -> {"total_us", "wasted_us"} after scheduling (the last block of each name)."""
  stats, name = {}, None
  for line in log.splitlines():
    m = _STAT_RE.search(line)
    if not m:
      continue
    text = m.group(1)
    if text.startswith("For computation:"):
      name = text[len("For computation:") :].split(",")[0].strip()
      stats[name] = {}
    elif name is not None and text.startswith("Total wasted cycles:"):
      stats[name]["wasted_us"] = float(text.split(":")[1])
    elif name is not None and text.startswith("Total cycles:"):
      stats[name]["total_us"] = float(text.split(":")[1])
  return {k: v for k, v in stats.items() if {"total_us", "wasted_us"} <= set(v)}


def sequenced_computations(comps: dict) -> set[str]:
  """Computations that run as an instruction sequence of their own: while bodies, called
  computations and conditional branches (fusions, reducers and async wrappers are parts of
  one instruction and costed with it). Loop conditions, a compare each, are left out."""
  out = set()
  for instrs in comps.values():
    for i in instrs:
      if i.op == "while":
        out.update(re.findall(r"\bbody=%?([\w.\-]+)", i.attrs))
      elif i.op == "call":
        out.update(re.findall(r"\bto_apply=%?([\w.\-]+)", i.attrs))
      elif i.op == "conditional":
        for group in re.findall(r"branch_computations=\{([^}]*)\}", i.attrs):
          out.update(re.findall(r"%?([\w.\-]+)", group))
        out.update(re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", i.attrs))
  return out


# The host's time per step beyond the GPU's kernels (dispatch, the step's launch): the median of
# the measured step less the GPU's busy time over the 15 runs of experiments/results/gpu_measure/.
HOST_GAP_S = 2.06e-3


def compose(
  hlo_text: str,
  stats: dict,
  peak_flops: float,
  memory_bandwidth: float,
  efficiency: kernel_time.Efficiency = kernel_time.H100,
) -> dict:
  """The step's time from its kernels, XLA's scheduler and the program's loop structure.

  Each computation that runs as a sequence of its own costs, per execution, its kernels one
  after the other at `efficiency` of the peaks (kernel_time.kernel_seconds: matmuls at the rate
  their operands run at, cuDNN's attention included), plus, where XLA scheduled it, the time
  XLA's scheduler has it wait on collectives; times its executions per step. The host's gap per
  step (HOST_GAP_S) is added. XLA's own cost of the kernels is not used: untuned, its model
  prices the head's matmul about 20x its roofline (and more inside the micro-batch loop), and it
  charges cuDNN's attention and copies nothing. Its composed figure is kept as `xla_step_s`.

  Returns seconds: step, compute (step less waiting on collectives), exposed communication, the
  part from computations XLA did not schedule, attention, XLA's figure, and per computation its
  executions per step and time per execution.
  """
  comps, entry = roofline.parse_computations(hlo_text)
  counts = computation_counts(hlo_text)
  names = [
    c
    for c in sorted({entry} | sequenced_computations(comps), key=lambda c: (c != entry, c))
    if counts.get(c, 0)
  ]

  def cost(name, only=None):
    return kernel_time.computation_seconds(
      comps, name, peak_flops, memory_bandwidth, only=only, efficiency=efficiency
    )

  step, compute, unscheduled, attention, xla = HOST_GAP_S, HOST_GAP_S, 0.0, 0.0, 0.0
  rows = []
  for name in names:
    n = counts[name]
    kernels = cost(name)
    attention += n * cost(name, roofline.is_attention)
    if name in stats:
      wasted, source = stats[name]["wasted_us"] * 1e-6, "kernels + XLA's waiting"
      xla += n * stats[name]["total_us"] * 1e-6
    else:
      wasted, source = 0.0, "kernels"
      unscheduled += n * kernels
    step += n * (kernels + wasted)
    compute += n * kernels
    rows.append(
      {
        "computation": name,
        "executions": n,
        "time_s": kernels + wasted,
        "wait_s": wasted,
        "source": source,
      }
    )
  return {
    "step_s": step,
    "compute_s": compute,
    "exposed_comm_s": step - compute,
    "unscheduled_s": unscheduled,
    "attention_s": attention,
    "host_s": HOST_GAP_S,
    "xla_step_s": xla if stats else None,
    "computations": rows,
  }


def unavailable_reason(hlo_text: str, compute_capability: tuple[int, ...]) -> str | None:
  """Why XLA gives no time for this program on this target, in one line; None when it does."""
  if compute_capability[:1] < (9,):
    cc = ".".join(str(x) for x in compute_capability[:2])
    return (
      f"XLA has no time-based estimator for compute capability {cc}: its SoL cost model is "
      "for Hopper and Blackwell only, older GPUs get fixed-size costs that are not times"
    )
  for op in UNSUPPORTED_OPS:
    if re.search(rf"\s{op}(-start)?\(", hlo_text):
      return f"the program holds a {op}, which XLA's SoL cost model does not price"
  return None


def estimate(
  hlo_text: str,
  log: str,
  *,
  compute_capability: tuple[int, ...],
  peak_flops: float,
  memory_bandwidth: float,
  devices: int,
  tokens_per_step: int,
  flops_per_step: float,
  inter_bits_per_s: float | None,
  gpus_per_node: int,
  instruction_costs: dict | None = None,
) -> dict:
  """The `estimate` section of `inspect --target`: the step's time (`compose`), compute,
  exposed communication, tokens/s and MFU; a one-line reason and no numbers where XLA has no
  time-based model of the target.

  Given what XLA charged each instruction (`instruction_costs.read` of the compile's schedule
  dump), also the matmuls XLA's own model prices out of line with the program's others
  (`overpriced`): why its figure (`xla_step_s`) is not the estimate; and XLA's figure with
  those at the typical price (`step_s_repriced`: the waiting on collectives left as XLA
  scheduled it, so a collective the overpriced matmul hid stays hidden: a lower bound)."""
  network = {
    "inter_bandwidth_gbps": None if inter_bits_per_s is None else inter_bits_per_s / 1e9,
    "network": network_options(inter_bits_per_s, gpus_per_node)
    + ("" if inter_bits_per_s is not None else f" and {XLA_DEFAULTS}"),
  }
  reason = unavailable_reason(hlo_text, compute_capability)
  if reason is not None:
    return {"source": None, "unavailable": reason, **network}
  stats = parse_statistics(log)
  source = SOURCE
  if not stats and not _ASYNC_COLLECTIVE.search(hlo_text):
    # One device (or no communication at all): XLA schedules no computation, so it logs
    # nothing, by design; there is no waiting on collectives to add.
    source = ROOFLINE_SOURCE
  elif not stats:
    raise RuntimeError(
      "XLA logged no latency-hiding scheduler statistics while compiling for the target: "
      f"was {', '.join(f'{k}={v}' for k, v in STATS_ENV.items())} set before jax started? "
      "If it was, this jaxlib no longer logs them and the estimate must be read another way"
    )
  c = compose(hlo_text, stats, peak_flops, memory_bandwidth)
  extra = {}
  if instruction_costs is not None:
    out = overpriced(instruction_costs, hlo_text, peak_flops, memory_bandwidth)
    extra = {"overpriced": out}
    if c["xla_step_s"]:  # XLA's own figure with those at the typical price (a lower bound)
      extra["step_s_repriced"] = c["xla_step_s"] - out["overcharge_s"]
  return {
    "step_s": c["step_s"],
    "compute_s": c["compute_s"],
    "exposed_comm_s": c["exposed_comm_s"],
    "tokens_per_s": tokens_per_step / c["step_s"],
    "mfu": flops_per_step / (c["step_s"] * peak_flops * devices),
    **network,
    "source": source,
    "unscheduled_s": c["unscheduled_s"],
    "attention_s": c["attention_s"],
    "host_s": c["host_s"],
    "xla_step_s": c["xla_step_s"],
    "computations": c["computations"],
    **extra,
  }


def link_floor(
  inter_bytes: float, global_bytes: float, nodes: int, gpus_per_node: int, inter_bits_per_s: float
) -> dict:
  """The time the step's inter-node bytes per GPU take on the GPU's share of its node's link: no
  schedule of the step is shorter. `inter_bytes` are those of collectives across nodes only
  (one GPU per node in each group); of a collective over all n GPUs only the fraction
  (nodes - 1) / (n - 1) of its ring bytes has to cross nodes (its hierarchical form: the rest
  stays inside the node). XLA's model gives each collective in flight the whole link, so its
  estimate of a program with several in flight can be shorter than this."""
  devices = nodes * gpus_per_node
  crossing = inter_bytes + (global_bytes * (nodes - 1) / (devices - 1) if devices > 1 else 0.0)
  share = inter_bits_per_s / 8 / gpus_per_node
  return {"inter_bytes_per_device": crossing, "inter_link_s": crossing / share}


def format_estimate(e: dict) -> str:
  if e.get("source") is None:
    return f"step time estimate: none ({e['unavailable']})"
  bw = e["inter_bandwidth_gbps"]
  lines = [
    f"step time estimated from {e['source']} (a cost model, not a measurement; network "
    f"{'%g Gbit/s per node' % bw if bw is not None else 'defaults'}: {e['network']})",
    f"  step {e['step_s'] * 1e3:.2f} ms = compute {e['compute_s'] * 1e3:.2f} ms + exposed "
    f"communication {e['exposed_comm_s'] * 1e3:.2f} ms; {e['tokens_per_s']:,.0f} tokens/s, "
    f"MFU {e['mfu']:.1%}",
  ]
  if e.get("inter_link_s"):
    lines.append(
      f"  the inter-node link alone: {e['inter_link_s'] * 1e3:.2f} ms per step "
      f"({e['inter_bytes_per_device'] / 1e9:.3g} GB per GPU at its share of the node's link)"
    )
  if e.get("step_bound") == BOUND_LINK:
    lines.append(
      f"  the step is set by the inter-node link: the schedule alone gives "
      f"{e['schedule_step_s'] * 1e3:.2f} ms, XLA's network model giving each collective in "
      "flight the whole link; shared among them, "
      + (
        "each computation (the entry, a loop body) lasts at least its own collectives' time on "
        "the link"
        if e.get("link_s_by_computation")
        else "the link carries the step's bytes in no less than the above"
      )
    )
  elif e.get("step_bound") == BOUND_SCHEDULE:
    lines.append("  the step is set by the schedule (the link does not bind)")
  lines.append(
    f"  of it: cuDNN attention {e['attention_s'] * 1e3:.2f} ms, the host's gap "
    f"{e['host_s'] * 1e3:.2f} ms"
    + (f"; XLA's own figure {e['xla_step_s'] * 1e3:.2f} ms" if e.get("xla_step_s") else "")
  )
  over = e.get("overpriced") or {}
  if over.get("matmuls"):
    top = over["matmuls"][0]
    lines.append(
      f"  XLA's model prices {len(over['matmuls'])} matmul(s) far above the program's others "
      f"({over['overcharge_s'] * 1e3:.2f} ms per step over the typical price; the largest: "
      f"{top['op_name'] or top['instruction']}, {top['xla_s'] * 1e3:.2f} ms against a roofline "
      f"of {top['roofline_s'] * 1e3:.2f} ms): not used here"
    )
  return "\n".join(lines)
