"""The cache stores (docs/design.md §2.1): ``dsv4::fused_k_norm_rope_flashmla`` (K RMSNorm + RoPE +
quantize + paged store) and ``dsv4::quantize_store`` (quantize + paged store).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import layout
from ..checks import F32, FLOAT_DTYPES, INDEX_DTYPES, Checker
from .registry import OpSpec, define

__all__ = ["fused_k_norm_rope_flashmla", "quantize_store"]  # the public wrappers (re-exported by the package)


class StoreCall(NamedTuple):
    """What a provider's rule may look at in a store call (either store op)."""

    page_size: int
    page_stride: int
    kv_format: layout.CacheFormat


# --------------------------------------------------------------------------------------------
# dsv4::fused_k_norm_rope_flashmla
# --------------------------------------------------------------------------------------------

_STORE = Checker("fused_k_norm_rope_flashmla")
_STORE_TENSORS = ("kv", "kv_weight", "freqs", "positions", "out_loc", "kvcache")


def check_store(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size, kv_format=layout.V4) -> int:
    c = _STORE
    c.same_device(_STORE_TENSORS, kv, kv_weight, freqs, positions, out_loc, kvcache)
    num_tokens = c.tensor("kv", kv, FLOAT_DTYPES, (None, layout.HEAD_DIM))[0]
    if kv.stride(1) != 1:
        c.fail("kv", "last-dim contiguous (stride(1) == 1)", f"strides {tuple(kv.stride())}")
    c.tensor("kv_weight", kv_weight, (kv.dtype,), (layout.HEAD_DIM,))
    c.tensor("freqs", freqs, F32, (None, layout.ROPE_DIM))
    c.tensor("positions", positions, INDEX_DTYPES, (num_tokens,))
    c.tensor("out_loc", out_loc, INDEX_DTYPES, (num_tokens,))
    c.cache("kvcache", kvcache, c.positive_int("page_size", page_size), c.kv_format("kv_format", kv_format))
    if type(eps) is not float or not eps >= 0.0:
        c.fail("eps", "a non-negative float", eps)
    return num_tokens


def check_store_data(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size, kv_format=layout.V4) -> None:
    if kv.shape[0] == 0:
        return
    c = _STORE
    c.slots_valid("out_loc", out_loc, layout.capacity(kvcache, page_size), holes="negative")
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= freqs.shape[0]:
        c.fail("positions", f"within [0, {freqs.shape[0]}) (rows of freqs)", f"values in [{lo}, {hi}]")


def _store_call(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size, kv_format):
    return page_size, kvcache.stride(0), kv_format


_STORE_OP = define(OpSpec(
    schema=(
        "fused_k_norm_rope_flashmla(Tensor kv, Tensor kv_weight, Tensor freqs, Tensor positions, "
        "Tensor out_loc, Tensor(a!) kvcache, float eps, int page_size, str kv_format=\"v4\") -> ()"
    ),
    check=check_store,
    check_data=check_store_data,
    float_inputs=("kv", "kv_weight", "freqs"),
    call=StoreCall,
    call_fields=_store_call,
    formats=("kv_format",),
))


def fused_k_norm_rope_flashmla(
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    eps: float,
    page_size: int,
    kv_format: str = "v4",
) -> None:
    """RMSNorm ``kv`` (weight ``kv_weight``), RoPE its dims 448..511, quantize, store at ``out_loc``.

    Args:
        kv: ``[T, 512]`` bf16/fp16/fp32 keys, last dim contiguous.
        kv_weight: ``[512]`` RMSNorm weight, dtype of ``kv``.
        freqs: the real ``float32 [max_pos, 64]`` table ``(cos_0, sin_0, cos_1, ...)`` or the
            complex ``freqs_cis [max_pos, 32]``.
        positions: ``[T]`` int32/int64 rows of ``freqs``.
        out_loc: ``[T]`` int32/int64 slots ``page * page_size + offset``; below 0: skipped.
        kvcache: the uint8 base cache (:func:`dsv4_compile.alloc_cache`), written in place.
        eps: the RMSNorm epsilon.
        page_size: tokens per page of ``kvcache``.
        kv_format: the cache's format (``layout.FORMATS``): ``"v4"`` (default) or a V4.1 one
            (norm, bf16, RoPE, bf16, then all 512 dims quantized).
    """
    if isinstance(freqs, torch.Tensor) and freqs.is_complex():
        freqs = torch.view_as_real(freqs).flatten(-2).float()
    _STORE_OP.run(kv, kv_weight, freqs, positions, out_loc, kvcache, float(eps), page_size, kv_format)


# --------------------------------------------------------------------------------------------
# dsv4::quantize_store
# --------------------------------------------------------------------------------------------

_QUANTIZE_STORE = Checker("quantize_store")
_QUANTIZE_STORE_TENSORS = ("kv", "out_loc", "kvcache")


def check_quantize_store(kv, out_loc, kvcache, page_size, kv_format=layout.V4) -> int:
    c = _QUANTIZE_STORE
    c.same_device(_QUANTIZE_STORE_TENSORS, kv, out_loc, kvcache)
    num_tokens = c.tensor("kv", kv, FLOAT_DTYPES, (None, layout.HEAD_DIM))[0]
    if kv.stride(1) != 1:
        c.fail("kv", "last-dim contiguous (stride(1) == 1)", f"strides {tuple(kv.stride())}")
    c.tensor("out_loc", out_loc, INDEX_DTYPES, (num_tokens,))
    c.cache("kvcache", kvcache, c.positive_int("page_size", page_size), c.kv_format("kv_format", kv_format))
    return num_tokens


def check_quantize_store_data(kv, out_loc, kvcache, page_size, kv_format=layout.V4) -> None:
    if kv.shape[0]:
        _QUANTIZE_STORE.slots_valid("out_loc", out_loc, layout.capacity(kvcache, page_size), holes="negative")


def _quantize_store_call(kv, out_loc, kvcache, page_size, kv_format):
    return page_size, kvcache.stride(0), kv_format


_QUANTIZE_STORE_OP = define(OpSpec(
    schema=(
        "quantize_store(Tensor kv, Tensor out_loc, Tensor(a!) kvcache, int page_size, "
        "str kv_format=\"v4\") -> ()"
    ),
    check=check_quantize_store,
    check_data=check_quantize_store_data,
    float_inputs=("kv",),
    call=StoreCall,
    call_fields=_quantize_store_call,
    formats=("kv_format",),
))


def quantize_store(
    kv: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int, kv_format: str = "v4",
) -> None:
    """Quantize ``kv`` as it is (no norm, no RoPE) and store it at ``out_loc``: for caches the
    model fills itself, e.g. the compressed (FP4) caches of DSV4.1.

    Args:
        kv: ``[T, 512]`` bf16/fp16/fp32 values, last dim contiguous (V4: dims 448..511 are stored
            as bf16).
        out_loc: ``[T]`` int32/int64 slots; below 0: skipped.
        kvcache: the uint8 base cache, written in place.
        page_size: tokens per page of ``kvcache``.
        kv_format: the cache's format (``layout.FORMATS``, default ``"v4"``).
    """
    _QUANTIZE_STORE_OP.run(kv, out_loc, kvcache, page_size, kv_format)
