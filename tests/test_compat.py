"""dsv4_compile.compat: FlashMLA's and sgl-kernel-xpu's Python interfaces over the dsv4 ops."""

from __future__ import annotations

import math

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.compat import flash_mla, sgl_kernel
from dsv4_compile.tolerances import DEVICE, REFERENCE

from helpers import filled_cache, random_indices, rope_table, store_inputs


def decode_case(heads=64, kv_format="v4", extra_format=None, batch=2, device="cpu"):
    """A V4 (or V4.1) main cache and extra cache, their FlashMLA views, and decode inputs."""
    cache, _ = filled_cache(3, 64, kv_format=kv_format)
    extra_format = extra_format or kv_format
    extra, _ = filled_cache(4, 2, kv_format=extra_format)
    q = torch.randn(batch, 1, heads, 512, dtype=torch.bfloat16)
    idx = random_indices((batch, 1, 64), 3 * 64)
    eidx = random_indices((batch, 1, 8), 8)
    lengths = torch.tensor([64, 20], dtype=torch.int32)[:batch]
    elen = torch.tensor([8, 3], dtype=torch.int32)[:batch]
    sink = torch.randn(heads)
    tensors = [t.to(device) for t in (q, cache, extra, idx, eidx, lengths, elen, sink)]
    return tensors, kv_format, extra_format


def our_decode(case):
    (q, cache, extra, idx, eidx, lengths, elen, sink), fmt, extra_fmt = case
    return d4.flash_mla_with_kvcache(q, cache, 64, idx, lengths, sink, extra, 2, eidx, elen,
                                     kv_format=fmt, extra_kv_format=extra_fmt)


def upstream_decode(case, sched, use_legacy=False):
    (q, cache, extra, idx, eidx, lengths, elen, sink), fmt, extra_fmt = case
    return flash_mla.flash_mla_with_kvcache(
        q, d4.flashmla_view(cache, 64, fmt), None, None, 512, sched, is_fp8_kvcache=True, indices=idx,
        attn_sink=sink, extra_k_cache=d4.flashmla_view(extra, 2, extra_fmt), extra_indices_in_kvcache=eidx,
        topk_length=lengths, extra_topk_length=elen, use_legacy=use_legacy,
    )


# --------------------------------------------------------------------------------------------
# FlashMLA's interface
# --------------------------------------------------------------------------------------------


def test_flash_mla_decode_equals_the_op_and_fills_the_scheduler_once():
    case = decode_case()
    want = our_decode(case)
    sched, none = flash_mla.get_mla_metadata()
    assert none is None and not sched.have_initialized
    first = upstream_decode(case, sched)
    meta = sched.tile_scheduler_metadata
    assert sched.have_initialized and sched.config.topk == 64 and sched.config.extra_topk == 8
    second = upstream_decode(case, sched)
    assert sched.tile_scheduler_metadata is meta  # reused, not recomputed
    for got in (first, second, upstream_decode(case, None)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_flash_mla_scheduler_reused_for_other_shapes_is_an_error():
    sched, _ = flash_mla.get_mla_metadata()
    upstream_decode(decode_case(batch=2), sched)
    with pytest.raises(ValueError, match=r"filled for other shapes \(b differ"):
        upstream_decode(decode_case(batch=1), sched)


def test_flash_mla_accepts_the_metadata_tensors():
    case = decode_case()
    (q, cache, extra, idx, eidx, lengths, elen, sink), _, _ = case
    meta, splits = d4.get_mla_metadata(q, idx, lengths, eidx, elen)
    got = flash_mla.flash_mla_with_kvcache(
        q, d4.flashmla_view(cache, 64), None, None, 512, meta, splits, indices=idx, attn_sink=sink,
        extra_k_cache=d4.flashmla_view(extra, 2), extra_indices_in_kvcache=eidx, topk_length=lengths,
        extra_topk_length=elen)
    assert torch.equal(got[0], our_decode(case)[0])


@pytest.mark.parametrize("use_legacy,formats", [
    (True, ("v4.1-fp8", "v4.1-fp4")),  # the legacy kernels' V4.1: block-split
    (False, ("v4.1-fp8-interleaved", "v4.1-fp4-interleaved")),  # the current kernels': interleaved
])
def test_flash_mla_v41_views_name_their_format(use_legacy, formats):
    case = decode_case(kv_format=formats[0], extra_format=formats[1])
    got = upstream_decode(case, None, use_legacy=use_legacy)
    want = our_decode(case)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("over,match", [
    (dict(causal=True), "causal must be False"),
    (dict(is_fp8_kvcache=False), "is_fp8_kvcache must be None or True"),
    (dict(indices=None), "indices must be given"),
    (dict(descale_q=torch.ones(1)), "descale_q"),
    (dict(kv_format="V32"), "kv_format must be None or name the 584-byte tokens"),
    (dict(num_splits=torch.zeros(3, dtype=torch.int32)), "num_splits must be None with a FlashMLASchedMeta"),
    (dict(tile_scheduler_metadata="sched"), "tile_scheduler_metadata must be a FlashMLASchedMeta"),
])
def test_flash_mla_rejects_what_is_no_dsv4_call(over, match):
    (q, cache, _, idx, _, lengths, _, sink), _, _ = decode_case()
    kwargs = dict(is_fp8_kvcache=True, indices=idx, attn_sink=sink, topk_length=lengths)
    kwargs.update(over)
    sched = kwargs.pop("tile_scheduler_metadata", flash_mla.get_mla_metadata()[0])
    with pytest.raises((ValueError, TypeError), match=match):
        flash_mla.flash_mla_with_kvcache(q, d4.flashmla_view(cache, 64), None, None, 512, sched, **kwargs)


def test_flash_mla_ignores_block_table_and_cache_seqlens():
    case = decode_case()
    (q, cache, extra, idx, eidx, lengths, elen, sink), _, _ = case
    got = flash_mla.flash_mla_with_kvcache(
        q, d4.flashmla_view(cache, 64), torch.zeros(2, 3, dtype=torch.int32), torch.full((2,), 99, dtype=torch.int32),
        512, None, indices=idx, attn_sink=sink, extra_k_cache=d4.flashmla_view(extra, 2),
        extra_indices_in_kvcache=eidx, topk_length=lengths, extra_topk_length=elen)
    assert torch.equal(got[0], our_decode(case)[0])


def test_flash_mla_prefill_return_conventions():
    q = torch.randn(3, 64, 576, dtype=torch.bfloat16)
    kv = torch.randn(10, 1, 576, dtype=torch.bfloat16)
    idx = torch.randint(-1, 10, (3, 1, 6), dtype=torch.int32)
    out, mx, lse = d4.flash_mla_sparse_fwd(q, kv, idx, 0.05)
    natural = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05)
    assert all(torch.equal(a, b) for a, b in zip(natural, (out, mx, lse)))
    assert flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, return_log2_lse=False)[1:] == (None, None)
    log2 = flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, use_legacy=True, return_log2_lse=True)
    torch.testing.assert_close(log2[1], mx / math.log(2.0))
    torch.testing.assert_close(log2[2], lse / math.log(2.0))
    with pytest.raises(ValueError, match="use_legacy=True"):
        flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.05, return_log2_lse=True)


# --------------------------------------------------------------------------------------------
# Cache views
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_format", ["v4", "v4.1-fp8-interleaved", "v4.1-fp4-interleaved", "v4.1-fp8"])
def test_cache_from_view_is_the_base_without_a_copy(kv_format):
    cache = d4.alloc_cache(3, 5, kv_format=kv_format, page_stride=layout.FORMATS[kv_format].token_bytes * 5 + 16)
    view = cache[:, : 5 * layout.FORMATS[kv_format].token_bytes].view(torch.float8_e4m3fn).unflatten(
        1, (5, 1, -1))
    base, page_size, token = layout.cache_from_view(view)
    assert (page_size, token) == (5, layout.FORMATS[kv_format].token_bytes)
    assert base.data_ptr() == cache.data_ptr() and base.shape == cache.shape and base.stride() == cache.stride()


@pytest.mark.parametrize("make,match", [
    (lambda c: d4.flashmla_view(c, 64).view(torch.int16), "float8_e4m3fn/uint8/int8"),
    (lambda c: d4.flashmla_view(c, 64)[:, :, 0], "float8_e4m3fn/uint8/int8"),  # 3-D
    (lambda c: c[:, : 32 * 584].view(torch.float8_e4m3fn).view(3, 32, 1, 584)[:, ::2], "tokens packed"),
    (lambda c: d4.flashmla_view(c, 64)[:, :, :, :576], "token_bytes in"),
    # pages 38440 bytes apart in a storage that ends 900 bytes into the last page's padding
    (lambda c: torch.as_strided(torch.zeros(3 * 38440 - 900, dtype=torch.uint8), (3, 64, 1, 584),
                                (38440, 584, 584, 1)), "stays inside the storage"),
])
def test_views_that_are_no_base_cache_are_rejected(make, match):
    cache = d4.alloc_cache(3, 64)
    with pytest.raises(ValueError, match=match):
        layout.cache_from_view(make(cache))


# --------------------------------------------------------------------------------------------
# sgl-kernel-xpu's interface
# --------------------------------------------------------------------------------------------


def test_sgl_kernel_decode_treats_out_of_range_indices_as_holes():
    case = decode_case(heads=16)
    (q, cache, extra, idx, eidx, lengths, elen, sink), _, _ = case
    wild = idx.clone()
    wild[0, 0, :5] = torch.tensor([-7, 3 * 64, 10**6, -1, 3 * 64 + 5], dtype=torch.int32)
    tame = idx.clone()
    tame[0, 0, :5] = -1
    got = sgl_kernel.flash_mla_with_kvcache(
        q=q, k_cache=d4.flashmla_view(cache, 64), head_dim_v=512, is_fp8_kvcache=True, indices=wild,
        attn_sink=sink, extra_k_cache=d4.flashmla_view(extra, 2), extra_indices_in_kvcache=eidx,
        topk_length=lengths, extra_topk_length=elen)
    want = d4.flash_mla_with_kvcache(q, cache, 64, tame, lengths, sink, extra, 2, eidx, elen)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("over,match", [
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "dense path"),
    (dict(is_fp8_kvcache=False), "is_fp8_kvcache must be True"),
    (dict(causal=True), "causal must be False"),
    (dict(extra_k_cache="view"), "must be given together"),
])
def test_sgl_kernel_decode_rejects_what_is_no_dsv4_call(over, match):
    (q, cache, _, idx, _, _, _, _), _, _ = decode_case(heads=16)
    kwargs = dict(q=q, k_cache=d4.flashmla_view(cache, 64), indices=idx, is_fp8_kvcache=True)
    kwargs.update({k: (kwargs["k_cache"] if v == "view" else v) for k, v in over.items()})
    with pytest.raises(ValueError, match=match):
        sgl_kernel.flash_mla_with_kvcache(**kwargs)


def test_sgl_kernel_store_takes_complex_or_real_freqs_and_any_page_size():
    kv, w, _, pos = store_inputs(5, max_pos=16)
    angles = torch.rand(16, 32, dtype=torch.float64) * 6
    cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    real = torch.view_as_real(cis).flatten(-2)
    slots = torch.tensor([0, 4, -1, 9, 2], dtype=torch.int32)
    a, b, c = (d4.alloc_cache(2, 6) for _ in range(3))
    sgl_kernel.fused_k_norm_rope_flashmla(kv=kv, kv_weight=w, freqs_cis=cis, positions=pos, out_loc=slots,
                                          kvcache=a, eps=1e-6, page_size=6)
    sgl_kernel.fused_k_norm_rope_flashmla(kv, w, real, pos, slots, b, 1e-6, 6)
    d4.fused_k_norm_rope_flashmla(kv, w, real, pos, slots, c, 1e-6, 6)
    assert torch.equal(a, c) and torch.equal(b, c) and c.any()


def test_sgl_kernel_prefill_has_three_natural_log_outputs():
    q = torch.randn(3, 8, 512, dtype=torch.bfloat16)
    kv = torch.randn(10, 1, 512, dtype=torch.bfloat16)
    idx = torch.randint(-1, 12, (3, 1, 6), dtype=torch.int32)
    sink = torch.randn(8)
    got = sgl_kernel.flash_mla_sparse_fwd(q, kv, idx, 0.05, attn_sink=sink)
    assert len(got) == 3 and got[0].shape == (3, 8, 512) and got[2].dtype == torch.float32
    want = d4.flash_mla_sparse_fwd(q, kv, idx, 0.05, attn_sink=sink)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # lse and max_logits in natural log, without the sink: an independent float64 computation
    valid = (idx[:, 0] >= 0) & (idx[:, 0] < 10)  # [s_q, K]; an entry counts once per occurrence
    scores = 0.05 * torch.einsum("shd,skd->shk", q.double(), kv[idx[:, 0].clamp(0, 9), 0].double())
    scores = scores.masked_fill(~valid[:, None], -math.inf)
    lse = torch.logsumexp(scores, -1).masked_fill(~valid.any(-1)[:, None], math.inf)
    torch.testing.assert_close(got[2].double(), lse, atol=REFERENCE["lse"].atol, rtol=REFERENCE["lse"].rtol)
    torch.testing.assert_close(got[1].double(), scores.amax(-1), atol=REFERENCE["max_logits"].atol,
                               rtol=REFERENCE["max_logits"].rtol)


# --------------------------------------------------------------------------------------------
# Call sites written once: compiled, and on every device
# --------------------------------------------------------------------------------------------


def backend_step(q, k_view, idx, lengths, sink, extra_view, eidx, elen, sched):
    """A DSV4 backend's decode call site, written once against the compat module."""
    out, _ = flash_mla.flash_mla_with_kvcache(
        q, k_view, None, None, 512, sched, softmax_scale=512**-0.5, is_fp8_kvcache=True, indices=idx,
        attn_sink=sink, extra_k_cache=extra_view, extra_indices_in_kvcache=eidx, topk_length=lengths,
        extra_topk_length=elen,
    )
    return out


def call_site_args(case, sched):
    (q, cache, extra, idx, eidx, lengths, elen, sink), fmt, efmt = case
    return (q, d4.flashmla_view(cache, 64, fmt), idx, lengths, sink, d4.flashmla_view(extra, 2, efmt), eidx, elen,
            sched)


def test_call_site_compiles_to_one_graph():
    case = decode_case()
    sched, _ = flash_mla.get_mla_metadata()
    eager = backend_step(*call_site_args(case, sched))  # fills the scheduler eagerly
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(backend_step)(*call_site_args(case, sched))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    compiled = torch.compile(backend_step, fullgraph=True)(*call_site_args(case, sched))
    assert torch.equal(compiled, eager)


def test_an_unfilled_scheduler_is_refused_under_tracing_with_a_way_out():
    torch._dynamo.reset()
    sched, _ = flash_mla.get_mla_metadata()
    with pytest.raises(Exception, match="fill it with one eager call before compiling"):
        torch.compile(backend_step, fullgraph=True)(*call_site_args(decode_case(), sched))


@pytest.mark.cuda
@pytest.mark.parametrize("kv_format,extra_format", [("v4", "v4"), ("v4.1-fp8-interleaved", "v4.1-fp4-interleaved")])
def test_the_same_call_site_on_cpu_and_cuda(kv_format, extra_format):
    """The call site above gives the same results on CPU (the reference) and CUDA (FlashMLA or
    Triton), within the documented device tolerances."""
    torch.manual_seed(0)
    case = decode_case(kv_format=kv_format, extra_format=extra_format)
    cpu = backend_step(*call_site_args(case, flash_mla.get_mla_metadata()[0]))
    tensors, fmt, efmt = case
    cuda_case = ([t.to("cuda") for t in tensors], fmt, efmt)
    gpu = backend_step(*call_site_args(cuda_case, flash_mla.get_mla_metadata()[0]))
    vmax = max(layout.gather_dequant(c, p, torch.arange(layout.capacity(c, p)), torch.float32, f).abs().max().item()
               for c, p, f in ((tensors[1], 64, fmt), (tensors[2], 2, efmt)))
    torch.testing.assert_close(gpu.cpu().float(), cpu.float(), atol=DEVICE["out"].atol * vmax, rtol=DEVICE["out"].rtol)
    q = torch.randn(4, 64, 576, dtype=torch.bfloat16)
    kv = torch.randn(50, 1, 576, dtype=torch.bfloat16)
    idx = torch.randint(-1, 50, (4, 1, 128), dtype=torch.int32)
    want = sgl_kernel.flash_mla_sparse_fwd(q, kv, idx, 0.05)
    got = sgl_kernel.flash_mla_sparse_fwd(q.cuda(), kv.cuda(), idx.cuda(), 0.05)
    torch.testing.assert_close(got[0].cpu().float(), want[0].float(), atol=DEVICE["out"].atol * kv.abs().max().item(),
                               rtol=DEVICE["out"].rtol)
    torch.testing.assert_close(got[2].cpu(), want[2], atol=DEVICE["lse"].atol, rtol=DEVICE["lse"].rtol)
    kv_s, w, freqs, pos = store_inputs(9, max_pos=64)
    caches = [d4.alloc_cache(2, 8), d4.alloc_cache(2, 8, "cuda")]
    slots = torch.tensor([0, 3, 15, -1, 7, 8, 1, 2, 9])
    for cache, device in zip(caches, ("cpu", "cuda")):
        sgl_kernel.fused_k_norm_rope_flashmla(kv_s.to(device), w.to(device), freqs.to(device), pos.to(device),
                                              slots.to(device), cache, 1e-6, 8)
    live = slots[slots >= 0]
    torch.testing.assert_close(d4.gather_dequant(caches[1], 8, live.cuda(), torch.float32).cpu(),
                               d4.gather_dequant(caches[0], 8, live, torch.float32), rtol=2**-3, atol=1e-3)
