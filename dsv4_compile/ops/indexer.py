"""The lightning indexer (docs/design.md §2.8, §2.9): ``dsv4::indexer_logits`` (block logits) and
``dsv4::indexer_topk`` (the selection)."""

from __future__ import annotations

import torch

from ..checks import F32, INDEX_DTYPES, Checker
from .registry import OpSpec, define

__all__ = ["indexer_logits", "indexer_topk"]  # the public wrappers (re-exported by the package)

#: Widest indexer key accepted (``keys`` last dim): a whole key is one tile of the Triton kernel.
#: DSV4's is 128.
MAX_INDEX_HEAD_DIM = 512

# --------------------------------------------------------------------------------------------
# dsv4::indexer_logits
# --------------------------------------------------------------------------------------------


def indexer_logits_output(q: torch.Tensor, block_slots: torch.Tensor) -> torch.Tensor:
    """Empty ``logits [T, M]`` fp32 (contiguous) on ``q.device``."""
    return q.new_empty(q.shape[0], block_slots.shape[1])


_INDEXER = Checker("indexer_logits")
_INDEXER_TENSORS = ("q", "weights", "keys", "block_slots")


def check_indexer_logits(q, weights, keys, block_slots) -> tuple[int, int, int]:
    c = _INDEXER
    c.same_device(_INDEXER_TENSORS, q, weights, keys, block_slots)
    tokens, heads, dim = c.tensor("q", q, F32, (None, None, None))
    if not 1 <= dim <= MAX_INDEX_HEAD_DIM:
        c.fail("q", f"float32 [T, H, D] with 1 <= D <= {MAX_INDEX_HEAD_DIM}", q)
    c.tensor("weights", weights, F32, (tokens, heads))
    c.tensor("keys", keys, F32, (None, dim))
    width = c.width("block_slots", block_slots, c.tensor("block_slots", block_slots, INDEX_DTYPES, (tokens, None)))
    return tokens, heads, width


def check_indexer_logits_data(q, weights, keys, block_slots) -> None:
    _INDEXER.slots_valid("block_slots", block_slots, keys.shape[0], cap_name="keys.shape[0]")


_INDEXER_LOGITS_OP = define(OpSpec(
    schema="indexer_logits(Tensor q, Tensor weights, Tensor keys, Tensor block_slots) -> Tensor",
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
