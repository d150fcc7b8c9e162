"""The RoPE Triton kernel. :mod:`..rope` launches it and documents what it computes; importing
this module imports Triton (the provider imports it on first use)."""

import triton
import triton.language as tl

from .... import layout

#: Triton reads module globals in a kernel as constexprs only.
_PAIRS = tl.constexpr(layout.ROPE_DIM // 2)


@triton.jit
def _nearest(v, BF16: tl.constexpr):
    """fp32 ``v``, rounded to the nearest bf16 (ties to even, NaN kept) if ``BF16``: a value the
    conversion to bf16 then keeps exactly, whether it rounds or truncates."""
    if not BF16:
        return v
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def rope_kernel(
    x, freqs, positions, rows, heads, x_t, x_h, freqs_t, freqs_d, positions_s, tail,
    INVERSE: tl.constexpr, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    t = r // heads
    h = r - t * heads
    pos = tl.load(positions + t.to(tl.int64) * positions_s, mask=live, other=0).to(tl.int64)
    d = tl.arange(0, 2 * _PAIRS)
    mask = live[:, None]
    # the rows' rotated dims and their (cos, sin) pairs as whole tiles (contiguous loads), split
    # into the pairs' first and second members
    dims = (x + t.to(tl.int64) * x_t + h.to(tl.int64) * x_h + tail)[:, None] + d[None, :]
    a, b = tl.split(tl.reshape(tl.load(dims, mask=mask, other=0.0).to(tl.float32), [BLOCK_R, _PAIRS, 2]))
    table = (freqs + pos * freqs_t)[:, None] + (d * freqs_d)[None, :]
    cos, sin = tl.split(tl.reshape(tl.load(table, mask=mask, other=0.0), [BLOCK_R, _PAIRS, 2]))
    if INVERSE:
        sin = -sin
    rotated = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), [BLOCK_R, 2 * _PAIRS])
    tl.store(dims, _nearest(rotated, BF16).to(x.dtype.element_ty), mask=mask)
