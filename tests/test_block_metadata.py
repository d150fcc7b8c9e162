"""The per-step metadata builder on cases small enough to check by hand."""

from __future__ import annotations

import torch

from dsv4_compile.models import CacheConfig, build_step_metadata, step_inputs

CACHE = CacheConfig(max_requests=2, max_seq_len=256, page_size=128)
PAGE_TABLE = torch.tensor([[1, 3], [2, 0]], dtype=torch.int32)  # request r, page j -> page id
W = 4


def build(chunks, starts, mode, req_slots=(1, 0)):
    args = step_inputs([[0] * n for n in chunks], starts, "cpu")
    del args["input_ids"]
    args["req_slots"] = torch.tensor(req_slots[: len(chunks)])
    return build_step_metadata(**args, page_table=PAGE_TABLE, cache=CACHE, window=W, ratios=(4, 128), mode=mode)


def swa_slot(req, pos):
    return int(PAGE_TABLE[req, pos // 128]) * 128 + pos % 128


def test_decode_window_is_newest_first_and_padded():
    meta = build([1, 1], [2, 130], "decode")  # positions 2 (request 1) and 130 (request 0)
    assert meta.swa_slots.tolist() == [swa_slot(1, 2), swa_slot(0, 130)]
    assert meta.window_indices[:, 0].tolist() == [
        [swa_slot(1, 2), swa_slot(1, 1), swa_slot(1, 0), -1],
        [swa_slot(0, p) for p in (130, 129, 128, 127)],  # crosses a page boundary
    ]
    assert meta.window_lengths.tolist() == [3, 4]
    assert meta.last_rows.tolist() == [0, 1]


def test_compress_plan_emits_completed_blocks_at_their_first_position():
    meta = build([6, 1], [0, 127], "decode")  # request 1: positions 0..5; request 0: position 127
    c4, c128 = meta.plans[4], meta.plans[128]
    # ratio 4: position 3 (block 0 of request 1) and 127 (block 31 of request 0) complete blocks
    emitted = [(int(s), int(p)) for s, p in zip(c4.emit_slot, c4.emit_pos) if s >= 0]
    assert emitted == [(int(PAGE_TABLE[1, 0]) * 32 + 0, 0), (int(PAGE_TABLE[0, 0]) * 32 + 31, 124)]
    emitted = [(int(s), int(p)) for s, p in zip(c128.emit_slot, c128.emit_pos) if s >= 0]
    assert emitted == [(int(PAGE_TABLE[0, 0]) * 1 + 0, 0)]
    assert c4.lengths.tolist() == [0, 0, 0, 1, 1, 1, 32]
    # overlapping window of block 0: four pads (before position 0), then positions 0..3 from the step
    n = 0
    assert c4.source_pad[n].tolist() == [True] * 4 + [False] * 4
    assert c4.source_row[n, 4:].tolist() == [0, 1, 2, 3]
    # block 31 of request 0 pools positions 120..127: 120..126 from the state ring, 127 from the step
    n = 1
    assert c4.source_from_step[n].tolist() == [False] * 7 + [True]
    assert c4.source_state[n, :7].tolist() == [0 * 8 + p % 8 for p in range(120, 127)]


def test_prefill_workspace_holds_each_rows_window():
    meta = build([3, 2], [0, 5], "prefill")  # request 1: positions 0..2; request 0: positions 5, 6
    ws = meta.window_workspace_slots.tolist()
    assert len(ws) == 5 + 2 * (W - 1)
    # row b's region: W-1 positions before its first token, then its tokens
    assert ws[:6] == [-1, -1, -1] + [swa_slot(1, p) for p in range(3)]
    assert ws[6:] == [swa_slot(0, p) for p in range(2, 7)]
    idx = meta.window_indices[:, 0]
    assert idx[2].tolist() == [5, 4, 3, -1]  # position 2 of request 1 -> rows of positions 2, 1, 0
    assert [ws[i] for i in idx[4].tolist()] == [swa_slot(0, p) for p in (6, 5, 4, 3)]


def test_plans_address_blocks_through_the_page_table():
    """A plan's :meth:`slots` of each query's blocks: the page table's page, the offset in it."""
    meta = build([6, 1], [0, 127], "decode")  # request 1: positions 0..5; request 0: position 127
    c4 = meta.plans[4]
    blocks = torch.tensor([[0, -1]] * 6 + [[31, 40]])
    slots = c4.slots(blocks).tolist()
    assert slots[0] == [int(PAGE_TABLE[1, 0]) * 32, -1]
    assert slots[6] == [int(PAGE_TABLE[0, 0]) * 32 + 31, int(PAGE_TABLE[0, 1]) * 32 + 8]  # block 40: page 1


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _tensors(getattr(value, name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def test_step_metadata_holds_no_table_of_tokens_by_blocks():
    """At a long context no tensor of the step's metadata is ``[T, max_blocks]``: its size follows
    the step's tokens, requests and window (the prefill workspace's block slots are ``[B,
    max_blocks]``), not tokens times the cache's reach."""
    cache = CacheConfig(max_requests=2, max_seq_len=1 << 16, page_size=256)
    pages = torch.arange(cache.num_pages, dtype=torch.int32).view(2, -1)
    for mode in ("prefill", "decode"):
        args = step_inputs([[0] * 200, [0] * 100], [60000, 3000], "cpu")
        del args["input_ids"]
        meta = build_step_metadata(**args, page_table=pages, cache=cache, window=128, ratios=(4, 128), mode=mode)
        largest = max(t.numel() for t in _tensors(meta) if t is not pages)
        # [B, M] (the workspace's blocks) or [T, W] (the window) at most; [T, M] would be 4.9 M
        assert largest <= max(2 * cache.max_blocks(4), 300 * 128), (mode, largest)
