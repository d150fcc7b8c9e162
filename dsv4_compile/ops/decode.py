"""The sparse decode over paged quantized caches and its scheduler (docs/design.md §2.3):
``dsv4::flash_mla_with_kvcache``, ``dsv4::get_mla_metadata``, ``dsv4::get_mla_metadata_stacked``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import dispatch, invariance, layout
from ..checks import BF16, F32, I32, MAX_INDEX_WIDTH, Checker, counted_mask
from .registry import OpSpec, define

__all__ = ["flash_mla_with_kvcache", "get_mla_metadata", "get_mla_metadata_stacked"]  # the public wrappers (re-exported by the package)


def decode_outputs(q: torch.Tensor, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``out [B, s_q, H, head_dim_v]`` bf16 (contiguous) and ``lse [B, H, s_q]`` fp32.

    ``lse`` is stored row-major as ``[B, s_q, H]`` and returned transposed (strides
    ``(s_q*H, 1, H)``), as FlashMLA allocates it; so one query row's statistics are contiguous and
    ``s_q = 1`` rows of an MTP batch map onto it without a copy.
    """
    batch, s_q, heads = q.shape[:3]
    out = q.new_empty(batch, s_q, heads, head_dim_v)
    lse = q.new_empty(batch, s_q, heads, dtype=torch.float32).transpose(1, 2)
    return out, lse


def metadata_outputs(q: torch.Tensor, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(tile_scheduler_metadata, num_splits)`` int32 of the shapes ``get_mla_metadata``
    returns on ``q.device``, whichever provider serves it (``dispatch.metadata_shapes``: FlashMLA's
    scheduler geometry on CUDA, ``(0,)`` each elsewhere); ``count``: that many stacked
    (``get_mla_metadata_stacked``'s ``[count, ...]``)."""
    batch, s_q, heads = q.shape[:3]
    stack = () if count is None else (count,)
    meta_shape, splits_shape = dispatch.metadata_shapes(q.device, batch, s_q, heads)
    return (
        q.new_empty(*stack, *meta_shape, dtype=torch.int32),
        q.new_empty(*stack, *splits_shape, dtype=torch.int32),
    )


# --------------------------------------------------------------------------------------------
# dsv4::flash_mla_with_kvcache
# --------------------------------------------------------------------------------------------


class DecodeCall(NamedTuple):
    """What a provider's rule may look at in a decode call (``extra_*``: 0 / ``None`` without an
    extra cache; ``extra_kv_format`` resolved: the main format when not given)."""

    page_size: int
    page_stride: int
    extra_page_size: int
    extra_page_stride: int
    kv_format: layout.CacheFormat
    extra_kv_format: layout.CacheFormat | None


_DECODE = Checker("flash_mla_with_kvcache")
_DECODE_TENSORS = ("q", "k_cache", "indices", "topk_length", "attn_sink", "extra_k_cache", "extra_indices",
                   "extra_topk_length", "tile_scheduler_metadata", "num_splits")


def check_decode(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format=layout.V4, extra_kv_format=None,
    batch_invariant=False,
) -> tuple[int, int, int]:
    c = _DECODE
    c.same_device(
        _DECODE_TENSORS, q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
        extra_topk_length, tile_scheduler_metadata, num_splits,
    )
    batch, s_q, heads, _ = c.tensor("q", q, BF16, (None, None, None, layout.HEAD_DIM))
    c.positive_int("page_size", page_size)
    fmt = c.kv_format("kv_format", kv_format)
    if fmt.values == "fp4":
        c.fail("kv_format", "an FP8 format for the main cache (FP4 serves only as the extra cache)", kv_format)
    c.cache("k_cache", k_cache, page_size, fmt)
    c.width("indices", indices, c.tensor("indices", indices, I32, (batch, s_q, None)))
    if topk_length is not None:
        c.tensor("topk_length", topk_length, I32, (batch,))
    if attn_sink is not None:
        c.tensor("attn_sink", attn_sink, F32, (heads,))
    if extra_k_cache is None:
        for arg, value in (("extra_indices", extra_indices), ("extra_topk_length", extra_topk_length),
                           ("extra_kv_format", extra_kv_format)):
            if value is not None:
                c.fail(arg, "None when extra_k_cache is None", value)
    else:
        c.positive_int("extra_page_size", extra_page_size)
        extra_fmt = fmt if extra_kv_format is None else c.kv_format("extra_kv_format", extra_kv_format)
        if extra_fmt.is_v4 != fmt.is_v4:
            c.fail("extra_kv_format", f"a {'V4' if fmt.is_v4 else 'V4.1'} format like kv_format={fmt.name!r}",
                   extra_fmt.name)
        c.cache("extra_k_cache", extra_k_cache, extra_page_size, extra_fmt)
        if extra_indices is None:
            c.fail("extra_indices", "an int32 [B, s_q, K2] tensor when extra_k_cache is given", None)
        c.width("extra_indices", extra_indices, c.tensor("extra_indices", extra_indices, I32, (batch, s_q, None)))
        if extra_topk_length is not None:
            c.tensor("extra_topk_length", extra_topk_length, I32, (batch,))
    if (tile_scheduler_metadata is None) != (num_splits is None):
        c.fail(
            "tile_scheduler_metadata/num_splits", "both None or both tensors (from get_mla_metadata)",
            (tile_scheduler_metadata, num_splits),
        )
    if tile_scheduler_metadata is not None:
        c.tensor("tile_scheduler_metadata", tile_scheduler_metadata, I32, (None,) * tile_scheduler_metadata.dim())
        c.tensor("num_splits", num_splits, I32, (None,) * num_splits.dim())
    if head_dim_v != layout.HEAD_DIM:
        c.fail("head_dim_v", f"{layout.HEAD_DIM} (V is the full key)", head_dim_v)
    if type(softmax_scale) is not float:
        c.fail("softmax_scale", "a float", softmax_scale, TypeError)
    c.flag("batch_invariant", batch_invariant)
    return batch, s_q, heads


def check_decode_data(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format=layout.V4, extra_kv_format=None,
    batch_invariant=False,
) -> None:
    c = _DECODE
    c.lengths_within("topk_length", topk_length, indices.shape[-1])
    c.slots_valid("indices", indices, layout.capacity(k_cache, page_size), counted_mask(indices, topk_length))
    if extra_k_cache is not None:
        c.lengths_within("extra_topk_length", extra_topk_length, extra_indices.shape[-1])
        c.slots_valid("extra_indices", extra_indices, layout.capacity(extra_k_cache, extra_page_size),
                      counted_mask(extra_indices, extra_topk_length))


def _decode_call(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format, extra_kv_format, batch_invariant,
):
    if extra_k_cache is None:
        return page_size, k_cache.stride(0), 0, 0, kv_format, None
    return page_size, k_cache.stride(0), extra_page_size, extra_k_cache.stride(0), kv_format, extra_kv_format or kv_format


_DECODE_OP = define(OpSpec(
    schema=(
        "flash_mla_with_kvcache(Tensor q, Tensor k_cache, int page_size, Tensor indices, "
        "Tensor? topk_length, Tensor? attn_sink, Tensor? extra_k_cache, int extra_page_size, "
        "Tensor? extra_indices, Tensor? extra_topk_length, Tensor? tile_scheduler_metadata, "
        "Tensor? num_splits, float softmax_scale, int head_dim_v, str kv_format=\"v4\", "
        "str? extra_kv_format=None, bool batch_invariant=False) -> (Tensor out, Tensor lse)"
    ),
    check=check_decode,
    check_data=check_decode_data,
    outputs=decode_outputs,
    float_inputs=("q", "attn_sink"),
    call=DecodeCall,
    call_fields=_decode_call,
    formats=("kv_format", "extra_kv_format"),
))


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_size: int,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_page_size: int = 1,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    tile_scheduler_metadata: torch.Tensor | None = None,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    head_dim_v: int = layout.HEAD_DIM,
    kv_format: str = "v4",
    extra_kv_format: str | None = None,
    batch_invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode over paged quantized caches; returns ``out [B, s_q, H, 512]`` bf16 and
    ``lse [B, H, s_q]`` fp32 (natural log, sink excluded). docs/design.md §2.3.

    Args:
        q: ``[B, s_q, H, 512]`` bf16 queries.
        k_cache: the main uint8 base cache (the sliding window), of format ``kv_format``.
        page_size: tokens per page of ``k_cache``.
        indices: ``[B, s_q, K]`` int32 slots into ``k_cache``; ``-1`` is a hole.
        topk_length: ``[B]`` int32: only a row's first ``topk_length`` entries count (``None``: all).
        attn_sink: ``[H]`` float32 learned sink logits (``None``: no sink).
        extra_k_cache: an optional second cache (a compressed one), of format ``extra_kv_format``.
        extra_page_size: tokens per page of ``extra_k_cache``.
        extra_indices: ``[B, s_q, K2]`` int32 slots into ``extra_k_cache``.
        extra_topk_length: ``[B]`` int32 counted entries of ``extra_indices``.
        tile_scheduler_metadata, num_splits: from :func:`get_mla_metadata` for this step, or
            ``None``: computed inside the call.
        softmax_scale: defaults to ``512 ** -0.5``.
        head_dim_v: 512 (V is the full key).
        kv_format: the format of ``k_cache`` (default ``"v4"``; FP4 serves only as the extra cache).
        extra_kv_format: the format of ``extra_k_cache`` (``None``: ``kv_format``).
        batch_invariant: a row's outputs independent of the rest of the batch, bit for bit
            (docs/design.md §3); ``None``: the switch (:func:`dsv4_compile.batch_invariant`).
    """
    if softmax_scale is None:
        softmax_scale = layout.HEAD_DIM**-0.5
    return _DECODE_OP.run(
        q, k_cache, page_size, indices, topk_length, attn_sink,
        extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
        tile_scheduler_metadata, num_splits, float(softmax_scale), head_dim_v, kv_format, extra_kv_format,
        invariance.resolve(batch_invariant),
    )


# --------------------------------------------------------------------------------------------
# dsv4::get_mla_metadata
# --------------------------------------------------------------------------------------------

_METADATA = Checker("get_mla_metadata")
_METADATA_TENSORS = ("q", "indices", "topk_length", "extra_indices", "extra_topk_length")


def check_metadata(q, indices, topk_length, extra_indices, extra_topk_length) -> tuple[int, int, int]:
    c = _METADATA
    c.same_device(_METADATA_TENSORS, q, indices, topk_length, extra_indices, extra_topk_length)
    batch, s_q, heads, _ = c.tensor("q", q, BF16, (None, None, None, layout.HEAD_DIM))
    c.width("indices", indices, c.tensor("indices", indices, I32, (batch, s_q, None)))
    if topk_length is not None:
        c.tensor("topk_length", topk_length, I32, (batch,))
    if extra_indices is not None:
        c.width("extra_indices", extra_indices, c.tensor("extra_indices", extra_indices, I32, (batch, s_q, None)))
    elif extra_topk_length is not None:
        c.fail("extra_topk_length", "None when extra_indices is None", extra_topk_length)
    if extra_topk_length is not None:
        c.tensor("extra_topk_length", extra_topk_length, I32, (batch,))
    return batch, s_q, heads


def check_metadata_data(q, indices, topk_length, extra_indices, extra_topk_length) -> None:
    """Nothing: the scheduler reads only lengths, and any length gives a valid schedule."""


_METADATA_OP = define(OpSpec(
    schema=(
        "get_mla_metadata(Tensor q, Tensor indices, Tensor? topk_length, Tensor? extra_indices, "
        "Tensor? extra_topk_length) -> (Tensor tile_scheduler_metadata, Tensor num_splits)"
    ),
    check=check_metadata,
    check_data=check_metadata_data,
    outputs=lambda q: metadata_outputs(q),
    float_inputs=("q",),
))


def get_mla_metadata(
    q: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode scheduler metadata ``(tile_scheduler_metadata, num_splits)`` for one step.

    Depends on the shapes *and the length values*: compute it once per step, after the lengths
    are final, and share it between the layers of that step. Empty on devices without a scheduler.
    """
    return _METADATA_OP.run(q, indices, topk_length, extra_indices, extra_topk_length)


# --------------------------------------------------------------------------------------------
# dsv4::get_mla_metadata_stacked
# --------------------------------------------------------------------------------------------

_METADATA_STACKED = Checker("get_mla_metadata_stacked")


def check_metadata_stacked(q, topk, topk_length, extra_topk, extra_topk_length) -> tuple[int, int, int, int]:
    """``(batch, s_q, heads, count)``: ``count`` schedules, entry ``k`` that of
    :func:`check_metadata`'s call with indices ``topk[k]`` wide and extra indices
    ``extra_topk[k]`` wide (0: none)."""
    c = _METADATA_STACKED
    batch, s_q, heads, _ = c.tensor("q", q, BF16, (None, None, None, layout.HEAD_DIM))
    lists = {"topk": topk, "topk_length": topk_length, "extra_topk": extra_topk, "extra_topk_length": extra_topk_length}
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            c.fail(name, "a list", type(value).__name__, TypeError)
        if len(value) != len(topk):
            c.fail(name, f"a list of {len(topk)} entries (as topk)", f"{len(value)} entries")
    count = len(topk)
    c.same_device(("q", *(f"{name}[{k}]" for name in ("topk_length", "extra_topk_length") for k in range(count))),
                  q, *topk_length, *extra_topk_length)
    for k in range(count):
        for name in ("topk", "extra_topk"):
            width = lists[name][k]
            if type(width) is not int or not 0 <= width <= MAX_INDEX_WIDTH:
                c.fail(f"{name}[{k}]", f"an int in [0, {MAX_INDEX_WIDTH}] (an index width)", width)
        for name in ("topk_length", "extra_topk_length"):
            if lists[name][k] is not None:
                c.tensor(f"{name}[{k}]", lists[name][k], I32, (batch,))
        if extra_topk[k] == 0 and extra_topk_length[k] is not None:
            c.fail(f"extra_topk_length[{k}]", f"None when extra_topk[{k}] is 0 (no extra cache)", extra_topk_length[k])
    return batch, s_q, heads, count


def check_metadata_stacked_data(q, topk, topk_length, extra_topk, extra_topk_length) -> None:
    """Nothing: the scheduler reads only lengths, and any length gives a valid schedule."""


_METADATA_STACKED_OP = define(OpSpec(
    schema=(
        "get_mla_metadata_stacked(Tensor q, int[] topk, Tensor?[] topk_length, int[] extra_topk, "
        "Tensor?[] extra_topk_length) -> (Tensor tile_scheduler_metadata, Tensor num_splits)"
    ),
    check=check_metadata_stacked,
    check_data=check_metadata_stacked_data,
    outputs=lambda q, topk: metadata_outputs(q, len(topk)),
    float_inputs=("q",),
))


def get_mla_metadata_stacked(
    q: torch.Tensor,
    topk: list[int],
    topk_length: list[torch.Tensor | None],
    extra_topk: list[int],
    extra_topk_length: list[torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several decode schedules of one step at once, stacked: ``(tile_scheduler_metadata
    [K, ...], num_splits [K, ...])``, entry ``k`` equal to :func:`get_mla_metadata` for indices
    ``topk[k]`` wide with ``topk_length[k]`` and extra indices ``extra_topk[k]`` wide (0: no extra
    cache) with ``extra_topk_length[k]`` (docs/design.md §2.3). A schedule depends on the index
    widths and the length values only, so the indices themselves are not needed; on FlashMLA's
    SM90 kernels the ``K`` schedules are computed side by side in one launch (a model's layer
    kinds: one launch per step instead of one per kind).

    Args:
        q: ``[B, s_q, H, 512]`` bf16 queries (their shape sets the geometry).
        topk: ``K`` index widths (``indices.shape[-1]`` of each decode).
        topk_length: ``K`` ``[B]`` int32 tensors or ``None``.
        extra_topk: ``K`` extra index widths, 0 without an extra cache.
        extra_topk_length: ``K`` ``[B]`` int32 tensors or ``None`` (``None`` where ``extra_topk`` is 0).
    """
    return _METADATA_STACKED_OP.run(q, list(topk), list(topk_length), list(extra_topk), list(extra_topk_length))
