"""A program whose step time is known by hand, for tests/analysis/test_estimate.py.

`python tests/analysis/scan_program.py N` compiles, for 2 nodes x 4 H100 at 100 Gbit/s per node,
an all-reduce followed by a scan of N identical bodies (a matmul and an all-reduce each), and
prints one JSON object: XLA's logged statistics, the composed estimate and the HLO text.
"""

import json
import sys

from paro_jax.analysis.gpu import estimate, targets

targets.prepare_deviceless_compile()
estimate.prepare_environment(100e9, 4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

N = int(sys.argv[1])
mesh = jax.sharding.Mesh(np.array(targets.devices("h100", 2, 4)).reshape(2, 4), ("inter", "intra"))


def step(x, ws):
  x = jax.lax.psum(x, "intra") / 4

  def body(x, w):
    return jax.lax.psum(jnp.tanh(x @ w), ("inter", "intra")) / 8, None

  return jax.lax.scan(body, x, ws)[0]


f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
ws = jax.ShapeDtypeStruct((N, 1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
with estimate.captured_stderr() as log:
  text = f.lower(x, ws).compile().as_text()
stats = estimate.parse_statistics(log[0])
composed = estimate.compose(text, stats, 989e12, 3.35e12)
print(json.dumps({"stats": stats, "compose": composed, "hlo": text}))
