"""The lightning indexer (docs/design.md §2.8, §2.9, §2.11, §2.12): ``dsv4::indexer_logits`` (block
logits over a float32 key buffer), ``dsv4::indexer_topk`` (the selection), ``dsv4::indexer_store``
(keys into a paged indexer key cache, quantized), ``dsv4::indexer_cache_logits`` (block logits
over that cache) and ``dsv4::indexer_cache_topk`` (the selection over that cache through a block
table, without a logits tensor of the whole context)."""

from __future__ import annotations

import torch

from .. import invariance, layout
from ..checks import F32, INDEX_DTYPES, Checker
from .registry import OpSpec, define

__all__ = ["indexer_logits", "indexer_topk", "indexer_store", "indexer_cache_logits", "indexer_cache_topk"]  # the public wrappers (re-exported by the package)

#: Widest indexer key accepted (``keys`` last dim): a whole key is one tile of the Triton kernel.
#: DSV4's is 128.
MAX_INDEX_HEAD_DIM = 512

# --------------------------------------------------------------------------------------------
# dsv4::indexer_logits
# --------------------------------------------------------------------------------------------


def indexer_logits_output(q: torch.Tensor, block_slots: torch.Tensor) -> torch.Tensor:
    """Empty ``logits [T, M]`` fp32 (contiguous) on ``q.device`` (whatever ``q``'s dtype)."""
    return q.new_empty(q.shape[0], block_slots.shape[1], dtype=torch.float32)


_INDEXER = Checker("indexer_logits")
_INDEXER_TENSORS = ("q", "weights", "keys", "block_slots")


def check_indexer_logits(q, weights, keys, block_slots, batch_invariant=False) -> tuple[int, int, int]:
    c = _INDEXER
    c.same_device(_INDEXER_TENSORS, q, weights, keys, block_slots)
    tokens, heads, dim = c.tensor("q", q, F32, (None, None, None))
    if not 1 <= dim <= MAX_INDEX_HEAD_DIM:
        c.fail("q", f"float32 [T, H, D] with 1 <= D <= {MAX_INDEX_HEAD_DIM}", q)
    c.tensor("weights", weights, F32, (tokens, heads))
    c.tensor("keys", keys, F32, (None, dim))
    width = c.width("block_slots", block_slots, c.tensor("block_slots", block_slots, INDEX_DTYPES, (tokens, None)))
    c.flag("batch_invariant", batch_invariant)
    return tokens, heads, width


def check_indexer_logits_data(q, weights, keys, block_slots, batch_invariant=False) -> None:
    _INDEXER.slots_valid("block_slots", block_slots, keys.shape[0], cap_name="keys.shape[0]")


_INDEXER_LOGITS_OP = define(OpSpec(
    schema="indexer_logits(Tensor q, Tensor weights, Tensor keys, Tensor block_slots, bool batch_invariant=False) -> Tensor",
    check=check_indexer_logits,
    check_data=check_indexer_logits_data,
    outputs=indexer_logits_output,
    float_inputs=("q", "weights", "keys"),
))


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    block_slots: torch.Tensor,
    batch_invariant: bool | None = None,
) -> torch.Tensor:
    """The lightning indexer's block logits: ``logits [T, M]`` float32 with
    ``logits[t, k] = sum_h weights[t, h] * relu(<q[t, h], keys[block_slots[t, k]]>)`` where
    ``block_slots[t, k] >= 0``, and ``-inf`` where it is ``-1`` (a block the query does not see).

    Args:
        q: ``[T, H, D]`` float32 indexer queries (``1 <= D <= 512``).
        weights: ``[T, H]`` float32 head weights (scales included).
        keys: ``[S, D]`` float32 key buffer, one row per compressed-block slot.
        block_slots: ``[T, M]`` int32/int64: the slot of each query's ``k``-th block, or ``-1``.
        batch_invariant: a row's logits independent of the other rows, bit for bit
            (docs/design.md §3); ``None``: the switch (:func:`dsv4_compile.batch_invariant`).

    Only the referenced rows of ``keys`` are read; a query's cost follows its visible blocks.
    """
    return _INDEXER_LOGITS_OP.run(q, weights, keys, block_slots, invariance.resolve(batch_invariant))


# --------------------------------------------------------------------------------------------
# dsv4::indexer_topk
# --------------------------------------------------------------------------------------------


def indexer_topk_output(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Empty ``indices [T, k]`` int64 (contiguous) on ``logits.device``."""
    return logits.new_empty(logits.shape[0], k, dtype=torch.int64)


_TOPK = Checker("indexer_topk")


def check_indexer_topk(logits, k) -> tuple[int, int]:
    c = _TOPK
    width = c.width("logits", logits, c.tensor("logits", logits, F32, (None, None)))
    if type(k) is not int or not 0 <= k <= width:  # bool is no int here
        c.fail("k", f"an int in [0, {width}] (logits.shape[1])", k)
    return logits.shape[0], width


def check_indexer_topk_data(logits, k) -> None:
    """Nothing: every float32 value has its place in the order (NaN included)."""


_INDEXER_TOPK_OP = define(OpSpec(
    schema="indexer_topk(Tensor logits, int k) -> Tensor",
    check=check_indexer_topk,
    check_data=check_indexer_topk_data,
    outputs=indexer_topk_output,
    float_inputs=("logits",),
))


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


# --------------------------------------------------------------------------------------------
# dsv4::indexer_store
# --------------------------------------------------------------------------------------------

_INDEX_STORE = Checker("indexer_store")
_INDEX_STORE_TENSORS = ("keys", "index_cache", "slots")


def check_indexer_store(keys, index_cache, slots, page_size, index_format="fp8") -> int:
    c = _INDEX_STORE
    c.same_device(_INDEX_STORE_TENSORS, keys, index_cache, slots)
    fmt = c.index_format("index_format", index_format)
    count = c.tensor("keys", keys, F32, (None, layout.INDEX_HEAD_DIM))[0]
    if keys.stride(1) != 1:
        c.fail("keys", "last-dim contiguous (stride(1) == 1)", f"strides {tuple(keys.stride())}")
    c.tensor("slots", slots, INDEX_DTYPES, (count,))
    c.index_cache("index_cache", index_cache, c.positive_int("page_size", page_size), fmt)
    return count


def check_indexer_store_data(keys, index_cache, slots, page_size, index_format="fp8") -> None:
    _INDEX_STORE.slots_valid("slots", slots, layout.capacity(index_cache, page_size), holes="negative")


_INDEX_STORE_OP = define(OpSpec(
    schema=(
        "indexer_store(Tensor keys, Tensor(a!) index_cache, Tensor slots, int page_size, "
        "str index_format=\"fp8\") -> ()"
    ),
    check=check_indexer_store,
    check_data=check_indexer_store_data,
    float_inputs=("keys",),
    formats=("index_format",),
))


def indexer_store(
    keys: torch.Tensor,
    index_cache: torch.Tensor,
    slots: torch.Tensor,
    page_size: int,
    index_format: str = "fp8",
) -> None:
    """Quantize indexer keys into a paged indexer key cache (docs/design.md §2.11).

    Args:
        keys: ``[N, 128]`` float32 keys as the indexer scores them (for ``"fp8"`` / ``"fp4"``
            already rotated by :func:`dsv4_compile.layout.hadamard`, as the queries must be).
        index_cache: the uint8 base cache (:func:`dsv4_compile.layout.alloc_index_cache`), written
            in place.
        slots: ``[N]`` int32/int64 slots ``page * page_size + offset``; below 0: skipped.
        page_size: keys per page of ``index_cache``.
        index_format: ``"fp8"`` (default), ``"fp4"`` or ``"fp32"`` (``layout.INDEX_FORMATS``); the
            bytes are those of :func:`dsv4_compile.layout.quantize_index`.
    """
    _INDEX_STORE_OP.run(keys, index_cache, slots, page_size, index_format)


# --------------------------------------------------------------------------------------------
# dsv4::indexer_cache_logits
# --------------------------------------------------------------------------------------------

_CACHE_LOGITS = Checker("indexer_cache_logits")
_CACHE_LOGITS_TENSORS = ("q", "weights", "index_cache", "block_slots", "q_scales")
#: What ``q`` (and ``q_scales``) hold per format: :func:`layout.quantize_index`'s codes (and scales).
_QUERY_DTYPES = {"fp32": torch.float32, "fp8": torch.float8_e4m3fn, "fp4": torch.uint8}


def _check_cache_queries(c: Checker, q, weights, q_scales, fmt: layout.IndexFormat) -> tuple[int, int]:
    """The queries' codes (and FP4 scales) and head weights of an op over the indexer key cache:
    ``(tokens, heads)``."""
    packed = fmt.data_bytes if fmt.values == "fp4" else layout.INDEX_HEAD_DIM
    tokens, heads, _ = c.tensor("q", q, (_QUERY_DTYPES[fmt.values],), (None, None, packed))
    if q.stride(2) != 1:
        c.fail("q", "last-dim contiguous (stride(2) == 1)", f"strides {tuple(q.stride())}")
    if fmt.values == "fp4":
        c.tensor("q_scales", q_scales, (torch.uint8,), (tokens, heads, fmt.scale_bytes))
        if q_scales.stride(2) != 1:
            c.fail("q_scales", "last-dim contiguous (stride(2) == 1)", f"strides {tuple(q_scales.stride())}")
    elif q_scales is not None:
        c.fail("q_scales", f"None with index_format {fmt.name!r} (only 'fp4' queries carry scales; "
               "fold an fp8 query's scale into weights)", q_scales)
    c.tensor("weights", weights, F32, (tokens, heads))
    return tokens, heads


def check_indexer_cache_logits(q, weights, index_cache, block_slots, page_size, index_format="fp8",
                               q_scales=None, batch_invariant=False) -> tuple[int, int, int]:
    c = _CACHE_LOGITS
    c.same_device(_CACHE_LOGITS_TENSORS, q, weights, index_cache, block_slots, q_scales)
    fmt = c.index_format("index_format", index_format)
    tokens, heads = _check_cache_queries(c, q, weights, q_scales, fmt)
    c.index_cache("index_cache", index_cache, c.positive_int("page_size", page_size), fmt)
    width = c.width("block_slots", block_slots, c.tensor("block_slots", block_slots, INDEX_DTYPES, (tokens, None)))
    c.flag("batch_invariant", batch_invariant)
    return tokens, heads, width


def check_indexer_cache_logits_data(q, weights, index_cache, block_slots, page_size, index_format="fp8",
                                    q_scales=None, batch_invariant=False) -> None:
    _CACHE_LOGITS.slots_valid("block_slots", block_slots, layout.capacity(index_cache, page_size))


_CACHE_LOGITS_OP = define(OpSpec(
    schema=(
        "indexer_cache_logits(Tensor q, Tensor weights, Tensor index_cache, Tensor block_slots, "
        "int page_size, str index_format=\"fp8\", Tensor? q_scales=None, bool batch_invariant=False) -> Tensor"
    ),
    check=check_indexer_cache_logits,
    check_data=check_indexer_cache_logits_data,
    outputs=indexer_logits_output,
    float_inputs=("q", "weights"),
    formats=("index_format",),
))


def indexer_cache_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_slots: torch.Tensor,
    page_size: int,
    index_format: str = "fp8",
    q_scales: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
) -> torch.Tensor:
    """The lightning indexer's block logits over a paged indexer key cache (docs/design.md
    §2.11): ``logits [T, M]`` float32 with ``logits[t, k] = sum_h weights[t, h] * relu(<q̂[t, h],
    k̂[block_slots[t, k]]>)`` where ``block_slots[t, k] >= 0`` and ``-inf`` where it is ``-1``;
    ``q̂`` / ``k̂`` the dequantized queries and keys.

    Args:
        q: the queries' codes, :func:`dsv4_compile.layout.quantize_index` of the (rotated, for
            ``"fp8"`` / ``"fp4"``) float32 queries: ``[T, H, 128]`` float32 (``"fp32"``),
            ``[T, H, 128]`` float8_e4m3fn (``"fp8"``), ``[T, H, 64]`` uint8 (``"fp4"``); last dim
            contiguous (any other strides).
        weights: ``[T, H]`` float32 head weights; with ``"fp8"`` times the queries' scales.
        index_cache: the cache :func:`indexer_store` wrote.
        block_slots: ``[T, M]`` int32/int64 slot of each query's ``k``-th block, or ``-1``.
        page_size: keys per page of ``index_cache``.
        index_format: the cache's format (``layout.INDEX_FORMATS``).
        q_scales: ``"fp4"`` only: the queries' UE8M0 bytes ``[T, H, 4]`` uint8.
        batch_invariant: a row's logits independent of the other rows, bit for bit
            (docs/design.md §3); ``None``: the switch (:func:`dsv4_compile.batch_invariant`).

    Only the referenced keys are read; a query's cost follows its visible blocks.
    """
    return _CACHE_LOGITS_OP.run(q, weights, index_cache, block_slots, page_size, index_format, q_scales,
                                invariance.resolve(batch_invariant))


# --------------------------------------------------------------------------------------------
# dsv4::indexer_cache_topk
# --------------------------------------------------------------------------------------------

_CACHE_TOPK = Checker("indexer_cache_topk")
_CACHE_TOPK_TENSORS = ("q", "weights", "index_cache", "block_table", "table_rows", "lengths", "q_scales")


def indexer_cache_topk_output(q: torch.Tensor, k: int) -> torch.Tensor:
    """Empty ``indices [T, k]`` int64 (contiguous) on ``q.device``."""
    return q.new_empty(q.shape[0], k, dtype=torch.int64)


def check_indexer_cache_topk(q, weights, index_cache, block_table, table_rows, lengths, page_size, k,
                             index_format="fp8", q_scales=None, batch_invariant=False) -> tuple[int, int, int]:
    c = _CACHE_TOPK
    c.same_device(_CACHE_TOPK_TENSORS, q, weights, index_cache, block_table, table_rows, lengths, q_scales)
    fmt = c.index_format("index_format", index_format)
    tokens, heads = _check_cache_queries(c, q, weights, q_scales, fmt)
    c.index_cache("index_cache", index_cache, c.positive_int("page_size", page_size), fmt)
    pages = c.tensor("block_table", block_table, INDEX_DTYPES, (None, None))[1]
    c.tensor("table_rows", table_rows, INDEX_DTYPES, (tokens,))
    c.tensor("lengths", lengths, INDEX_DTYPES, (tokens,))
    width = c.width("block_table", block_table, torch.Size([pages * page_size]))
    if type(k) is not int or not 0 <= k <= width:  # bool is no int here
        c.fail("k", f"an int in [0, {width}] (block_table's pages * page_size: the widest row)", k)
    c.flag("batch_invariant", batch_invariant)
    return tokens, heads, width


def check_indexer_cache_topk_data(q, weights, index_cache, block_table, table_rows, lengths, page_size, k,
                                  index_format="fp8", q_scales=None, batch_invariant=False) -> None:
    c = _CACHE_TOPK
    if table_rows.numel() == 0:
        return
    rows = block_table.shape[0]
    lo, hi = int(table_rows.min()), int(table_rows.max())
    if lo < 0 or hi >= rows:
        c.fail("table_rows", f"rows of block_table, in [0, {rows})", f"values in [{lo}, {hi}]")
    c.lengths_within("lengths", lengths, block_table.shape[1] * page_size)
    # every page a query reads (those of its visible blocks) is a page of index_cache
    read = torch.arange(block_table.shape[1], device=block_table.device) < -(-lengths.long() // page_size)[:, None]
    pages = block_table[table_rows.long()]
    bad = read & ((pages < 0) | (pages >= index_cache.shape[0]))
    if bool(bad.any()):
        t, j = (int(i) for i in bad.nonzero()[0])
        c.fail("block_table", f"page ids in [0, {index_cache.shape[0]}) (index_cache's pages) for every visible block",
               f"{int(pages[t, j])} at row {int(table_rows[t])}, page {j} (query {t})")


_CACHE_TOPK_OP = define(OpSpec(
    schema=(
        "indexer_cache_topk(Tensor q, Tensor weights, Tensor index_cache, Tensor block_table, Tensor table_rows, "
        "Tensor lengths, int page_size, int k, str index_format=\"fp8\", Tensor? q_scales=None, "
        "bool batch_invariant=False) -> Tensor"
    ),
    check=check_indexer_cache_topk,
    check_data=check_indexer_cache_topk_data,
    outputs=indexer_cache_topk_output,
    float_inputs=("q", "weights"),
    formats=("index_format",),
))


def indexer_cache_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    table_rows: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    k: int,
    index_format: str = "fp8",
    q_scales: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
) -> torch.Tensor:
    """The lightning indexer's selection over a paged indexer key cache (docs/design.md §2.12):
    query ``t`` sees blocks ``0 .. lengths[t] - 1`` of the request whose pages are
    ``block_table[table_rows[t]]`` (block ``j`` at slot ``block_table[row, j // page_size] *
    page_size + j % page_size``), scores them as :func:`indexer_cache_logits` does, and returns
    ``indices [T, k]`` int64: every visible block in order then ``-1`` where ``lengths[t] <= k``,
    else the ``k`` highest-scoring blocks in ascending order (:func:`indexer_topk`'s order: equal
    logits to the lower block). Equal to :func:`indexer_topk` of :func:`indexer_cache_logits` over
    those blocks, without a ``[T, context]`` logits or slots tensor: a call's temporaries are
    bounded whatever the context (the rows are scored and selected in bounded groups).

    Args:
        q: the queries' codes, as :func:`indexer_cache_logits` takes them.
        weights: ``[T, H]`` float32 head weights (with ``"fp8"`` times the queries' scales).
        index_cache: the cache :func:`indexer_store` wrote.
        block_table: ``[R, P]`` int32/int64 page ids of ``index_cache``, one row per request
            (entries past a request's pages are not read; ``-1`` allowed there).
        table_rows: ``[T]`` int32/int64: the ``block_table`` row of each query.
        lengths: ``[T]`` int32/int64 visible blocks of each query, at most ``P * page_size``.
        page_size: blocks per page of ``index_cache``.
        k: blocks to select, ``0 <= k <= P * page_size``.
        index_format: the cache's format (``layout.INDEX_FORMATS``).
        q_scales: ``"fp4"`` only: the queries' UE8M0 bytes ``[T, H, 4]`` uint8.
        batch_invariant: a row's selection independent of the other rows (docs/design.md §3);
            ``None``: the switch (:func:`dsv4_compile.batch_invariant`).
    """
    return _CACHE_TOPK_OP.run(q, weights, index_cache, block_table, table_rows, lengths, page_size, k,
                              index_format, q_scales, invariance.resolve(batch_invariant))
