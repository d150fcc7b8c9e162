"""A CPU stand-in for sgl-kernel-xpu's ``sgl_kernel`` module, for the XPU adapter tests.

It has the library's Python signatures (``sgl_kernel.flash_mla_with_kvcache``,
``flash_mla_sparse_fwd``, ``fused_k_norm_rope_flashmla``, as exported at its top level) and makes
the same input checks: the Python-side ``assert``s raise ``AssertionError``, the checks the library
makes in its compiled kernels raise ``RuntimeError``, and the requirements it does not check but
relies on (raw int32/float32 pointers, contiguous rows) raise ``RuntimeError`` too. It computes with
the reference kernels, reading the cache through what the 4-D view points at (its page count, page
size and page stride), under the library's rules: an index column counts iff it is below
``topk_length`` and its slot lies in ``[0, capacity)``; a store slot below 0 is skipped.

Every call is appended to :data:`calls` with its positional and keyword arguments as received.
Called with meta tensors it checks its inputs and returns its outputs unwritten (shapes only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dsv4_compile import layout
from dsv4_compile.providers import reference


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict


calls: list[Call] = []


def _recorded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls.append(Call(fn.__name__, args, kwargs))
        return fn(*args, **kwargs)

    return wrapper


def _check(condition: bool, message: str) -> None:
    """A check the library makes in compiled code (or relies on): ``RuntimeError`` like TORCH_CHECK."""
    if not condition:
        raise RuntimeError(message)


def _int32_rows(name: str, t: torch.Tensor | None, rows: int) -> None:
    if t is not None:
        _check(t.dtype == torch.int32 and t.shape == (rows,) and t.is_contiguous(),
               f"{name} must be contiguous int32 [{rows}], got {t.dtype} {list(t.shape)}")


def _sink(t: torch.Tensor | None, heads: int) -> None:
    if t is not None:
        _check(t.dtype == torch.float32 and t.shape == (heads,) and t.is_contiguous(),
               f"attn_sink must be contiguous float32 [{heads}]")


def _base_of(view: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The uint8 pages ``[num_pages, stride(0)]`` a ``[num_pages, P, 1, 584]`` view points at, and P."""
    pages, page_size = view.shape[0], view.shape[1]
    base = view.view(torch.uint8).as_strided(
        (pages, view.stride(0)), (view.stride(0), 1), view.storage_offset()
    )
    return base, page_size


def _counted_slots(indices, lengths, capacity):
    """``[n, K]`` slots with every column the library ignores set to -1."""
    col = torch.arange(indices.shape[-1])
    valid = (indices >= 0) & (indices < capacity)
    if lengths is not None:
        valid &= col < lengths[:, None]
    return torch.where(valid, indices, -1)


@_recorded
def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
    head_dim_v: int = 512,
    tile_scheduler_metadata: Optional[torch.Tensor] = None,
    num_splits: Optional[torch.Tensor] = None,
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
    # Python-side asserts
    assert tile_scheduler_metadata is None, "tile_scheduler_metadata is not supported for xpu"
    assert num_splits is None, "num_splits is not supported for xpu"
    assert not causal, "causal attention is not supported for xpu"
    assert q.ndim == 4, f"q must be 4D [B, s_q, H, D_qk], got {q.ndim}D"
    assert k_cache.ndim == 4, f"k_cache must be 4D [num_pages, P, 1, D], got {k_cache.ndim}D"
    batch, s_q, heads, d_qk = q.shape
    if softmax_scale is None:
        softmax_scale = d_qk**-0.5
    assert q.dtype == torch.bfloat16, f"q.dtype must be bf16, got {q.dtype}"
    out = q.new_empty((batch, s_q, heads, head_dim_v))
    lse = torch.empty((batch, heads, s_q), dtype=torch.float32, device=q.device)
    if block_table is not None:  # dense paged decode: not implemented, outputs left unwritten
        assert cache_seqlens is not None, "block_table path is not enabled yet for xpu"
        return out, lse
    assert indices is not None, "indices must be provided for sparse decode path"
    if topk_length is not None:
        assert topk_length.device == q.device and topk_length.dtype == torch.int32
        assert topk_length.shape == (batch,), "topk_length must be int32 [B]"
    if attn_sink is not None:
        assert attn_sink.device == q.device and attn_sink.dtype == torch.float32
        assert attn_sink.shape == (heads,), "attn_sink must be float32 [H]"
    if (extra_k_cache is None) ^ (extra_indices_in_kvcache is None):
        raise AssertionError("extra_k_cache and extra_indices_in_kvcache must be provided together")
    if extra_indices_in_kvcache is not None:
        assert extra_indices_in_kvcache.dtype == torch.int32
        assert extra_indices_in_kvcache.device == q.device
        assert extra_indices_in_kvcache.shape[:2] == (batch, s_q), "extra indices must be [B, s_q, *]"
    if extra_topk_length is not None:
        assert extra_topk_length.device == q.device and extra_topk_length.dtype == torch.int32
        assert extra_topk_length.shape == (batch,), "extra_topk_length must be int32 [B]"

    # compiled-side checks
    _check(q.is_contiguous() and indices.is_contiguous(), "q and indices must be contiguous")
    _check(s_q == 1, "q must have shape [B, 1, H, D_qk] (decode-only)")
    _check(indices.dim() == 3 and indices.shape[0] == batch and indices.shape[1] == 1,
           "indices must have shape [B, 1, topk]")
    _check(indices.dtype == torch.int32, "indices must be int32")
    _check(k_cache.shape[2] == 1, "k_cache must have shape [num_pages, page_size, 1, D]")
    _check(k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[3] == layout.TOKEN_BYTES,
           "k_cache must use the DeepSeek V4 FP8 packed layout: dtype=float8_e4m3fn, last_dim=584")
    _check(heads % 8 == 0, "num_heads must be a multiple of 8")
    _check(head_dim_v == 512, "head_dim_v must be 512")
    _check(d_qk == 512, "d_qk must be 512")
    _check(is_fp8_kvcache, "2-stage sparse MLA decode requires the FP8 packed KV cache")
    _sink(attn_sink, heads)
    if extra_k_cache is not None:
        _check(extra_k_cache.dim() == 4 and extra_k_cache.dtype == torch.float8_e4m3fn
               and extra_k_cache.shape[2] == 1 and extra_k_cache.shape[3] == layout.TOKEN_BYTES,
               "extra_k_cache must use the FP8 packed layout [num_pages, P, 1, 584]")
        _check(extra_indices_in_kvcache.dim() == 3 and extra_indices_in_kvcache.stride(-1) == 1,
               "extra_indices must be [B, 1, extra_topk] with contiguous rows")
    width = indices.shape[2] + (0 if extra_k_cache is None else extra_indices_in_kvcache.shape[2])
    _check(batch > 0 and width > 0, "can_implement: b > 0 and topk + extra_topk > 0")
    if q.is_meta:
        return out, lse

    base, page_size = _base_of(k_cache)
    idx = _counted_slots(indices[:, 0], topk_length, base.shape[0] * page_size)[:, None]
    extra = (None, 1, None)
    if extra_k_cache is not None:
        extra_base, extra_page_size = _base_of(extra_k_cache)
        extra_idx = _counted_slots(
            extra_indices_in_kvcache[:, 0], extra_topk_length, extra_base.shape[0] * extra_page_size
        )[:, None]
        extra = (extra_base, extra_page_size, extra_idx)
    o, l = reference.flash_mla_with_kvcache(
        q, base, page_size, idx, None, attn_sink, extra[0], extra[1], extra[2], None,
        None, None, float(softmax_scale), head_dim_v,
    )
    out.copy_(o)
    lse.copy_(l)
    return out, lse


@_recorded
def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    output = torch.empty((q.shape[0], q.shape[1], d_v), device=q.device, dtype=q.dtype)
    max_logits = torch.empty((q.shape[0], q.shape[1]), device=q.device, dtype=torch.float32)
    lse = torch.empty((q.shape[0], q.shape[1]), device=q.device, dtype=torch.float32)

    # compiled-side checks (no Python asserts in the library's wrapper)
    _check(q.is_contiguous() and kv.is_contiguous() and indices.is_contiguous(),
           "q, kv and indices must be contiguous")
    _check(q.dim() == 3, "q must have shape [s_q, h_q, d_qk]")
    _check(kv.dim() == 3 and kv.shape[1] == 1, "kv must have shape [s_kv, 1, d_qk]")
    s_q, heads, d_qk = q.shape
    _check(indices.dim() == 3 and indices.shape[0] == s_q and indices.shape[1] == 1,
           "indices must have shape [s_q, 1, topk]")
    _check(indices.dtype == torch.int32, "indices must be int32")
    _check(heads % 8 == 0, "num_heads must be a multiple of 8")
    _check(q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16, "q and kv must be bfloat16")
    _check(d_v == 512, "head_dim_v must be 512")
    _check(d_qk in (512, 576) and kv.shape[2] == d_qk, "d_qk must be 512 or 576, kv's as q's")
    _sink(attn_sink, heads)
    _int32_rows("topk_length", topk_length, s_q)
    _check(s_q == 0 or indices.shape[2] > 0, "can_implement: topk > 0")
    if q.is_meta:
        return output, max_logits, lse

    idx = _counted_slots(indices[:, 0], topk_length, kv.shape[0])
    keys = kv[:, 0][idx.clamp_min(0).long()] if kv.shape[0] else kv.new_zeros(*idx.shape, d_qk)
    o, m, l = reference.sparse_attention(q, [(keys, idx >= 0)], sm_scale, attn_sink)
    output.copy_(o[..., :d_v])
    max_logits.copy_(m)
    lse.copy_(l)
    return output, max_logits, lse


@_recorded
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
    _check(kv.dim() == 2, "kv must be 2D [num_tokens, head_dim]")
    head_dim = kv.shape[1]
    _check(kv_weight.dim() == 1 and kv_weight.shape[0] == head_dim, "kv_weight must be [head_dim]")
    _check(kv.dtype == kv_weight.dtype, "kv and kv_weight must have the same dtype")
    _check(kv.dtype in (torch.float16, torch.bfloat16, torch.float32), "kv must be fp16/bf16/fp32")
    _check(freqs_cis.dtype == torch.float32 and freqs_cis.dim() == 2, "freqs_cis must be fp32 2D")
    rope_dim = freqs_cis.shape[1]
    _check(rope_dim % 2 == 0 and 0 < rope_dim <= head_dim, "rope_dim must be even, in (0, head_dim]")
    _check(positions.dim() == 1 and positions.dtype in (torch.int32, torch.int64),
           "positions must be 1D int32/int64")
    _check(out_loc.dim() == 1 and out_loc.dtype == torch.int32, "out_loc must be 1D int32")
    _check(kvcache.dim() == 2 and kvcache.dtype == torch.uint8, "kvcache must be 2D uint8")
    _check(kv.stride(-1) == 1, "kv must be contiguous in its last dimension")
    for name, t in (("kv_weight", kv_weight), ("freqs_cis", freqs_cis), ("positions", positions),
                    ("out_loc", out_loc)):
        _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(kvcache.stride(-1) == 1, "kvcache must be contiguous in its last dimension")
    num_tokens = kv.shape[0]
    _check(positions.shape[0] == num_tokens and out_loc.shape[0] == num_tokens,
           "positions and out_loc must have one entry per token")
    _check(page_size > 0 and page_size & (page_size - 1) == 0,
           f"page_size must be a power of 2, got {page_size}")
    _check(kvcache.stride(0) >= page_size * layout.TOKEN_BYTES,
           f"kvcache stride(0) must be at least page_size * {layout.TOKEN_BYTES}")
    if num_tokens == 0 or kv.is_meta:
        return
    pages = kvcache.as_strided((kvcache.shape[0], kvcache.stride(0)), (kvcache.stride(0), 1))
    reference.fused_k_norm_rope_flashmla(kv, kv_weight, freqs_cis, positions, out_loc, pages, eps, page_size)
