"""The lightning indexer's Triton kernels: block logits, top-k, and the paged indexer key cache's
store and block logits. :mod:`..indexer` launches them and documents what they compute; importing
this module imports Triton (the provider imports it on first use)."""

import triton
import triton.language as tl

from .... import layout
from .attention import _e2m1_values, _e4m3_values
from .store import _all_finite, _nan_or_fp8

#: Triton reads module globals in a kernel as constexprs only.
_DIM = tl.constexpr(layout.INDEX_HEAD_DIM)
_FP8_MAX, _FP4_MAX = tl.constexpr(layout.FP8_MAX), tl.constexpr(layout.FP4_MAX)
_SCALE_MIN = tl.constexpr(layout.INDEX_SCALE_MIN)
#: the ``FORMAT`` constexpr of the paged-cache kernels: layout.INDEX_FORMATS' "fp32", "fp8", "fp4"
FP32, FP8, FP4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def logits_kernel(
    q_ptr, w_ptr, keys_ptr, slots_ptr, out_ptr,
    heads, dim, width,
    q_t, q_h, q_d, w_t, w_h, k_s, k_d, s_t, s_k, out_t,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    in_dim = d < dim
    # this program's blocks of BLOCK_N columns: its index in the row, then every num_programs(1)-th
    for block in range(tl.program_id(1), tl.cdiv(width, BLOCK_N), tl.num_programs(1)):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        in_row = cols < width
        slots = tl.load(slots_ptr + t * s_t + cols * s_k, mask=in_row, other=-1).to(tl.int64)
        live = slots >= 0
        # no head is scored (no key read) in a block none of whose columns is visible
        scored_heads = heads * tl.max(live.to(tl.int32), axis=0)
        key = tl.load(
            keys_ptr + slots[:, None] * k_s + d[None, :] * k_d, mask=live[:, None] & in_dim[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_D]
        acc = tl.zeros([BLOCK_N], tl.float32)
        for h0 in range(0, scored_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            in_heads = h < heads
            qh = tl.load(
                q_ptr + t * q_t + h[:, None] * q_h + d[None, :] * q_d,
                mask=in_heads[:, None] & in_dim[None, :], other=0.0,
            )  # [BLOCK_H, BLOCK_D]
            scores = tl.dot(qh, tl.trans(key), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
            w = tl.load(w_ptr + t * w_t + h * w_h, mask=in_heads, other=0.0)
            relu = tl.maximum(scores, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch.relu
            acc += tl.sum(relu * w[:, None], axis=0)
        logits = tl.where(live, acc, float("-inf"))
        tl.store(out_ptr + t * out_t + cols, logits, mask=in_row)


@triton.jit
def _topk_key(x):
    """32-bit unsigned keys in the op's order of float32 ``x``: one NaN (above ``+inf``), ``-0.0``
    as ``0.0``."""
    x = tl.where(x != x, float("nan"), tl.where(x == 0.0, 0.0, x))
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float order (signed)
    return (ordered ^ -2147483648).to(tl.uint32, bitcast=True)  # the same order, unsigned


@triton.jit
def _topk_digit(count, need, prefix, shift: tl.constexpr):
    """One radix step: of the candidates' histogram ``count`` over the byte at ``shift``, the
    bucket that holds the ``need``-th largest; returns ``prefix`` with that byte set and what is
    left to take in it."""
    bins = tl.arange(0, 256)
    above = tl.sum(count, axis=0) - tl.cumsum(count, axis=0)  # candidates in higher buckets
    hit = (above < need) & (above + count >= need)  # exactly one bucket
    chosen = tl.sum(tl.where(hit, bins, 0), axis=0)
    need -= tl.sum(tl.where(hit, above, 0), axis=0)
    return prefix | (chosen.to(tl.uint32) << shift), need


@triton.jit
def _topk_write(out_row, key, cols, in_row, prefix, need, taken, equal_seen, key_row, KEYS_OUT: tl.constexpr):
    """Write the columns of ``key`` above ``prefix`` (the ``k``-th largest key) and those equal to
    it up to the ``need``-th, counting ``equal_seen`` equal ones before these, in column order after
    the ``taken`` already written (with ``KEYS_OUT`` their keys too, at the same places of
    ``key_row``); return both counts with these columns'. At most 65535 columns at a time: one
    prefix sum counts the keys above (low 16 bits) and equal (high bits) up to each column."""
    above = in_row & (key > prefix)
    equal = in_row & (key == prefix)
    counts = above.to(tl.int32) + (equal.to(tl.int32) << 16)
    both = tl.cumsum(counts, axis=0)
    rank = equal_seen + (both >> 16)  # equal keys up to this column, this one included
    take = above | (equal & (rank <= need))
    # columns taken up to this one: those before, the keys above up to here, the equal ones up to
    # the need-th
    done = tl.minimum(equal_seen, need)
    slot = taken + (both & 0xFFFF) + tl.minimum(rank, need) - done - 1
    tl.store(out_row + slot, cols.to(out_row.dtype.element_ty), mask=take)
    if KEYS_OUT:
        tl.store(key_row + slot, key.to(tl.int32, bitcast=True), mask=take)
    total = tl.sum(counts, axis=0)
    seen = equal_seen + (total >> 16)
    return taken + (total & 0xFFFF) + tl.minimum(seen, need) - done, seen


@triton.jit
def topk_kernel(
    x_ptr, col_ptr, out_ptr, key_out_ptr, width, k, x_t, x_m, out_t,
    BLOCK: tl.constexpr, KEYS_IN: tl.constexpr, KEYS_OUT: tl.constexpr,
):
    """A row of at most ``BLOCK`` columns, held in registers. With ``KEYS_IN`` the row is a
    candidate list (32-bit keys at ``x_ptr``, their columns at ``col_ptr``, both ``[T, width]`` of
    row stride ``x_t``) instead of float32 logits. With ``KEYS_OUT`` a program takes the
    ``BLOCK``-column piece ``program_id(1)`` of its row and writes the columns and keys of the
    piece's top ``min(k, its width)`` at ``piece * k`` of ``out_ptr`` / ``key_out_ptr`` (row stride
    ``out_t``): a candidate list, in column order, for the next step."""
    tl.static_assert(BLOCK < 65536)  # _topk_write's counts
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    if KEYS_IN:
        key = tl.load(x_ptr + t * x_t + cols, mask=in_row, other=0).to(tl.uint32, bitcast=True)
        index = tl.load(col_ptr + t * x_t + cols, mask=in_row, other=0)
    else:
        key = _topk_key(tl.load(x_ptr + t * x_t + cols.to(tl.int64) * x_m, mask=in_row, other=0.0))
        index = cols
    out_row = out_ptr + t * out_t
    key_row = key_out_ptr + t * out_t
    need = k
    if KEYS_OUT:
        out_row += tl.program_id(1) * k
        key_row += tl.program_id(1) * k
        need = tl.minimum(k, width - tl.program_id(1) * BLOCK)
    # the need-th largest key: the row's smallest where fewer than `need` keys are above it (a
    # row with fewer visible columns than `need`: the rest are all -inf); else a bit at a time
    # from the top, the largest key that at least `need` keys reach (every real key is above 0,
    # the key of the columns past the row), stopping early where exactly `need` keys reach it
    # (~19 of the 32 steps for 4096 distinct values: those are the need largest, and the write
    # below takes them all). Then how many of the keys equal to it are to take
    key = tl.where(in_row, key, 0)
    low = tl.min(tl.where(in_row, key, tl.full([], 0xFFFFFFFF, tl.uint32)), axis=0)
    few = tl.sum((key > low).to(tl.int32), axis=0) < need
    prefix = tl.where(few, low, 0)
    reach = tl.where(few, need, need + 1)  # keys at or above prefix where that ends the search
    step = need * 0
    while (step < 32) & (reach != need):
        probe = prefix | (tl.full([], 1, tl.uint32) << (31 - step).to(tl.uint32))
        count = tl.sum((key >= probe).to(tl.int32), axis=0)
        prefix = tl.where(count >= need, probe, prefix)
        reach = tl.where(count >= need, count, reach)
        step += 1
    need -= tl.sum((key > prefix).to(tl.int32), axis=0)
    # every key above it, and the first `need` equal to it in column order; written in column order
    _topk_write(out_row, key, index, in_row, prefix, need, 0, 0, key_row, KEYS_OUT)


@triton.jit
def topk_looped_kernel(
    x_ptr, out_ptr, width, k, x_t, x_m, out_t,
    CHUNK: tl.constexpr,
):
    """A row of any width, read ``CHUNK`` columns at a time: four histogram passes (one per byte
    of the k-th largest key), then one pass that writes the selection in column order."""
    tl.static_assert(CHUNK < 65536)  # _topk_write's counts
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * x_t
    prefix = tl.zeros([], tl.uint32)
    need = k
    for i in tl.static_range(4):
        shift = 24 - 8 * i
        count = tl.zeros([256], tl.int32)
        for c0 in range(0, width, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            in_row = cols < width
            key = _topk_key(tl.load(row + cols.to(tl.int64) * x_m, mask=in_row, other=0.0))
            candidate = in_row
            if i > 0:  # the keys that share the bytes found so far
                candidate = candidate & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            count += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=candidate)
        prefix, need = _topk_digit(count, need, prefix, shift)
    taken = 0  # columns written so far
    equal_seen = 0  # keys equal to the k-th largest seen so far
    for c0 in range(0, width, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        in_row = cols < width
        key = _topk_key(tl.load(row + cols.to(tl.int64) * x_m, mask=in_row, other=0.0))
        taken, equal_seen = _topk_write(
            out_ptr + t * out_t, key, cols, in_row, prefix, need, taken, equal_seen, out_ptr, False
        )


# --------------------------------------------------------------------------------------------
# The paged indexer key cache (layout.IndexFormat): store and block logits
# --------------------------------------------------------------------------------------------


@triton.jit
def _fp4_values(byte, e):
    """``[R, 128]`` float32 values times ``2^-14`` (exact) of FP4 vectors: ``byte [R, 64]`` e2m1
    codes two per byte (element ``2i`` in the low nibble), ``e [R, 4]`` their UE8M0 bytes (one per
    32 values; 255: NaN for code 0, as the store writes a non-finite vector)."""
    code = byte.to(tl.int32)
    pairs = tl.join(_e2m1_values(code & 15), _e2m1_values(code >> 4))  # [R, 64, 2]
    groups = tl.reshape(pairs, (byte.shape[0], 4, 32))
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127); 255: inf
    return tl.reshape(groups * scale[:, :, None], (byte.shape[0], _DIM))


@triton.jit
def index_store_kernel(
    keys_ptr, cache_ptr, slots_ptr, count, page_size, page_stride, k_t,
    FORMAT: tl.constexpr, BLOCK_T: tl.constexpr, HW: tl.constexpr,
):
    """``BLOCK_T`` keys a program: quantized as ``layout.quantize_index`` and written at their
    slots (negative: skipped)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slots_ptr + t, mask=t < count, other=-1).to(tl.int64)
    live = slot >= 0
    page = slot // page_size
    offset = slot - page * page_size
    base = cache_ptr + page * page_stride
    d = tl.arange(0, _DIM)
    x = tl.load(keys_ptr + t.to(tl.int64)[:, None] * k_t + d[None, :], mask=live[:, None], other=0.0)
    if FORMAT == FP32:
        data = (base + offset * (4 * _DIM)).to(tl.pointer_type(tl.float32))  # 4-byte aligned strides
        tl.store(data[:, None] + d[None, :], x, mask=live[:, None])
    else:
        finite = _all_finite(x, _DIM)
        if FORMAT == FP8:
            amax = tl.max(tl.abs(x), axis=1)
            scale = tl.where(finite, tl.div_rn(tl.maximum(amax, _SCALE_MIN), _FP8_MAX), float("nan"))
            inv = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
            codes = _nan_or_fp8(x * inv[:, None], finite, True, HW)
            tl.store(base[:, None] + offset[:, None] * _DIM + d[None, :], codes, mask=live[:, None])
            scales = (base + page_size * _DIM + offset * 4).to(tl.pointer_type(tl.float32))
            tl.store(scales, scale, mask=live)
        else:
            groups = tl.reshape(x, (BLOCK_T, 4, 32))
            bound = tl.maximum(tl.div_rn(tl.max(tl.abs(groups), axis=2), _FP4_MAX), _SCALE_MIN)  # floor after /6
            bits = bound.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2)
            e = tl.where(finite[:, None], e, 0)
            a = tl.abs(groups * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, :, None])  # * 2^-e
            code = ((a > 0.25).to(tl.int32) + (a > 0.75) + (a > 1.25) + (a > 1.75) + (a > 2.5) + (a > 3.5)
                    + (a > 5.0))  # nearest, ties toward zero
            code = code | (((groups < 0) & (code > 0)).to(tl.int32) << 3)
            code = tl.where(finite[:, None, None], code, 0)
            even, odd = tl.split(tl.reshape(code, (BLOCK_T, _DIM // 2, 2)))
            j = tl.arange(0, _DIM // 2)
            tl.store(base[:, None] + offset[:, None] * (_DIM // 2) + j[None, :], (even | (odd << 4)).to(tl.uint8),
                     mask=live[:, None])
            g = tl.arange(0, 4)
            exponent = tl.where(finite[:, None], e + 127, 255).to(tl.uint8)
            tl.store(base[:, None] + page_size * (_DIM // 2) + offset[:, None] * 4 + g[None, :], exponent,
                     mask=live[:, None])


@triton.jit
def _cache_queries(q_ptr, qs_ptr, t, h, in_heads, q_h, qs_h, FORMAT: tl.constexpr, HW: tl.constexpr):
    """The ``[BLOCK_H, 128]`` query tile of heads ``h`` of row ``t``: float32 (``"fp32"``), else
    bf16 values (exact; times ``2^-8`` for fp8 without ``HW``, ``2^-14`` for fp4)."""
    if FORMAT == FP32:
        d = tl.arange(0, _DIM)
        return tl.load(q_ptr + t + h[:, None] * q_h + d[None, :], mask=in_heads[:, None], other=0.0)
    elif FORMAT == FP8:
        d = tl.arange(0, _DIM)
        code = tl.load(q_ptr + t + h[:, None] * q_h + d[None, :], mask=in_heads[:, None], other=0)
        return _e4m3_values(code, HW).to(tl.bfloat16)
    else:
        j = tl.arange(0, _DIM // 2)
        g = tl.arange(0, 4)
        byte = tl.load(q_ptr + t + h[:, None] * q_h + j[None, :], mask=in_heads[:, None], other=0)
        e = tl.load(qs_ptr + h[:, None] * qs_h + g[None, :], mask=in_heads[:, None], other=0)
        return _fp4_values(byte, e).to(tl.bfloat16)


@triton.jit
def _cache_keys(base, offset, live, page_size, FORMAT: tl.constexpr, HW: tl.constexpr, FP8_MMA: tl.constexpr):
    """The ``[BLOCK_N, 128]`` keys at ``offset`` of the pages at ``base`` (``live`` rows; zeros
    elsewhere) and, for ``"fp8"``, their scales: float32 (``"fp32"``), e4m3 codes (``FP8_MMA``),
    else bf16 values (exact; times :func:`_cache_queries`' factors)."""
    d = tl.arange(0, _DIM)
    key_scale = tl.zeros(live.shape, tl.float32)  # fp8 only
    if FORMAT == FP32:
        data = (base + offset * (4 * _DIM)).to(tl.pointer_type(tl.float32))
        key = tl.load(data[:, None] + d[None, :], mask=live[:, None], other=0.0)
    elif FORMAT == FP8:
        code = tl.load(base[:, None] + offset[:, None] * _DIM + d[None, :], mask=live[:, None], other=0)
        if FP8_MMA:
            key = code.to(tl.float8e4nv, bitcast=True)
        else:
            key = _e4m3_values(code, HW).to(tl.bfloat16)
        scales = (base + page_size * _DIM + offset * 4).to(tl.pointer_type(tl.float32))
        key_scale = tl.load(scales, mask=live, other=0.0)
    else:
        j = tl.arange(0, _DIM // 2)
        g = tl.arange(0, 4)
        byte = tl.load(base[:, None] + offset[:, None] * (_DIM // 2) + j[None, :], mask=live[:, None], other=0)
        e = tl.load(base[:, None] + page_size * (_DIM // 2) + offset[:, None] * 4 + g[None, :],
                    mask=live[:, None], other=0)
        key = _fp4_values(byte, e).to(tl.bfloat16)
    return key, key_scale


@triton.jit
def _unscale(FORMAT: tl.constexpr, HW: tl.constexpr, FP8_MMA: tl.constexpr):
    """What the factors of :func:`_cache_queries` / :func:`_cache_keys`' values leave on a product."""
    if FORMAT == FP4:
        return 268435456.0  # 2^28
    elif FORMAT == FP8 and not HW and not FP8_MMA:
        return 65536.0  # 2^16
    else:
        return 1.0


@triton.jit
def _tile_request(rows_ptr, t0, tokens, BLOCK_T: tl.constexpr):
    """``(uniform, row)``: whether the queries ``t0 .. t0 + BLOCK_T - 1`` (those below ``tokens``)
    are all of one request (one row of the block table), and the first one's row."""
    t = t0 + tl.arange(0, BLOCK_T)
    first = tl.load(rows_ptr + t0)
    rows = tl.load(rows_ptr + t, mask=t < tokens, other=first)
    return tl.min(rows, axis=0) == tl.max(rows, axis=0), first.to(tl.int64)


@triton.jit
def cache_logits_kernel(
    q_ptr, qs_ptr, w_ptr, cache_ptr, slots_ptr, table_ptr, rows_ptr, len_ptr, out_ptr,
    tokens, heads, width, page_size, page_stride,
    q_t, q_h, qs_t, qs_h, w_t, w_h, s_t, s_k, tab_r, tab_p, out_t,
    FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
    HW: tl.constexpr, TABLE: tl.constexpr,
):
    """``logits_kernel`` over a paged indexer key cache: keys dequantized in registers as they are
    gathered, one ``tl.dot`` per ``BLOCK_H`` heads (float32 operands for ``"fp32"``, exact bf16 ones
    otherwise), an fp8 key's scale applied to its column's sum. The row's slots: ``block_slots``,
    or with ``TABLE`` its request's pages (``table_ptr`` row ``rows_ptr[t]``) and its length."""
    t = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(width, BLOCK_N)
    row = t  # the query's block-table row (TABLE)
    length = width
    if TABLE:
        row = tl.load(rows_ptr + t).to(tl.int64)
        length = tl.load(len_ptr + t)
    unscale = _unscale(FORMAT, HW, False)
    for block in range(tl.program_id(1), blocks, tl.num_programs(1)):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        in_row = cols < width
        if TABLE:
            live = cols < length
            entry = cols // page_size
            page = tl.load(table_ptr + row * tab_r + entry * tab_p, mask=live, other=0).to(tl.int64)
            offset = cols - entry * page_size
        else:
            slots = tl.load(slots_ptr + t * s_t + cols * s_k, mask=in_row, other=-1).to(tl.int64)
            live = slots >= 0
            page = slots // page_size
            offset = slots - page * page_size
        scored_heads = heads * tl.max(live.to(tl.int32), axis=0)
        key, key_scale = _cache_keys(cache_ptr + page * page_stride, offset, live, page_size, FORMAT, HW, False)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for h0 in range(0, scored_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            in_heads = h < heads
            qh = _cache_queries(q_ptr, qs_ptr + t * qs_t, t * q_t, h, in_heads, q_h, qs_h, FORMAT, HW)
            if FORMAT == FP32:
                scores = tl.dot(qh, tl.trans(key), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
            else:
                scores = tl.dot(qh, tl.trans(key))
            w = tl.load(w_ptr + t * w_t + h * w_h, mask=in_heads, other=0.0)
            relu = tl.maximum(scores, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch.relu
            acc += tl.sum(relu * w[:, None], axis=0)
        acc = acc * unscale
        if FORMAT == FP8:
            acc = acc * key_scale
        logits = tl.where(live, acc, float("-inf"))
        tl.store(out_ptr + t * out_t + cols, logits, mask=in_row)


@triton.jit
def tile_logits_kernel(
    q_ptr, qs_ptr, w_ptr, cache_ptr, table_ptr, rows_ptr, len_ptr, out_ptr,
    tokens, heads, width, page_size, page_stride,
    q_t, q_h, qs_t, qs_h, w_t, w_h, tab_r, tab_p, out_t,
    FORMAT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    HW: tl.constexpr, FP8_MMA: tl.constexpr, SKIP_T: tl.constexpr,
):
    """The block logits of ``BLOCK_T`` queries of one request (a tile; a tile of several requests
    is left to another launch; with ``SKIP_T`` > 0, tiles inside a ``SKIP_T``-row tile of one
    request are left to the launch of that geometry) over the paged cache, ``"fp8"`` or ``"fp4"``: each
    ``BLOCK_N`` keys of the request are gathered once and scored against every head of every query
    of the tile by one ``tl.dot`` (``[BLOCK_N, 128] x [128, BLOCK_T * BLOCK_H]``: e4m3 codes with
    ``FP8_MMA``, exact bf16 values otherwise), then the ReLU, the head weights and the sum over each
    query's heads; ``-inf`` past each query's length and up to ``width``."""
    t0 = tl.program_id(0) * BLOCK_T
    uniform, row = _tile_request(rows_ptr, t0, tokens, BLOCK_T)
    if SKIP_T > 0:
        wider, _ = _tile_request(rows_ptr, t0 // SKIP_T * SKIP_T, tokens, SKIP_T)
        uniform = uniform & ~wider
    t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    in_t = t < tokens
    lengths = tl.load(len_ptr + t, mask=in_t, other=0)
    scored = tl.where(uniform, tl.cdiv(tl.max(lengths, axis=0), BLOCK_N), 0)
    blocks = tl.where(uniform, tl.cdiv(width, BLOCK_N), 0)
    # the tile's queries, head-major within a query: [BLOCK_T * BLOCK_H, 128] with its weights
    m = tl.arange(0, BLOCK_T * BLOCK_H)
    mt = t0.to(tl.int64) + m // BLOCK_H
    mh = m % BLOCK_H
    in_m = (mt < tokens) & (mh < heads)
    if FORMAT == FP8:
        d = tl.arange(0, _DIM)
        code = tl.load(q_ptr + mt[:, None] * q_t + mh[:, None] * q_h + d[None, :], mask=in_m[:, None], other=0)
        if FP8_MMA:
            queries = code.to(tl.float8e4nv, bitcast=True)
        else:
            queries = _e4m3_values(code, HW).to(tl.bfloat16)
    else:
        j = tl.arange(0, _DIM // 2)
        g = tl.arange(0, 4)
        byte = tl.load(q_ptr + mt[:, None] * q_t + mh[:, None] * q_h + j[None, :], mask=in_m[:, None], other=0)
        e = tl.load(qs_ptr + mt[:, None] * qs_t + mh[:, None] * qs_h + g[None, :], mask=in_m[:, None], other=0)
        queries = _fp4_values(byte, e).to(tl.bfloat16)
    w = tl.load(w_ptr + mt * w_t + mh * w_h, mask=in_m, other=0.0)
    unscale = _unscale(FORMAT, HW, FP8_MMA)
    for block in range(tl.program_id(1), scored, tl.num_programs(1)):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        seen = cols < tl.max(lengths, axis=0)  # by some query of the tile
        entry = cols // page_size
        page = tl.load(table_ptr + row * tab_r + entry * tab_p, mask=seen, other=0).to(tl.int64)
        key, key_scale = _cache_keys(cache_ptr + page * page_stride, cols - entry * page_size, seen, page_size,
                                     FORMAT, HW, FP8_MMA)
        scores = tl.dot(key, tl.trans(queries))  # [BLOCK_N, BLOCK_T * BLOCK_H]
        relu = tl.maximum(scores, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
        acc = tl.sum(tl.reshape(relu, (BLOCK_N, BLOCK_T, BLOCK_H)), axis=2) * unscale  # [BLOCK_N, BLOCK_T]
        if FORMAT == FP8:
            acc = acc * key_scale[:, None]
        logits = tl.where(cols[:, None] < lengths[None, :], acc, float("-inf"))
        tl.store(out_ptr + t[None, :] * out_t + cols[:, None], logits, mask=in_t[None, :] & (cols < width)[:, None])
    for block in range(scored + tl.program_id(1), blocks, tl.num_programs(1)):  # past every query: -inf
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + t[None, :] * out_t + cols[:, None], tl.full([BLOCK_N, BLOCK_T], float("-inf"), tl.float32),
                 mask=in_t[None, :] & (cols < width)[:, None])
