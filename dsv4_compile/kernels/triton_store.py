"""Triton kernel for ``dsv4::fused_k_norm_rope_flashmla`` on CUDA and XPU (provider ``"triton"``).

One program stores ``BLOCK_T`` tokens. Per token, in fp32 (docs/design.md §2.1, layout §2.2)::

    y     = x * rsqrt(mean(x^2) + eps) * w                              all 512 dims, overflow-free
                                                                        (reference.rms_norm)
    rope  = (a*c - b*s, a*s + b*c) on pairs (y[448+2i], y[449+2i])      bf16, RNE
    e     = ceil(log2(fp32(max(1e-4, amax(|tile|)) / 448)))             7 tiles of 64, exact
    value = e4m3fn(clamp(y * 2^-e, -448, 448))                          RNE, saturating

a token whose values are not all finite is stored as the NaN token (layout.NAN_DATA_RECORD,
layout.NAN_SCALE_RECORD), as the reference does; written as bytes: the 576-byte data record at ``page*S + off*576``, the 8-byte scale record
(``e + 127`` x 7, then a 0 pad byte) at ``page*S + P*576 + off*8``; negative slots write nothing.

Rounding is done in integer arithmetic on the fp32 bit patterns (no fp8 dtype, no
architecture-specific instruction), so the kernel runs on any GPU Triton targets and produces the
reference's bytes given the same ``y``; ``y`` itself may differ from the reference's in the last
fp32 bit (reduction order, ``rsqrt``), which can move a rounding tie.

Importing this module imports no Triton: the kernel functions below are plain Python until the
provider first loads (:func:`_triton`), which imports Triton and jits them in place; so
``TRITON_INTERPRET`` is read then.

Under ``torch.compile`` the op is decomposed into the Triton launch (a FunctionalTensorMode rule,
the mechanism of ``torch.library.triton_op``), so Inductor launches the kernel from its generated
code, provided the ``triton`` provider serves the device *when the graph is compiled*: the
provider is then bound into the compiled graph (see :func:`inlines`).
"""

from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from .. import checks, dispatch, layout
from . import triton_common

OP = "fused_k_norm_rope_flashmla"
NAME = "triton"
#: Launch geometry: tokens per program (a power of two) and warps per program.
BLOCK_T = 4
NUM_WARPS = 4


# --------------------------------------------------------------------------------------------
# The Triton code: plain functions and ints until _triton() jits them and makes them constexprs.
# --------------------------------------------------------------------------------------------

triton = tl = None  # bound by _triton()
_HEAD_DIM, _NOPE_DIM, _ROPE_DIM, _TILE = layout.HEAD_DIM, layout.NOPE_DIM, layout.ROPE_DIM, layout.TILE
_NUM_TILES, _DATA_BYTES, _SCALE_BYTES = layout.NUM_TILES, layout.DATA_BYTES, layout.SCALE_BYTES
_FP8_MAX, _SCALE_MIN, _BIAS = layout.FP8_MAX, layout.SCALE_MIN, layout.UE8M0_BIAS
_CONSTEXPRS = (
    "_HEAD_DIM", "_NOPE_DIM", "_ROPE_DIM", "_TILE", "_NUM_TILES", "_DATA_BYTES", "_SCALE_BYTES",
    "_FP8_MAX", "_SCALE_MIN", "_BIAS",
)


def _e4m3fn_bits(v):
    """float8_e4m3fn bits (int32 in 0..255) of fp32 ``v`` in [-448, 448], round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal (|v| >= 2^-6): round the 23-bit mantissa to 3 bits at bit 20, rebias 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal (|v| < 2^-6, steps of 2^-9): the fp32 add rounds |v| to a multiple of 2^-9,
    # the ulp of 2^14, so the low mantissa bits of the sum are the 3-bit code
    subnormal = (tl.abs(v) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    return sign | tl.where(mag < 0x3C800000, subnormal, normal)  # 0x3C800000 = 2^-6

def _bf16_bits(v):
    """bfloat16 bits (int32 in 0..65535) of fp32 ``v``, round to nearest even, NaN kept quiet."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(v != v, 0x7FC0, rounded)

def _ue8m0_exponent(amax):
    """Smallest int ``e`` with ``2^e >= fp32(max(1e-4, amax) / 448)``, from the quotient's bits."""
    scale = tl.div_rn(tl.maximum(amax, _SCALE_MIN), _FP8_MAX)  # IEEE-rounded like the reference
    bits = scale.to(tl.int32, bitcast=True)  # scale > 0: exponent field | mantissa
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)

def _store_kernel(
    kv_ptr, weight_ptr, freqs_ptr, positions_ptr, out_loc_ptr, cache_ptr,
    num_tokens, kv_stride, weight_stride, freqs_stride0, freqs_stride1,
    positions_stride, out_loc_stride, page_stride, eps,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] token rows
    slot = tl.load(out_loc_ptr + t * out_loc_stride, mask=t < num_tokens, other=-1).to(tl.int64)
    live = slot >= 0  # negative slots (and rows past the end) write nothing
    pos = tl.load(positions_ptr + t * positions_stride, mask=live, other=0).to(tl.int64)
    page_ptr = cache_ptr + (slot // PAGE_SIZE) * page_stride
    off = slot % PAGE_SIZE
    data_ptr = page_ptr + off * _DATA_BYTES  # [BT] 576-byte data records
    scale_ptr = page_ptr + PAGE_SIZE * _DATA_BYTES + off * _SCALE_BYTES  # [BT] 8-byte scale records
    row_ptr = kv_ptr + t.to(tl.int64) * kv_stride

    # y = x * rsqrt(mean(x^2) + eps) * w over all 512 dims, overflow-free: x scaled by an exact
    # 2^-k (max|x| into [2, 4), k clamped to [-63, 126]) and eps by 4^-k, as the reference does
    d = tl.arange(0, _HEAD_DIM)
    x = tl.load(row_ptr[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + d * weight_stride).to(tl.float32)
    amax_bits = tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True)
    k = tl.minimum(tl.maximum(((amax_bits >> 23) & 0xFF) - 128, -63), 126)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k, exact
    xs = x * inv[:, None]
    # eps arrives as fp32 from an eager launch but as fp64 from Inductor's launcher: fix it to fp32
    # (the reference adds eps to an fp32 tensor, rounding it to fp32 too)
    eps_scaled = tl.cast(eps, tl.float32) * inv * inv
    rstd = tl.rsqrt(tl.sum(xs * xs, axis=1) * (1.0 / _HEAD_DIM) + eps_scaled)
    y = xs * rstd[:, None] * w[None, :]

    # interleaved RoPE on dims 448..511 with freqs[pos] = (c0, s0, c1, s1, ...)
    r = tl.arange(0, _ROPE_DIM)
    xr = tl.load(row_ptr[:, None] + _NOPE_DIM + r[None, :], mask=live[:, None], other=0.0)
    wr = tl.load(weight_ptr + (_NOPE_DIM + r) * weight_stride).to(tl.float32)
    yr = xr.to(tl.float32) * inv[:, None] * rstd[:, None] * wr[None, :]
    cs = tl.load(
        freqs_ptr + pos[:, None] * freqs_stride0 + r[None, :] * freqs_stride1,
        mask=live[:, None], other=0.0,
    )
    a, b = tl.split(tl.reshape(yr, (BLOCK_T, _ROPE_DIM // 2, 2)))
    c, s = tl.split(tl.reshape(cs, (BLOCK_T, _ROPE_DIM // 2, 2)))
    rope = tl.reshape(tl.join(a * c - b * s, a * s + b * c), (BLOCK_T, _ROPE_DIM))

    # a token with a non-finite value (dims 0..447 of y, or the rotated RoPE dims) is a NaN token
    nope_ok = (y == y) & (tl.abs(y) != float("inf")) | (d[None, :] >= _NOPE_DIM)
    rope_ok = (rope == rope) & (tl.abs(rope) != float("inf"))
    finite = (tl.min(nope_ok.to(tl.int32), axis=1) * tl.min(rope_ok.to(tl.int32), axis=1)) != 0

    # 8 tiles of 64 (the 8th holds the RoPE dims; its exponent slot becomes the pad byte)
    tiles = tl.reshape(y, (BLOCK_T, _NUM_TILES + 1, _TILE))
    e = _ue8m0_exponent(tl.max(tl.abs(tiles), axis=2))  # [BT, 8]
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    scaled = tl.reshape(tiles * inv_scale[:, :, None], (BLOCK_T, _HEAD_DIM))
    fp8 = _e4m3fn_bits(tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX))
    fp8 = tl.where(finite[:, None], fp8, 0x7F)
    nope_mask = live[:, None] & (d[None, :] < _NOPE_DIM)
    tl.store(data_ptr[:, None] + d[None, :], fp8.to(tl.uint8), mask=nope_mask)
    kk = tl.arange(0, _NUM_TILES + 1)
    exponent_bytes = tl.where(finite[:, None], e + _BIAS, 0xFF)
    exponent_bytes = tl.where(kk[None, :] < _NUM_TILES, exponent_bytes, 0)
    tl.store(scale_ptr[:, None] + kk[None, :], exponent_bytes.to(tl.uint8), mask=live[:, None])

    code = tl.where(finite[:, None], _bf16_bits(rope), 0x7FC0)
    rope_bytes = tl.reshape(tl.join(code & 0xFF, code >> 8), (BLOCK_T, 2 * _ROPE_DIM))  # little-endian
    rb = tl.arange(0, 2 * _ROPE_DIM)
    tl.store(data_ptr[:, None] + _NOPE_DIM + rb[None, :], rope_bytes.to(tl.uint8), mask=live[:, None])


_JITTED = ("_e4m3fn_bits", "_bf16_bits", "_ue8m0_exponent", "_store_kernel")
def _triton():
    """Import Triton and jit this module's kernels in place, once (:mod:`.triton_common`)."""
    return triton_common.jit_in_place(globals(), _CONSTEXPRS, _JITTED)


def _launch(kernel, kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size) -> None:
    """Launch ``kernel`` (the jitted kernel, its ``triton_common.eager`` launcher, or it wrapped by
    ``wrap_triton``) over all tokens."""
    num_tokens = kv.shape[0]
    if num_tokens == 0:
        return
    kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        kv, kv_weight, freqs, positions, out_loc, kvcache,
        num_tokens, kv.stride(0), kv_weight.stride(0), freqs.stride(0), freqs.stride(1),
        positions.stride(0), out_loc.stride(0), kvcache.stride(0), eps,
        PAGE_SIZE=page_size, BLOCK_T=BLOCK_T, num_warps=NUM_WARPS,
    )


def fused_k_norm_rope_flashmla(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size):
    """The provider kernel (eager) on validated arguments: one launch, no host sync."""
    _triton()
    with triton_common.device_guard(kv.device):
        _launch(triton_common.eager(_store_kernel), kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size)


def load(device: torch.device) -> dict:
    """Provider loader: the kernel, or :class:`~dsv4_compile.dispatch.ProviderUnavailable` saying why."""
    triton_common.require_device(_triton(), _store_kernel, device, "store")
    return {OP: fused_k_norm_rope_flashmla}


def register() -> None:
    """Register the store's ``triton`` entries for ``"cuda"`` and ``"xpu"`` (idempotent; imports nothing)."""
    for device_type in triton_common.DEVICE_TYPES:
        dispatch.register_provider(dispatch.Provider(NAME, device_type, load, ops=(OP,), fallback=True))


register()


# --------------------------------------------------------------------------------------------
# Inductor visibility: decompose the op into the Triton launch under functionalization.
# --------------------------------------------------------------------------------------------


def inlines(device: torch.device) -> bool:
    """Whether ``torch.compile`` traces the op on ``device`` into a visible Triton launch.

    True when, at compile time, the provider serving the op on ``device`` (under the current
    :func:`~dsv4_compile.use_provider` override) runs this module's kernel, compiled (not
    ``TRITON_INTERPRET``), and :func:`.triton_common.inlining_allowed`. The graph then launches the
    kernel directly: a provider override or checked mode set *after* compiling does not reach it
    (recompile, e.g. after ``torch._dynamo.reset()``). The compile caches' key includes whether
    inlining is possible now (:func:`.triton_common.register_cache_key`), so a cached inlined graph
    is not reused by a compile made under an override. Otherwise the op stays an opaque call that
    resolves its provider when it runs.
    """
    if not triton_common.inlining_allowed(device):
        return False
    try:
        if dispatch.resolve(OP, device)[1] is not fused_k_norm_rope_flashmla:
            return False
    except dispatch.ProviderUnavailable:  # e.g. a forced provider that does not serve the device
        return False
    return not triton_common.interpreting(_store_kernel)  # interpreted kernels cannot be traced


def _functional_rule(mode, op, types, args, kwargs):
    """FunctionalTensorMode rule: run the launch through ``wrap_triton`` so it enters the graph."""
    symbolic = not all(isinstance(n, int) for n in args[0].shape)
    if symbolic or not triton_common.may_trace(types) or not inlines(args[0].device):
        # A symbolic token count keeps the opaque op: a graph traced with one gave wrong cache
        # bytes on the H200 at 1025 tokens (correct at 37 and 300), static graphs are exact.
        return mode.__torch_dispatch__(op, types, args, kwargs)
    with mode:
        checks.check_store(*args)
        _launch(torch.library.wrap_triton(_store_kernel), *args)
    return None


_lib = torch.library.Library("dsv4", "FRAGMENT")
torch.library.register_torch_dispatch(f"dsv4::{OP}", FunctionalTensorMode, _functional_rule, lib=_lib)
triton_common.register_cache_key(OP, triton_common.InlinedKernels(inlines, ("_store_kernel",), globals()))
