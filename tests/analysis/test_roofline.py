"""The roofline's pricing of GPU kernels (paro_jax/analysis/gpu/roofline.py), on small HLO texts
whose costs are computed here by hand: cuDNN's causal attention at half an unmasked one's FLOPs,
fp32 matmuls at the TF32 rate, allocations free, copies as the bytes they move, updates in place
as the update, slices as the slice."""

import pytest

from paro_jax.analysis.gpu import roofline
from paro_jax.analysis.gpu.hardware import TF32_OVER_BF16

PEAK, BW = 1e15, 1e12  # FLOP/s and bytes/s: round numbers to price by hand


def _priced(hlo: str, name: str) -> tuple[float, float]:
  """(bytes moved, seconds) of instruction `name` of the entry computation."""
  comps, entry = roofline.parse_computations(hlo)
  instrs = comps[entry]
  types = {i.name: i.type_text for i in instrs}
  i = next(i for i in instrs if i.name == name)
  return (
    roofline.kernel_bytes(i, comps, types),
    roofline.instruction_seconds(i, comps, types, PEAK, BW),
  )


# cuDNN's fused attention as XLA writes it: B=1, L=2048, H=32, D=128 (q, k, v [B, L, H, D]).
_FMHA = (
  "%fmha = (bf16[1,32,2048,128]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), "
  'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[1,2048,32,128]'
  "{3,2,1,0}, bf16[1,2048,32,128]{3,2,1,0}, bf16[1,2048,32,128]{3,2,1,0}}, "
  'backend_config={"cudnn_fmha_backend_config":{"mask_type": "MASK"}}'
)
ATTENTION_HLO = """HloModule m, is_scheduled=true

ENTRY %main (q, k, v) -> bf16[1,32,2048,128] {
  %q = bf16[1,2048,32,128]{3,2,1,0} parameter(0)
  %k = bf16[1,2048,32,128]{3,2,1,0} parameter(1)
  %v = bf16[1,2048,32,128]{3,2,1,0} parameter(2)
  FMHA
  ROOT %out = bf16[1,32,2048,128]{3,2,1,0} get-tuple-element(%fmha), index=0
}
"""


@pytest.mark.parametrize("mask, share", [('"NO_MASK"', 1.0), ('"CAUSAL"', 0.5)])
def test_causal_attention_counts_half(mask, share):
  """4 B H L^2 D FLOPs forward; a causal mask (written `"mask_type": "CAUSAL"`, with a space,
  in the backend config) skips the masked half."""
  hlo = ATTENTION_HLO.replace("FMHA", _FMHA.replace('"MASK"', mask))
  comps, entry = roofline.parse_computations(hlo)
  fmha = next(i for i in comps[entry] if i.name == "fmha")
  assert roofline.is_attention(fmha)
  flops = roofline.instruction_flops(fmha, comps, {})
  assert flops == pytest.approx(share * 4 * 1 * 32 * 2048 * 2048 * 128)


# A GEMM fusion: [M, K] x [K, N] with M = N = K = 4096, operands of dtype DT, an f32 result.
GEMM_HLO = """HloModule m, is_scheduled=true

%gemm (a: DT[4096,4096], b: DT[4096,4096]) -> f32[4096,4096] {
  %a = DT[4096,4096]{1,0} parameter(0)
  %b = DT[4096,4096]{1,0} parameter(1)
  ROOT %dot = f32[4096,4096]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: DT[4096,4096], y: DT[4096,4096]) -> f32[4096,4096] {
  %x = DT[4096,4096]{1,0} parameter(0)
  %y = DT[4096,4096]{1,0} parameter(1)
  ROOT %mm = f32[4096,4096]{1,0} fusion(%x, %y), kind=kCustom, calls=%gemm
}
"""


@pytest.mark.parametrize("dtype, rate", [("bf16", 1.0), ("f32", TF32_OVER_BF16)])
def test_fp32_matmul_runs_at_the_tf32_rate(dtype, rate):
  """2 M N K FLOPs at the bf16 peak, or at half of it (TF32) when an operand is fp32."""
  assert TF32_OVER_BF16 == 0.5  # H100 SXM dense: 494.7 TF32 against 989.4 bf16 TFLOP/s
  moved, seconds = _priced(GEMM_HLO.replace("DT", dtype), "mm")
  flops = 2.0 * 4096**3
  assert seconds == pytest.approx(max(flops / (PEAK * rate), moved / BW))
  assert seconds == pytest.approx(flops / (PEAK * rate))  # compute-bound at these sizes


MOVES_HLO = """HloModule m, is_scheduled=true

%update (buf: f32[64,1024], row: f32[1,1024], i: s32[]) -> f32[64,1024] {
  %buf = f32[64,1024]{1,0} parameter(0)
  %row = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[64,1024]{1,0} dynamic-update-slice(%buf, %row, %i, %zero)
}

%take (stack: bf16[8,512,512], j: s32[]) -> f32[1,512,512] {
  %stack = bf16[8,512,512]{2,1,0} parameter(0)
  %j = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,512,512]{2,1,0} dynamic-slice(%stack, %j, %z, %z), dynamic_slice_sizes={1,512,512}
  ROOT %cv = f32[1,512,512]{2,1,0} convert(%ds)
}

%half (h: f32[256,1024]) -> f32[128,1024] {
  %h = f32[256,1024]{1,0} parameter(0)
  ROOT %sl = f32[128,1024]{1,0} slice(%h), slice={[0:128], [0:1024]}
}

ENTRY %main (b, r, n, s, w) -> f32[64,1024] {
  %b = f32[64,1024]{1,0} parameter(0)
  %r = f32[1,1024]{1,0} parameter(1)
  %n = s32[] parameter(2)
  %s = bf16[8,512,512]{2,1,0} parameter(3)
  %w = f32[256,1024]{1,0} parameter(4)
  %empty = f32[4096,4096]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  %cp = f32[256,1024]{0,1} copy(%w)
  %sliced = f32[1,512,512]{2,1,0} fusion(%s, %n), kind=kLoop, calls=%take
  %top = f32[128,1024]{1,0} fusion(%w), kind=kLoop, calls=%half
  ROOT %upd = f32[64,1024]{1,0} fusion(%b, %r, %n), kind=kLoop, calls=%update
}
"""


def test_allocation_is_free():
  """lax.empty's AllocateBuffer runs no kernel: nothing moves, no time."""
  assert _priced(MOVES_HLO, "empty") == (0.0, 0.0)


def test_copy_is_what_it_reads_and_writes():
  """A layout copy of a [256, 1024] fp32 array reads it and writes it: 2 x 1 MiB."""
  moved, seconds = _priced(MOVES_HLO, "cp")
  assert moved == 2 * 256 * 1024 * 4 and seconds == pytest.approx(moved / BW)


def test_update_in_place_moves_the_update():
  """A dynamic-update-slice of a parameter's buffer writes one [1, 1024] fp32 row in place: the
  row read (4 KiB), the row written (4 KiB), the index (4 bytes); not the 256 KiB buffer."""
  moved, seconds = _priced(MOVES_HLO, "upd")
  assert moved == 1024 * 4 + 1024 * 4 + 4 and seconds == pytest.approx(moved / BW)


def test_slices_read_what_they_take():
  """One layer's [512, 512] bf16 slice of an [8, 512, 512] stack read (512 KiB, not 4 MiB) and
  written as fp32 (1 MiB), plus the index; the first half of a [256, 1024] fp32 array read and
  written (2 x 512 KiB)."""
  moved, _ = _priced(MOVES_HLO, "sliced")
  assert moved == 512 * 512 * 2 + 512 * 512 * 4 + 4
  moved, _ = _priced(MOVES_HLO, "top")
  assert moved == 2 * 128 * 1024 * 4


UNPACK_HLO = """HloModule m, is_scheduled=true

%unpack (a: bf16[1024], b: bf16[3072]) -> bf16[3072] {
  %a = bf16[1024]{0} parameter(0)
  %b = bf16[3072]{0} parameter(1)
  %bucket = bf16[4096]{0} concatenate(%a, %b), dimensions={0}
  ROOT %second = bf16[3072]{0} slice(%bucket), slice={[1024:4096]}
}

ENTRY %main (x, y) -> bf16[3072] {
  %x = bf16[1024]{0} parameter(0)
  %y = bf16[3072]{0} parameter(1)
  ROOT %out = bf16[3072]{0} fusion(%x, %y), kind=kLoop, calls=%unpack
}
"""


def test_unpacking_reads_only_its_part_of_the_bucket():
  """A fusion that slices the second part out of a concatenated bucket reads that part's
  operand alone (6 KiB) and writes it (6 KiB): the first part is not read."""
  moved, _ = _priced(UNPACK_HLO, "out")
  assert moved == 3072 * 2 + 3072 * 2
