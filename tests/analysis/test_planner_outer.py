"""`plan --outer-sync H` and `train --strategy auto --outer-sync H`
(paro_jax/analysis/planner/auto.py): the outer loop (DiLoCo, core/outer.py) ranked beside the 14
strategies (analysis/planner/step_model.py predict_outer).

The round's bytes are derived here from docs/outer.md's description of the round (three
collectives, fp32 but for the pseudo-gradient's wire, ring factors written out), not from
paro_jax/analysis/planner/costs.py's outer_round_traffic, which the plan's figures come from."""

import json

import pytest

from models.presets import get_config
from paro_jax.analysis.planner import inputs, planner
from paro_jax.cli import main
from paro_jax.core.strategy import GROUP_NAMES, VALID_NAMES, GroupStrategy, parse_strategy
from paro_jax.core.wire import WireConfig

G, M, H = 4, 8, 50
BANDWIDTH, LATENCY = 125e6, 1e-3  # 1 Gbit/s per node; 1 ms per collective between nodes
LEAVES = 12  # the round syncs the 12 stacked leaves, one collective each (9 per layer + 3)


def outer_plan(
  model="7b",
  grads="same",
  h=H,
  global_collectives="flat",
  fragments=1,
  delay=0,
  state="G",
  memory=80e9,
):
  cfg = get_config(model)
  w = inputs.Workload(
    cfg,
    micro_batch=1,
    micro_batches=8,
    seq_len=2048,
    wire=WireConfig(grads=grads),
    outer_sync=h,
    outer_fragments=fragments,
    outer_delay=delay,
    outer_state=state,
  )
  net = inputs.Links(BANDWIDTH, 300e9, LATENCY, 10e-6, global_collectives=global_collectives)
  return planner.plan(w, inputs.Cluster(G, M, net, 312e12, device_memory=memory)), cfg.param_count()


def wire_bytes(fmt: str) -> float:
  """Bytes per pseudo-gradient element on the wire: fp32, bf16, or int8 with one fp32 scale per
  block of 32 (the default --int8-block), or int4: two values a byte, the same scales."""
  return {"same": 4.0, "bf16": 2.0, "int8": 1 + 4 / 32, "int4": 0.5 + 4 / 32}[fmt]


@pytest.mark.parametrize("grads", ["same", "bf16", "int8", "int4"])
def test_round_of_an_intra_sharded_master_is_three_rings_over_inter(grads):
  """OS = I (III, NNI, ...): the outer weights out (4 bytes), the pseudo-gradient back (its
  wire's bytes) and the new outer weights out (4 bytes), each a ring over the g nodes on the
  node's 1/m share: (g-1)/g x psi/m per device and round, 1/H of it per step; its time is the
  bytes at each device's share of the node's link plus the latency of 3 x 12 collectives,
  over H."""
  p, psi = outer_plan(grads=grads)
  for name in ("III", "NNI", "NII", "INI"):
    e = p.get(name)
    per_round = (G - 1) / G * psi / M * (4 + wire_bytes(grads) + 4)
    assert e.traffic["inter_bytes"] == pytest.approx(per_round / H, rel=1e-9)
    assert e.traffic["outer_round"]["inter_bytes"] == pytest.approx(per_round, rel=1e-9)
    seconds = (3 * LEAVES * LATENCY + per_round / (BANDWIDTH / M)) / H
    assert e.times["outer_sync"] == pytest.approx(seconds, rel=1e-9)
    # the rest of the step is the group's own step, which crosses no node
    inner = next(x for x in p.synchronous if x.strategy == name)
    assert e.step_time_s == pytest.approx(
      e.times["compute"] + sum(v for k, v in e.times.items() if k != "compute"), rel=1e-12
    )
    assert e.times["grad_sync"] < inner.times["grad_sync"]  # no gradient sync across nodes


def test_round_of_a_replicated_master_spans_both_axes():
  """OS = N (NNN): the collectives run over all n devices; uncompressed, a flat ring moves
  (n-1)/n x 4 psi per gather and per reduce-scatter; with int8 the reduce-scatter's intra level
  carries fp32 ((m-1)/m x 4 psi, inside the node) and its inter level int8 on 1/m."""
  n = G * M
  p, psi = outer_plan(grads="same")
  assert p.get("NNN").traffic["outer_round"]["inter_bytes"] == pytest.approx(
    3 * (n - 1) / n * 4 * psi, rel=1e-9
  )
  p, psi = outer_plan(grads="int8")
  round_ = p.get("NNN").traffic["outer_round"]
  assert round_["inter_bytes"] == pytest.approx(
    2 * (n - 1) / n * 4 * psi + (G - 1) / G * wire_bytes("int8") * psi / M, rel=1e-9
  )
  assert round_["intra_bytes"] == pytest.approx((M - 1) / M * 4 * psi, rel=1e-9)


def test_h_divides_the_bytes_and_the_sync_time():
  one, _ = outer_plan(h=1)
  fifty, _ = outer_plan(h=50)
  for name in GROUP_NAMES:
    a, b = one.get(name), fifty.get(name)
    assert a.traffic["inter_bytes"] == pytest.approx(50 * b.traffic["inter_bytes"], rel=1e-12)
    assert a.times["outer_sync"] == pytest.approx(50 * b.times["outer_sync"], rel=1e-12)
    assert a.memory == b.memory  # H changes no buffer


def test_g_strategies_are_not_offered():
  """The candidates are the strategies of N and I letters; the 14 stand beside them, not in the
  ranking the pick comes from."""
  p, _ = outer_plan()
  assert sorted(e.strategy for e in p.ranking) == sorted(GROUP_NAMES)
  assert all("G" not in e.strategy and e.outer_sync == H for e in p.ranking)
  assert sorted(e.strategy for e in p.synchronous) == sorted(VALID_NAMES)
  assert all(e.outer_sync is None for e in p.synchronous)
  assert p.pick in GROUP_NAMES and p.ranking[0].strategy == p.pick


def test_slow_link_diloco_beats_every_synchronous_strategy():
  """At 1 Gbit/s per node a 7b step that syncs every step spends most of it on the link; once
  every 50 steps it does not."""
  p, _ = outer_plan()
  best_sync = min(e.step_time_s for e in p.synchronous if e.fits)
  assert p.get(p.pick).step_time_s * 2 < best_sync
  assert "DiLoCo (--outer-sync 50)" in p.explain and "the fastest synchronous strategy" in p.explain


def test_outer_axes_are_the_rounds():
  """The planner's axes of the round are core/outer.py's (which imports jax; the planner may
  not)."""
  from paro_jax.core import outer

  for name in GROUP_NAMES:
    s = GroupStrategy.of(parse_strategy(name))
    assert s.outer_sync_axes == outer.sync_axes(s)


PLAN = ["plan", "--model", "7b", "--nodes", "4", "--inter-bandwidth", "1gbit"]


def test_plan_outer_json_and_table(capsys):
  main([*PLAN, "--outer-sync", "10", "--inter-grads", "int8", "--json"])
  out = json.loads(capsys.readouterr().out)
  assert out["inputs"]["outer_sync"] == 10 and out["pick"] in GROUP_NAMES
  assert [r["strategy"] for r in out["ranking"]][0] == out["pick"]
  assert all(r["outer_sync"] == 10 and "outer_sync" in r["times"] for r in out["ranking"])
  assert len(out["synchronous"]) == 14
  main([*PLAN, "--outer-sync", "10"])
  text = capsys.readouterr().out
  assert "outer sync every 10 steps" in text and "beside it, the synchronous strategies" in text


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--outer-sync", "0"], "--outer-sync must be >= 1"),
    (["--outer-sync", "5", "--target", "h100"], "drop --target with --outer-sync"),
    (["--outer-sync", "4", "--outer-fragments", "3"], "--outer-fragments 3 must divide --outer-"),
    (["--outer-fragments", "2"], "--outer-fragments 2 splits the outer loop's syncs, and there"),
    (["--outer-sync", "4", "--outer-delay", "4"], "--outer-delay must be in [0, H/F) = [0, 4)"),
    (["--outer-sync", "64", "--outer-fragments", "64"], "and the model has 32 layers: pass at"),
  ],
)
def test_plan_outer_bad_input(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    main([*PLAN, *argv])
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_train_strategy_auto_with_the_outer_loop(tmp_path, capsys):
  """`--strategy auto --outer-sync H` runs the planner's pick among the N and I strategies;
  with `--outer-state auto`, its outer state at I where the run's memory fits (a test model
  fits the host's memory: I), the checkpoint recording the state resolved."""
  from paro_jax.run.checkpoint import Checkpointer

  out = tmp_path / "run"
  main(
    ["train", "--strategy", "auto", "--outer-sync", "2", "--model", "test", "--mesh", "2x4"]
    + ["--steps", "2", "--batch-size", "8", "--seq-len", "16", "--dtype", "fp32"]
    + ["--outer-state", "auto", "--out", str(out)]
  )
  text = capsys.readouterr().out
  line = next(x for x in text.splitlines() if "--strategy auto picked" in x)
  pick = line.split("picked ")[1][:3]
  assert pick in GROUP_NAMES and "DiLoCo (--outer-sync 2)" in line
  assert "the pick's outer state at I" in line
  assert "paro-jax: --outer-state auto: I (a round sends the pseudo-gradient alone" in text
  assert f"strategy {pick} on mesh 2x4" in text and "outer sync every 2 steps" in text
  assert "outer state at I: a copy per node" in text
  ckpt = Checkpointer(str(out / "checkpoints"), read_only=True)
  assert ckpt.newest_meta().outer["state"] == "I"
  ckpt.close()
  rows = (out / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [1, 2]


def test_a_model_no_node_can_hold_is_not_planned_with_the_outer_loop():
  """65b on nodes of 8 x 80 GB: a group's replica (16 bytes per parameter over 8 devices at
  best, III) does not fit; the synchronous strategies that shard over all devices do."""
  p, _ = outer_plan(model="65b")
  assert p.pick is None and not any(e.fits for e in p.ranking)
  assert any(e.fits for e in p.synchronous)
  assert "each node holds a whole replica" in p.explain


def test_int4_is_the_rounds_format_only(capsys):
  """int4 is the pseudo-gradient's format: without --outer-sync it is refused as train refuses
  it, and beside the outer loop the synchronous strategies are priced with int8 (what train
  would run them with), the explanation saying so."""
  p, _ = outer_plan(grads="int4")
  int8, _ = outer_plan(grads="int8")
  for a, b in zip(p.synchronous, int8.synchronous):
    assert (a.strategy, a.step_time_s) == (b.strategy, b.step_time_s)
  assert "the fastest synchronous strategy (int8 on its wire)" in p.explain
  with pytest.raises(SystemExit) as e:
    main(["plan", "--model", "7b", "--nodes", "4", "--inter-grads", "int4"])
  assert e.value.code == 2
  assert "--inter-grads int4 is the outer loop's pseudo-gradient format" in capsys.readouterr().err


@pytest.mark.parametrize("grads", ["same", "int8"])
def test_fragments_split_the_round_over_f_sync_steps(grads):
  """--outer-fragments F: the round's bytes are the same, a sync step moves 1/F of them; each
  fragment's step runs the three collectives on its slice of the 9 leaves of the layer stack and
  of the embedding and the head, the last fragment's on the final norm too (3 x 12 collectives
  at the busiest step, 3 x (11 F + 1) in a round)."""
  f = 5
  plain, psi = outer_plan(grads=grads)
  p, _ = outer_plan(grads=grads, fragments=f)
  for name in ("III", "NNI", "NII", "INI"):
    e = p.get(name)
    per_round = (G - 1) / G * psi / M * (4 + wire_bytes(grads) + 4)
    link = BANDWIDTH / M  # each device's share of the node's link
    assert e.traffic["inter_bytes"] == pytest.approx(per_round / H, rel=1e-9)
    busiest = e.traffic["outer_round"]["busiest_step"]
    assert busiest["inter_bytes"] == pytest.approx(per_round / f, rel=1e-9)
    assert busiest["seconds"] == pytest.approx(3 * 12 * LATENCY + per_round / f / link, rel=1e-9)
    sync = (3 * (11 * f + 1) * LATENCY + per_round / link) / H
    assert e.times["outer_sync"] == pytest.approx(sync, rel=1e-9)
    assert e.memory == plain.get(name).memory  # fragments partition the same outer state
    one = plain.get(name).traffic["outer_round"]["busiest_step"]
    assert one["inter_bytes"] == pytest.approx(per_round, rel=1e-9)  # F = 1: the whole round


def test_delay_keeps_one_copy_of_the_master_weights():
  """--outer-delay: each device keeps its fp32 master weights at OS for the delayed exchange:
  4 psi / m bytes for OS = I, 4 psi for OS = N; nothing else changes."""
  plain, psi = outer_plan(fragments=2)
  p, _ = outer_plan(fragments=2, delay=1)
  for name in GROUP_NAMES:
    kept = 4 * psi // (M if name[2] == "I" else 1)
    a, b = plain.get(name), p.get(name)
    assert b.memory["model_states"]["kept"] == kept and "kept" not in a.memory["model_states"]
    assert b.memory["total"] == a.memory["total"] + kept
    assert b.step_time_s == a.step_time_s


def test_plan_fragments_json_and_text(capsys):
  main([*PLAN, "--outer-sync", "10", "--outer-fragments", "2", "--outer-delay", "1", "--json"])
  out = json.loads(capsys.readouterr().out)
  assert (out["inputs"]["outer_fragments"], out["inputs"]["outer_delay"]) == (2, 1)
  for r in out["ranking"]:
    round_ = r["traffic"]["outer_round"]
    assert round_["fragments"] == 2
    assert round_["busiest_step"]["inter_bytes"] == pytest.approx(round_["inter_bytes"] / 2)
    assert "kept" in r["memory"]["model_states"]
  main([*PLAN, "--outer-sync", "10", "--outer-fragments", "2"])
  text = capsys.readouterr().out
  assert "in 2 fragments (a sync step moves 1/2 of the round)" in text
  assert "in 2 fragments its busiest sync step moves" in text


@pytest.mark.parametrize("grads", ["same", "int8", "int4"])
def test_round_with_the_outer_state_at_node_is_one_all_reduce_over_inter(grads):
  """--outer-state I: the pseudo-gradient of each device's 1/m share all-reduced over the g
  nodes (a reduce-scatter and an all-gather ring, each (g-1)/g of it at the wire's bytes) and
  nothing else across nodes: 2w bytes per parameter where the state at G sends 8 + w; the latency
  of 12 all-reduces. The new outer weights are gathered inside the node where OS = N (NNN:
  (m-1)/m x 4 psi), nowhere else. Memory: 8 bytes per parameter over the node's m devices."""
  at_node, psi = outer_plan(grads=grads, state="I")
  at_g, _ = outer_plan(grads=grads)
  per_round = (G - 1) / G * psi / M * 2 * wire_bytes(grads)
  for name in GROUP_NAMES:
    e, g = at_node.get(name), at_g.get(name)
    assert e.traffic["outer_round"]["inter_bytes"] == pytest.approx(per_round, rel=1e-9)
    intra = (M - 1) / M * 4 * psi if name == "NNN" else 0
    assert e.traffic["outer_round"]["intra_bytes"] == pytest.approx(intra, rel=1e-9)
    restart = LEAVES * 10e-6 + intra / 300e9 if intra else 0  # the intra link's latency, bytes
    seconds = (LEAVES * LATENCY + per_round / (BANDWIDTH / M) + restart) / H
    assert e.times["outer_sync"] == pytest.approx(seconds, rel=1e-9)
    extra = 8 * -(-psi // M) - 8 * -(-psi // (G * M))  # the state over m devices, not n
    residual = e.memory["model_states"].get("outer", 0) - 8 * -(-psi // M)
    assert residual == g.memory["model_states"]["outer"] - 8 * -(-psi // (G * M))
    assert e.memory["total"] == g.memory["total"] + extra
  if grads == "int8":  # 2.25 against 9.125 bytes per parameter and device: about four times
    ratio = at_g.get("III").traffic["outer_round"]["inter_bytes"] / per_round
    assert ratio == pytest.approx((8 + 1.125) / 2.25, rel=1e-9)


def test_plan_with_the_outer_state_at_node(capsys):
  main([*PLAN, "--outer-sync", "10", "--inter-grads", "int8", "--outer-state", "I", "--json"])
  out = json.loads(capsys.readouterr().out)
  assert out["inputs"]["outer_state"] == "I"
  phases = out["ranking"][0]["traffic"]["phases"]
  assert "outer pseudo-gradient/inter" in phases and "outer start/inter" not in phases
  main([*PLAN, "--outer-sync", "10", "--outer-state", "i"])
  assert "the outer state at I" in capsys.readouterr().out
  with pytest.raises(SystemExit) as e:
    main([*PLAN, "--outer-state", "I"])
  assert e.value.code == 2
  assert (
    "--outer-state I places the outer loop's state, and there is none" in capsys.readouterr().err
  )


def test_outer_state_auto_takes_i_where_it_fits():
  """--outer-state auto: each strategy at I where its memory with the state at I fits, else at
  G. On 80 GB every fitting strategy is at I (a quarter of G's round bytes with int8); with the
  memory between III's need at G and at I, III is at G."""
  at_g, _ = outer_plan(grads="int8")
  at_node, _ = outer_plan(grads="int8", state="I")
  auto, _ = outer_plan(grads="int8", state="auto")
  for e in auto.ranking:
    fits = at_node.get(e.strategy).fits
    assert e.outer_state == ("I" if fits else "G"), e.strategy
    want = (at_node if fits else at_g).get(e.strategy)
    assert e.step_time_s == want.step_time_s and e.memory == want.memory
  assert auto.get(auto.pick).outer_state == "I" and "the pick's outer state at I" in auto.explain
  g_need, i_need = (p.get("III").memory["total"] for p in (at_g, at_node))
  between = (g_need + i_need) / 2 / inputs.USABLE_MEMORY
  tight, _ = outer_plan(grads="int8", state="auto", memory=between)
  assert tight.get("III").outer_state == "G" and tight.get("III").fits
