"""The sparse decode (with its combine) and sparse prefill Triton kernels. :mod:`..attention`
launches them and documents what they compute; importing this module imports Triton (the provider
imports it on first use)."""

import math

import triton
import triton.language as tl

from .... import layout

try:  # griddepcontrol (SM90+), traced only where a launch asks for it (``PDL``)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton build without them (older, or without NVIDIA's extras)
    gdc_launch_dependents = gdc_wait = None
#: Whether this Triton can launch the decode kernels as programmatic dependent launches.
PDL_AVAILABLE = gdc_wait is not None

#: Triton reads module globals in a kernel as constexprs only.
_NOPE, _ROPE, _D, _TILE = (tl.constexpr(v) for v in (layout.NOPE_DIM, layout.ROPE_DIM, layout.HEAD_DIM, layout.TILE))
_DATA_BYTES, _SCALE_BYTES = tl.constexpr(layout.DATA_BYTES), tl.constexpr(layout.SCALE_BYTES)
_LN2, _LOG2E = tl.constexpr(math.log(2.0)), tl.constexpr(math.log2(math.e))
#: the key's column pieces: [0, 256) [256, 384) [384, 448) [448, 512)
_C0, _C1, _C2, _C3 = tl.constexpr(0), tl.constexpr(256), tl.constexpr(384), tl.constexpr(448)


@triton.jit
def _records(
    cache_ptr, slot, page_size, page_shift, page_stride,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, INTERLEAVED: tl.constexpr, POW2: tl.constexpr,
):
    """Byte pointers of the data and scale records of ``slot`` (valid slots) in a paged cache whose
    tokens are ``DATA_BYTES`` then ``SCALE_BYTES``, block-split or ``INTERLEAVED``. ``POW2``: the
    page size is ``2^page_shift`` (a shift and a mask instead of an integer division)."""
    if POW2:
        page = slot >> page_shift
        offset = (slot & (page_size - 1)).to(tl.int64)
    else:
        page = slot // page_size
        offset = (slot - page * page_size).to(tl.int64)
    base = cache_ptr + page.to(tl.int64) * page_stride
    if INTERLEAVED:
        data = base + offset * (DATA_BYTES + SCALE_BYTES)
        return data, data + DATA_BYTES
    return base + offset * DATA_BYTES, base + page_size * DATA_BYTES + offset * SCALE_BYTES


@triton.jit
def _e4m3_values(code, HW: tl.constexpr):
    """float8_e4m3fn codes (uint8) as fp32 values, exactly: ``HW``, by the GPU's conversion
    instruction; else through fp16 bits, as the value times ``2^-8`` (which :func:`_ue8m0_scale`
    and :func:`_e4m3_scale` undo) and 480 * 2^-8 for the NaN codes 0x7F / 0xFF, whose tokens'
    scales carry the NaN there (:data:`~dsv4_compile.layout.NAN_SCALE_RECORD`)."""
    if HW:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    code = code.to(tl.int32)
    half = (((code & 0x80) << 8) | ((code & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32)


@triton.jit
def _ue8m0_scale(e, HW: tl.constexpr):
    """UE8M0 bytes ``e`` (uint8) as the factor of :func:`_e4m3_values`' values (``HW`` alike):
    ``2^(e - 127)`` as the reference reads it (0 for ``e = 0``, inf for the NaN byte 255);
    without ``HW`` times ``2^8``, NaN for 255, and inf for 247..254 (factors of ``2^120`` and up,
    past what a store of finite fp32 values writes)."""
    e = e.to(tl.int32)
    if HW:
        return (e << 23).to(tl.float32, bitcast=True)
    scale = tl.where(e < 247, ((e + 8) << 23).to(tl.float32, bitcast=True), float("inf"))
    return tl.where(e == 0, 0.0, tl.where(e == 255, float("nan"), scale))


@triton.jit
def _e4m3_scale(code, HW: tl.constexpr):
    """e4m3 scale bytes (uint8) as fp32 values, exactly: NaN for the NaN codes 0x7F / 0xFF."""
    if HW:
        return _e4m3_values(code, HW)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), _e4m3_values(code, HW) * 256.0)


@triton.jit
def _e2m1_values(code):
    """e2m1 codes (int32 0..15, bit 3 the sign) as fp32 values times 2^-14, exactly: the three
    magnitude bits as an fp16's bits 11..9 (exponent low bits and the mantissa's top bit) and the
    sign as bit 15 read 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2^-14 (0.5: the subnormal 2^-15),
    as the integer fp8 path does for e4m3 (:func:`_e4m3_values`)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp8_piece(
    data, scales, valid, OFF: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr, HW: tl.constexpr,
):
    """Dims ``OFF .. OFF+WIDTH`` of keys stored as e4m3 values, one UE8M0 scale per ``GROUP``
    values (V4 dims 0..447: 64; V4.1 FP8: 32), whose data / scale records start at the byte
    pointers ``data`` / ``scales [BN]``: ``[BN, WIDTH]`` bf16, exact; 0 where not ``valid``."""
    code = tl.load(data[:, None] + (tl.arange(0, WIDTH) + OFF)[None, :], mask=valid[:, None], other=0)
    g = tl.arange(0, WIDTH // GROUP) + OFF // GROUP
    e = tl.load(scales[:, None] + g[None, :], mask=valid[:, None], other=0)
    value = tl.reshape(_e4m3_values(code, HW), (data.shape[0], WIDTH // GROUP, GROUP))
    value = value * _ue8m0_scale(e, HW)[:, :, None]
    return tl.reshape(value, (data.shape[0], WIDTH)).to(tl.bfloat16)


@triton.jit
def _bf16_piece(data, valid):
    """V4 dims 448..511 (the bf16 RoPE values) of the keys at ``data``: ``[BN, 64]`` bf16.
    Read as bytes, so any page stride (odd ones too) is fine."""
    b = tl.arange(0, 2 * _ROPE)
    byte = tl.load(data[:, None] + (b + _NOPE)[None, :], mask=valid[:, None], other=0)
    lo, hi = tl.split(tl.reshape(byte.to(tl.int32), (data.shape[0], _ROPE, 2)))
    return (lo | (hi << 8)).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp4_piece(data, scales, valid, OFF: tl.constexpr, WIDTH: tl.constexpr, HW: tl.constexpr):
    """V4.1 FP4 dims ``OFF .. OFF+WIDTH``: e2m1 values (two per byte, the even one in the low
    nibble) times their e4m3 scale (one per 16): ``[BN, WIDTH]`` bf16, exact."""
    b = tl.arange(0, WIDTH // 2) + OFF // 2
    byte = tl.load(data[:, None] + b[None, :], mask=valid[:, None], other=0).to(tl.int32)
    code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (data.shape[0], WIDTH))  # value 2i, 2i+1
    g = tl.arange(0, WIDTH // 16) + OFF // 16
    scale = _e4m3_scale(tl.load(scales[:, None] + g[None, :], mask=valid[:, None], other=0), HW) * 16384.0
    value = tl.reshape(_e2m1_values(code), (data.shape[0], WIDTH // 16, 16)) * scale[:, :, None]  # 2^-14 * 2^14
    return tl.reshape(value, (data.shape[0], WIDTH)).to(tl.bfloat16)


@triton.jit
def _piece(data, scales, valid, OFF: tl.constexpr, WIDTH: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    """Dims ``OFF .. OFF+WIDTH`` of the keys at ``data`` / ``scales`` of a format-``FMT`` cache
    (0: V4, 1: V4.1 FP8, 2: V4.1 FP4): ``[BN, WIDTH]`` bf16, exact; a V4 piece lies within dims
    0..447 (fp8) or is dims 448..511 (bf16)."""
    if FMT == 0:
        if OFF == _NOPE:
            return _bf16_piece(data, valid)
        return _fp8_piece(data, scales, valid, OFF, WIDTH, _TILE, HW)
    elif FMT == 1:
        return _fp8_piece(data, scales, valid, OFF, WIDTH, 32, HW)
    else:
        return _fp4_piece(data, scales, valid, OFF, WIDTH, HW)


@triton.jit
def _online_softmax(s, valid, m, l, scale_log2):
    """One step of the online softmax over scores ``s [BH, BN]`` (raw dot products): returns
    the bf16 weights ``p``, the rescale ``alpha`` of what was accumulated, new ``m`` and ``l``
    (base 2: ``m`` the running max of ``scale*log2(e)*s``, ``l = sum 2^(s2 - m)``)."""
    s = tl.where(valid[None, :], s * scale_log2, -float("inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # no key yet: keep everything 0
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return p.to(tl.bfloat16), alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def _attend(
    acc0, acc1, acc2, acc3, m, l, q0, q1, q2, q3, j0, j1, scale_log2,
    cache_ptr, page_size, page_shift, page_stride, idx_ptr, idx_stride,
    FMT: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, INTERLEAVED: tl.constexpr,
    POW2: tl.constexpr, BLOCK_N: tl.constexpr, HW: tl.constexpr, STAGES: tl.constexpr,
):
    """Accumulate the keys of index entries ``[j0, j1)`` of one cache: format ``FMT`` (0: V4,
    1: V4.1 FP8, 2: V4.1 FP4), tokens of ``DATA_BYTES`` then ``SCALE_BYTES``, ``INTERLEAVED`` or
    block-split pages of ``page_size`` (``2^page_shift`` if ``POW2``) tokens. Queries, keys and
    outputs in the four column pieces ``_C0 .. _C3``: each key piece is dequantized, multiplied
    into the scores and later into its output piece, and never concatenated with the others
    (a whole ``[BN, 512]`` tile in registers spilled on SM90). Nothing is hoisted out of the loop
    (``disable_licm``): hoisted, the MMAs' shared-memory descriptors and the per-block address
    terms lived across the loop, were spilled (664 stack bytes per thread on SM90) and reloaded
    every block; recomputed, nothing spills and a block issues 11-12% fewer instructions (SM90;
    H200: 1.18-1.23x the decode at T = 8 .. 256). Each block's index entries are loaded one block
    ahead, so a block does not start by waiting for them."""
    j = j0 + tl.arange(0, BLOCK_N)
    ahead = tl.load(idx_ptr + j * idx_stride, mask=j < j1, other=-1)
    for b0 in tl.range(j0, j1, BLOCK_N, num_stages=STAGES, disable_licm=True):
        slot = ahead
        j = b0 + BLOCK_N + tl.arange(0, BLOCK_N)
        ahead = tl.load(idx_ptr + j * idx_stride, mask=j < j1, other=-1)
        valid = slot >= 0  # -1: a hole (other negatives are undefined: skipped too)
        slot = tl.where(valid, slot, 0)
        data, scales = _records(
            cache_ptr, slot, page_size, page_shift, page_stride, DATA_BYTES, SCALE_BYTES, INTERLEAVED, POW2,
        )
        k0 = _piece(data, scales, valid, _C0, _C1 - _C0, FMT, HW)
        k1 = _piece(data, scales, valid, _C1, _C2 - _C1, FMT, HW)
        k2 = _piece(data, scales, valid, _C2, _C3 - _C2, FMT, HW)
        k3 = _piece(data, scales, valid, _C3, _D - _C3, FMT, HW)
        scores = tl.dot(q3, tl.trans(k3), tl.dot(q2, tl.trans(k2), tl.dot(q1, tl.trans(k1), tl.dot(q0, tl.trans(k0)))))
        p, alpha, m, l = _online_softmax(scores, valid, m, l, scale_log2)
        acc0 = tl.dot(p, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(p, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(p, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(p, k3, acc3 * alpha[:, None])
    return acc0, acc1, acc2, acc3, m, l


@triton.jit
def _lse2_and_inverse(m, l):
    """Base-2 ``lse = m + log2(l)`` (-inf where no key counted, ``l = 0``) and ``1 / l`` (0 there);
    NaN both where a NaN score made ``l`` NaN."""
    empty = l == 0
    safe = tl.where(empty, 1.0, l)
    return tl.where(empty, -float("inf"), m + tl.log2(safe)), tl.where(empty, 0.0, 1.0 / safe)


@triton.jit
def _sink_and_lse(lse2, sink_ptr, sink_stride, h, h_mask, HAS_SINK: tl.constexpr):
    """From the base-2 log-sum-exp ``lse2 [BH]`` (-inf: no key): the factor ``out`` gets
    (``1 / (1 + e^(sink - lse))``; 0 for an empty row) and the natural ``lse`` (+inf if empty)."""
    empty = lse2 == -float("inf")
    factor = tl.where(empty, 0.0, 1.0)
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + h * sink_stride, mask=h_mask, other=0.0) * _LOG2E
        factor = tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp2(sink2 - tl.where(empty, 0.0, lse2))))
    return factor, tl.where(empty, float("inf"), lse2 * _LN2)


@triton.jit
def _final_factor(lse_at, lse2, inv_l, sink_ptr, sink_stride, h, h_mask, HAS_SINK: tl.constexpr, lse_mask):
    """Store the natural ``lse`` at the pointers ``lse_at`` where ``lse_mask``; return the factor
    of the accumulated output: ``out = acc * inv_l * sigmoid(lse - sink)``."""
    factor, lse = _sink_and_lse(lse2, sink_ptr, sink_stride, h, h_mask, HAS_SINK)
    tl.store(lse_at, lse, mask=lse_mask)
    return inv_l * factor


@triton.jit
def _store_columns(ptr, at, d, h_mask, value):
    """``value [BH, len(d)]`` at columns ``d`` of the 512-wide rows at flat index ``at``."""
    tl.store(ptr + at[:, None] * _D + d[None, :], value.to(ptr.dtype.element_ty), mask=h_mask[:, None])


@triton.jit
def _store_pieces(ptr, at, h_mask, acc0, acc1, acc2, acc3, factor):
    """The four column pieces of :func:`_attend`'s output, times ``factor [BH]``."""
    _store_columns(ptr, at, tl.arange(0, _C1 - _C0) + _C0, h_mask, acc0 * factor[:, None])
    _store_columns(ptr, at, tl.arange(0, _C2 - _C1) + _C1, h_mask, acc1 * factor[:, None])
    _store_columns(ptr, at, tl.arange(0, _C3 - _C2) + _C2, h_mask, acc2 * factor[:, None])
    _store_columns(ptr, at, tl.arange(0, _D - _C3) + _C3, h_mask, acc3 * factor[:, None])


@triton.jit
def _store_final(
    out_ptr, lse_at, at, d, h, h_mask, acc, lse2, inv_l, sink_ptr, sink_stride, HAS_SINK: tl.constexpr, lse_mask,
):
    """``out = acc * inv_l * sigmoid(lse - sink)`` at flat (row, head) ``at``, columns ``d``; the
    natural ``lse`` at the pointers ``lse_at`` where ``lse_mask``."""
    factor = _final_factor(lse_at, lse2, inv_l, sink_ptr, sink_stride, h, h_mask, HAS_SINK, lse_mask)
    _store_columns(out_ptr, at, d, h_mask, acc * factor[:, None])


@triton.jit
def _counted(n, x_n, width, x_width, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_X_LEN: tl.constexpr):
    """The counted entries ``[0, n)`` of the main indices and ``[0, x_n)`` of the extra ones, from
    the lengths ``n`` / ``x_n`` as loaded (read only where ``HAS_LEN`` / ``HAS_X_LEN``; scalars or
    vectors). The loads stay in the kernel: a pointer passed to a function on the way to a store's
    address reads to torch's mutation analysis as written."""
    if HAS_LEN:
        n = tl.minimum(tl.maximum(n, 0), width)
    else:
        n = width
    if HAS_EXTRA:
        if HAS_X_LEN:
            x_n = tl.minimum(tl.maximum(x_n, 0), x_width)
        else:
            x_n = x_width
    else:
        x_n = 0
    return n, x_n


@triton.jit
def _longest_first(p, blocks, live, BINS: tl.constexpr):
    """The row of rank ``p`` when the rows (``live`` entries of ``blocks``, each row's key block
    count ``< BINS``) are ordered by their block counts, most first, ties by row: a counting sort,
    which each program runs for itself (O(rows), no launch, no sync)."""
    key = (BINS - 1) - blocks  # ascending: most blocks first
    count = tl.histogram(key, BINS, mask=live)
    before = tl.cumsum(count, 0) - count  # rows of smaller keys
    here = (before <= p) & (p < before + count)
    k = tl.sum(tl.where(here, tl.arange(0, BINS), 0), 0)
    nth = p - tl.sum(tl.where(here, before, 0), 0)
    same = live & (key == k)
    rank = tl.cumsum(same.to(tl.int32), 0)
    return tl.sum(tl.where(same & (rank == nth + 1), tl.arange(0, blocks.shape[0]), 0), 0)


@triton.jit
def decode_kernel(
    q_ptr, q_sb, q_ss, q_sh, q_sd,
    cache_ptr, page_size, page_shift, page_stride, idx_ptr, idx_sb, idx_ss, idx_sj, width, len_ptr, len_sb,
    x_cache_ptr, x_page_size, x_page_shift, x_page_stride, x_idx_ptr, x_idx_sb, x_idx_ss, x_idx_sj, x_width,
    x_len_ptr, x_len_sb,
    sink_ptr, sink_stride, out_ptr, lse_ptr, lse_sb, lse_ss, lse_sh, part_ptr, part_lse_ptr,
    rows, s_q, heads, num_splits, split_keys, wave, scale_log2,
    HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_X_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr, PARTIAL: tl.constexpr, INVARIANT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, INTERLEAVED: tl.constexpr,
    POW2: tl.constexpr, X_FMT: tl.constexpr, X_DATA_BYTES: tl.constexpr, X_SCALE_BYTES: tl.constexpr,
    X_INTERLEAVED: tl.constexpr, X_POW2: tl.constexpr, HW: tl.constexpr, STAGES: tl.constexpr,
    X_STAGES: tl.constexpr, ORDER: tl.constexpr, ORDER_ROWS: tl.constexpr, ORDER_BINS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, head block, split). ``PARTIAL`` 1: write the normalised partial output and
    base-2 lse to the workspace ``[rows, num_splits, heads, (512)]``; 0: the final outputs;
    2: decide at run time (``num_splits > 1``), for a split count that is symbolic when traced.
    ``INVARIANT`` (the batch-invariant mode): a row's splits are ``split_keys`` entries each of its
    virtual list, as many as its lengths need (:func:`_row_splits`), whatever ``num_splits`` (the
    launch's, for the widest row); a row of one split writes the final outputs, a longer one its
    partial results, and the programs past a row's splits return at once.
    ``POW2`` / ``X_POW2``: the main / extra page size is a power of two (``2^page_shift``);
    ``HW``: fp8 by conversion instructions (:func:`.common.hardware_conversions`).
    ``ORDER`` (:func:`decode_order`) 1: program ``i`` takes the row of rank ``i`` longest first;
    2: so if at run time one split per row leaves more rows than one ``wave`` of programs.
    ``PDL`` (launched as a programmatic dependent launch): wait for the previous kernel before any
    memory access, then let the next one (the combine) be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor's launcher passes Python floats as fp64
    row = tl.program_id(0)
    # constexpr for ORDER 0 / 1 (the `or` / `and` short-circuit on them), a run-time test for 2
    if ORDER == 1 or (ORDER == 2 and ((num_splits == 1) & (rows > wave) & (rows <= ORDER_ROWS))):
        r = tl.arange(0, ORDER_ROWS)
        live = r < rows
        n_r, x_n_r = _counted(tl.load(len_ptr + (r // s_q) * len_sb, mask=live & HAS_LEN, other=0),
                              tl.load(x_len_ptr + (r // s_q) * x_len_sb, mask=live & HAS_X_LEN, other=0),
                              width, x_width, HAS_LEN, HAS_EXTRA, HAS_X_LEN)
        row = _longest_first(row, tl.cdiv(n_r, BLOCK_N) + tl.cdiv(x_n_r, BLOCK_N), live, ORDER_BINS)
    split = tl.program_id(2)
    b = row // s_q
    s = row - b * s_q
    # the row's counted entries: [0, n) of the main indices, then [0, x_n) of the extra ones
    n, x_n = _counted(tl.load(len_ptr + b * len_sb, mask=HAS_LEN, other=0),
                      tl.load(x_len_ptr + b * x_len_sb, mask=HAS_X_LEN, other=0),
                      width, x_width, HAS_LEN, HAS_EXTRA, HAS_X_LEN)
    # the virtual list: the main entries padded to whole key blocks, then the extra ones, so that
    # every key block of a split lies in one cache (no split pays a partial block on both sides)
    n_pad = tl.cdiv(n, BLOCK_N) * BLOCK_N
    if INVARIANT:  # fixed splits of the row's own list
        chunk = split_keys
        row_splits = _row_splits(n, x_n, split_keys, BLOCK_N)
        if split >= row_splits:
            return
    else:  # num_splits equal splits of whole key blocks
        chunk = tl.cdiv(tl.cdiv(n_pad + x_n, num_splits), BLOCK_N) * BLOCK_N
        row_splits = num_splits
    v0 = split * chunk
    v1 = tl.minimum(v0 + chunk, n_pad + x_n)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    q_row = q_ptr + b.to(tl.int64) * q_sb + s.to(tl.int64) * q_ss + h[:, None] * q_sh
    q0 = tl.load(q_row + (tl.arange(0, _C1 - _C0) + _C0)[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    q1 = tl.load(q_row + (tl.arange(0, _C2 - _C1) + _C1)[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    q2 = tl.load(q_row + (tl.arange(0, _C3 - _C2) + _C2)[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    q3 = tl.load(q_row + (tl.arange(0, _D - _C3) + _C3)[None, :] * q_sd, mask=h_mask[:, None], other=0.0)

    acc0 = tl.zeros((BLOCK_H, _C1 - _C0), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_H, _C2 - _C1), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_H, _C3 - _C2), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_H, _D - _C3), dtype=tl.float32)
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    idx_row = idx_ptr + b.to(tl.int64) * idx_sb + s.to(tl.int64) * idx_ss
    x_idx_row = x_idx_ptr + b.to(tl.int64) * x_idx_sb + s.to(tl.int64) * x_idx_ss
    # the split's part of the main entries, then of the extra ones (each cache has its own format)
    acc0, acc1, acc2, acc3, m, l = _attend(
        acc0, acc1, acc2, acc3, m, l, q0, q1, q2, q3, v0, tl.minimum(v1, n), scale_log2,
        cache_ptr, page_size, page_shift, page_stride, idx_row, idx_sj,
        FMT, DATA_BYTES, SCALE_BYTES, INTERLEAVED, POW2, BLOCK_N, HW, STAGES,
    )
    if HAS_EXTRA:
        acc0, acc1, acc2, acc3, m, l = _attend(
            acc0, acc1, acc2, acc3, m, l, q0, q1, q2, q3, tl.maximum(v0, n_pad) - n_pad, v1 - n_pad, scale_log2,
            x_cache_ptr, x_page_size, x_page_shift, x_page_stride, x_idx_row, x_idx_sj,
            X_FMT, X_DATA_BYTES, X_SCALE_BYTES, X_INTERLEAVED, X_POW2, BLOCK_N, HW, X_STAGES,
        )

    lse2, inv_l = _lse2_and_inverse(m, l)
    part_at = (row.to(tl.int64) * num_splits + split) * heads + h
    out_at = row.to(tl.int64) * heads + h
    lse_at = lse_ptr + b.to(tl.int64) * lse_sb + s.to(tl.int64) * lse_ss + h * lse_sh
    # several splits: the split's normalised output acc / l and base-2 lse; one: the final outputs
    partial = PARTIAL == 1
    if PARTIAL == 2 or INVARIANT:
        partial = row_splits > 1
    if partial:
        tl.store(part_lse_ptr + part_at, lse2, mask=h_mask)
        _store_pieces(part_ptr, part_at, h_mask, acc0, acc1, acc2, acc3, inv_l)
    else:
        factor = _final_factor(lse_at, lse2, inv_l, sink_ptr, sink_stride, h, h_mask, HAS_SINK, h_mask)
        _store_pieces(out_ptr, out_at, h_mask, acc0, acc1, acc2, acc3, factor)


@triton.jit
def _row_splits(n, x_n, split_keys, BLOCK_N: tl.constexpr):
    """The batch-invariant mode's split count of a row of ``n`` main and ``x_n`` extra counted
    entries: its virtual list (the main entries padded to whole key blocks, then the extra ones) in
    pieces of ``split_keys``; one for an empty row (which writes its empty outputs)."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, BLOCK_N) * BLOCK_N + x_n, split_keys), 1)


@triton.jit
def _combine(
    part_ptr, part_lse_ptr, sink_ptr, sink_stride, out_ptr, lse_ptr, lse_sb, lse_ss, lse_sh,
    s_q, heads, num_splits, count, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Columns ``BLOCK_D * program_id(2) ..`` of one row's head block, and its lse, from its first
    ``count`` of ``num_splits`` partial results, in split order:
    ``lse = log sum_i e^{lse_i}``, ``out = sum_i e^{lse_i - lse} o_i * sigmoid(lse - sink)``."""
    row = tl.program_id(0)
    b = row // s_q
    s = row - b * s_q
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    first = row.to(tl.int64) * num_splits * heads + h  # split 0's entry of each head
    top = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    for i in range(count):
        top = tl.maximum(top, tl.load(part_lse_ptr + first + i * heads, mask=h_mask, other=-float("inf")))
    ref = tl.where(top == -float("inf"), 0.0, top)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for i in range(count):
        w = tl.exp2(tl.load(part_lse_ptr + first + i * heads, mask=h_mask, other=-float("inf")) - ref)
        o = tl.load(part_ptr + (first + i * heads)[:, None] * _D + d[None, :], mask=h_mask[:, None], other=0.0)
        total += w
        acc += w[:, None] * o
    lse2, inv_total = _lse2_and_inverse(ref, total)
    lse_at = lse_ptr + b.to(tl.int64) * lse_sb + s.to(tl.int64) * lse_ss + h * lse_sh
    _store_final(out_ptr, lse_at, row.to(tl.int64) * heads + h, d, h, h_mask, acc, lse2, inv_total,
                 sink_ptr, sink_stride, HAS_SINK, h_mask & (tl.program_id(2) == 0))


@triton.jit
def combine_kernel(
    part_ptr, part_lse_ptr, sink_ptr, sink_stride, out_ptr, lse_ptr, lse_sb, lse_ss, lse_sh,
    s_q, heads, num_splits, len_ptr, len_sb, x_len_ptr, x_len_sb, width, x_width, split_keys,
    HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INVARIANT: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_X_LEN: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, head block, column block): merge the row's ``num_splits`` partial results, or
    with ``INVARIANT`` its own split count's (:func:`_row_splits`, from its lengths); nothing to
    do for one split: the decode kernel wrote the outputs. ``PDL``: as the decode kernel's (the
    programs are scheduled while the decode runs and wait for it here)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    count = num_splits
    if INVARIANT:
        b = tl.program_id(0) // s_q
        n, x_n = _counted(tl.load(len_ptr + b * len_sb, mask=HAS_LEN, other=0),
                          tl.load(x_len_ptr + b * x_len_sb, mask=HAS_X_LEN, other=0),
                          width, x_width, HAS_LEN, HAS_EXTRA, HAS_X_LEN)
        count = _row_splits(n, x_n, split_keys, BLOCK_N)
    if count > 1:
        _combine(part_ptr, part_lse_ptr, sink_ptr, sink_stride, out_ptr, lse_ptr, lse_sb, lse_ss, lse_sh,
                 s_q, heads, num_splits, count, HAS_SINK, BLOCK_H, BLOCK_D)


@triton.jit
def prefill_kernel(
    q_ptr, q_ss, q_sh, q_sd, kv_ptr, kv_s, kv_sd, s_kv, idx_ptr, idx_ss, idx_sj, width,
    len_ptr, len_s, sink_ptr, sink_stride, out_ptr, max_logits_ptr, lse_ptr, heads, scale_log2,
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ROPE_QK: tl.constexpr,
):
    """Program (query, head block) over the query's counted indices into ``kv``. ``ROPE_QK``: the
    V3.2 shape, ``d_qk = 576``: 64 more dims (512..575) enter the scores, not the output."""
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor's launcher passes Python floats as fp64
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    d = tl.arange(0, _D)
    q = tl.load(q_ptr + s * q_ss + h[:, None] * q_sh + d[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    r = _D + tl.arange(0, _ROPE)
    if ROPE_QK:
        q_rope = tl.load(q_ptr + s * q_ss + h[:, None] * q_sh + r[None, :] * q_sd, mask=h_mask[:, None], other=0.0)
    n = width
    if HAS_LEN:
        n = tl.minimum(tl.maximum(tl.load(len_ptr + s * len_s), 0), width)
    acc = tl.zeros((BLOCK_H, _D), dtype=tl.float32)
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j0 in range(0, n, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        t = tl.load(idx_ptr + s * idx_ss + j * idx_sj, mask=j < n, other=-1)
        valid = (t >= 0) & (t < s_kv)
        t = tl.where(valid, t, 0).to(tl.int64)
        k = tl.load(kv_ptr + t[:, None] * kv_s + d[None, :] * kv_sd, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k))
        if ROPE_QK:
            k_rope = tl.load(kv_ptr + t[:, None] * kv_s + r[None, :] * kv_sd, mask=valid[:, None], other=0.0)
            scores = tl.dot(q_rope, tl.trans(k_rope), scores)
        p, alpha, m, l = _online_softmax(scores, valid, m, l, scale_log2)
        acc = tl.dot(p, k, acc * alpha[:, None])
    lse2, inv_l = _lse2_and_inverse(m, l)
    at = s * heads + h
    tl.store(max_logits_ptr + at, m * _LN2, mask=h_mask)
    _store_final(out_ptr, lse_ptr + at, at, d, h, h_mask, acc, lse2, inv_l, sink_ptr, sink_stride, HAS_SINK, h_mask)
