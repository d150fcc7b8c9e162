"""Sparse decode and prefill on the reference, against the float64 model (docs/design.md §2.3, §2.4)."""

import math

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile.tolerances import REFERENCE

from conftest import call
from float64_model import attend, decode_cache_token
from helpers import (
    GARBAGE_BYTES,
    decode_args_around_garbage,
    filled_cache,
    poisoned_decode_args,
    poisoned_prefill_args,
    prefill_args_around_garbage,
    random_indices,
    sink,
)

DECODE = torch.ops.dsv4.flash_mla_with_kvcache.default
PREFILL = torch.ops.dsv4.flash_mla_sparse_fwd.default


def decoded(cache, page_size):
    return torch.tensor(
        [decode_cache_token(cache, page_size, s) for s in range(cache.shape[0] * page_size)], dtype=torch.float64
    )


def close(name, got, want, vmax=1.0):
    tol = REFERENCE[name]
    scale = vmax if name == "out" else 1.0
    torch.testing.assert_close(got.double(), want, atol=tol.atol * scale, rtol=tol.rtol, equal_nan=False)


def expected_decode(q, table, indices, lengths, extra_table, extra_indices, extra_lengths, scale, sink_vals):
    batch, s_q, heads, _ = q.shape
    out = torch.zeros(batch, s_q, heads, 512, dtype=torch.float64)
    lse = torch.zeros(batch, heads, s_q, dtype=torch.float64)
    for b in range(batch):
        for s in range(s_q):
            keys = []
            for tab, idx, ln in ((table, indices, lengths), (extra_table, extra_indices, extra_lengths)):
                if tab is None:
                    continue
                n = idx.shape[-1] if ln is None else int(ln[b])
                keys += [tab[int(i)] for i in idx[b, s, :n] if int(i) != -1]
            keys = torch.stack(keys) if keys else torch.zeros(0, 512, dtype=torch.float64)
            o, l, _ = attend(q[b, s].double(), keys, scale, sink_vals)
            out[b, s], lse[b, :, s] = o, l
    return out, lse


@pytest.mark.parametrize("heads", [64, 128, 3])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("sink_kind", ["none", "random", "+inf", "-inf"])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_decode_matches_float64(heads, s_q, extra, sink_kind, with_lengths):
    batch, page_size, width = 3, 16, 10
    cache, _ = filled_cache(4, page_size)
    table = decoded(cache, page_size)
    indices = random_indices((batch, s_q, width), 4 * page_size)
    lengths = torch.tensor([width, 4, 0], dtype=torch.int32) if with_lengths else None
    ecache = etable = eidx = elen = None
    if extra:
        ecache, _ = filled_cache(3, 2)
        etable = decoded(ecache, 2)
        eidx = random_indices((batch, s_q, 5), 6)
        elen = torch.tensor([5, 0, 2], dtype=torch.int32) if with_lengths else None
    q = torch.randn(batch, s_q, heads, 512, dtype=torch.bfloat16)
    sink_vals = sink(sink_kind, heads)
    scale = 512**-0.5
    out, lse = call(
        DECODE, q, cache, page_size, indices, lengths, sink_vals, ecache, 2, eidx, elen, None, None, scale, 512
    )
    want_out, want_lse = expected_decode(q, table, indices, lengths, etable, eidx, elen, scale, sink_vals)
    assert out.dtype == torch.bfloat16 and out.shape == (batch, s_q, heads, 512)
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, s_q)
    vmax = table.abs().max().item()
    close("out", out, want_out, vmax)
    close("lse", lse, want_lse)


def test_decode_empty_rows():
    """No valid key: out = 0 and lse = +inf, with or without a sink."""
    cache, _ = filled_cache(2, 4)
    q = torch.randn(2, 1, 8, 512, dtype=torch.bfloat16)
    indices = torch.tensor([[[-1, -1, -1]], [[1, 2, 3]]], dtype=torch.int32)
    lengths = torch.tensor([3, 0], dtype=torch.int32)
    out, lse = DECODE(q, cache, 4, indices, lengths, torch.randn(8), None, 1, None, None, None, None, 0.1, 512)
    assert not out.any()
    assert torch.isposinf(lse).all()


def test_decode_sink_limits():
    cache, _ = filled_cache(2, 4)
    q = torch.randn(1, 1, 4, 512, dtype=torch.bfloat16)
    idx = torch.tensor([[[0, 5, 7]]], dtype=torch.int32)
    args = (q, cache, 4, idx, None)
    rest = (None, 1, None, None, None, None, 0.05, 512)
    plain, lse0 = DECODE(*args, None, *rest)
    neg, lse1 = DECODE(*args, torch.full((4,), -math.inf), *rest)
    pos, lse2 = DECODE(*args, torch.full((4,), math.inf), *rest)
    assert torch.equal(plain, neg) and not pos.any()
    assert torch.equal(lse0, lse1) and torch.equal(lse0, lse2)  # lse excludes the sink


def test_decode_counts_duplicates():
    cache, _ = filled_cache(2, 4)
    q = torch.randn(1, 1, 2, 512, dtype=torch.bfloat16)
    once = DECODE(q, cache, 4, torch.tensor([[[3, 6]]], dtype=torch.int32), None, None, None, 1, None, None, None, None, 0.1, 512)
    twice = DECODE(q, cache, 4, torch.tensor([[[3, 3, 6]]], dtype=torch.int32), None, None, None, 1, None, None, None, None, 0.1, 512)
    table = decoded(cache, 4)
    want, _, _ = attend(q[0, 0], table[[3, 3, 6]], 0.1, None)
    close("out", twice[0][0, 0], want, table.abs().max().item())
    assert not torch.equal(once[0], twice[0])


def test_decode_ignores_entries_past_topk_length():
    """Entries at j >= topk_length are not read, whatever they hold (even out of range): the
    result is the one of the same row with those entries invalid (-1), bit for bit (same width,
    so the same reductions), and of the row cut to its first ``topk_length`` entries within the
    reference tolerance (a narrower row sums its scores in another order)."""
    cache, _ = filled_cache(2, 4)
    q = torch.randn(1, 1, 2, 512, dtype=torch.bfloat16)
    lengths = torch.tensor([2], dtype=torch.int32)
    a = DECODE(q, cache, 4, torch.tensor([[[3, 6, 999, -5]]], dtype=torch.int32), lengths, None, None, 1, None, None, None, None, 0.1, 512)
    b = DECODE(q, cache, 4, torch.tensor([[[3, 6, -1, -1]]], dtype=torch.int32), None, None, None, 1, None, None, None, None, 0.1, 512)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    cut = DECODE(q, cache, 4, torch.tensor([[[3, 6]]], dtype=torch.int32), None, None, None, 1, None, None, None, None, 0.1, 512)
    close("out", a[0], cut[0].double(), decoded(cache, 4).abs().max().item())
    torch.testing.assert_close(a[1], cut[1], atol=1e-6, rtol=1e-6)


def test_decode_metadata_is_ignored_on_cpu():
    cache, _ = filled_cache(2, 4)
    q = torch.randn(2, 1, 4, 512, dtype=torch.bfloat16)
    idx = random_indices((2, 1, 6), 8)
    meta, splits = d4.get_mla_metadata(q, idx)
    assert meta.shape == (0,) and splits.shape == (0,) and meta.dtype == torch.int32
    a = d4.flash_mla_with_kvcache(q, cache, 4, idx, tile_scheduler_metadata=meta, num_splits=splits)
    b = d4.flash_mla_with_kvcache(q, cache, 4, idx)
    assert torch.equal(a[0], b[0])


def test_decode_page_stride_does_not_matter():
    padded, _ = filled_cache(3, 8)
    unpadded = d4.alloc_cache(3, 8, page_stride=8 * 584)
    unpadded.copy_(padded[:, : 8 * 584])
    q = torch.randn(2, 1, 4, 512, dtype=torch.bfloat16)
    idx = random_indices((2, 1, 9), 24)
    a = d4.flash_mla_with_kvcache(q, padded, 8, idx)
    b = d4.flash_mla_with_kvcache(q, unpadded, 8, idx)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_decode_chunking_is_invisible(monkeypatch):
    """One query row per step of the reference (a tiny :data:`reference.CHUNK_BYTES`) gives the
    whole call's result within the reference tolerance (not bit for bit: BLAS may sum a smaller
    batch in another order, and does on some CPUs)."""
    from dsv4_compile.providers import reference

    cache, _ = filled_cache(2, 8)
    q = torch.randn(5, 2, 4, 512, dtype=torch.bfloat16)
    idx = random_indices((5, 2, 7), 16)
    whole = d4.flash_mla_with_kvcache(q, cache, 8, idx)
    monkeypatch.setattr(reference, "CHUNK_BYTES", 1)  # one row per chunk
    rows = d4.flash_mla_with_kvcache(q, cache, 8, idx)
    close("out", rows[0], whole[0].double(), decoded(cache, 8).abs().max().item())
    close("lse", rows[1], whole[1].double())


def test_decode_key_blocks_match_float64(monkeypatch):
    """Rows wider than one key block merge their blocks (running max, rescaled sums) exactly
    enough: a 3-key block size gives the float64 model's result within the reference tolerance."""
    from dsv4_compile.providers import reference

    cache, _ = filled_cache(4, 16)
    table = decoded(cache, 16)
    q = torch.randn(2, 1, 8, 512, dtype=torch.bfloat16)
    idx = random_indices((2, 1, 20), 64)
    lengths = torch.tensor([20, 7], dtype=torch.int32)
    sink_vals = torch.randn(8)
    monkeypatch.setattr(reference, "_plan", lambda rows, width, heads: (1, 3))
    out, lse = DECODE(q, cache, 16, idx, lengths, sink_vals, None, 1, None, None, None, None, 0.05, 512)
    want_out, want_lse = expected_decode(q, table, idx, lengths, None, None, None, 0.05, sink_vals)
    close("out", out, want_out, table.abs().max().item())
    close("lse", lse, want_lse)


@pytest.mark.parametrize("byte", GARBAGE_BYTES, ids=hex)
def test_decode_reads_nothing_its_row_does_not_reference(byte):
    """Every cache byte outside the records the counted entries reference is garbage (NaN/Inf
    patterns): outputs are bit-identical to those over a clean cache (holes, entries past
    topk_length pointing at slot 0, padding, other tokens' records)."""
    args = decode_args_around_garbage()
    clean = call(DECODE, *args)
    dirty = call(DECODE, *poisoned_decode_args(args, byte))
    assert clean[0].isfinite().all() and not clean[1].isnan().any()
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


@pytest.mark.parametrize("byte", GARBAGE_BYTES, ids=hex)
def test_prefill_reads_nothing_its_row_does_not_reference(byte):
    args = prefill_args_around_garbage()
    clean = call(PREFILL, *args)
    dirty = call(PREFILL, *poisoned_prefill_args(args, byte))
    assert clean[0].isfinite().all()
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))


@pytest.mark.parametrize("batch,s_q,width", [(0, 1, 8), (2, 0, 8), (0, 0, 0), (2, 1, 0)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_decode_empty_batches(batch, s_q, width, compiled):
    """Engines call with empty batches: no rows, or rows with no index column."""
    cache, _ = filled_cache(2, 4)
    extra, _ = filled_cache(2, 2)
    q = torch.randn(batch, s_q, 8, 512, dtype=torch.bfloat16)
    idx = torch.zeros(batch, s_q, width, dtype=torch.int32)
    lengths = torch.zeros(batch, dtype=torch.int32)
    fn = torch.compile(d4.flash_mla_with_kvcache, fullgraph=True) if compiled else d4.flash_mla_with_kvcache
    meta, splits = d4.get_mla_metadata(q, idx, lengths, idx, lengths)
    out, lse = fn(q, cache, 4, idx, lengths, torch.randn(8), extra, 2, idx, lengths, meta, splits)
    assert out.shape == (batch, s_q, 8, 512) and lse.shape == (batch, 8, s_q)
    assert not out.any() and torch.isposinf(lse).all()


@pytest.mark.parametrize("s_q,s_kv,width", [(0, 4, 8), (3, 0, 8), (3, 4, 0), (0, 0, 0)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_prefill_empty_batches(s_q, s_kv, width, compiled):
    q = torch.randn(s_q, 8, 512, dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16)
    idx = torch.zeros(s_q, 1, width, dtype=torch.int32)
    fn = torch.compile(d4.flash_mla_sparse_fwd, fullgraph=True) if compiled else d4.flash_mla_sparse_fwd
    out, mx, lse = fn(q, kv, idx, 0.1, attn_sink=torch.randn(8))
    assert out.shape == (s_q, 8, 512) and mx.shape == lse.shape == (s_q, 8)
    assert not out.any() and torch.isposinf(lse).all() and torch.isneginf(mx).all()


def expected_prefill(q, kv, indices, lengths, scale, sink_vals, d=512):
    s_q, heads, _ = q.shape
    out = torch.zeros(s_q, heads, d, dtype=torch.float64)
    lse = torch.zeros(s_q, heads, dtype=torch.float64)
    mx = torch.zeros(s_q, heads, dtype=torch.float64)
    for s in range(s_q):
        n = indices.shape[-1] if lengths is None else int(lengths[s])
        keys = [kv[int(i), 0].double() for i in indices[s, 0, :n] if 0 <= int(i) < kv.shape[0]]
        keys = torch.stack(keys) if keys else torch.zeros(0, d, dtype=torch.float64)
        out[s], lse[s], mx[s] = attend(q[s].double(), keys, scale, sink_vals)
    return out, mx, lse


@pytest.mark.parametrize("heads", [64, 128, 5])
@pytest.mark.parametrize("sink_kind", ["none", "random", "+inf", "-inf"])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_prefill_matches_float64(heads, sink_kind, with_lengths):
    s_q, s_kv, width = 6, 20, 12
    q = torch.randn(s_q, heads, 512, dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16)
    indices = torch.randint(-3, s_kv + 4, (s_q, 1, width), dtype=torch.int32)  # < 0 and >= s_kv: holes
    indices[-1] = -1  # one empty row
    lengths = torch.randint(0, width + 1, (s_q,), dtype=torch.int32) if with_lengths else None
    sink_vals = sink(sink_kind, heads)
    out, mx, lse = call(PREFILL, q, kv, indices, 0.07, 512, sink_vals, lengths)
    want = expected_prefill(q, kv, indices, lengths, 0.07, sink_vals)
    assert out.shape == (s_q, heads, 512) and mx.shape == lse.shape == (s_q, heads)
    close("out", out, want[0], kv.abs().max().item())
    close("max_logits", mx, want[1])
    close("lse", lse, want[2])
    assert torch.isposinf(lse[-1]).all() and torch.isneginf(mx[-1]).all() and not out[-1].any()


@pytest.mark.parametrize("heads", [64, 5])
def test_prefill_with_576_dim_keys_matches_float64(heads):
    """The V3.2 shape: q and kv carry 512 latent + 64 RoPE dims; scores over all 576, V = the
    first 512."""
    s_q, s_kv, width = 4, 20, 12
    q = torch.randn(s_q, heads, 576, dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, 576, dtype=torch.bfloat16)
    indices = torch.randint(-2, s_kv + 3, (s_q, 1, width), dtype=torch.int32)
    lengths = torch.tensor([12, 5, 0, 9], dtype=torch.int32)
    sink_vals = torch.randn(heads)
    out, mx, lse = call(PREFILL, q, kv, indices, 0.05, 512, sink_vals, lengths)
    want_out, want_mx, want_lse = expected_prefill(q, kv, indices, lengths, 0.05, sink_vals, d=576)
    assert out.shape == (s_q, heads, 512)
    close("out", out, want_out[..., :512], kv.abs().max().item())
    close("max_logits", mx, want_mx)
    close("lse", lse, want_lse)


def test_prefill_wrapper_defaults():
    q = torch.randn(3, 4, 512, dtype=torch.bfloat16)
    kv = torch.randn(8, 1, 512, dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (3, 1, 5), dtype=torch.int32)
    a = d4.flash_mla_sparse_fwd(q, kv, idx, 0.1)
    b = PREFILL(q, kv, idx, 0.1, 512, None, None)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
