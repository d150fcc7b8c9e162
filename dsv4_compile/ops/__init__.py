"""The ``dsv4`` operator contract: schemas, fake implementations, public wrappers.

This package is the one place to read what each op takes and returns (docs/design.md §2). Each op
is declared by one ``registry.define(OpSpec(...))``, which defines it in the ``dsv4`` namespace,
registers its fake (so ``torch.compile`` traces through it without a graph break) and one kernel
per dispatch key — ``CPU``, ``CUDA``, ``XPU``, plus ``CompositeExplicitAutograd`` for any other
device — each a trampoline into :mod:`dsv4_compile.dispatch`, which picks the provider. The ops are
inference-only: calling them with inputs that require grad is an error.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import checks, dispatch, layout
from .registry import SCHEMAS, OpSpec, define  # noqa: F401 (SCHEMAS: re-exported)
from .store import fused_k_norm_rope_flashmla, quantize_store  # noqa: F401 (defined first: dsv4.OPS order)

# --------------------------------------------------------------------------------------------
# Output geometry, shared by the fakes and the kernels: one definition of what each op returns.
# --------------------------------------------------------------------------------------------


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


def prefill_outputs(q: torch.Tensor, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``out [s_q, H, d_v]`` bf16, ``max_logits`` and ``lse [s_q, H]`` fp32, contiguous."""
    s_q, heads = q.shape[:2]
    out = q.new_empty(s_q, heads, d_v)
    max_logits = q.new_empty(s_q, heads, dtype=torch.float32)
    return out, max_logits, torch.empty_like(max_logits)


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


def indexer_logits_output(q: torch.Tensor, block_slots: torch.Tensor) -> torch.Tensor:
    """Empty ``logits [T, M]`` fp32 (contiguous) on ``q.device``."""
    return q.new_empty(q.shape[0], block_slots.shape[1])


def indexer_topk_output(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Empty ``indices [T, k]`` int64 (contiguous) on ``logits.device``."""
    return logits.new_empty(logits.shape[0], k, dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# Fakes: the same metadata checks as the kernels, the same outputs' geometry.
# --------------------------------------------------------------------------------------------


def _decode_fake(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format="v4", extra_kv_format=None,
):
    checks.check_decode(
        q, k_cache, page_size, indices, topk_length, attn_sink,
        extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
        tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format, extra_kv_format,
    )
    return decode_outputs(q, head_dim_v)


def _prefill_fake(q, kv, indices, sm_scale, d_v=layout.HEAD_DIM, attn_sink=None, topk_length=None):
    checks.check_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    return prefill_outputs(q, d_v)


def _metadata_fake(q, indices, topk_length, extra_indices, extra_topk_length):
    checks.check_metadata(q, indices, topk_length, extra_indices, extra_topk_length)
    return metadata_outputs(q)


def _metadata_stacked_fake(q, topk, topk_length, extra_topk, extra_topk_length):
    count = checks.check_metadata_stacked(q, topk, topk_length, extra_topk, extra_topk_length)[3]
    return metadata_outputs(q, count)


def _indexer_logits_fake(q, weights, keys, block_slots):
    checks.check_indexer_logits(q, weights, keys, block_slots)
    return indexer_logits_output(q, block_slots)


def _indexer_topk_fake(logits, k):
    checks.check_indexer_topk(logits, k)
    return indexer_topk_output(logits, k)


def _rope_fake(x, freqs, positions, inverse=False):
    checks.check_rope(x, freqs, positions, inverse)


# --------------------------------------------------------------------------------------------
# The ops: schema, checks, fake, call signature (registry.define registers the rest).
# --------------------------------------------------------------------------------------------


class DecodeCall(NamedTuple):
    """What a provider's rule may look at in a decode call (``extra_*``: 0 / ``None`` without an
    extra cache; ``extra_kv_format`` resolved: the main format when not given)."""

    page_size: int
    page_stride: int
    extra_page_size: int
    extra_page_stride: int
    kv_format: str
    extra_kv_format: str | None


def _decode_call(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format, extra_kv_format,
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
        "str? extra_kv_format=None) -> (Tensor out, Tensor lse)"
    ),
    fake=_decode_fake, check=checks.check_decode, check_data=checks.check_decode_data,
    float_inputs=("q", "attn_sink"), call=DecodeCall, call_fields=_decode_call,
))
_PREFILL_OP = define(OpSpec(
    schema=(
        "flash_mla_sparse_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, "
        "Tensor? attn_sink=None, Tensor? topk_length=None) "
        "-> (Tensor out, Tensor max_logits, Tensor lse)"
    ),
    fake=_prefill_fake, check=checks.check_prefill, check_data=checks.check_prefill_data,
    float_inputs=("q", "kv", "attn_sink"),
))
_METADATA_OP = define(OpSpec(
    schema=(
        "get_mla_metadata(Tensor q, Tensor indices, Tensor? topk_length, Tensor? extra_indices, "
        "Tensor? extra_topk_length) -> (Tensor tile_scheduler_metadata, Tensor num_splits)"
    ),
    fake=_metadata_fake, check=checks.check_metadata, check_data=checks.check_metadata_data,
    float_inputs=("q",),
))
_METADATA_STACKED_OP = define(OpSpec(
    schema=(
        "get_mla_metadata_stacked(Tensor q, int[] topk, Tensor?[] topk_length, int[] extra_topk, "
        "Tensor?[] extra_topk_length) -> (Tensor tile_scheduler_metadata, Tensor num_splits)"
    ),
    fake=_metadata_stacked_fake, check=checks.check_metadata_stacked, check_data=checks.check_metadata_stacked_data,
    float_inputs=("q",),
))
_INDEXER_LOGITS_OP = define(OpSpec(
    schema="indexer_logits(Tensor q, Tensor weights, Tensor keys, Tensor block_slots) -> Tensor",
    fake=_indexer_logits_fake, check=checks.check_indexer_logits, check_data=checks.check_indexer_logits_data,
    float_inputs=("q", "weights", "keys"),
))
_INDEXER_TOPK_OP = define(OpSpec(
    schema="indexer_topk(Tensor logits, int k) -> Tensor",
    fake=_indexer_topk_fake, check=checks.check_indexer_topk, check_data=checks.check_indexer_topk_data,
    float_inputs=("logits",),
))
_ROPE_OP = define(OpSpec(
    schema="rope_(Tensor(a!) x, Tensor freqs, Tensor positions, bool inverse=False) -> ()",
    fake=_rope_fake, check=checks.check_rope, check_data=checks.check_rope_data,
    float_inputs=("x", "freqs"),
))

dispatch.reset()  # read the environment: DSV4_COMPILE_PROVIDER may name any op defined above


# --------------------------------------------------------------------------------------------
# Public wrappers: keyword-friendly, upstream names, one call of the op each.
# --------------------------------------------------------------------------------------------


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
    """
    if softmax_scale is None:
        softmax_scale = layout.HEAD_DIM**-0.5
    return _DECODE_OP.run(
        q, k_cache, page_size, indices, topk_length, attn_sink,
        extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
        tile_scheduler_metadata, num_splits, float(softmax_scale), head_dim_v, kv_format, extra_kv_format,
    )


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = layout.HEAD_DIM,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill over a bf16 workspace; returns ``(out, max_logits, lse)`` (natural log).

    Args:
        q: ``[s_q, H, 512]`` bf16 queries.
        kv: ``[s_kv, 1, 512]`` bf16 workspace (e.g. :func:`dsv4_compile.dequant_workspace`).
        indices: ``[s_q, 1, K]`` int32 rows of ``kv``; ``< 0`` or ``>= s_kv``: holes.
        sm_scale: the softmax scale.
        d_v: 512 (V is the full key).
        attn_sink: ``[H]`` float32 sink logits, or ``None``.
        topk_length: ``[s_q]`` int32 counted entries per query, or ``None``.
    """
    return _PREFILL_OP.run(q, kv, indices, float(sm_scale), d_v, attn_sink, topk_length)


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


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    block_slots: torch.Tensor,
) -> torch.Tensor:
    """The lightning indexer's block logits: ``logits [T, M]`` float32 with
    ``logits[t, k] = sum_h weights[t, h] * relu(<q[t, h], keys[block_slots[t, k]]>)`` where
    ``block_slots[t, k] >= 0``, and ``-inf`` where it is ``-1`` (a block the query does not see).

    Args:
        q: ``[T, H, D]`` float32 indexer queries (``1 <= D <= 512``).
        weights: ``[T, H]`` float32 head weights (scales included).
        keys: ``[S, D]`` float32 key buffer, one row per compressed-block slot.
        block_slots: ``[T, M]`` int32/int64: the slot of each query's ``k``-th block, or ``-1``.

    Only the referenced rows of ``keys`` are read; a query's cost follows its visible blocks.
    """
    return _INDEXER_LOGITS_OP.run(q, weights, keys, block_slots)


def indexer_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer's selection: ``indices [T, k]`` int64, the columns of each row's ``k`` largest
    ``logits`` in ascending order. Among equal values the lower columns rank higher; ``-0.0``
    equals ``0.0``; every NaN ranks above ``+inf``. The choice is exact (no rounding), so every
    provider returns the same indices.

    Args:
        logits: ``[T, M]`` float32 (``-inf``: a block the row does not see).
        k: ``0 <= k <= M`` columns per row.
    """
    return _INDEXER_TOPK_OP.run(logits, k)


def rope_(x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> None:
    """Rotate the last 64 dims of ``x`` in place by DSV4's interleaved RoPE: each pair
    ``(a, b) = (x[..., D-64+2i], x[..., D-64+2i+1])`` of token ``t`` becomes ``(a c - b s, a s + b c)``
    with ``(c, s) = (freqs[positions[t], 2i], freqs[positions[t], 2i+1])``; ``inverse`` rotates by
    the opposite angle (``s -> -s``), undoing the forward rotation. Float32 arithmetic, one rounding
    to ``x``'s dtype; the other dims are neither read nor written.

    Args:
        x: ``[T, D]`` or ``[T, H, D]`` bf16/fp16/fp32, ``D >= 64``, last dim contiguous, rows
            not overlapping (written in place).
        freqs: ``[max_pos, 64]`` float32 ``(cos_0, sin_0, cos_1, sin_1, ...)`` per position, the
            table ``fused_k_norm_rope_flashmla`` takes.
        positions: ``[T]`` int32/int64 in ``[0, max_pos)``.
        inverse: rotate by ``-angle`` (DSV4's output path undoes the keys' rotation).
    """
    return _ROPE_OP.run(x, freqs, positions, inverse)
