"""paro_jax: PaRO partial-redundancy sharding strategies and HO-Ring collectives in JAX."""

__version__ = "0.1.0"
