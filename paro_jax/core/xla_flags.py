"""XLA flags that let GPUs overlap collectives, HO-Ring's two directions in particular.

HO-Ring sends one chunk on the intra ring and one on the inter ring in every step; the two
`collective-permute`s do not depend on each other (tests/test_collectives.py checks the HLO), but
XLA:GPU runs them concurrently only if its scheduler may keep more than one collective in
flight (openxla/xla#10640 reports ppermutes in two directions serialised on one stream).
Names checked against the pinned jaxlib 0.10.2: XLA aborts at start-up on an unknown flag, and
tests/test_xla_flags.py starts jax with these set.
"""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

GPU_OVERLAP_FLAGS = (
  # Schedule asynchronous collectives around compute and around each other.
  "--xla_gpu_enable_latency_hiding_scheduler=true",
  # Up to two collectives in flight at once: an HO-Ring step's intra and inter permutes.
  "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
)


def add_xla_flags(flags=GPU_OVERLAP_FLAGS) -> list[str]:
  """Append flags to XLA_FLAGS (before jax starts), leaving any the user set alone."""
  current = os.environ.get("XLA_FLAGS", "")
  added = [f for f in flags if f.split("=")[0] not in current]
  if added:
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
  return added


def provide_cpu_devices(count: int) -> None:
  """Ask XLA for `count` virtual CPU devices; must run before jax is imported.

  The flag only shapes the host (CPU) platform, so it is harmless where a GPU is the backend.
  A count the user already set in XLA_FLAGS is left alone.
  """
  add_xla_flags([f"{DEVICE_COUNT_FLAG}={count}"])
