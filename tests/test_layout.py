"""The V4 cache layout helpers: geometry, allocation, slots, the FlashMLA view, dequantization."""

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile import layout

from float64_model import decode_cache_token
from helpers import filled_cache


@pytest.mark.parametrize("page_size,expected", [(256, 149760), (128, 74880), (64, 37440), (2, 1728), (1, 1152)])
def test_page_bytes(page_size, expected):
    assert d4.page_bytes(page_size) == expected


def test_page_bytes_is_the_smallest_multiple_of_576_holding_the_page():
    for page_size in range(1, 1025):
        stride = d4.page_bytes(page_size)
        assert stride % 576 == 0 and page_size * 584 <= stride < page_size * 584 + 576, page_size


def test_constants():
    assert (layout.HEAD_DIM, layout.NOPE_DIM, layout.ROPE_DIM) == (512, 448, 64)
    assert (layout.DATA_BYTES, layout.SCALE_BYTES, layout.TOKEN_BYTES) == (576, 8, 584)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_page_bytes_rejects(bad):
    with pytest.raises(ValueError, match="page_size"):
        d4.page_bytes(bad)


def test_alloc_cache():
    cache = d4.alloc_cache(3, 64)
    assert cache.dtype == torch.uint8 and cache.shape == (3, 37440) and not cache.any()
    assert d4.alloc_cache(2, 64, page_stride=64 * 584).shape == (2, 64 * 584)
    with pytest.raises(ValueError, match="page_stride"):
        d4.alloc_cache(2, 64, page_stride=64 * 584 - 1)


def test_slot_arithmetic():
    slots = torch.tensor([0, 63, 64, 127, 200])
    page, offset = layout.page_and_offset(slots, 64)
    assert page.tolist() == [0, 0, 1, 1, 3] and offset.tolist() == [0, 63, 0, 63, 8]
    assert torch.equal(layout.slot(page, offset, 64), slots)


def test_flashmla_view_geometry():
    cache = d4.alloc_cache(5, 64)
    view = d4.flashmla_view(cache, 64)
    assert view.dtype == torch.float8_e4m3fn
    assert view.shape == (5, 64, 1, 584)
    assert view.stride(0) == cache.stride(0) == 37440
    assert view.data_ptr() == cache.data_ptr()


@pytest.mark.parametrize("page_size,stride", [(1, None), (2, None), (61, None), (64, 64 * 584), (16, None)])
def test_gather_dequant_matches_independent_decoder(page_size, stride):
    cache, _ = filled_cache(3, page_size, page_stride=stride)
    cap = 3 * page_size
    slots = torch.tensor([0, page_size - 1, min(page_size, cap - 1), cap - 1])
    got = d4.gather_dequant(cache, page_size, slots, torch.float64)
    for i, s in enumerate(slots.tolist()):
        assert got[i].tolist() == decode_cache_token(cache, page_size, s)
    # bf16 dequantization is exact: fp8 (3 mantissa bits) times a power of two
    assert torch.equal(d4.gather_dequant(cache, page_size, slots).double(), got)


def test_dequant_workspace_zeroes_holes():
    cache, _ = filled_cache(2, 4)
    ws = d4.dequant_workspace(cache, 4, torch.tensor([3, -1, 5]))
    assert ws.shape == (3, 1, 512) and ws.dtype == torch.bfloat16
    assert not ws[1].any() and ws[0].any() and ws[2].any()
    assert torch.equal(ws[0, 0], d4.gather_dequant(cache, 4, torch.tensor(3)))


def test_visible_slots():
    """Block ``j`` of a request at ``page * page_size + j % page_size`` of its ``j // page_size``-th
    page; ``-1`` past a row's length (unread table entries, ``-1`` here, are never used)."""
    table = torch.tensor([[7, 2, -1], [0, 5, 3]], dtype=torch.int32)
    rows, lengths = torch.tensor([1, 0, 1]), torch.tensor([10, 3, 0])
    want = [[(int(table[r, j // 4]) * 4 + j % 4) if j < n else -1 for j in range(12)]
            for r, n in zip(rows.tolist(), lengths.tolist())]
    assert layout.visible_slots(table, rows, lengths, 4, 12).tolist() == want
    assert layout.visible_slots(table, rows, lengths, 4, 7).tolist() == [w[:7] for w in want]
