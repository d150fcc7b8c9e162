"""sgl-kernel-xpu's DSV4 Python interface over the ``dsv4`` ops, on every device.

``from dsv4_compile.compat import sgl_kernel`` replaces ``import sgl_kernel`` (sgl-kernel-xpu, on
Intel GPUs) at the DSV4 call sites: ``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd`` and
``fused_k_norm_rope_flashmla`` keep their names, keyword signatures and return values, and run
wherever a ``dsv4`` provider does (sgl-kernel-xpu itself on XPU, FlashMLA or Triton on CUDA, the
reference on CPU).

Upstream's conventions kept: an index counts iff it is in ``[0, capacity)`` (``-1`` and any other
out-of-range value are holes: mapped to ``-1`` here, an elementwise op without a sync);
``softmax_scale`` defaults to ``d_qk ** -0.5``; prefill returns three tensors, natural log; the
store takes the uint8 base cache, ``freqs_cis`` real interleaved ``[max_pos, 64]`` (or complex
``[max_pos, 32]``), int32/int64 ``out_loc`` with negative slots skipped (any page size here, not
only powers of two).

Arguments: ``tile_scheduler_metadata`` / ``num_splits`` as in :mod:`.flash_mla` (``None``, a
scheduler object, or the metadata tensors; upstream XPU accepts ``None`` only); ``causal`` must be
``False`` and ``is_fp8_kvcache`` ``True`` (the DSV4 caches are quantized; upstream's bf16-cache
path is not a DSV4 op); ``block_table`` / ``cache_seqlens`` must be ``None`` (upstream's dense
path, not enabled there either). The cache views are ``[num_pages, P, 1, token_bytes]`` as in
:mod:`.flash_mla` (584: V4; 528 / 288: V4.1 interleaved).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import ops
from .flash_mla import sparse_decode


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
    head_dim_v: int = 512,
    tile_scheduler_metadata=None,
    num_splits=None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode, sgl-kernel-xpu's signature: ``(out [B, s_q, H, 512], lse [B, H, s_q])``."""
    if block_table is not None or cache_seqlens is not None:
        raise ValueError("block_table and cache_seqlens must be None: the dense path is not a DSV4 op")
    if causal:
        raise ValueError("causal must be False: sparse decoding has no causal mask")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache must be True: the DSV4 caches are quantized")
    if indices is None:
        raise ValueError("indices must be given (sparse decode)")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache must be given together")
    return sparse_decode(
        q, k_cache, extra_k_cache, indices, extra_indices_in_kvcache, topk_length, extra_topk_length,
        attn_sink, tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, use_legacy=False,
        out_of_range_holes=True,
    )


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill, sgl-kernel-xpu's signature: ``(out, max_logits, lse)``, natural log;
    ``d_qk`` 512 or 576."""
    return ops.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


def fused_k_norm_rope_flashmla(
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    eps: float,
    page_size: int,
) -> None:
    """The fused K norm + RoPE + V4 FP8 store into the uint8 base cache ``kvcache``."""
    ops.fused_k_norm_rope_flashmla(kv, kv_weight, freqs_cis, positions, out_loc, kvcache, eps, page_size)
