"""The reference kernels: plain PyTorch, the executable specification of every ``dsv4`` op.

They serve CPU tensors, and any device no other provider serves. They are written for clarity and
exactness first (fp32 math, the formulas of DESIGN.md §2), vectorised over tokens, and chunked
over query rows so memory stays bounded (:data:`CHUNK_BYTES`).

Arguments arrive validated: the op's kernel runs its checks (``ops.CHECKS``) before any provider,
data checks included (slots in range, lengths <= widths) — always on CPU, where reading values is
free, and in checked mode elsewhere.
"""

from __future__ import annotations

import math

import torch

from .. import checks, layout, ops

#: Upper bound on the bytes of dequantized keys gathered at once by decode and prefill.
CHUNK_BYTES = 128 << 20


# --------------------------------------------------------------------------------------------
# fused_k_norm_rope_flashmla
# --------------------------------------------------------------------------------------------


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest ``e`` with ``2**e >= max(1e-4, amax) / 448``, exactly (``ceil(log2(.))`` via frexp)."""
    scale = amax.clamp_min(layout.SCALE_MIN) / layout.FP8_MAX
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def quantize_token_records(
    kv: torch.Tensor, kv_weight: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm + RoPE + quantize ``T`` tokens into their ``[T, 576]`` data and ``[T, 8]`` scale records."""
    x = kv.float()
    # y = x * rsqrt(mean(x^2) + eps) * w, over all 512 dims, fp32
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * kv_weight.float()
    nope, rope = y[:, : layout.NOPE_DIM], y[:, layout.NOPE_DIM :]

    # interleaved (GPT-J) RoPE: (a, b) -> (a*c - b*s, a*s + b*c), freqs rows are (c0, s0, c1, s1, ...)
    cs = freqs[positions.long()].view(-1, layout.ROPE_DIM // 2, 2)
    cos, sin = cs[..., 0], cs[..., 1]
    a, b = rope.view(-1, layout.ROPE_DIM // 2, 2).unbind(-1)
    rope = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).view(-1, layout.ROPE_DIM)

    # 7 tiles of 64: UE8M0 scale 2**e (rounded up), value fp8(clamp(y / 2**e, -448, 448)), RNE
    tiles = nope.view(-1, layout.NUM_TILES, layout.TILE)
    e = ue8m0_exponent(tiles.abs().amax(-1))  # [T, 7] int32
    scaled = torch.ldexp(tiles, -e[..., None].to(torch.float32))
    fp8 = scaled.clamp(-layout.FP8_MAX, layout.FP8_MAX).to(torch.float8_e4m3fn)

    data = torch.cat(
        [fp8.view(-1, layout.NOPE_DIM).view(torch.uint8), rope.to(torch.bfloat16).view(torch.uint8)],
        dim=-1,
    )
    pad = torch.zeros_like(e[:, :1])
    scales = torch.cat([e + layout.UE8M0_BIAS, pad], dim=-1).to(torch.uint8)
    return data, scales


def fused_k_norm_rope_flashmla(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size):
    keep = out_loc >= 0  # negative slots are not written
    kv, positions, out_loc = kv[keep], positions[keep], out_loc[keep].long()
    if out_loc.numel() == 0:
        return
    data, scales = quantize_token_records(kv, kv_weight, freqs, positions, eps)
    page, offset = layout.page_and_offset(out_loc, page_size)
    rows = page[:, None]
    data_cols = offset[:, None] * layout.DATA_BYTES + torch.arange(layout.DATA_BYTES, device=kv.device)
    scale_cols = (
        page_size * layout.DATA_BYTES
        + offset[:, None] * layout.SCALE_BYTES
        + torch.arange(layout.SCALE_BYTES, device=kv.device)
    )
    kvcache[rows, data_cols] = data
    kvcache[rows, scale_cols] = scales


# --------------------------------------------------------------------------------------------
# Sparse attention core shared by decode and prefill
# --------------------------------------------------------------------------------------------


def sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float, attn_sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``q [n, H, D]`` over per-row keys ``keys [n, K, D]`` (V = K) where ``valid [n, K]``.

    ``s_j = scale * <q, K_j>``; ``lse = ln sum_j e^{s_j}`` (sink excluded, ``+inf`` for an empty
    row); ``out = sum_j e^{s_j} K_j / (sum_j e^{s_j} + e^{sink_h})`` (0 for an empty row);
    ``max_logits = max_j s_j`` (``-inf`` for an empty row). All fp32.
    """
    scores = torch.einsum("nhd,nkd->nhk", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    # [n, H]; amax refuses an empty dim: a row with no index column gets -inf directly
    max_logits = scores.amax(-1) if scores.shape[-1] else scores.new_full(scores.shape[:-1], -math.inf)
    empty = ~valid.any(-1)[:, None]  # [n, 1]
    lse = torch.logsumexp(scores, -1)  # -inf for empty rows
    weights = torch.exp(scores - lse[..., None]).nan_to_num(nan=0.0)  # softmax without the sink
    if attn_sink is not None:
        # sum e^s / (sum e^s + e^sink) = 1 / (1 + e^{sink - lse})
        weights = weights * torch.sigmoid(lse - attn_sink.float())[..., None]
    out = torch.einsum("nhk,nkd->nhd", weights, keys.float())
    out = out.masked_fill(empty[..., None], 0.0)
    lse = lse.masked_fill(empty, math.inf)
    return out, max_logits, lse


def _rows_per_chunk(keys_per_row: int, heads: int) -> int:
    per_row = keys_per_row * (layout.HEAD_DIM + 2 * heads) * 4
    return max(1, CHUNK_BYTES // max(per_row, 1))


# --------------------------------------------------------------------------------------------
# flash_mla_with_kvcache (sparse decode over paged FP8 caches)
# --------------------------------------------------------------------------------------------


def _counted(indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Entries that count: ``j < topk_length`` of their batch row, and not a ``-1`` hole."""
    mask = checks.counted_mask(indices, lengths)
    return indices >= 0 if mask is None else (indices >= 0) & mask


def flash_mla_with_kvcache(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v,
):
    batch, s_q, heads = q.shape[:3]
    rows = batch * s_q
    # (cache, page size, slots [rows, K], counted [rows, K]) per cache: the main one, the extra one
    caches = [(k_cache, page_size, indices, topk_length)]
    if extra_k_cache is not None:
        caches.append((extra_k_cache, extra_page_size, extra_indices, extra_topk_length))
    caches = [(c, p, i.reshape(rows, -1), _counted(i, n).reshape(rows, -1)) for c, p, i, n in caches]

    step = _rows_per_chunk(sum(i.shape[1] for _, _, i, _ in caches), heads)
    out, lse = ops.decode_outputs(q, head_dim_v)  # [B, s_q, H, dv], [B, H, s_q]
    q_rows = q.reshape(rows, heads, layout.HEAD_DIM)
    out_rows, lse_rows = out.view(rows, heads, head_dim_v), lse.transpose(1, 2).view(rows, heads)
    for start in range(0, rows, step):
        sl = slice(start, start + step)
        keys = [
            layout.gather_dequant(c, p, torch.where(v[sl], i[sl], 0), torch.float32)
            for c, p, i, v in caches
        ]
        valid = torch.cat([v[sl] for _, _, _, v in caches], 1)
        o, _, l = sparse_attention(q_rows[sl], torch.cat(keys, 1), valid, softmax_scale, attn_sink)
        out_rows[sl] = o[..., :head_dim_v].to(out.dtype)
        lse_rows[sl] = l
    return out, lse


def get_mla_metadata(q, indices, topk_length, extra_indices, extra_topk_length):
    """No scheduler here: two empty int32 tensors, which the decode ignores."""
    empty = torch.empty(0, dtype=torch.int32, device=q.device)
    return empty, empty.clone()


# --------------------------------------------------------------------------------------------
# flash_mla_sparse_fwd (sparse prefill over a bf16 workspace)
# --------------------------------------------------------------------------------------------


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    s_q, heads = q.shape[:2]
    idx = indices[:, 0, :]  # [s_q, K]; one KV head
    s_kv = kv.shape[0]
    valid = _counted(idx, topk_length) & (idx < s_kv)  # negative or >= s_kv: holes here
    safe = torch.where(valid, idx, 0).long()
    kv_rows = kv[:, 0, :]

    step = _rows_per_chunk(idx.shape[1], heads)
    out, max_logits, lse = ops.prefill_outputs(q, d_v)
    for start in range(0, s_q, step):
        sl = slice(start, start + step)
        keys = kv_rows[safe[sl]] if s_kv > 0 else kv_rows.new_zeros(*safe[sl].shape, layout.HEAD_DIM)
        o, m, l = sparse_attention(q[sl], keys, valid[sl], sm_scale, attn_sink)
        out[sl] = o[..., :d_v].to(out.dtype)
        max_logits[sl], lse[sl] = m, l
    return out, max_logits, lse


KERNELS = {
    "fused_k_norm_rope_flashmla": fused_k_norm_rope_flashmla,
    "flash_mla_with_kvcache": flash_mla_with_kvcache,
    "flash_mla_sparse_fwd": flash_mla_sparse_fwd,
    "get_mla_metadata": get_mla_metadata,
}
