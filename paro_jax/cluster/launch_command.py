"""`paro-jax launch --nodes G --devices-per-node M -- train ...`: its flags and its entry
(cluster/launch.py starts the nodes). The per-node command is checked by the entry point first."""

from __future__ import annotations

import sys

from paro_jax.cluster.launch import launch


def add_parser(sub) -> None:
  launch = sub.add_parser(
    "launch",
    help="emulate a cluster here: one train process per node, shaped links",
    usage="paro-jax launch --nodes G --devices-per-node M [options] -- train [train options]",
    description="Start G `paro-jax train` processes with M virtual CPU devices each, joined by "
    "jax.distributed; as root with ip/tc each runs in its own network namespace behind a "
    "shaped link, otherwise on loopback without shaping. Everything after -- is the per-node "
    "command: `train ...`, `export RUN --out DIR` (node 0 writes) or `python SCRIPT [args]`; "
    "the launcher adds the multi-process flags, and --mesh GxM to all but export.",
  )
  launch.add_argument("--nodes", type=int, required=True, help="G: processes (nodes)")
  launch.add_argument("--devices-per-node", type=int, required=True, help="M: devices per node")
  launch.add_argument("--inter-bandwidth", default="1gbit", help="tc rate of each node's link")
  launch.add_argument("--inter-latency", default="0.5ms", help="one-way delay (netem); 0 for none")
  launch.add_argument(
    "--intra-bandwidth",
    default=None,
    help="tc rate of each node's loopback (intra-node traffic); default unshaped",
  )
  launch.add_argument(
    "--heartbeat-timeout",
    type=float,
    default=60.0,
    metavar="S",
    help="a node with no heartbeat for S s (stopped, frozen) fails the run "
    "(default %(default)g; 0: off)",
  )
  launch.add_argument(
    "--progress-timeout",
    type=float,
    default=900.0,
    metavar="S",
    help="a node that finished no step for S s (hung), the first compile included, fails the "
    "run (default %(default)g; 0: off)",
  )
  launch.add_argument(
    "--stop-grace",
    type=float,
    default=120.0,
    metavar="S",
    help="after Ctrl-C, how long the nodes get to checkpoint and exit before SIGKILL "
    "(default %(default)g)",
  )
  launch.add_argument(
    "--max-restarts",
    type=int,
    default=0,
    metavar="K",
    help="when a node dies, freezes or hangs, continue the run from its newest checkpoint on the "
    "nodes left (one fewer, mesh rebuilt, global batch and data order kept), up to K times",
  )
  launch.add_argument(
    "--show-gloo",
    action="store_true",
    help="print the nodes' Gloo connection messages (kept in OUT/paro-jax.launch.log otherwise)",
  )
  launch.add_argument(
    "--loopback",
    action="store_true",
    help="plain processes on 127.0.0.1, no namespaces and no shaping",
  )


def main(args, child_argv: list[str]) -> None:
  """Start the nodes with `child_argv` (what followed --) and exit with the run's code."""
  sys.exit(
    launch(
      child_argv,
      nodes=args.nodes,
      devices_per_node=args.devices_per_node,
      inter_bandwidth=args.inter_bandwidth,
      inter_latency=args.inter_latency,
      intra_bandwidth=args.intra_bandwidth,
      shaped=not args.loopback,
      heartbeat_timeout=args.heartbeat_timeout,
      progress_timeout=args.progress_timeout,
      stop_grace=args.stop_grace,
      max_restarts=args.max_restarts,
      show_gloo=args.show_gloo,
    )
  )
