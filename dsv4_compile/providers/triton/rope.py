"""``dsv4::rope_`` in Triton (``triton``, CUDA and XPU): the RoPE of a tensor's last 64 dims, in place.

A *row* is one vector of ``x [T, D]`` or ``x [T, H, D]`` (token ``t``, head ``h``); a program
rotates :data:`ROWS` rows. It reads and writes only the rotated dims ``D - 64 .. D - 1`` of each
row (one contiguous tile of them, and the row's ``(cos, sin)`` pairs from ``freqs`` at its
token's position), so the cost follows ``T * H * 64`` elements, not the full width.

The arithmetic is the reference's (:func:`.reference.rope`): float32, ``a' = a c - b s``,
``b' = a s + b c`` (inverse: ``s -> -s``), each product and sum rounded on its own (the launch
turns off the compiler's multiply-add contraction), then one rounding to ``x``'s dtype, to
nearest even (bf16 in integer arithmetic: Triton's interpreter truncates). So a row's bits equal
the reference's.
"""

from __future__ import annotations

import torch

from ... import dispatch, layout
from . import common as triton_common

NAME = "triton"
OP = "rope_"
#: Rows per program and warps: 16 rows x 64 dims, 8 dims per thread.
ROWS = 16
NUM_WARPS = 4

triton = tl = None  # bound by _triton()
_PAIRS = layout.ROPE_DIM // 2
_CONSTEXPRS = ("_PAIRS",)


def _nearest(v, BF16: tl.constexpr):
    """fp32 ``v``, rounded to the nearest bf16 (ties to even, NaN kept) if ``BF16``: a value the
    conversion to bf16 then keeps exactly, whether it rounds or truncates."""
    if not BF16:
        return v
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


def _rope_kernel(
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


_JITTED = ("_nearest", "_rope_kernel")


def _triton():
    """Import Triton and jit this module's kernel in place, once (:mod:`.common`)."""
    return triton_common.jit_in_place(globals(), _CONSTEXPRS, _JITTED)


def rope_(x, freqs, positions, inverse=False):
    """``dsv4::rope_`` on validated arguments: one launch, no host sync."""
    _triton()
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    if rows == 0:
        return
    x_stride, freqs_stride = x.stride(), freqs.stride()
    with triton_common.device_guard(x.device):
        triton_common.eager(_rope_kernel)[(-(-rows // ROWS),)](
            x, freqs, positions, rows, heads, x_stride[0], x_stride[1] if x.dim() == 3 else 0,
            freqs_stride[0], freqs_stride[1], positions.stride()[0], x.shape[-1] - layout.ROPE_DIM,
            INVERSE=inverse, BF16=x.dtype == torch.bfloat16, BLOCK_R=ROWS, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )


def load(device: torch.device) -> dict:
    """Provider loader: the kernel, or :class:`~dsv4_compile.dispatch.ProviderUnavailable` saying why."""
    triton_common.require_device(_triton(), _rope_kernel, device, "rope")
    return {OP: rope_}


def register() -> None:
    """Register the ``triton`` entry of ``rope_`` for ``"cuda"`` and ``"xpu"`` (idempotent; imports nothing)."""
    for device_type in triton_common.DEVICE_TYPES:
        dispatch.register_provider(dispatch.Provider(NAME, device_type, load, ops=(OP,), fallback=True))


register()
