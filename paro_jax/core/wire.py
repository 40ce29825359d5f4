"""The wire formats of the inter-node level (`--inter-params`, `--inter-grads`, `--int8-block`;
`int4`, two values a byte, is the outer loop's pseudo-gradient format).

What each format puts on the wire and how many bytes that is; core/compress.py does the
quantizing. No jax at import: `paro-jax plan` prices the formats without it.
"""

from __future__ import annotations

import dataclasses

from paro_jax.core.names import DEFAULT_INT8_BLOCK, WIRE_FORMATS

FORMATS = WIRE_FORMATS
# Elements per int8 scale: names.DEFAULT_INT8_BLOCK (32) costs 4/32 = 12.5% of the int8 payload
# in scales; the relative error is set by each block's largest element, so smaller blocks are
# more accurate and cost more bytes (the default's measurement is beside it in names.py).
SCALE_BYTES = 4  # one fp32 scale per block
VALUE_BYTES = {"int8": 1.0, "int4": 0.5}  # int4: two values packed in a byte


@dataclasses.dataclass(frozen=True)
class Codec:
  """The wire format of one collective's inter level (hashable: a static argument)."""

  fmt: str = "same"
  block: int = DEFAULT_INT8_BLOCK

  def __post_init__(self):
    if self.fmt not in FORMATS:
      raise ValueError(f"unknown wire precision {self.fmt!r}; choose one of {FORMATS}")
    if not isinstance(self.block, int) or self.block < 1:
      raise ValueError(f"--int8-block must be a positive integer, got {self.block!r}")

  def compresses(self, itemsize: int) -> bool:
    """Whether this codec changes what a floating operand of `itemsize` bytes sends."""
    return self.fmt in ("int8", "int4") or (self.fmt == "bf16" and itemsize > 2)

  def active_for(self, dtype) -> bool:
    """Whether this codec changes what a `dtype` operand sends (bf16 on bf16 does not)."""
    import jax.numpy as jnp  # only traced code asks, with jax loaded

    return jnp.issubdtype(dtype, jnp.floating) and self.compresses(jnp.dtype(dtype).itemsize)

  def bytes_per_element(self, itemsize: int) -> float:
    """Bytes on the wire per element of an `itemsize`-byte dtype, for large chunks (the
    formulas' rate: int8 and int4 add one fp32 scale per block)."""
    if self.fmt == "same":
      return float(itemsize)
    if self.fmt == "bf16":
      return float(min(itemsize, 2))
    return VALUE_BYTES[self.fmt] + SCALE_BYTES / self.block


@dataclasses.dataclass(frozen=True)
class WireConfig:
  """`--inter-params`, `--inter-grads` and `--int8-block`: the engine's communication precision."""

  params: str = "same"
  grads: str = "same"
  block: int = DEFAULT_INT8_BLOCK

  def __post_init__(self):
    Codec(self.params, self.block), Codec(self.grads, self.block)  # their checks

  @property
  def params_codec(self) -> Codec:
    return Codec(self.params, self.block)

  @property
  def grads_codec(self) -> Codec:
    return Codec(self.grads, self.block)
