"""The reference kernels: plain PyTorch, the executable specification of every ``dsv4`` op.

They serve CPU tensors, and any device no other provider serves. They are written for clarity and
exactness first (fp32 math, the formulas of docs/design.md §2), vectorised over tokens, and chunked
over tokens, query rows and keys so memory stays bounded (:data:`CHUNK_BYTES`) whatever the sizes.

In the batch-invariant mode (the ``batch_invariant`` argument of the attention and indexer-logit
kernels) they take one query row at a time, copied to a fresh (aligned) tensor: every product and
sum of a row then has the same shapes and the same alignment whatever the batch, so a row's bits
cannot follow the library's choice of kernel for a batch's shapes (:func:`_row_steps`).

Arguments arrive validated: the op's kernel runs its checks (``OpSpec.check``, in the op's module
under ``ops/``) before any provider, data checks included (``OpSpec.check_data``: slots in range,
lengths <= widths) — always on CPU, where reading values is free, and in checked mode elsewhere.
"""

from __future__ import annotations

import math

import torch

from .. import dispatch, layout
from ..ops.decode import decode_outputs, metadata_outputs
from ..ops.indexer import indexer_cache_topk_output, indexer_logits_output, indexer_topk_output
from ..ops.prefill import prefill_outputs

#: Upper bound on the bytes of temporaries (gathered keys, their dequantization, scores) one step
#: of decode, prefill or the store holds at once (see :func:`_plan`); the outputs come on top.
#: tests/test_reference_memory.py measures the peak RSS of each op against this bound.
CHUNK_BYTES = 64 << 20
#: Bytes one gathered key costs while its step runs: its 584 record bytes and (page, offset)
#: indices, the fp32 dequantization and its temporaries (fp8 -> fp32, scaled, cat), the zeroed copy,
#: allocator slack (measured peak / planned keys, rounded up).
KEY_BYTES = 16 << 10
#: Bytes per (key, head): the fp32 score, its exponential, the mask, one temporary.
SCORE_BYTES = 16
#: Bytes one stored token costs while its step runs: fp32 row, scaled and normed rows, RoPE, tiles,
#: fp8 and bf16 records (measured peak / tokens, rounded up).
TOKEN_BYTES = 22 << 10


# --------------------------------------------------------------------------------------------
# fused_k_norm_rope_flashmla
# --------------------------------------------------------------------------------------------


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**k`` for integer ``k`` in [-126, 127] (built from the exponent bits)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``y = x * rsqrt(mean(x^2) + eps) * w`` over the last dim, fp32, without overflow.

    ``x`` is first scaled by an exact power of two ``2**-k`` that brings ``max|x|`` into ``[2, 4)``
    (``k`` from the exponent bits of ``max|x|``, clamped to [-63, 126]), and ``eps`` by ``4**-k``:
    ``x * rsqrt(mean(x^2) + eps) = (x 2^-k) * rsqrt(mean((x 2^-k)^2) + eps 4^-k)``. Scaling by a
    power of two commutes with every rounding, so this is bit-identical to the plain formula wherever
    that neither overflows nor underflows, and finite where ``sum(x^2)`` would overflow fp32.
    """
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 126  # frexp's exponent for normal amax
    inv = _pow2(-(exponent - 2).clamp(-63, 126))
    xs = x * inv
    eps_scaled = torch.tensor(eps, dtype=torch.float32, device=x.device) * inv * inv
    return xs * torch.rsqrt(xs.square().mean(-1, keepdim=True) + eps_scaled) * weight.float()


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """V4: the smallest ``e`` with ``2**e >= max(1e-4, amax) / 448``, exactly (``ceil(log2(.))``
    via frexp)."""
    return layout.ceil_log2(amax.clamp_min(layout.SCALE_MIN) / layout.FP8_MAX)


def v41_fp8_exponent(amax: torch.Tensor) -> torch.Tensor:
    """V4.1 FP8: the smallest ``e`` with ``2**e >= max(amax / 448, 1e-4)``, exactly."""
    return layout.ceil_log2((amax / layout.FP8_MAX).clamp_min(layout.SCALE_MIN))


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) of fp32 ``v``: round to nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties
    to the even code (mantissa bit 0), saturating at 6; bit 3 is the sign bit of ``v`` (kept on
    values that round to 0)."""
    a = v.abs()
    code = (
        (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    )
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def rope(values: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved (GPT-J) RoPE on ``values [T, ..., 2n]`` (DSV4: ``2n = 64``), fp32:
    ``(a, b) -> (a*c - b*s, a*s + b*c)`` with ``freqs[pos] = (c0, s0, c1, s1, ...)`` (``[max_pos,
    2n]``) at each token's position; ``inverse``: ``s -> -s`` (the rotation by the opposite angle)."""
    cs = freqs[positions.long()].view(-1, *([1] * (values.dim() - 2)), values.shape[-1] // 2, 2)
    cos, sin = cs.unbind(-1)
    if inverse:
        sin = -sin
    a, b = values.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def normed_rotated(kv, kv_weight, freqs, positions, eps, fmt: layout.CacheFormat) -> torch.Tensor:
    """The values the fused K store quantizes, ``[T, 512]`` fp32.

    V4: ``y = rms_norm(kv)`` (fp32), RoPE on dims 448..511 (fp32). V4.1: ``y`` rounded to bf16,
    RoPE on dims 448..511 of the bf16 values (fp32 math), the result rounded to bf16 again.
    """
    y = rms_norm(kv, kv_weight, eps)
    if not fmt.is_v4:
        y = y.to(torch.bfloat16).float()
    rotated = rope(y[:, layout.NOPE_DIM :], freqs, positions)
    if not fmt.is_v4:
        rotated = rotated.to(torch.bfloat16).float()
    return torch.cat([y[:, : layout.NOPE_DIM], rotated], dim=-1)


def encode_tokens(values: torch.Tensor, fmt: layout.CacheFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [T, 512]`` (fp32) as ``fmt``'s data ``[T, data_bytes]`` and scale records
    ``[T, scale_bytes]`` (uint8). docs/design.md §2.1 and §2.5:

    * V4: dims 0..447 in 7 tiles of 64: ``e = ceil(log2(max(1e-4, amax) / 448))``, value
      ``e4m3(clamp(y * 2^-e, +-448))`` RNE, byte ``e + 127``; dims 448..511 as bf16 (RNE); pad 0.
    * V4.1 FP8: 16 groups of 32: ``e = ceil(log2(max(amax / 448, 1e-4)))``, value ``e4m3(y * 2^-e)``
      RNE (no saturation possible), byte ``e + 127``.
    * V4.1 FP4: 32 groups of 16: scale ``s = e4m3(clamp(amax / 6, 2^-9, 448))`` RNE, code
      ``e2m1(y / s)`` (IEEE division; ties to even, saturating, sign kept), two codes per byte
      (even index in the low nibble), scale byte the e4m3 ``s``.

    A token with a non-finite value is the NaN token (``fmt.nan_data``, ``fmt.nan_scales``).
    """
    t = values.shape[0]
    if fmt.is_v4:
        tiles = values[:, : layout.NOPE_DIM].view(t, layout.NUM_TILES, layout.TILE)
        e = ue8m0_exponent(tiles.abs().amax(-1))  # [T, 7]
        fp8 = (tiles * _pow2(-e)[..., None]).clamp(-layout.FP8_MAX, layout.FP8_MAX).to(torch.float8_e4m3fn)
        rope_bytes = values[:, layout.NOPE_DIM :].to(torch.bfloat16).view(torch.uint8)
        data = torch.cat([fp8.view(t, layout.NOPE_DIM).view(torch.uint8), rope_bytes], dim=-1)
        scales = torch.cat([e + layout.UE8M0_BIAS, torch.zeros_like(e[:, :1])], dim=-1).to(torch.uint8)
    elif fmt.values == "fp8":
        groups = values.view(t, -1, fmt.group)
        e = v41_fp8_exponent(groups.abs().amax(-1))  # [T, 16]
        data = (groups * _pow2(-e)[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(t, fmt.data_bytes)
        scales = (e + layout.UE8M0_BIAS).to(torch.uint8)
    else:  # fp4
        groups = values.view(t, -1, fmt.group)
        amax = groups.abs().amax(-1)  # [T, 32]
        scale = (amax / layout.FP4_MAX).clamp(layout.FP4_SCALE_MIN, layout.FP8_MAX).to(torch.float8_e4m3fn)
        codes = e2m1_codes(groups / scale.float()[..., None]).view(t, layout.HEAD_DIM)
        data = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales = scale.view(torch.uint8)
    finite = values.isfinite().all(-1, keepdim=True)
    nan_data = torch.tensor(fmt.nan_data, dtype=torch.uint8, device=values.device)
    nan_scales = torch.tensor(fmt.nan_scales, dtype=torch.uint8, device=values.device)
    return torch.where(finite, data, nan_data), torch.where(finite, scales, nan_scales)


def _store(records, page_size, out_loc, encode, token_bytes: int = TOKEN_BYTES) -> None:
    """Write ``encode(rows)``'s ``(data, scales)`` (rows: the selection of the tokens with a
    non-negative slot) to their slots of ``records``, views ``[num_pages, P, bytes]`` of a cache's
    data and scale records, a chunk of tokens (``token_bytes`` of temporaries each) at a time."""
    data_records, scale_records = records
    step = max(1, CHUNK_BYTES // token_bytes)
    for start in range(0, out_loc.shape[0], step):
        sl = slice(start, start + step)
        keep = out_loc[sl] >= 0  # negative slots are not written
        slots = out_loc[sl][keep].long()
        if slots.numel() == 0:
            continue
        index = torch.arange(start, start + keep.shape[0], device=keep.device)[keep]
        data, scales = encode(index)
        page, offset = layout.page_and_offset(slots, page_size)
        data_records[page, offset] = data
        scale_records[page, offset] = scales


def _records(kvcache, page_size, fmt):
    return layout.data_records(kvcache, page_size, fmt), layout.scale_records(kvcache, page_size, fmt)


def fused_k_norm_rope_flashmla(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size, kv_format=layout.V4):
    _store(_records(kvcache, page_size, kv_format), page_size, out_loc, lambda rows: encode_tokens(
        normed_rotated(kv[rows], kv_weight, freqs, positions[rows], eps, kv_format), kv_format))


def quantize_store(kv, out_loc, kvcache, page_size, kv_format=layout.V4):
    _store(_records(kvcache, page_size, kv_format), page_size, out_loc,
           lambda rows: encode_tokens(kv[rows].float(), kv_format))


# --------------------------------------------------------------------------------------------
# Sparse attention core shared by decode and prefill
# --------------------------------------------------------------------------------------------


def sparse_attention(
    q: torch.Tensor, key_blocks, scale: float, attn_sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``q [n, H, D]`` over per-row keys (V: a key's first 512 dims), given in blocks.

    ``key_blocks`` yields ``(keys [n, k, D], valid [n, k])``: a row's keys are the valid entries of
    all its blocks. ``s_j = scale * <q, K_j>``; ``lse = ln sum_j e^{s_j}`` (sink excluded, ``+inf``
    for an empty row); ``out = sum_j e^{s_j} K_j / (sum_j e^{s_j} + e^{sink_h})`` (0 for an empty
    row); ``max_logits = max_j s_j`` (``-inf`` for an empty row). All fp32.

    Blocks are merged with the running maximum ``m``: ``l = sum_j e^{s_j - m}``,
    ``acc = sum_j e^{s_j - m} K_j``, rescaled by ``e^{m_old - m_new}`` when ``m`` grows. Keys that
    are not valid are zeroed before use, so no output depends on bytes its row does not reference.
    """
    n, heads = q.shape[:2]
    q = q.float()
    m = q.new_full((n, heads), -math.inf)
    l = q.new_zeros(n, heads)
    acc = q.new_zeros(n, heads, layout.HEAD_DIM)
    for keys, valid in key_blocks:
        if keys.shape[1] == 0:
            continue
        keys = torch.where(valid[..., None], keys.float(), 0.0)
        scores = torch.einsum("nhd,nkd->nhk", q, keys) * scale
        scores = scores.masked_fill(~valid[:, None, :], -math.inf)
        m_new = torch.maximum(m, scores.amax(-1))
        ref = torch.where(m_new == -math.inf, 0.0, m_new)  # no key yet: everything stays 0
        alpha = torch.exp(m - ref)
        p = torch.exp(scores - ref[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("nhk,nkd->nhd", p, keys[..., : layout.HEAD_DIM])
        m = m_new
    empty = l == 0
    lse = torch.where(empty, math.inf, m + torch.log(l))
    factor = 1.0 / l
    if attn_sink is not None:
        # sum e^s / (sum e^s + e^sink) = 1 / (1 + e^{sink - lse})
        factor = factor * torch.sigmoid(lse - attn_sink.float())
    factor = torch.where(empty, 0.0, factor)
    return acc * factor[..., None], m, lse


def _row_steps(rows: int, step: int, batch_invariant: bool):
    """Slices of ``rows`` of ``step`` rows; of one row each in the batch-invariant mode."""
    step = 1 if batch_invariant else step
    return (slice(start, start + step) for start in range(0, rows, step))


def _rows(x: torch.Tensor, sl: slice, batch_invariant: bool) -> torch.Tensor:
    """``x[sl]``; in the batch-invariant mode a fresh copy (the allocator aligns it, whatever the
    row's offset in ``x``)."""
    return x[sl].clone() if batch_invariant else x[sl]


def _plan(rows: int, width: int, heads: int) -> tuple[int, int]:
    """``(rows, keys)`` per step so that a step's temporaries stay within :data:`CHUNK_BYTES`:
    up to 1024 keys per block, then as many rows as fit (at least one)."""
    keys = max(1, min(width, 1024))
    per_row = keys * (KEY_BYTES + SCORE_BYTES * heads) + 3 * heads * layout.HEAD_DIM * 4
    return max(1, min(rows, CHUNK_BYTES // per_row)), keys


# --------------------------------------------------------------------------------------------
# flash_mla_with_kvcache (sparse decode over paged FP8 caches)
# --------------------------------------------------------------------------------------------


def _blocks(cache, page_size, kv_format, indices, lengths, rows: slice, keys: int):
    """``(keys [n, k, 512] fp32, valid [n, k])`` blocks of ``k`` index columns of the query rows
    ``rows`` (of ``indices [R, K]``, per-row ``lengths [R]`` or ``None``). An entry counts iff it
    is not a ``-1`` hole and ``j < length``; other entries read nothing (slot 0, then zeroed)."""
    for j in range(0, indices.shape[1], keys):
        idx = indices[rows, j : j + keys]
        valid = idx >= 0
        if lengths is not None:
            column = torch.arange(j, j + idx.shape[1], device=idx.device)
            valid &= column < lengths[rows, None]
        yield layout.gather_dequant(cache, page_size, torch.where(valid, idx, 0), torch.float32, kv_format), valid


def flash_mla_with_kvcache(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format=layout.V4, extra_kv_format=None,
    batch_invariant=False,
):
    batch, s_q, heads = q.shape[:3]
    rows = batch * s_q
    out, lse = decode_outputs(q, head_dim_v)  # [B, s_q, H, dv], [B, H, s_q]
    if rows == 0:
        return out, lse
    # per cache: (cache, page size, format, slots [rows, K], lengths per query row [rows] or None)
    caches = [(k_cache, page_size, kv_format, indices, topk_length)]
    if extra_k_cache is not None:
        caches.append((extra_k_cache, extra_page_size, extra_kv_format or kv_format, extra_indices,
                       extra_topk_length))
    caches = [
        (c, p, f, i.reshape(rows, i.shape[-1]), None if n is None else n.repeat_interleave(s_q))
        for c, p, f, i, n in caches
    ]

    step, keys = _plan(rows, max(c[3].shape[1] for c in caches), heads)
    q_rows = q.reshape(rows, heads, layout.HEAD_DIM)
    out_rows, lse_rows = out.view(rows, heads, head_dim_v), lse.transpose(1, 2).view(rows, heads)
    for sl in _row_steps(rows, step, batch_invariant):
        blocks = (block for c, p, f, i, n in caches for block in _blocks(c, p, f, i, n, sl, keys))
        o, _, l = sparse_attention(_rows(q_rows, sl, batch_invariant), blocks, softmax_scale, attn_sink)
        out_rows[sl] = o[..., :head_dim_v].to(out.dtype)
        lse_rows[sl] = l
    return out, lse


def get_mla_metadata(q, indices, topk_length, extra_indices, extra_topk_length):
    """No scheduler here: zeros of the device's metadata geometry (``metadata_outputs``; empty
    off CUDA), which the decode of every provider without a scheduler ignores."""
    meta, splits = metadata_outputs(q)
    return meta.zero_(), splits.zero_()


def get_mla_metadata_stacked(q, topk, topk_length, extra_topk, extra_topk_length):
    """:func:`get_mla_metadata`'s zeros, ``len(topk)`` of them stacked."""
    meta, splits = metadata_outputs(q, len(topk))
    return meta.zero_(), splits.zero_()


# --------------------------------------------------------------------------------------------
# flash_mla_sparse_fwd (sparse prefill over a bf16 workspace)
# --------------------------------------------------------------------------------------------


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, batch_invariant=False):
    s_q, heads = q.shape[:2]
    out, max_logits, lse = prefill_outputs(q, d_v)
    if s_q == 0:
        return out, max_logits, lse
    idx = indices[:, 0, :]  # [s_q, K]; one KV head
    s_kv = kv.shape[0]
    kv_rows = kv[:, 0, :] if s_kv > 0 else kv.new_zeros(1, kv.shape[-1])  # d_qk 512 or 576

    def blocks(rows: slice, keys: int):
        """Blocks of ``keys`` columns; an entry counts iff ``0 <= idx < s_kv`` and ``j < length``."""
        for j in range(0, idx.shape[1], keys):
            block = idx[rows, j : j + keys]
            valid = (block >= 0) & (block < s_kv)
            if topk_length is not None:
                column = torch.arange(j, j + block.shape[1], device=block.device)
                valid &= column < topk_length[rows, None]
            yield kv_rows[torch.where(valid, block, 0).long()], valid

    step, keys = _plan(s_q, idx.shape[1], heads)
    for sl in _row_steps(s_q, step, batch_invariant):
        o, m, l = sparse_attention(_rows(q, sl, batch_invariant), blocks(sl, keys), sm_scale, attn_sink)
        out[sl] = o[..., :d_v].to(out.dtype)
        max_logits[sl], lse[sl] = m, l
    return out, max_logits, lse


# --------------------------------------------------------------------------------------------
# indexer_logits (the lightning indexer's block scores)
# --------------------------------------------------------------------------------------------

def indexer_logits(q, weights, keys, block_slots, batch_invariant=False):
    """``logits[t, k] = sum_h w[t, h] relu(<q[t, h], keys[slot]>)``, ``-inf`` where the slot is
    ``-1`` (:func:`_block_logits`)."""
    if keys.shape[0] == 0:  # every slot is -1 (data checks): nothing is visible
        return indexer_logits_output(q, block_slots).fill_(float("-inf"))

    def gather(slots, out):
        torch.index_select(keys, 0, slots, out=out)

    return _block_logits(q, weights, block_slots, gather, 0, batch_invariant)


def _block_logits(q, weights, block_slots, gather, key_bytes: int, batch_invariant: bool = False):
    """``logits[t, k] = sum_h w[t, h] relu(<q[t, h], key(slot)>)``, ``-inf`` where the slot is
    ``-1``, float32, ``gather(slots, out)`` writing the float32 keys of ``slots >= 0`` into ``out``
    (``key_bytes``: the temporaries it holds per key): in blocks of rows and columns whose gathered
    keys and scores (two buffers allocated once and reused, so the peak does not depend on the
    allocator's reuse of freed blocks) fit in :data:`CHUNK_BYTES`; one row at a time in the
    batch-invariant mode (:func:`_row_steps`)."""
    tokens, heads, dim = q.shape
    width = block_slots.shape[1]
    logits = indexer_logits_output(q, block_slots)
    if tokens == 0 or width == 0:
        return logits
    # a gathered key and a score per head (float32); slot, mask, sum; the gather's temporaries
    per_entry = 4 * (dim + heads) + 24 + key_bytes
    cols = max(1, min(width, CHUNK_BYTES // per_entry))
    rows = 1 if batch_invariant else max(1, min(tokens, CHUNK_BYTES // (per_entry * cols)))
    gathered, scores = q.new_empty(rows * cols * dim), q.new_empty(rows * heads * cols)
    for sl in _row_steps(tokens, rows, batch_invariant):
        qt, wt = _rows(q, sl, batch_invariant), _rows(weights, sl, batch_invariant)[:, :, None]
        for k in range(0, width, cols):
            slots = block_slots[sl, k : k + cols]
            n, c = slots.shape
            keys_nc = gathered[: n * c * dim].view(n, c, dim)
            gather(slots.clamp_min(0).flatten(), keys_nc.view(n * c, dim))
            s = torch.bmm(qt, keys_nc.transpose(1, 2), out=scores[: n * heads * c].view(n, heads, c))
            block = s.relu_().mul_(wt).sum(1)  # [n, c]
            logits[sl, k : k + c] = block.masked_fill_(slots < 0, float("-inf"))
    return logits


# --------------------------------------------------------------------------------------------
# indexer_store, indexer_cache_logits (the paged indexer key cache)
# --------------------------------------------------------------------------------------------

#: Bytes of temporaries per key while the indexer store quantizes it, or a logits step gathers and
#: dequantizes it (records, codes, float32 values and their intermediates; generous).
INDEX_KEY_BYTES = 32 * layout.INDEX_HEAD_DIM


def indexer_store(keys, index_cache, slots, page_size, index_format=layout.INDEX_FP8):
    """The bytes of :func:`layout.quantize_index` of each key at its slot (negative: skipped), in
    blocks of keys whose temporaries fit in :data:`CHUNK_BYTES`."""
    fmt = index_format

    def encode(rows):
        codes, scales = layout.quantize_index(keys[rows], fmt)
        data = codes.contiguous().view(torch.uint8).view(-1, fmt.data_bytes)
        return data, data[:, :0] if scales is None else scales.contiguous().view(torch.uint8).view(-1, fmt.scale_bytes)

    _store(layout.index_records(index_cache, page_size, fmt), page_size, slots, encode, INDEX_KEY_BYTES)


def indexer_cache_logits(q, weights, index_cache, block_slots, page_size, index_format=layout.INDEX_FP8,
                         q_scales=None, batch_invariant=False):
    """:func:`_block_logits` of the dequantized queries against the dequantized keys
    (:func:`layout.dequant_index`: exact; then float32 products and sums)."""
    queries = layout.dequant_index(q, q_scales, index_format)

    def gather(slots, out):
        out.copy_(layout.gather_index_keys(index_cache, page_size, slots, index_format))

    return _block_logits(queries, weights, block_slots, gather, INDEX_KEY_BYTES, batch_invariant)


# --------------------------------------------------------------------------------------------
# indexer_topk (the indexer's selection)
# --------------------------------------------------------------------------------------------

def topk_keys(logits: torch.Tensor) -> torch.Tensor:
    """One distinct int64 per entry whose order is the op's order (docs/design.md §2.9): the float32
    bits made monotone (``-0.0`` as ``0.0``, every NaN as one NaN above ``+inf``) in the high
    word, ``2^31 - 1 - column`` in the low word (equal values: the lower column ranks higher)."""
    x = torch.where(logits.isnan(), float("nan"), logits + 0.0)  # -0.0 + 0.0 = +0.0
    bits = x.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    column = torch.arange(logits.shape[1], device=logits.device)
    return (ordered << 32) | ((1 << 31) - 1 - column)


def indexer_topk(logits, k):
    """The ``k`` largest :func:`topk_keys` of each row (distinct, so the set is unique), their
    columns in ascending order; rows in chunks whose keys and selection fit in :data:`CHUNK_BYTES`."""
    tokens, width = logits.shape
    out = indexer_topk_output(logits, k)
    if tokens == 0 or k == 0:
        return out
    # per entry ~40 bytes of temporaries (the keys, then topk's); half the chunk, for allocator slack
    rows = max(1, CHUNK_BYTES // (128 * width))
    for t in range(0, tokens, rows):
        best = topk_keys(logits[t : t + rows]).topk(k, dim=1, sorted=False).indices
        out[t : t + rows] = best.sort(dim=1).values
    return out


# --------------------------------------------------------------------------------------------
# indexer_cache_topk (the selection over the paged indexer key cache, through a block table)
# --------------------------------------------------------------------------------------------

#: Bytes an entry of a group's visible slots (int64) and logits (float32) in ``dsv4::indexer_cache_topk``.
CACHE_TOPK_ENTRY_BYTES = 12


def cache_topk_in_groups(group_logits, topk, rows: int, q, lengths, k, width):
    """``dsv4::indexer_cache_topk`` in groups of ``rows`` rows: ``topk(group_logits(sl, visible), k)``
    of each group's slice ``sl`` of the queries (``visible``: their lengths; the logits ``[rows,
    width]``, ``-inf`` past each row's length), ``-1`` where a column is past the row's length (a
    row with at most ``k`` visible blocks takes them all, in order). A row's result depends on its
    group only through ``group_logits``: the selection is exact."""
    tokens = q.shape[0]
    if tokens == 0 or k == 0:
        return indexer_cache_topk_output(q, k)
    if k >= width:  # every visible block, in order
        order = torch.arange(k, device=q.device)
        return torch.where(order < lengths[:, None], order, -1)
    groups = []
    for t in range(0, tokens, rows):
        sl = slice(t, t + rows)
        visible = lengths[sl]
        # a row with at most k visible blocks: its top k are those blocks (above -inf, or equal
        # to -inf at lower columns), then the lowest invisible columns, which become -1
        best = topk(group_logits(sl, visible), k)
        groups.append(best.masked_fill_(best >= visible[:, None], -1))
    return groups[0] if len(groups) == 1 else torch.cat(groups)


#: Bytes of one group's visible slots and logits in ``dsv4::indexer_cache_topk``: the two ops it
#: runs per group hold up to :data:`CHUNK_BYTES` more of their own.
CACHE_TOPK_GROUP_BYTES = CHUNK_BYTES // 4


def indexer_cache_topk(q, weights, index_cache, block_table, table_rows, lengths, page_size, k,
                       index_format=layout.INDEX_FP8, q_scales=None, batch_invariant=False):
    """:func:`indexer_topk` of :func:`indexer_cache_logits` over each row's visible blocks
    (:func:`layout.visible_slots`), in groups of rows within :data:`CACHE_TOPK_GROUP_BYTES`
    (:func:`cache_topk_in_groups`)."""
    width = block_table.shape[1] * page_size

    def group_logits(sl, visible):
        slots = layout.visible_slots(block_table, table_rows[sl].long(), visible.long(), page_size, width)
        return indexer_cache_logits(q[sl], weights[sl], index_cache, slots, page_size, index_format,
                                    None if q_scales is None else q_scales[sl], batch_invariant)

    rows = max(1, CACHE_TOPK_GROUP_BYTES // (CACHE_TOPK_ENTRY_BYTES * width))
    return cache_topk_in_groups(group_logits, indexer_topk, rows, q, lengths, k, width)


# --------------------------------------------------------------------------------------------
# rope_ (the RoPE of the last 64 dims, in place)
# --------------------------------------------------------------------------------------------


def rope_(x, freqs, positions, inverse=False):
    """``x[..., -64:] = rope(x[..., -64:])`` (:func:`rope`, rounded to ``x``'s dtype), in blocks of
    tokens whose float32 temporaries fit in :data:`CHUNK_BYTES`."""
    if x.numel() == 0:
        return
    tail = x[..., -layout.ROPE_DIM :]
    # ~6 float32 temporaries of the tail per token
    step = max(1, CHUNK_BYTES // (24 * tail[0].numel()))
    for t in range(0, x.shape[0], step):
        rows = slice(t, t + step)
        tail[rows] = rope(tail[rows], freqs, positions[rows], inverse)


KERNELS = {
    "fused_k_norm_rope_flashmla": fused_k_norm_rope_flashmla,
    "quantize_store": quantize_store,
    "flash_mla_with_kvcache": flash_mla_with_kvcache,
    "flash_mla_sparse_fwd": flash_mla_sparse_fwd,
    "get_mla_metadata": get_mla_metadata,
    "get_mla_metadata_stacked": get_mla_metadata_stacked,
    "indexer_logits": indexer_logits,
    "indexer_topk": indexer_topk,
    "indexer_store": indexer_store,
    "indexer_cache_logits": indexer_cache_logits,
    "indexer_cache_topk": indexer_cache_topk,
    "rope_": rope_,
}

dispatch.register_provider(dispatch.Provider(
    dispatch.REFERENCE, "*", lambda device: KERNELS, fallback=True, checks_data=True,
    invariant=dict.fromkeys(("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "indexer_logits", "indexer_cache_logits",
                             "indexer_cache_topk")),
))
