"""The cache store's Triton kernels: K norm + RoPE + quantization + paged store, V4 and V4.1
formats. :mod:`..store` launches them and documents what they compute; importing this module
imports Triton (the provider imports it on first use)."""

import triton
import triton.language as tl

from .... import layout

#: Triton reads module globals in a kernel as constexprs only.
_HEAD_DIM, _NOPE_DIM = tl.constexpr(layout.HEAD_DIM), tl.constexpr(layout.NOPE_DIM)
_ROPE_DIM, _TILE = tl.constexpr(layout.ROPE_DIM), tl.constexpr(layout.TILE)
_NUM_TILES, _DATA_BYTES = tl.constexpr(layout.NUM_TILES), tl.constexpr(layout.DATA_BYTES)
_SCALE_BYTES = tl.constexpr(layout.SCALE_BYTES)
_FP8_MAX, _SCALE_MIN, _BIAS = tl.constexpr(layout.FP8_MAX), tl.constexpr(layout.SCALE_MIN), tl.constexpr(layout.UE8M0_BIAS)
_FP4_MAX, _FP4_SCALE_MIN = tl.constexpr(layout.FP4_MAX), tl.constexpr(layout.FP4_SCALE_MIN)


@triton.jit
def _e4m3fn_bits(v, HW: tl.constexpr):
    """float8_e4m3fn bits (int32 in 0..255) of fp32 ``v`` in [-448, 448], round to nearest even:
    ``HW``: the GPU's conversion instruction (SM89+), else in integer arithmetic (the same bits)."""
    if HW:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal (|v| >= 2^-6): round the 23-bit mantissa to 3 bits at bit 20, rebias 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal (|v| < 2^-6, steps of 2^-9): the fp32 add rounds |v| to a multiple of 2^-9,
    # the ulp of 2^14, so the low mantissa bits of the sum are the 3-bit code
    subnormal = (tl.abs(v) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    return sign | tl.where(mag < 0x3C800000, subnormal, normal)  # 0x3C800000 = 2^-6


@triton.jit
def _e4m3fn_saturated(v, HW: tl.constexpr):
    """:func:`_e4m3fn_bits` of finite fp32 ``v`` clamped to [-448, 448]: ``HW``, the conversion
    instruction saturates by itself (``cvt.rn.satfinite``); else clamped first."""
    if not HW:
        v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    return _e4m3fn_bits(v, HW)


@triton.jit
def _bf16_bits(v, HW: tl.constexpr):
    """bfloat16 bits (int32 in 0..65535) of fp32 ``v``, round to nearest even, NaN kept quiet:
    ``HW``: the GPU's conversion instruction, else in integer arithmetic (the same bits but for
    NaN payloads)."""
    if HW:
        return v.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(v != v, 0x7FC0, rounded)


@triton.jit
def _ue8m0_exponent(amax):
    """Smallest int ``e`` with ``2^e >= fp32(max(1e-4, amax) / 448)``, from the quotient's bits.
    (``e`` also follows from ``amax``'s own bits, without the division: ``fp32(a / 448) <= 2^e``
    exactly when ``a <= 448 * 2^e``. That form issues ~14 fewer instructions per token, yet the
    V4 store was 4-6% slower with it on the H200: benchmarks/RESULTS.md, "Cache store".)"""
    scale = tl.div_rn(tl.maximum(amax, _SCALE_MIN), _FP8_MAX)  # IEEE-rounded like the reference
    bits = scale.to(tl.int32, bitcast=True)  # scale > 0: exponent field | mantissa
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _nan_or_fp8(scaled, finite, CLAMP: tl.constexpr, HW: tl.constexpr):
    """float8_e4m3fn bytes (uint8) of ``scaled [BT, N]`` (``CLAMP``: clamped to [-448, 448]
    first); 0x7F for every value of a token that is not ``finite``. ``HW``: the caller has made
    those tokens' values NaN (a NaN scale factor), which the conversion instruction turns into
    0x7F, and the instruction saturates by itself: no select per byte (with one, the compiled code
    unpacks the instruction's byte pairs to select and repack them: ~4 more instructions per
    value). Else a select on the integer path's codes."""
    if HW:
        return _e4m3fn_bits(scaled, True).to(tl.uint8)
    codes = _e4m3fn_saturated(scaled, False) if CLAMP else _e4m3fn_bits(scaled, False)
    return tl.where(finite[:, None], codes, 0x7F).to(tl.uint8)


@triton.jit
def _round_bf16(v, HW: tl.constexpr):
    """fp32 ``v`` rounded to bf16 (nearest even; ``HW``: by the GPU's instruction, else in integer
    arithmetic: exact on every backend), as fp32."""
    if HW:
        return v.to(tl.bfloat16).to(tl.float32)
    return (_bf16_bits(v, False) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _normed(x, weight_ptr, weight_stride, eps, LEN: tl.constexpr):
    """``y = x * rsqrt(mean(x^2) + eps) * w`` of ``x [BT, 512]`` (fp32) without overflow: ``x``
    scaled by an exact ``2^-k`` (max|x| into [2, 4), k clamped to [-63, 126]) and eps by ``4^-k``,
    as the reference does. Returns ``y`` and the per-token factor ``2^-k * rsqrt(...)``."""
    d = tl.arange(0, LEN)
    w = tl.load(weight_ptr + d * weight_stride).to(tl.float32)
    amax_bits = tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True)
    k = tl.minimum(tl.maximum(((amax_bits >> 23) & 0xFF) - 128, -63), 126)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k, exact
    xs = x * inv[:, None]
    # eps arrives as fp32 from an eager launch but as fp64 from Inductor's launcher: fix it to fp32
    # (the reference adds eps to an fp32 tensor, rounding it to fp32 too)
    eps_scaled = tl.cast(eps, tl.float32) * inv * inv
    rstd = tl.rsqrt(tl.sum(xs * xs, axis=1) * (1.0 / LEN) + eps_scaled)
    return xs * rstd[:, None] * w[None, :], inv, rstd


@triton.jit
def _rope_dims(row_ptr, live, weight_ptr, weight_stride, inv, rstd, freqs_ptr, freqs_stride0,
               freqs_stride1, pos, FUSED: tl.constexpr, ROUND: tl.constexpr, BLOCK_T: tl.constexpr,
               HW: tl.constexpr):
    """Dims 448..511 as the store quantizes them, ``[BT, 64]`` fp32: ``FUSED``: normed (the same
    factor as :func:`_normed`), rounded to bf16 if ``ROUND`` (V4.1), interleaved RoPE with
    ``freqs[pos] = (c0, s0, c1, s1, ...)``, rounded to bf16 if ``ROUND``; else the input values."""
    r = tl.arange(0, _ROPE_DIM)
    xr = tl.load(row_ptr[:, None] + _NOPE_DIM + r[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    # (one return, after the branches: the compiler, unlike the interpreter, goes on past a return
    # inside a constexpr branch and would build the fused code for the plain store's operands)
    if FUSED:
        wr = tl.load(weight_ptr + (_NOPE_DIM + r) * weight_stride).to(tl.float32)
        yr = xr * inv[:, None] * rstd[:, None] * wr[None, :]
        if ROUND:
            yr = _round_bf16(yr, HW)
        cs = tl.load(
            freqs_ptr + pos[:, None] * freqs_stride0 + r[None, :] * freqs_stride1, mask=live[:, None], other=0.0,
        )
        a, b = tl.split(tl.reshape(yr, (BLOCK_T, _ROPE_DIM // 2, 2)))
        c, s = tl.split(tl.reshape(cs, (BLOCK_T, _ROPE_DIM // 2, 2)))
        rope = tl.reshape(tl.join(a * c - b * s, a * s + b * c), (BLOCK_T, _ROPE_DIM))
        if ROUND:
            rope = _round_bf16(rope, HW)
    else:
        rope = xr
    return rope


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _all_finite(values, LIMIT: tl.constexpr):
    """Per token (row): every value of columns ``[0, LIMIT)`` finite (their largest magnitude,
    NaN if any is NaN, is below infinity)."""
    a = tl.abs(values)
    if LIMIT < values.shape[1]:
        a = tl.where(tl.arange(0, values.shape[1])[None, :] < LIMIT, a, 0.0)
    return tl.reduce(a, 1, _max_nan) < float("inf")


@triton.jit
def store_kernel(
    kv_ptr, weight_ptr, freqs_ptr, positions_ptr, out_loc_ptr, cache_ptr,
    num_tokens, kv_stride, weight_stride, freqs_stride0, freqs_stride1,
    positions_stride, out_loc_stride, page_stride, eps,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, FUSED: tl.constexpr, HW: tl.constexpr,
):
    """V4 (584-byte tokens): ``FUSED`` (the fused K store) or the plain quantize-and-store;
    ``HW``: fp8 / bf16 rounding by conversion instructions
    (:func:`.common.hardware_conversions`)."""
    # (the token rows are read here, not in a helper: torch's analysis of which pointers a Triton
    # kernel mutates counts a pointer passed to a helper that returns loaded values as written)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] token rows
    slot = tl.load(out_loc_ptr + t * out_loc_stride, mask=t < num_tokens, other=-1).to(tl.int64)
    live = slot >= 0  # negative slots (and rows past the end) write nothing
    pos = tl.load(positions_ptr + t * positions_stride, mask=live, other=0).to(tl.int64)
    page_ptr = cache_ptr + (slot // PAGE_SIZE) * page_stride
    off = slot % PAGE_SIZE
    data_ptr = page_ptr + off * _DATA_BYTES  # [BT] 576-byte data records
    scale_ptr = page_ptr + PAGE_SIZE * _DATA_BYTES + off * _SCALE_BYTES  # [BT] 8-byte scale records
    row_ptr = kv_ptr + t.to(tl.int64) * kv_stride

    d = tl.arange(0, _HEAD_DIM)
    x = tl.load(row_ptr[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    if FUSED:
        y, inv, rstd = _normed(x, weight_ptr, weight_stride, eps, _HEAD_DIM)
    else:
        y, inv, rstd = x, x, x  # (inv, rstd unused)
    rope = _rope_dims(row_ptr, live, weight_ptr, weight_stride, inv, rstd, freqs_ptr, freqs_stride0,
                      freqs_stride1, pos, FUSED, False, BLOCK_T, HW)

    # 8 tiles of 64 (the 8th holds the RoPE dims; its exponent slot becomes the pad byte); each
    # tile's largest magnitude, NaN if it holds a NaN, also gives the finiteness of dims 0..447:
    # a token with a non-finite value (there, or in the RoPE dims) is a NaN token
    tiles = tl.reshape(y, (BLOCK_T, _NUM_TILES + 1, _TILE))
    amax = tl.reduce(tl.abs(tiles), 2, _max_nan)  # [BT, 8]
    kk = tl.arange(0, _NUM_TILES + 1)
    nope_amax = tl.reduce(tl.where(kk[None, :] < _NUM_TILES, amax, 0.0), 1, _max_nan)
    finite = (nope_amax < float("inf")) & _all_finite(rope, _ROPE_DIM)
    e = _ue8m0_exponent(amax)  # (of a NaN token: unused)
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    if HW:  # a NaN factor makes the NaN token's codes (see _nan_or_fp8)
        inv_scale = tl.where(finite[:, None], inv_scale, float("nan"))
    scaled = tl.reshape(tiles * inv_scale[:, :, None], (BLOCK_T, _HEAD_DIM))
    fp8 = _nan_or_fp8(scaled, finite, True, HW)
    nope_mask = live[:, None] & (d[None, :] < _NOPE_DIM)
    tl.store(data_ptr[:, None] + d[None, :], fp8, mask=nope_mask)
    exponent_bytes = tl.where(finite[:, None], e + _BIAS, 0xFF)
    exponent_bytes = tl.where(kk[None, :] < _NUM_TILES, exponent_bytes, 0)
    tl.store(scale_ptr[:, None] + kk[None, :], exponent_bytes.to(tl.uint8), mask=live[:, None])

    # the bf16 codes as little-endian byte pairs: a page stride need not be even (a 2-byte store
    # through a cast pointer faults on the GPU at an odd address)
    code = tl.where(finite[:, None], _bf16_bits(rope, HW), 0x7FC0)
    pairs = tl.join((code & 0xFF).to(tl.uint8), (code >> 8).to(tl.uint8))  # [BT, 64, 2]
    b = tl.arange(0, 2 * _ROPE_DIM)
    tl.store(data_ptr[:, None] + _NOPE_DIM + b[None, :], tl.reshape(pairs, (BLOCK_T, 2 * _ROPE_DIM)),
             mask=live[:, None])


@triton.jit
def _e4m3_value(code):
    """The fp32 value of positive float8_e4m3fn codes (int32), exactly (through fp16 bits)."""
    return ((code & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _v41_fp8(values, finite, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, HW: tl.constexpr):
    """V4.1 FP8 of ``values [BT, WIDTH]``: per group of 32, ``e = ceil(log2(max(amax / 448,
    1e-4)))`` from the quotient's bits; codes ``e4m3(x * 2^-e)`` (RNE, exact scaling), bytes
    ``e + 127``; the codes of a token that is not ``finite`` are 0x7F. Returns ``(codes [BT, WIDTH]``
    (uint8), ``scale bytes [BT, WIDTH // 32]`` (int32))."""
    groups = tl.reshape(values, (BLOCK_T, WIDTH // 32, 32))
    q = tl.maximum(tl.div_rn(tl.max(tl.abs(groups), axis=2), _FP8_MAX), _SCALE_MIN)
    bits = q.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    if HW:  # a NaN factor makes the NaN token's codes (see _nan_or_fp8)
        inv = tl.where(finite[:, None], inv, float("nan"))
    return _nan_or_fp8(tl.reshape(groups * inv[:, :, None], (BLOCK_T, WIDTH)), finite, False, HW), e + _BIAS


@triton.jit
def _v41_fp4(values, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, HW: tl.constexpr, BF16: tl.constexpr):
    """V4.1 FP4 of ``values [BT, WIDTH]`` (fp32; ``BF16``: all bf16 values): per group of 16, scale
    ``s = e4m3(clamp(amax / 6, 2^-9, 448))`` (RNE), codes e2m1 of ``x / s`` (:func:`_e2m1_bytes`).
    Returns ``(data bytes [BT, WIDTH // 2], scale bytes [BT, WIDTH // 16])`` (int32)."""
    groups = tl.reshape(values, (BLOCK_T, WIDTH // 16, 16))
    amax = tl.max(tl.abs(groups), axis=2)
    scale_code = _e4m3fn_saturated(tl.maximum(tl.div_rn(amax, _FP4_MAX), _FP4_SCALE_MIN), HW)
    return _e2m1_bytes(values, _e4m3_value(scale_code), WIDTH, BLOCK_T, BF16), scale_code


@triton.jit
def _e2m1_bytes(values, s, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BF16: tl.constexpr):
    """The e2m1 codes of ``x / s`` rounded to fp32 (IEEE; ties to even, saturating at 6, the sign
    bit kept), as :func:`~dsv4_compile.providers.reference.e2m1_codes` reads them, for the finite fp32
    values ``x`` of ``values [BT, WIDTH]`` (``BF16``: all bf16 values, as the store's are but for a
    plain store of float16 / float32 ``kv``) and their groups' e4m3 scales ``s [BT, WIDTH // 16]``
    in [2^-9, 448], without dividing; two codes a byte (int32 0..255), the even-indexed value's in
    the low nibble.

    A magnitude's code is the number of rounding thresholds ``t`` (0.25, 0.75, 1.25, 1.75, 2.5, 3.5,
    5) it passes (at 0.75, 1.75 and 3.5 a tie rounds up, to the even code), compared as ``t * s``.
    That product is exact, in bf16 too (3 and 4 significant bits), and the compare is the
    quotient's: an ``|x|`` past ``t * s`` is at least an ulp past, which puts the exact quotient more
    than half an fp32 ulp of ``t`` past ``t`` (``s``'s significand is < 2), so ``x / s`` rounds past
    ``t`` too, and ``|x| = t * s`` gives ``t`` exactly.

    Two values' bf16 bits share an int32 and each compare takes both: lane bit 15 of
    ``(t | 0x8000) - |x|`` is set where ``|x|`` is not past ``t`` (no borrow crosses the lanes). A
    value that is not bf16 is compared as the bf16 value below it where a tie passes (``|x| >= t``
    holds just when it does for that one: ``t`` is bf16) and as the one above it where it does not
    (``|x| > t``). The seven flags are a thermometer code, so the count's bits are XORs of them
    (bit 0 all seven, bit 1 those of 0.75, 1.75 and 3.5, bit 2 that of 1.75), taken at bit 15
    without moving each flag. (An IEEE division per value was 27% of the FP4 store's instructions;
    counting the seven compares value by value, the store issued 931 warp-instructions per token on
    SM90 at 128 registers per thread, against 853 at 72 here: ``scripts/store_instructions.py
    --sass``; on the H200, 65536 tokens in 74.4 then 68.4 us.)"""
    even, odd = tl.split(tl.reshape(values, (BLOCK_T, WIDTH // 2, 2)))
    even = even.to(tl.uint32, bitcast=True)
    odd = odd.to(tl.uint32, bitcast=True)
    packed = (even >> 16) | (odd & 0xFFFF0000)
    down = packed & 0x7FFF7FFF  # both magnitudes' bf16 bits (rounded down), ordered as the values
    up = down
    if not BF16:  # the bf16 value above where lower bits are set (a lane's 0x7FFF + 1 only for NaN)
        up = down + ((even & 0xFFFF) != 0).to(tl.uint32) + (((odd & 0xFFFF) != 0).to(tl.uint32) << 16)
    d0 = _flags(up, s, 0.25, 0, WIDTH, BLOCK_T)
    d1 = _flags(down, s, 0.75, 1, WIDTH, BLOCK_T)
    d2 = _flags(up, s, 1.25, 0, WIDTH, BLOCK_T)
    d3 = _flags(down, s, 1.75, 1, WIDTH, BLOCK_T)
    d4 = _flags(up, s, 2.5, 0, WIDTH, BLOCK_T)
    d5 = _flags(down, s, 3.5, 1, WIDTH, BLOCK_T)
    d6 = _flags(up, s, 5.0, 0, WIDTH, BLOCK_T)
    ones = 0xFFFFFFFF  # the flags mark thresholds not passed: their bits are negated
    bit0 = d0 ^ d1 ^ d2 ^ d3 ^ d4 ^ d5 ^ d6 ^ ones
    bit1 = d1 ^ d3 ^ d5 ^ ones
    bit2 = d3 ^ ones
    nibbles = ((packed & 0x80008000) | ((bit2 >> 1) & 0x40004000) | ((bit1 >> 2) & 0x20002000)
               | ((bit0 >> 3) & 0x10001000)) >> 12  # each lane's sign and count at its bits 0..3
    return ((nibbles & 0xF) | ((nibbles >> 12) & 0xF0)).to(tl.int32, bitcast=True)


@triton.jit
def _flags(a, s, T: tl.constexpr, AT: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per 16-bit lane of ``a [BT, WIDTH // 2]`` (pairs of non-negative bf16 values' bits), bit 15
    set where the value is not past (``AT``: not at or past) ``T`` times its group's scale
    ``s [BT, WIDTH // 16]`` (uint32; the lanes' other bits are not meaningful)."""
    t = ((T * s).to(tl.uint32, bitcast=True) >> 16) - AT  # T * s is a bf16 value: its bits
    t = ((t << 16) | t) | 0x80008000
    t, _ = tl.split(tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_T, WIDTH // 16, 16)), (BLOCK_T, WIDTH // 2, 2)))
    return t - a


@triton.jit
def _v41_bytes(values, finite, FP4: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
               HW: tl.constexpr, BF16: tl.constexpr):
    """``values [BT, WIDTH]`` as V4.1 data bytes (``[BT, WIDTH]`` FP8, ``[BT, WIDTH // 2]`` FP4:
    the even-indexed value in the low nibble) and scale bytes, uint8; a token that is not
    ``finite`` gets the NaN token's bytes (FP8: codes 0x7F, scales 0xFF; FP4: codes 0, scales 0x7F)."""
    if FP4:
        data, scales = _v41_fp4(values, WIDTH, BLOCK_T, HW, BF16)
        data = tl.where(finite[:, None], data, 0x00).to(tl.uint8)
        scales = tl.where(finite[:, None], scales, 0x7F)
    else:
        data, scales = _v41_fp8(values, finite, WIDTH, BLOCK_T, HW)
        scales = tl.where(finite[:, None], scales, 0xFF)
    return data, scales.to(tl.uint8)


@triton.jit
def store_v41_kernel(
    kv_ptr, weight_ptr, freqs_ptr, positions_ptr, out_loc_ptr, cache_ptr,
    num_tokens, kv_stride, weight_stride, freqs_stride0, freqs_stride1,
    positions_stride, out_loc_stride, page_stride, eps,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, FUSED: tl.constexpr, FP4: tl.constexpr,
    INTERLEAVED: tl.constexpr, HW: tl.constexpr,
):
    """V4.1 (528-byte FP8 or 288-byte ``FP4`` tokens, block-split or ``INTERLEAVED`` pages):
    ``FUSED``: norm, bf16, RoPE on dims 448..511, bf16, then all 512 dims quantized; else the
    plain quantize-and-store. Dims 0..447 and 448..511 are whole scale groups (448 = 14 x 32 =
    28 x 16), so they are quantized as two tiles: ``[BT, 512]`` (stored up to 448 when fused) and
    the RoPE dims ``[BT, 64]``. Where every value quantized is bf16 (fused, or a bf16 ``kv``) the
    FP4 codes' compares take two at a time (:func:`_e2m1_bytes`)."""
    BF16: tl.constexpr = FUSED or kv_ptr.dtype.element_ty == tl.bfloat16
    DATA: tl.constexpr = _HEAD_DIM // 2 if FP4 else _HEAD_DIM  # bytes per token
    SCALES: tl.constexpr = _HEAD_DIM // 16 if FP4 else _HEAD_DIM // 32
    NOPE_DATA: tl.constexpr = _NOPE_DIM // 2 if FP4 else _NOPE_DIM
    NOPE_SCALES: tl.constexpr = _NOPE_DIM // 16 if FP4 else _NOPE_DIM // 32
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] token rows
    slot = tl.load(out_loc_ptr + t * out_loc_stride, mask=t < num_tokens, other=-1).to(tl.int64)
    live = slot >= 0  # negative slots (and rows past the end) write nothing
    pos = tl.load(positions_ptr + t * positions_stride, mask=live, other=0).to(tl.int64)
    page_ptr = cache_ptr + (slot // PAGE_SIZE) * page_stride
    off = slot % PAGE_SIZE
    if INTERLEAVED:
        data_ptr = page_ptr + off * (DATA + SCALES)
        scale_ptr = data_ptr + DATA
    else:
        data_ptr = page_ptr + off * DATA
        scale_ptr = page_ptr + PAGE_SIZE * DATA + off * SCALES
    row_ptr = kv_ptr + t.to(tl.int64) * kv_stride

    d = tl.arange(0, _HEAD_DIM)
    x = tl.load(row_ptr[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    if FUSED:
        y, inv, rstd = _normed(x, weight_ptr, weight_stride, eps, _HEAD_DIM)
        y = _round_bf16(y, HW)
        rope = _rope_dims(row_ptr, live, weight_ptr, weight_stride, inv, rstd, freqs_ptr, freqs_stride0,
                          freqs_stride1, pos, True, True, BLOCK_T, HW)
        finite = _all_finite(y, _NOPE_DIM) & _all_finite(rope, _ROPE_DIM)
    else:
        y = x
        finite = _all_finite(y, _HEAD_DIM)

    data, scales = _v41_bytes(y, finite, FP4, _HEAD_DIM, BLOCK_T, HW, BF16)
    b = tl.arange(0, DATA)
    g = tl.arange(0, SCALES)
    data_end = NOPE_DATA if FUSED else DATA
    scales_end = NOPE_SCALES if FUSED else SCALES
    tl.store(data_ptr[:, None] + b[None, :], data, mask=live[:, None] & (b[None, :] < data_end))
    tl.store(scale_ptr[:, None] + g[None, :], scales, mask=live[:, None] & (g[None, :] < scales_end))
    if FUSED:  # the RoPE dims' own groups
        rope_data, rope_scales = _v41_bytes(rope, finite, FP4, _ROPE_DIM, BLOCK_T, HW, BF16)
        rb = tl.arange(0, DATA - NOPE_DATA)
        rg = tl.arange(0, SCALES - NOPE_SCALES)
        tl.store(data_ptr[:, None] + NOPE_DATA + rb[None, :], rope_data, mask=live[:, None])
        tl.store(scale_ptr[:, None] + NOPE_SCALES + rg[None, :], rope_scales, mask=live[:, None])
