"""The page of experiments/outer_vs_paro.py: its runs grouped by configuration (each seed of a
configuration is one run; the page reads their means and spread), the table, the goals judged on
the means, and the text around them.

A seed sets the initial weights, the order of the training batches and the held-out batches the
eval loss is taken over, so a configuration is compared with IIG over the seeds both ran.
"""

from __future__ import annotations

import statistics

BOUND = "bound"
SYNC = "IIG"
LOSS_GOAL, SPEED_GOAL = 0.02, 0.90  # eval loss at most 2% above IIG's; tokens/s >= 0.90 of bound


def configuration(run: dict) -> str:
  """The configuration's label of a run (its seed's suffix dropped)."""
  return run["label"].removesuffix(f" seed{run['seed']}") if run["seed"] else run["label"]


def mean(values) -> float:
  values = list(values)
  return sum(values) / len(values)


def by_configuration(rows: list[dict]) -> list[dict]:
  """The runs without an error grouped by configuration, in the rows' order: each group's label,
  kind, H, wire, its runs and seeds (by seed), each seed's eval loss, and the means over its seeds
  of tokens/s, the inter-node and the planned bytes per step and the eval loss."""
  groups: dict[str, dict] = {}
  for r in rows:
    if r.get("error"):
      continue
    label = configuration(r)
    g = groups.setdefault(label, dict(label=label, kind=r["kind"], h=r["h"], wire=r["wire"]))
    g.setdefault("runs", []).append(r)
  for g in groups.values():
    g["runs"].sort(key=lambda r: r["seed"])
    g["seeds"] = [r["seed"] for r in g["runs"]]
    g["eval_losses"] = [r["eval_loss"] for r in g["runs"]]
    for key in ("tokens_per_s", "inter_bytes_per_step", "planned_bytes_per_step", "eval_loss"):
      g[key] = mean(r[key] for r in g["runs"])
    g["fragments"] = g["runs"][0].get("fragments")
  return list(groups.values())


def spread(values: list[float]) -> float:
  """Max less min over the mean: how far apart a configuration's seeds are."""
  return (max(values) - min(values)) / mean(values)


def against(g: dict, ref: dict, key: str) -> tuple[float, list[int]] | None:
  """(g's mean `key` over the seeds it shares with `ref` over ref's mean over them; those seeds),
  or None where they share no seed. A seed sets the data; runs of one seed here also ran in one
  window of the machine's load (seed 0 on one day, the other seeds on another)."""
  shared = sorted(set(g["seeds"]) & set(ref["seeds"]))
  if not shared:
    return None
  value = lambda h: mean(r[key] for r in h["runs"] if r["seed"] in shared)  # noqa: E731
  return value(g) / value(ref), shared


def seeds_text(seeds: list[int]) -> str:
  """`1 seed`, `3 seeds`; the seeds named where they are not 0..N-1."""
  n = f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}"
  return n if seeds == list(range(len(seeds))) else f"{n} ({', '.join(map(str, seeds))})"


def table(rows: list[dict]) -> list[str]:
  """The page's table: one line per configuration, the means over its seeds, each seed's eval
  loss and their spread; a failed run on a line of its own (the test reads it back). A page
  without IIG's or the bound's run yet (the first run of a new page) says so in those cells."""
  groups = {g["label"]: g for g in by_configuration(rows)}

  def versus(g: dict, label: str, key: str, shown) -> str:
    """g's `key` against configuration `label`'s over their shared seeds, `shown`; or why there
    is none."""
    if label not in groups:
      return f"no {label} run"
    ratio = against(g, groups[label], key)
    return shown(ratio[0]) if ratio else "no shared seed"

  lines = [
    "| run | seeds | H | wire | tokens/s | vs bound | inter-node MB/step | planned MB/step "
    "| eval loss | by seed (spread) | vs IIG, same seeds |",
    "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|",
  ]
  for g in groups.values():
    loss, by_seed, gap = "-", "-", "-"
    speed = versus(g, BOUND, "tokens_per_s", lambda x: f"{x:.3f}")
    if g["kind"] != BOUND:
      loss = f"{g['eval_loss']:.4f}"
      if len(g["seeds"]) > 1:
        by_seed = ", ".join(f"{x:.4f}" for x in g["eval_losses"])
        by_seed += f" ({spread(g['eval_losses']):.1%})"
      gap = versus(g, SYNC, "eval_loss", lambda x: f"{x - 1:+.2%}")
    lines.append(
      f"| {g['label']} | {seeds_text(g['seeds'])} | {g['h'] or '-'} | {g['wire']} | "
      f"{g['tokens_per_s']:.0f} | {speed} | "
      f"{g['inter_bytes_per_step'] / 1e6:.3f} | {g['planned_bytes_per_step'] / 1e6:.3f} | "
      f"{loss} | {by_seed} | {gap} |"
    )
  for r in rows:
    if r.get("error"):
      lines.append(f"| {r['label']} | seed {r['seed']} | | | failed: {r['error']} |" + " |" * 6)
  return lines


def seeds_left_out(rows: list[dict], labels: list[str]) -> str:
  """What the page's seeds and configurations leave out: those of `labels` (every configuration)
  not run, and which configurations ran which seeds."""
  groups = by_configuration(rows)
  ran = {g["label"] for g in groups}
  absent = [label for label in labels if label not in ran]
  out = f"{', '.join(absent)} not run on this page; " if absent else ""
  by_seeds: dict[tuple, list[str]] = {}
  for g in groups:
    by_seeds.setdefault(tuple(g["seeds"]), []).append(g["label"])
  most = max(by_seeds, key=lambda s: len(by_seeds[s]))
  name = lambda s: f"seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))}"  # noqa: E731
  parts = [f"{name(s)} of {', '.join(ls)}" for s, ls in by_seeds.items() if s != most]
  every = "every other configuration" if parts else "every configuration"
  return out + "; ".join([*parts, f"{name(most)} of {every}"])


READING = (
  "Reading the table. A line is a configuration over the seeds its `seeds` cell counts (a run "
  "per seed, each in the JSON): tokens/s, the bytes and the eval loss are the means over its "
  "seeds, `by seed` each seed's eval loss and their spread (max less min over the mean); `vs "
  "IIG` is its mean eval loss against IIG's mean over the same seeds (a seed sets the initial "
  "weights, the batches and the held-out batches), `vs bound` its tokens/s against the bound's "
  "over the same seeds (each seed's runs measured in one window), so a 1-seed line is against "
  "seed 0. The bytes: a DiLoCo step sends only the groups' metrics floats and the launcher's "
  "heartbeats (the bound's ~8 kB) except at a round's end, which sends the whole round (the "
  "JSON's `bytes_per_step` has every step's); measured is above planned by the reduce-scatters, "
  "which XLA:CPU through gloo runs as an all-reduce and a slice (docs/multinode.md: twice the "
  "reduce-scatter's bytes; the planner prices the collective a GPU runs), and by TCP/IP's "
  "headers (~7%). The eval loss: DiLoCo's is of the outer weights after the last round (step "
  "100), each group (a node) having trained on its share of every batch (a half on 2 x 4, a "
  "quarter on 4 x 2); the bound's is of the initial weights (no round ended) and is no result. "
  "The speed: IIG's seeds do the same work, so their tokens/s apart is how much the machine's "
  "other load moves a run; differences within it are not resolved (between rounds DiLoCo's step "
  "is the bound's, so a DiLoCo run above the bound is such a difference); rows of other dates "
  "(the JSON's `date`) ran under other loads, so tokens/s compares best between rows of one "
  "date, and a goal's `its rounds add` reads each run against itself: its mean step over its "
  "median step (a step between rounds), less 1. The labels: `I` is `--outer-state I` (the round "
  "all-reduces the pseudo-gradient over `inter`, 2w bytes a parameter; without it the outer "
  "state is at G and a round sends 8 + w); Streaming DiLoCo syncs F = 4 fragments (1/F of the "
  "layers and of the vocabulary each) H/F = 5 steps apart, each exchange during the step after "
  "its sync step (TAU = 1); its goal reads the bytes of each exchange (its step and those either "
  "side, less the bound's level) against a round's (each fragment's mean exchange, summed). The "
  "planner splits a round evenly over the fragments; the last also holds the final norm, so the "
  "largest is 1/F of the parameters and D more. `m=0`: the outer step without momentum "
  "(`--outer-momentum 0`, outer lr 0.7), the others with the paper's Nesterov 0.9. `torch HSDP`, "
  "where a page has it: PyTorch's FSDP2 on the same model, batches, optimizer, schedule and "
  "held-out batches (experiments/bench/torch_peer.py), from transformers' initial weights (not "
  "ours: its seeds start elsewhere), on torch's CPU kernels (its tokens/s against ours is the "
  "frameworks' compute as much as the link); planned as III's synchronous step, whose gradient "
  "sync moves the same bytes."
)


def streaming_busiest(r: dict, quiet: float) -> tuple[float, float]:
  """(the busiest fragment exchange's bytes over a round's, the largest fragment's share of the
  parameters) of a Streaming run, from its per-step bytes less the quiet steps' `quiet` (the
  bound's). The fragment synced after step t is exchanged during step t + TAU (core/fragments.py);
  tc's counter is read when a metrics line appears, late under load, so an exchange is counted
  over its step and the steps either side. A round's bytes: each fragment's mean exchange, summed
  over the F fragments."""
  from models.presets import get_config
  from paro_jax.core.fragments import Fragments, split

  arg = lambda flag: r["command"][r["command"].index(flag) + 1]  # noqa: E731
  h, count, tau = r["h"], r["fragments"], int(arg("--outer-delay"))
  per_step = {int(s): b for s, b in r["bytes_per_step"].items()}
  apart, moved = h // count, {}
  for e in per_step:
    t = e - tau  # the sync step of the exchange run during step e
    if t > 0 and t % apart == 0:
      f = (t % h // apart - 1) % count
      sent = sum(per_step.get(s, quiet) - quiet for s in (e - 1, e, e + 1))
      moved.setdefault(f, []).append(sent)
  round_bytes = sum(sum(v) / len(v) for v in moved.values())
  model = get_config(arg("--model"))
  frags = Fragments(count, h, model.layers)
  tables = 1 if model.tie_embeddings else 2  # rows of the vocabulary: each fragment its share
  span = lambda a, b: b - a  # noqa: E731
  sizes = [
    span(*frags.layer_range(f)) * model.layer_param_count()
    + tables * span(*split(model.vocab, count, f)) * model.dim
    + model.dim * (f == count - 1)  # the final norm, with the last
    for f in range(count)
  ]
  return max(max(v) for v in moved.values()) / round_bytes, max(sizes) / sum(sizes)


def round_cost(g: dict) -> float | None:
  """The time a configuration's rounds add within its own runs: each run's mean step over its
  median step, less 1, averaged over its runs (None where no run kept its step times). Between
  rounds a DiLoCo step is the group step alone, and at H >= 3 the median step is such a step, so
  this figure does not move with the machine's load on the run's day as tokens/s against a bound
  measured on another day does; the bound's own figure is its steps' scatter."""
  times = [r["step_times_s"] for r in g["runs"] if r.get("step_times_s")]
  if not times:
    return None
  return mean(mean(t) / statistics.median(t) - 1 for t in times)


def over(name: str, seeds: list[int]) -> str:
  """`IIG's seed 0`, `IIG's mean over seeds 0, 1, 2`: what a configuration is judged against."""
  if len(seeds) == 1:
    return f"{name}'s seed {seeds[0]}"
  return f"{name}'s mean over seeds {', '.join(map(str, seeds))}"


def goals(rows: list[dict]) -> list[str]:
  """The goals, each stated met or not by a DiLoCo configuration's means over its seeds against
  the bound's and IIG's over the same seeds: tokens/s within 10% of the bound's, eval loss within
  2% of IIG's, IIG's seed-to-seed spread beside it; then IIG's scatter in eval loss and tokens/s."""
  groups = {g["label"]: g for g in by_configuration(rows)}
  bound, sync = groups.get(BOUND), groups.get(SYNC)
  lines = []
  beside = (
    f"IIG's {len(sync['seeds'])} seeds span {spread(sync['eval_losses']):.1%}"
    if sync and len(sync["seeds"]) > 1
    else "IIG has 1 seed: no spread to judge it by"
  )
  for g in groups.values():
    if g["kind"] != "diloco":
      continue
    parts = []
    speed = against(g, bound, "tokens_per_s") if bound else None
    if speed:
      met = "met" if speed[0] >= SPEED_GOAL else "NOT met"
      parts.append(
        f"tokens/s {speed[0]:.2f} of {over('the bound', speed[1])}: {met} (>= {SPEED_GOAL:.2f})"
      )
    cost, quiet = round_cost(g), round_cost(bound) if bound else None
    if cost is not None and quiet is not None:
      parts.append(
        f"its rounds add {cost:.1%} to its median step within its own runs (the bound's steps "
        f"{quiet:.1%} to theirs)"
      )
    loss = against(g, sync, "eval_loss") if sync else None
    if loss:
      gap = loss[0] - 1
      # the goal asks for a loss no worse than IIG's by more than 2%: a lower one meets it
      met = "met" if gap <= LOSS_GOAL else "NOT met"
      met += ", lower than IIG's" if gap < -LOSS_GOAL else ""
      own = f", its own {spread(g['eval_losses']):.1%}" if len(g["seeds"]) > 1 else ""
      parts.append(
        f"eval loss {gap:+.1%} against {over('IIG', loss[1])}: {met} "
        f"(within {LOSS_GOAL:.0%}; {beside}{own})"
      )
    if g["fragments"] and bound:
      share, largest = max(streaming_busiest(r, bound["inter_bytes_per_step"]) for r in g["runs"])
      parts.append(
        f"busiest exchange {share:.4f} of a round's bytes: "
        f"{'met' if share <= 1 / g['fragments'] else 'NOT met'} (<= 1/F = "
        f"{1 / g['fragments']:.4f}; its largest fragment holds {largest:.4f} of the parameters)"
      )
    lines.append(f"- {g['label']} ({seeds_text(g['seeds'])}): " + "; ".join(parts))
  if sync and len(sync["seeds"]) > 1:
    loss = ", ".join(f"{x:.4f}" for x in sync["eval_losses"])
    speed = ", ".join(f"{r['tokens_per_s']:.0f}" for r in sync["runs"])
    lines.append(
      f"- the scatter to judge them by: IIG's eval loss by seed is {loss} (spread "
      f"{spread(sync['eval_losses']):.1%}), its tokens/s (the same work) {speed} (spread "
      f"{spread([r['tokens_per_s'] for r in sync['runs']]):.1%}): the machine's other load moves "
      f"a run's speed that much"
    )
  return lines
