"""The reduce-scatter lowering of multi-process CPU runs (paro_jax/cluster/gloo_rs.py): the same
values as XLA's reduce-scatter, with no reduce-scatter left in the compiled program.

The registration is process-wide, so it runs in a child process of 8 virtual CPU devices. The
inputs are small integers: every sum is exact, so both lowerings must agree to the bit."""

import json
import os
import subprocess
import sys
import textwrap

from tests.fast_compile import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
  """
  import json
  import jax, jax.numpy as jnp, numpy as np
  from jax import lax
  from jax.sharding import Mesh, PartitionSpec as P
  from paro_jax.cluster import gloo_rs

  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("inter", "intra"))
  CASES = [("intra", 0, True), ("intra", 1, True), (("intra", "inter"), 0, True),
           ("inter", 1, True), ("intra", 0, False)]

  def run(axes, dim, tiled):  # a new function each call: compiled with the current lowering
    def body(v):
      if not tiled:  # the scattered dimension is the axis itself
        v = v.reshape((4,) + v.shape[:dim] + (-1,) + v.shape[dim + 1:])
        dim_ = 0
      else:
        dim_ = dim
      y = lax.psum_scatter(v, axes, scatter_dimension=dim_, tiled=tiled)
      g = jax.grad(lambda w: lax.psum(jnp.sum(lax.psum_scatter(w, axes, scatter_dimension=dim_,
                                                               tiled=tiled) ** 2), axes))(v)
      return y.reshape(-1), g.reshape(-1)
    spec = P(("inter", "intra"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    x = (jnp.arange(8 * 8 * 24, dtype=jnp.float32) % 97).reshape(8 * 8, 24)
    return [np.asarray(a).tolist() for a in f(x)], f.lower(x).compile().as_text()

  before = [run(*c) for c in CASES]
  gloo_rs.register()
  after = [run(*c) for c in CASES]
  print(json.dumps([
    {"same": a[0] == b[0], "xla_rs": "reduce-scatter(" in a[1], "new_rs": "reduce-scatter(" in b[1],
     "new_ar": "all-reduce(" in b[1]} for a, b in zip(before, after)]))
  """
)


def test_all_reduce_and_slice_equals_reduce_scatter():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  flags = f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}"
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
  proc = subprocess.run(
    [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  cases = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(cases) == 5
  for case in cases:
    assert case == {"same": True, "xla_rs": True, "new_rs": False, "new_ar": True}, cases
