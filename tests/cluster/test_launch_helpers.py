"""The launcher's public helpers that need no launch: the names of a node's namespace and link,
its tc byte counter, and a child's environment (experiments/bench/ uses all three)."""

import os

from paro_jax.cluster.launch import child_env
from paro_jax.cluster.netns import NamespaceNetwork, node_link, sent_bytes
from paro_jax.core.xla_flags import DEVICE_COUNT_FLAG

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_node_link_names_what_the_network_creates():
  net = NamespaceNetwork(3, "1gbit", None, None, tag=4321)  # names only: nothing is created
  assert [node_link(4321, k) for k in range(3)] == list(zip(net.namespaces, net.ifaces))
  assert node_link(4321, 1) == ("paro4321n1", "pj4321v1")
  # No such launch (or no `ip` at all): no counter, rather than an error.
  assert sent_bytes(4321, 0) is None
  assert net.link_bytes() == {}


def test_child_env_sets_the_device_count_and_this_checkout():
  env = child_env(3, {"XLA_FLAGS": f"{DEVICE_COUNT_FLAG}=8 --xla_foo=1", "PYTHONPATH": "/x"})
  assert env["XLA_FLAGS"] == f"--xla_foo=1 {DEVICE_COUNT_FLAG}=3"
  assert env["PYTHONPATH"].split(os.pathsep) == [REPO, "/x"]
  assert env["PYTHONUNBUFFERED"] == "1"
  assert child_env(2)["XLA_FLAGS"].endswith(f"{DEVICE_COUNT_FLAG}=2")  # this process's env
