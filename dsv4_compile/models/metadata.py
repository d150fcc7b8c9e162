"""Per-step metadata: everything the layers of one step share, built once from the batch.

:func:`build_step_metadata` turns the batch description — ``positions [T]``, ``batch_index [T]``
(the batch row of each token; a row's tokens are contiguous, one at least, at consecutive
positions ending at ``seq_lens - 1``), ``seq_lens [B]`` (lengths after the step), ``req_slots
[B]`` (the request's row in the page table and in the compressor states) and the page table —
into cache write slots, window indices, compressed-block indices and compressor plans. It is
traceable PyTorch with fixed shapes (functions of T, B and the
:class:`~dsv4_compile.models.config.CacheConfig`), no host sync and no data-dependent branch: a
slot of ``-1`` means "do not write" / "no key".

Addressing (:class:`~dsv4_compile.models.config.CacheConfig`): page ``j`` of request ``r`` is
``page_table[r, j]``; token ``p`` of the request lives at slot ``page * P + p % P`` of the window
cache (``P = page_size``), compressed block ``k`` (tokens ``[k*ratio, (k+1)*ratio)``) at slot
``page * (P/ratio) + k % (P/ratio)`` of the ratio's cache, with ``page = page_table[r, k*ratio // P]``.

Two attention modes, chosen by the caller per step (a static choice, one graph each):

* ``"decode"`` (decode and small extend): one query row per token for
  ``dsv4::flash_mla_with_kvcache``; window indices are window-cache slots.
* ``"prefill"``: ``dsv4::flash_mla_sparse_fwd`` over a bf16 workspace; each batch row's window
  tokens ``[start - (W-1), seq_len)`` are dequantized into the workspace (``T + B*(W-1)`` rows),
  window indices are workspace rows, and the compressed part appends ``B * max_blocks`` rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .. import layout, ops
from .config import CacheConfig

MODES = ("decode", "prefill")

_counts_apart = False  # see counts_apart()


@contextlib.contextmanager
def counts_apart():
    """Within: trace steps whose token and request counts are separate dynamic dimensions
    (``torch.export`` of a step that may extend requests). The running-state compressors then
    pool a block's full width of step tokens, where a width from ``T - B`` (one token in a decode
    step) would guard on the counts' difference, which export rejects."""
    global _counts_apart
    before, _counts_apart = _counts_apart, True
    try:
        yield
    finally:
        _counts_apart = before


def counts_are_apart() -> bool:
    """Whether a step is traced within :func:`counts_apart` (for ``torch.export``)."""
    return _counts_apart


def overlaps(ratio: int) -> bool:
    """Ratio-4 compression pools overlapping windows of two blocks (upstream: ``overlap``)."""
    return ratio == 4


def source_window(ratio: int) -> int:
    """Tokens pooled into one compressed block: ``2 * ratio`` with overlap, else ``ratio``."""
    return 2 * ratio if overlaps(ratio) else ratio


@dataclass
class Pooling:
    """``K`` blocks' tokens up to a position, for a compressor with a running state (ratios
    without overlap): the tokens of this step by their rows, the earlier ones summarised in the
    request's state. ``W`` bounds a block's tokens in one step."""

    rows: torch.Tensor  # [K, W] int64: step rows of the block's last W positions up to its end (clamped)
    from_step: torch.Tensor  # [K, W] bool: that position is one of the block's tokens in this step
    state: torch.Tensor  # [K] int64: the request's row in the compressor state
    from_state: torch.Tensor  # [K] bool: the block began before this step (its earlier tokens are in the state)


@dataclass
class CompressPlan:
    """What the layers of one compress ratio share in a step.

    ``N = T // ratio + B`` bounds the blocks that complete in a step (a row of ``n`` tokens
    completes at most ``n // ratio + 1``), so the compressor always computes ``N`` candidates;
    those that complete nothing have ``emit_slot = -1`` and are not stored.

    Ratio 4 (overlapping windows): ``S`` is the :func:`source_window`; the compressor state ring
    keeps each request's last ``S`` tokens at ``req * S + pos % S`` (row ``max_requests`` is
    scratch for writes that are not kept); the ``source_*`` and ``state_index`` fields.
    Other ratios: a running state per request summarises the tokens of its unfinished block
    before the step; ``pooled`` are the candidates' blocks, ``carry`` each batch row's
    unfinished block after the step (the next state).
    """

    ratio: int
    lengths: torch.Tensor  # [T] int64: compressed blocks visible to each query, (pos+1) // ratio
    #: the step's page table ``[R, P]``: block ``k`` of request ``r`` is at slot ``page_table[r, k //
    #: per_page] * per_page + k % per_page`` of the ratio's caches (:meth:`slots`)
    page_table: torch.Tensor
    rows: torch.Tensor  # [T] int64: the page-table row (request) of each query
    per_page: int  # compressed blocks a page
    max_blocks: int  # M: compressed blocks a request can reach (CacheConfig.max_blocks)
    block_offset: torch.Tensor  # [T] int64: pos % ratio, the token's place in its block (row of ape)
    emit_slot: torch.Tensor  # [N] int64: cache slot of the block candidate n completes, or -1
    emit_pos: torch.Tensor  # [N] int64: first position of that block (its RoPE position)
    workspace_slots: torch.Tensor | None  # prefill: [B * M] slot of block k of batch row b, or -1
    # ratio 4: the state ring
    source_row: torch.Tensor | None = None  # [N, S] int64: step row of each pooled token (clamped)
    source_from_step: torch.Tensor | None = None  # [N, S] bool: the pooled token is in this step
    source_state: torch.Tensor | None = None  # [N, S] int64: its index in the state ring (clamped)
    source_pad: torch.Tensor | None = None  # [N, S] bool: position < 0 (kv 0, score -inf)
    state_index: torch.Tensor | None = None  # [T] int64: where each token's (kv, score) goes in the ring
    # other ratios: the running state
    pooled: Pooling | None = None  # [N] the candidates' blocks
    carry: Pooling | None = None  # [B] each batch row's unfinished block after the step

    def visible(self, width: int) -> torch.Tensor:
        """``[T]`` int32: the compressed blocks a decode with extra indices ``width`` wide counts
        per query (its ``extra_topk_length``): the visible ones, at most ``width``."""
        return torch.clamp(self.lengths, max=width).int()

    def slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[T, n]`` int64 cache slots of each query's blocks ``blocks [T, n]`` (block ids of its
        request, ``-1``: none, kept ``-1``). Nothing of the width of the context is built unless
        ``blocks`` is that wide."""
        slots = slot_of(self.page_table, self.rows[:, None], blocks.clamp_min(0), self.per_page)
        return torch.where(blocks >= 0, slots, -1)


@dataclass
class StepMetadata:
    """Per-step metadata shared by every layer (see the module docstring)."""

    mode: str
    positions: torch.Tensor  # [T] int64
    batch_index: torch.Tensor  # [T] int64
    last_rows: torch.Tensor  # [B] int64: row of each batch row's last token
    swa_slots: torch.Tensor  # [T] int64: window-cache slot each token is stored at
    window_indices: torch.Tensor  # [T, 1, W] int32: newest first, -1 padded; slots or workspace rows
    window_lengths: torch.Tensor  # [T] int32: min(pos + 1, W)
    window_workspace_slots: torch.Tensor | None  # prefill: [T + B*(W-1)] window-cache slots, -1 = zero row
    plans: dict[int, CompressPlan]
    #: decode: each layer kind's extra index width (0: no extra cache), where the caller knows every
    #: kind of the step (the model); the first schedule then computes all of them (:meth:`scheduler`)
    extra_widths: dict[int, int] | None = None
    #: decode scheduler metadata per layer kind, computed by the first layer of the kind
    schedulers: dict = field(default_factory=dict)
    #: the step's latest ratio-4 selection ``[T, index_topk]``, for the layers that reuse it
    #: (``DeepseekV4Config.index_reuse``)
    selection: torch.Tensor | None = None

    def scheduler(self, kind: int, q, indices, lengths, extra_indices, extra_lengths):
        """``get_mla_metadata`` once per step and layer kind (0, 4, 128): the shapes and lengths of
        a kind are the same in every layer of the step. With :attr:`extra_widths`, the first call
        computes every kind's schedule in one ``get_mla_metadata_stacked`` (one launch where
        FlashMLA's SM90 schedule is ours), for the window indices and lengths and, per kind, extra
        indices of its width counting :meth:`CompressPlan.visible` blocks: what the layers pass."""
        if kind in self.schedulers:
            return self.schedulers[kind]
        widths = self.extra_widths
        if widths is None or kind not in widths:
            self.schedulers[kind] = ops.get_mla_metadata(q, indices, lengths, extra_indices, extra_lengths)
            return self.schedulers[kind]
        width = 0 if extra_indices is None else extra_indices.shape[-1]
        if width != widths[kind] or indices.shape[-1] != self.window_indices.shape[-1]:
            raise ValueError(
                f"the decode of layer kind {kind} has indices {indices.shape[-1]} and extra indices {width} "
                f"wide; the step's schedules were planned for {self.window_indices.shape[-1]} and "
                f"{widths[kind]} (StepMetadata.extra_widths)"
            )
        kinds = list(widths)
        meta, splits = ops.get_mla_metadata_stacked(
            q, [self.window_indices.shape[-1]] * len(kinds), [self.window_lengths] * len(kinds),
            [widths[k] for k in kinds],
            [self.plans[k].visible(widths[k]) if widths[k] else None for k in kinds],
        )
        self.schedulers.update({k: (meta[i], splits[i]) for i, k in enumerate(kinds)})
        return self.schedulers[kind]


def slot_of(page_table: torch.Tensor, req: torch.Tensor, entry: torch.Tensor, per_page: int) -> torch.Tensor:
    """Slot of entry ``entry`` (token or block, ``>= 0``) of request ``req`` in a cache of
    ``per_page`` entries a page; ``req`` and ``entry`` broadcast."""
    index, offset = layout.page_and_offset(entry, per_page)
    return layout.slot(page_table[req, index].long(), offset, per_page)


def build_step_metadata(
    positions: torch.Tensor,
    batch_index: torch.Tensor,
    seq_lens: torch.Tensor,
    req_slots: torch.Tensor,
    page_table: torch.Tensor,
    *,
    cache: CacheConfig,
    window: int,
    ratios: tuple[int, ...] = (4, 128),
    mode: str = "decode",
    extra_widths: dict[int, int] | None = None,
) -> StepMetadata:
    """Build the :class:`StepMetadata` of one step (traceable; fixed shapes; no host sync).
    ``extra_widths``: :attr:`StepMetadata.extra_widths` (decode).

    The token rows are grouped by batch row, in order (``batch_index`` non-decreasing), every
    batch row with one token at least, as :mod:`dsv4_compile.generation` lays them out."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    device = positions.device
    positions, batch_index = positions.long(), batch_index.long()
    seq_lens, req_slots = seq_lens.long(), req_slots.long()
    num_tokens, batch = positions.shape[0], seq_lens.shape[0]
    page = cache.page_size

    # rows are grouped by batch row, in order: batch row b holds rows first_row[b] .. ends[b]-1
    batch_rows = torch.arange(batch, device=device)
    first_row = torch.searchsorted(batch_index, batch_rows)  # [B] row of the first token of each batch row
    ends = torch.searchsorted(batch_index, batch_rows, right=True)
    counts = ends - first_row
    last_rows = ends - 1  # [B] row of the last token of each batch row
    chunk_start = seq_lens - counts  # [B] position of that token
    req = req_slots[batch_index]  # [T]
    swa_slots = slot_of(page_table, req, positions, page)

    # window: positions pos, pos-1, ..., pos-(W-1) (newest first); -1 before position 0
    back = torch.arange(window, device=device)
    window_pos = positions[:, None] - back
    in_window = window_pos >= 0
    window_lengths = torch.clamp(positions + 1, max=window).int()
    window_workspace_slots = None
    if mode == "decode":
        window_idx = torch.where(
            in_window, slot_of(page_table, req[:, None], window_pos.clamp_min(0), page), -1
        )
    else:
        # workspace row of (batch row b, position p): first_row[b] + b*(W-1) + (W-1) + p - start[b];
        # for a token at row t that is t + (b+1)*(W-1) - j for its j-th newest window key
        token_row = torch.arange(num_tokens, device=device) + (batch_index + 1) * (window - 1)
        window_idx = torch.where(in_window, token_row[:, None] - back, -1)
        pre = torch.arange(window - 1, device=device)
        pre_pos = chunk_start[:, None] - (window - 1) + pre  # [B, W-1]
        pre_rows = (first_row + torch.arange(batch, device=device) * (window - 1))[:, None] + pre
        pre_slots = torch.where(
            pre_pos >= 0, slot_of(page_table, req_slots[:, None], pre_pos.clamp_min(0), page), -1
        )
        window_workspace_slots = torch.full(
            (num_tokens + batch * (window - 1),), -1, dtype=torch.long, device=device
        )
        window_workspace_slots = window_workspace_slots.scatter(0, token_row, swa_slots).scatter(
            0, pre_rows.flatten(), pre_slots.flatten()
        )

    plans = {
        ratio: _compress_plan(
            ratio, positions, batch_index, req, seq_lens, req_slots, chunk_start, last_rows,
            page_table, cache, mode,
        )
        for ratio in ratios
    }
    return StepMetadata(
        mode=mode,
        positions=positions,
        batch_index=batch_index,
        last_rows=last_rows,
        swa_slots=swa_slots,
        window_indices=window_idx.int().unsqueeze(1),
        window_lengths=window_lengths,
        window_workspace_slots=window_workspace_slots,
        plans=plans,
        extra_widths=extra_widths if mode == "decode" else None,
    )


def _compress_plan(
    ratio, positions, batch_index, req, seq_lens, req_slots, chunk_start, last_rows, page_table, cache, mode
) -> CompressPlan:
    device = positions.device
    num_tokens, batch = positions.shape[0], seq_lens.shape[0]
    per_page = cache.compressed_page_size(ratio)
    max_blocks = cache.max_blocks(ratio)
    span = source_window(ratio)

    # visible blocks: block k is complete once position k*ratio + ratio - 1 is stored
    lengths = torch.div(positions + 1, ratio, rounding_mode="floor")

    # candidates: the n-th token (in row order) that ends a block -> n-th compressed output
    candidates = num_tokens // ratio + batch
    ends_block = (positions + 1) % ratio == 0
    # the n-th such token is the first row where the running count of them reaches n + 1
    found = torch.searchsorted(ends_block.long().cumsum(0), torch.arange(1, candidates + 1, device=device))
    emit_row = torch.where(found < num_tokens, found, -1)
    valid = emit_row >= 0
    row = emit_row.clamp_min(0)
    end = positions[row]
    b = batch_index[row]
    block = torch.div(end, ratio, rounding_mode="floor")
    emit_slot = torch.where(valid, slot_of(page_table, req_slots[b], block, per_page), -1)
    emit_pos = torch.where(valid, block * ratio, 0)

    workspace_slots = None
    if mode == "prefill":  # [B, M]: the batch rows' blocks, not the tokens'
        k = torch.arange(max_blocks, device=device)
        filled = torch.div(seq_lens, ratio, rounding_mode="floor")
        workspace_slots = torch.where(k < filled[:, None], slot_of(page_table, req_slots[:, None], k, per_page), -1)
        workspace_slots = workspace_slots.flatten()
    plan = CompressPlan(
        ratio=ratio,
        lengths=lengths,
        page_table=page_table,
        rows=req,
        per_page=per_page,
        max_blocks=max_blocks,
        block_offset=positions % ratio,
        emit_slot=emit_slot,
        emit_pos=emit_pos,
        workspace_slots=workspace_slots,
    )

    if not overlaps(ratio):
        # a block's tokens in one step: at most ratio, and at most a batch row's tokens (every
        # row has one at least); a decode step (T = B) pools one token per block with the state
        if mode == "prefill" or _counts_apart:
            width = ratio
        else:
            width = min(ratio, num_tokens - batch + 1)
        plan.pooled = _pooling(end, row, block * ratio, chunk_start[b], req_slots[b], width)
        next_block = torch.div(seq_lens, ratio, rounding_mode="floor") * ratio  # the unfinished block
        plan.carry = _pooling(seq_lens - 1, last_rows, next_block, chunk_start, req_slots, width)
        return plan

    # the pooled tokens: positions end-(S-1) .. end, oldest first
    source_pos = end[:, None] - (span - 1) + torch.arange(span, device=device)
    plan.source_from_step = source_pos >= chunk_start[b][:, None]
    plan.source_row = (row[:, None] + source_pos - end[:, None]).clamp_min(0)  # <= row: in range
    plan.source_state = req_slots[b][:, None] * span + source_pos.remainder(span)
    plan.source_pad = source_pos < 0

    # ring writes: keep each request's last S tokens; the others go to the scratch row
    keep = positions >= seq_lens[batch_index] - span
    scratch = cache.max_requests * span + torch.arange(num_tokens, device=device) % span
    plan.state_index = torch.where(keep, req * span + positions % span, scratch)
    return plan


def _pooling(end, end_row, block_start, chunk_start, state, width: int) -> Pooling:
    """:class:`Pooling` of blocks from ``block_start`` to position ``end`` (at step row
    ``end_row``; ``end < block_start``: an empty block) of batch rows whose step starts at
    ``chunk_start``, with request state rows ``state``."""
    back = torch.arange(width - 1, -1, -1, device=end.device)  # oldest first
    position = end[:, None] - back
    first = torch.maximum(block_start, chunk_start)
    return Pooling(
        rows=(end_row[:, None] - back).clamp_min(0),  # >= the batch row's first row where from_step
        from_step=position >= first[:, None],
        state=state,
        from_state=block_start < chunk_start,
    )
