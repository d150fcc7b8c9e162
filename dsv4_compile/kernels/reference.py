"""The reference kernels: plain PyTorch, the executable specification of every ``dsv4`` op.

They serve CPU tensors, and any device no other provider serves. They are written for clarity and
exactness first (fp32 math, the formulas of docs/design.md §2), vectorised over tokens, and chunked
over tokens, query rows and keys so memory stays bounded (:data:`CHUNK_BYTES`) whatever the sizes.

Arguments arrive validated: the op's kernel runs its checks (``ops.CHECKS``) before any provider,
data checks included (slots in range, lengths <= widths) — always on CPU, where reading values is
free, and in checked mode elsewhere.
"""

from __future__ import annotations

import math

import torch

from .. import dispatch, layout, ops

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
    """Smallest ``e`` with ``2**e >= max(1e-4, amax) / 448``, exactly (``ceil(log2(.))`` via frexp)."""
    scale = amax.clamp_min(layout.SCALE_MIN) / layout.FP8_MAX
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def quantize_token_records(
    kv: torch.Tensor, kv_weight: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm + RoPE + quantize ``T`` tokens into their ``[T, 576]`` data and ``[T, 8]`` scale records.

    A token whose normed, rotated values are not all finite (a NaN or Inf in ``kv``, the weight or
    its ``freqs`` row, or an overflow) is stored as a NaN token: every fp8 byte ``0x7F`` (NaN), every
    bf16 value ``0x7FC0`` (NaN), every scale byte ``0xFF`` (UE8M0 NaN), pad byte 0.
    """
    y = rms_norm(kv, kv_weight, eps)
    nope, rope = y[:, : layout.NOPE_DIM], y[:, layout.NOPE_DIM :]

    # interleaved (GPT-J) RoPE: (a, b) -> (a*c - b*s, a*s + b*c), freqs rows are (c0, s0, c1, s1, ...)
    cs = freqs[positions.long()].view(-1, layout.ROPE_DIM // 2, 2)
    cos, sin = cs[..., 0], cs[..., 1]
    a, b = rope.view(-1, layout.ROPE_DIM // 2, 2).unbind(-1)
    rope = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).view(-1, layout.ROPE_DIM)

    # 7 tiles of 64: UE8M0 scale 2**e (rounded up), value fp8(clamp(y / 2**e, -448, 448)), RNE
    tiles = nope.view(-1, layout.NUM_TILES, layout.TILE)
    e = ue8m0_exponent(tiles.abs().amax(-1))  # [T, 7] int32
    scaled = tiles * _pow2(-e)[..., None]
    fp8 = scaled.clamp(-layout.FP8_MAX, layout.FP8_MAX).to(torch.float8_e4m3fn)

    data = torch.cat(
        [fp8.view(-1, layout.NOPE_DIM).view(torch.uint8), rope.to(torch.bfloat16).view(torch.uint8)],
        dim=-1,
    )
    pad = torch.zeros_like(e[:, :1])
    scales = torch.cat([e + layout.UE8M0_BIAS, pad], dim=-1).to(torch.uint8)
    finite = nope.isfinite().all(-1, keepdim=True) & rope.isfinite().all(-1, keepdim=True)
    data = torch.where(finite, data, layout.NAN_DATA_RECORD.to(data.device))
    scales = torch.where(finite, scales, layout.NAN_SCALE_RECORD.to(scales.device))
    return data, scales


def fused_k_norm_rope_flashmla(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size):
    data_records = layout.data_records(kvcache, page_size)
    scale_records = layout.scale_records(kvcache, page_size)
    step = max(1, CHUNK_BYTES // TOKEN_BYTES)
    for start in range(0, kv.shape[0], step):
        sl = slice(start, start + step)
        keep = out_loc[sl] >= 0  # negative slots are not written
        slots = out_loc[sl][keep].long()
        if slots.numel() == 0:
            continue
        data, scales = quantize_token_records(kv[sl][keep], kv_weight, freqs, positions[sl][keep], eps)
        page, offset = layout.page_and_offset(slots, page_size)
        data_records[page, offset] = data
        scale_records[page, offset] = scales


# --------------------------------------------------------------------------------------------
# Sparse attention core shared by decode and prefill
# --------------------------------------------------------------------------------------------


def sparse_attention(
    q: torch.Tensor, key_blocks, scale: float, attn_sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``q [n, H, D]`` over per-row keys (V = K), given in blocks.

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
    acc = q.new_zeros(n, heads, q.shape[-1])
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
        acc = acc * alpha[..., None] + torch.einsum("nhk,nkd->nhd", p, keys)
        m = m_new
    empty = l == 0
    lse = torch.where(empty, math.inf, m + torch.log(l))
    factor = 1.0 / l
    if attn_sink is not None:
        # sum e^s / (sum e^s + e^sink) = 1 / (1 + e^{sink - lse})
        factor = factor * torch.sigmoid(lse - attn_sink.float())
    factor = torch.where(empty, 0.0, factor)
    return acc * factor[..., None], m, lse


def _plan(rows: int, width: int, heads: int) -> tuple[int, int]:
    """``(rows, keys)`` per step so that a step's temporaries stay within :data:`CHUNK_BYTES`:
    up to 1024 keys per block, then as many rows as fit (at least one)."""
    keys = max(1, min(width, 1024))
    per_row = keys * (KEY_BYTES + SCORE_BYTES * heads) + 3 * heads * layout.HEAD_DIM * 4
    return max(1, min(rows, CHUNK_BYTES // per_row)), keys


# --------------------------------------------------------------------------------------------
# flash_mla_with_kvcache (sparse decode over paged FP8 caches)
# --------------------------------------------------------------------------------------------


def _blocks(cache, page_size, indices, lengths, rows: slice, keys: int):
    """``(keys [n, k, 512] fp32, valid [n, k])`` blocks of ``k`` index columns of the query rows
    ``rows`` (of ``indices [R, K]``, per-row ``lengths [R]`` or ``None``). An entry counts iff it
    is not a ``-1`` hole and ``j < length``; other entries read nothing (slot 0, then zeroed)."""
    for j in range(0, indices.shape[1], keys):
        idx = indices[rows, j : j + keys]
        valid = idx >= 0
        if lengths is not None:
            column = torch.arange(j, j + idx.shape[1], device=idx.device)
            valid &= column < lengths[rows, None]
        yield layout.gather_dequant(cache, page_size, torch.where(valid, idx, 0), torch.float32), valid


def flash_mla_with_kvcache(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v,
):
    batch, s_q, heads = q.shape[:3]
    rows = batch * s_q
    out, lse = ops.decode_outputs(q, head_dim_v)  # [B, s_q, H, dv], [B, H, s_q]
    if rows == 0:
        return out, lse
    # per cache: (cache, page size, slots [rows, K], lengths per query row [rows] or None)
    caches = [(k_cache, page_size, indices, topk_length)]
    if extra_k_cache is not None:
        caches.append((extra_k_cache, extra_page_size, extra_indices, extra_topk_length))
    caches = [
        (c, p, i.reshape(rows, i.shape[-1]), None if n is None else n.repeat_interleave(s_q))
        for c, p, i, n in caches
    ]

    step, keys = _plan(rows, max(i.shape[1] for _, _, i, _ in caches), heads)
    q_rows = q.reshape(rows, heads, layout.HEAD_DIM)
    out_rows, lse_rows = out.view(rows, heads, head_dim_v), lse.transpose(1, 2).view(rows, heads)
    for start in range(0, rows, step):
        sl = slice(start, start + step)
        blocks = (block for c, p, i, n in caches for block in _blocks(c, p, i, n, sl, keys))
        o, _, l = sparse_attention(q_rows[sl], blocks, softmax_scale, attn_sink)
        out_rows[sl] = o[..., :head_dim_v].to(out.dtype)
        lse_rows[sl] = l
    return out, lse


def get_mla_metadata(q, indices, topk_length, extra_indices, extra_topk_length):
    """No scheduler here: zeros of the device's metadata geometry (``ops.metadata_outputs``; empty
    off CUDA), which the decode of every provider without a scheduler ignores."""
    meta, splits = ops.metadata_outputs(q)
    return meta.zero_(), splits.zero_()


# --------------------------------------------------------------------------------------------
# flash_mla_sparse_fwd (sparse prefill over a bf16 workspace)
# --------------------------------------------------------------------------------------------


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    s_q, heads = q.shape[:2]
    out, max_logits, lse = ops.prefill_outputs(q, d_v)
    if s_q == 0:
        return out, max_logits, lse
    idx = indices[:, 0, :]  # [s_q, K]; one KV head
    s_kv = kv.shape[0]
    kv_rows = kv[:, 0, :] if s_kv > 0 else kv.new_zeros(1, kv.shape[-1])

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
    for start in range(0, s_q, step):
        sl = slice(start, start + step)
        o, m, l = sparse_attention(q[sl], blocks(sl, keys), sm_scale, attn_sink)
        out[sl] = o[..., :d_v].to(out.dtype)
        max_logits[sl], lse[sl] = m, l
    return out, max_logits, lse


KERNELS = {
    "fused_k_norm_rope_flashmla": fused_k_norm_rope_flashmla,
    "flash_mla_with_kvcache": flash_mla_with_kvcache,
    "flash_mla_sparse_fwd": flash_mla_sparse_fwd,
    "get_mla_metadata": get_mla_metadata,
}

dispatch.register_provider(dispatch.Provider(
    dispatch.REFERENCE, "*", lambda device: KERNELS, fallback=True, checks_data=True,
))
