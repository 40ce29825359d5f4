"""Fixtures of the run tests."""

import tempfile

import jax
import pytest


@pytest.fixture(scope="module")
def compilation_cache():
  """Each train() builds a new engine whose programs jax would compile again from scratch; a
  persistent compilation cache turns those repeats into cache hits (seconds, not tens). A module
  that trains repeatedly asks for it with `pytestmark = pytest.mark.usefixtures(...)`."""
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="paro-jax-jit-"))
