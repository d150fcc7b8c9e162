"""The CUDA (FlashMLA) adapters on CPU, against stand-ins that follow FlashMLA's ops and checks.

The CUDA kernels are reached through the dispatcher (a redispatch to the CUDA key with CPU
tensors), so the real adapter code runs: head/width padding, the cache view, statistics
conversion, scheduler metadata handling and provider choice.
"""


import pytest
import torch

import dsv4_compile as d4
from dsv4_compile import dispatch
from dsv4_compile.providers import reference
from dsv4_compile.providers.flashmla import adapter as flashmla
from dsv4_compile.ops.decode import decode_outputs

import flashmla_standin as standin
from helpers import (
    GARBAGE_BYTES,
    assert_calls_keep_no_new_tensor,
    assert_garbage_is_invisible,
    assert_malformed_calls_named,
    filled_cache,
    random_indices,
    sink,
    unpadded_call,
)

CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)

# With a real GPU the real providers (and the real FlashMLA namespaces) are present: test_cuda.py
# covers them there; these stand-in tests are for machines without one.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in tests run without a GPU")


def on_cuda(op, *args):
    return getattr(torch.ops.dsv4, op).default.redispatch(CUDA, *args)


@pytest.fixture(params=["flashmla", "sgl_kernel"])
def provider(request, monkeypatch):
    standin.install(monkeypatch, request.param)
    monkeypatch.setattr(flashmla, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(flashmla, "_num_sms", lambda device: standin.NUM_SMS)
    dispatch.reset()
    standin.CALLS.clear()
    yield request.param
    dispatch.reset()


def decode_case(heads, s_q=1, extra=True, width=100, lengths=True, sink_kind="random", batch=3):
    cache, _ = filled_cache(4, 64, num_tokens=200)
    ecache, _ = filled_cache(3, 2)
    args = [
        torch.randn(batch, s_q, heads, 512, dtype=torch.bfloat16), cache, 64,
        random_indices((batch, s_q, width), 256),
        torch.randint(0, width + 1, (batch,), dtype=torch.int32) if lengths else None,
        sink(sink_kind, heads),
        ecache if extra else None, 2,
        random_indices((batch, s_q, 5), 6) if extra else None,
        torch.tensor([5, 0, 3], dtype=torch.int32)[:batch] if extra and lengths else None,
        None, None, 0.05, 512,
    ]
    return args


def test_provider_choice(provider):
    assert d4.providers("cuda:0") == {
        "fused_k_norm_rope_flashmla": "reference",  # the Triton store registers separately
        "quantize_store": "reference",
        "flash_mla_with_kvcache": provider,
        "flash_mla_sparse_fwd": provider,
        "get_mla_metadata": provider,
        "get_mla_metadata_stacked": provider,
        "indexer_logits": "reference",  # FlashMLA has none; the Triton one registers separately
        "indexer_topk": "reference",
        "indexer_store": "reference",
        "indexer_cache_logits": "reference",
        "indexer_cache_topk": "reference",
        "rope_": "reference",  # the Triton one registers separately
    }


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (12, 0)])
def test_unsupported_gpu_falls_back_with_a_warning(monkeypatch, capability):
    standin.install(monkeypatch, "flashmla")
    monkeypatch.setattr(flashmla, "_capability", lambda device: capability)
    dispatch.reset()
    try:
        args = decode_case(64)
        with pytest.warns(RuntimeWarning, match=f"sm_{capability[0]}{capability[1]}"):
            out, lse = on_cuda("flash_mla_with_kvcache", *args)
        want = reference.flash_mla_with_kvcache(*args)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    finally:
        dispatch.reset()


def test_no_flashmla_installed_falls_back(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flash_mla", None)
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_mla", None)
    dispatch.reset()
    try:
        with pytest.warns(RuntimeWarning, match="sgl-flash-mla"):
            on_cuda("flash_mla_with_kvcache", *decode_case(64))
    finally:
        dispatch.reset()


@pytest.mark.parametrize("heads", [64, 128, 16, 96, 200])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("extra", [False, True])
def test_decode_equals_reference(provider, heads, s_q, extra):
    args = decode_case(heads, s_q, extra)
    out, lse = on_cuda("flash_mla_with_kvcache", *args)
    want_out, want_lse = reference.flash_mla_with_kvcache(*args)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-6)
    fake_out, fake_lse = decode_outputs(args[0], 512)
    assert out.stride() == fake_out.stride() and lse.stride() == fake_lse.stride()
    for name, call in standin.CALLS:
        assert call["q"].shape[2] in (64, 128)
        assert call["indices"].shape[-1] % 64 == 0 and call["indices"].dtype == torch.int32
        assert call["kv"].dtype == torch.float8_e4m3fn and call["kv"].shape[1:] == (64, 1, 584)
        assert call["kv"].stride(0) == args[1].stride(0)
        if extra:
            assert call["extra_indices"].shape[-1] == 64 and call["extra_kv"].shape[1] == 2
    assert len(standin.CALLS) == (2 if heads > 128 else 1)


@pytest.mark.parametrize("sink_kind", ["none", "+inf", "-inf"])
def test_decode_sinks_and_empty_rows(provider, sink_kind):
    args = decode_case(64, sink_kind=sink_kind)
    args[3][0] = -1  # request 0: no valid main index
    args[4] = None
    args[9] = torch.tensor([0, 5, 3], dtype=torch.int32)
    out, lse = on_cuda("flash_mla_with_kvcache", *args)
    assert [name for name, _ in standin.CALLS] == ["decode"]  # served by the stand-in FlashMLA
    want = reference.flash_mla_with_kvcache(*args)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-2)
    torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-6)
    assert torch.isposinf(lse[0]).all() and not out[0].any()


def test_hoisted_metadata_is_identical_and_shaped_like_the_fake(provider):
    args = decode_case(64, s_q=2)
    q, idx, lengths, eidx, elen = args[0], args[3], args[4], args[8], args[9]
    meta, splits = on_cuda("get_mla_metadata", q, idx, lengths, eidx, elen)
    assert meta.shape == (standin.NUM_SMS // 2, 8) and splits.shape == (q.shape[0] + 1,)
    assert (meta.shape, splits.shape) == flashmla.metadata_shapes(torch.device("cuda"), q.shape[0], 2, 64)
    inside = on_cuda("flash_mla_with_kvcache", *args)
    args[10], args[11] = meta, splits
    hoisted = on_cuda("flash_mla_with_kvcache", *args)
    assert torch.equal(inside[0], hoisted[0]) and torch.equal(inside[1], hoisted[1])
    assert standin.CALLS[-1][1]["meta"] is meta  # passed through, not recomputed


def test_stacked_metadata_is_the_op_per_entry(provider):
    """Entry k of ``get_mla_metadata_stacked`` is ``get_mla_metadata`` for indices of its widths
    (here the library's scheduler, the stand-in's: a decode over a dummy cache per entry); an extra
    width of 0 is no extra cache."""
    q = torch.randn(3, 1, 64, 512, dtype=torch.bfloat16)
    lengths, extra = torch.tensor([5, 0, 100], dtype=torch.int32), torch.tensor([7, 512, 0], dtype=torch.int32)
    entries = [(128, lengths, 0, None), (128, lengths, 512, extra), (100, None, 32, None), (64, lengths, 5, extra)]
    meta, splits = on_cuda("get_mla_metadata_stacked", q, *map(list, zip(*entries)))
    assert meta.shape == (4, standin.NUM_SMS, 8) and splits.shape == (4, 4)
    for k, (width, topk_length, extra_width, extra_length) in enumerate(entries):
        idx = torch.zeros(3, 1, width, dtype=torch.int32)
        extra_idx = torch.zeros(3, 1, extra_width, dtype=torch.int32) if extra_width else None
        want = on_cuda("get_mla_metadata", q, idx, topk_length, extra_idx, extra_length)
        assert torch.equal(meta[k], want[0]) and torch.equal(splits[k], want[1]), k


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_own_schedule_only_where_it_was_checked_against_the_library(provider, monkeypatch, capability):
    """Our Triton schedule (providers/flashmla/schedule.py) serves ``flashmla`` on SM90, where
    test_flashmla_schedule.py compares it with FlashMLA's own; elsewhere the library schedules."""
    from dsv4_compile.providers.flashmla import schedule as flashmla_schedule

    monkeypatch.setattr(flashmla_schedule, "available", lambda device: True)
    monkeypatch.setattr(flashmla, "_capability", lambda device: capability)
    device = torch.device("cuda", 0)
    load = flashmla._load_flash_mla if provider == "flashmla" else flashmla._load_sgl_kernel
    kernels = load(device)["get_mla_metadata"].__self__
    assert kernels.own_schedule == (provider == "flashmla" and capability == (9, 0))
    monkeypatch.setattr(flashmla_schedule, "available", lambda device: False)  # no Triton for CUDA
    assert not load(device)["get_mla_metadata"].__self__.own_schedule


def test_calls_leave_no_new_tensor_behind(provider):
    args = decode_case(64)
    sparse = (torch.randn(5, 64, 512, dtype=torch.bfloat16), torch.randn(40, 1, 512, dtype=torch.bfloat16),
              torch.randint(-2, 45, (5, 1, 70), dtype=torch.int32), 0.06, 512)

    def calls():
        yield from on_cuda("get_mla_metadata", args[0], args[3], args[4], args[8], args[9])
        yield from on_cuda("flash_mla_with_kvcache", *args)
        yield from on_cuda("flash_mla_sparse_fwd", *sparse)

    assert_calls_keep_no_new_tensor(lambda: list(calls()), forget=standin.CALLS.clear)


def test_stale_metadata_is_caught_in_checked_mode(provider):
    args = decode_case(64)
    meta, splits = on_cuda("get_mla_metadata", args[0], args[3], args[4], args[8], args[9])
    args[4] = torch.clamp(args[4] - 40, min=0).to(torch.int32)  # the lengths change after the schedule
    args[10], args[11] = meta, splits
    assert torch.isnan(on_cuda("flash_mla_with_kvcache", *args)[0]).any()  # what FlashMLA does
    with d4.checked():
        with pytest.raises(ValueError, match="stale"):
            on_cuda("flash_mla_with_kvcache", *args)


def test_empty_metadata_from_another_provider_means_compute_inside(provider):
    args = decode_case(64)
    args[10], args[11] = reference.get_mla_metadata(args[0], args[3], args[4], args[8], args[9])
    out, _ = on_cuda("flash_mla_with_kvcache", *args)
    assert standin.CALLS[-1][1]["meta"] is None
    torch.testing.assert_close(out, reference.flash_mla_with_kvcache(*args)[0], atol=1e-5, rtol=1e-2)


@pytest.mark.parametrize("heads", [64, 128, 8, 130])
@pytest.mark.parametrize("sink_kind", ["random", "none"])
def test_prefill_equals_reference_with_natural_log(provider, heads, sink_kind):
    s_q, s_kv, width = 5, 40, 70
    args = (
        torch.randn(s_q, heads, 512, dtype=torch.bfloat16), torch.randn(s_kv, 1, 512, dtype=torch.bfloat16),
        torch.randint(-2, s_kv + 5, (s_q, 1, width), dtype=torch.int32), 0.06, 512, sink(sink_kind, heads),
        torch.randint(0, width + 1, (s_q,), dtype=torch.int32),
    )
    got = on_cuda("flash_mla_sparse_fwd", *args)
    want = reference.flash_mla_sparse_fwd(*args)
    assert len(got) == 3
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-2)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)  # natural log on both providers
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    assert [name for name, _ in standin.CALLS] == ["prefill"] * (2 if heads > 128 else 1)
    for _, call in standin.CALLS:
        assert call["q"].shape[1] in (64, 128) and call["indices"].shape[-1] % 128 == 0


def test_checked_mode_rejects_bad_indices_before_the_kernel(provider):
    args = decode_case(64)
    args[3][1, 0, 0] = 256  # == capacity: a wild read on the GPU
    with d4.checked():
        with pytest.raises(ValueError, match="indices"):
            on_cuda("flash_mla_with_kvcache", *args)
    assert standin.CALLS == []


def test_sm100_unpadded_page_stride_is_served_by_the_next_provider(monkeypatch):
    """SM100's FlashMLA reads page strides that are multiples of 576 only: an unpadded cache
    (stride P*584, legal by contract) goes to the next provider, with one warning."""
    standin.install(monkeypatch, "flashmla")
    monkeypatch.setattr(flashmla, "_capability", lambda device: (10, 0))
    monkeypatch.setattr(flashmla, "_num_sms", lambda device: standin.NUM_SMS)
    dispatch.reset()
    try:
        args = decode_case(64)
        padded = on_cuda("flash_mla_with_kvcache", *args)
        assert len(standin.CALLS) > 0
        standin.CALLS.clear()
        unpadded = d4.alloc_cache(4, 64, page_stride=64 * 584)
        unpadded.copy_(args[1][:, : 64 * 584])
        args[1] = unpadded
        with pytest.warns(RuntimeWarning, match="multiples of 576"):
            out, lse = on_cuda("flash_mla_with_kvcache", *args)
        assert standin.CALLS == []  # FlashMLA was not called
        torch.testing.assert_close(out, padded[0], atol=1e-5, rtol=1e-2)
        torch.testing.assert_close(lse, padded[1], atol=1e-5, rtol=1e-6)
    finally:
        dispatch.reset()


@pytest.mark.parametrize("byte", GARBAGE_BYTES, ids=hex)
def test_outputs_read_nothing_their_row_does_not_reference(provider, byte):
    """Garbage in every unreferenced cache byte / workspace row changes no output bit (the
    adapter's index padding points nowhere either)."""
    assert_garbage_is_invisible(on_cuda, heads=64, byte=byte)


@pytest.mark.parametrize("batch,s_q", [(0, 1), (2, 0)])
def test_empty_batches_launch_nothing(provider, batch, s_q):
    args = decode_case(64, s_q=s_q, batch=batch)
    args[3] = args[3][:batch, :s_q]
    args[8] = args[8][:batch, :s_q]
    args[4], args[9] = args[4][:batch], args[9][:batch]
    meta, splits = on_cuda("get_mla_metadata", args[0], args[3], args[4], args[8], args[9])
    meta_shape, splits_shape = flashmla.metadata_shapes(torch.device("cuda", 0), batch, s_q, 64)
    assert meta.shape == meta_shape and splits.shape == splits_shape
    args[10], args[11] = meta, splits
    out, lse = on_cuda("flash_mla_with_kvcache", *args)
    assert out.shape == (batch, s_q, 64, 512) and lse.shape == (batch, 64, s_q)
    prefill = on_cuda("flash_mla_sparse_fwd", args[0][0, :0] if batch else args[0].reshape(0, 64, 512),
                      torch.randn(4, 1, 512, dtype=torch.bfloat16), torch.zeros(0, 1, 8, dtype=torch.int32),
                      0.1, 512, None, None)
    assert prefill[0].shape == (0, 64, 512)
    assert standin.CALLS == []


def v41_case(kv_format="v4.1-fp8-interleaved", extra_format="v4.1-fp4-interleaved", heads=64, batch=2):
    """Decode arguments over V4.1 caches (stored by the reference), odd page sizes."""
    args = []
    caches = []
    for fmt, pages, page_size in ((kv_format, 3, 5), (extra_format, 4, 2)):
        cache = d4.alloc_cache(pages, page_size, kv_format=fmt)
        cap = pages * page_size
        d4.quantize_store(torch.randn(cap, 512), torch.arange(cap), cache, page_size, fmt)
        caches.append((cache, page_size, cap))
    (cache, p, cap), (extra, ep, ecap) = caches
    args = [torch.randn(batch, 1, heads, 512, dtype=torch.bfloat16), cache, p,
            random_indices((batch, 1, 40), cap), torch.tensor([40, 7], dtype=torch.int32)[:batch], sink("random", heads),
            extra, ep, random_indices((batch, 1, 6), ecap), None, None, None, 0.05, 512, kv_format, extra_format]
    return args


@pytest.fixture
def sm100_flashmla(monkeypatch):
    """The ``flashmla`` stand-in on an SM100 GPU (its current kernels serve V4.1 interleaved caches)."""
    standin.install(monkeypatch, "flashmla")
    monkeypatch.setattr(flashmla, "_capability", lambda device: (10, 0))
    monkeypatch.setattr(flashmla, "_num_sms", lambda device: standin.NUM_SMS)
    dispatch.reset()
    standin.CALLS.clear()
    yield
    dispatch.reset()


def test_v41_interleaved_on_sm100_runs_flashmla_current_kernels(sm100_flashmla):
    args = v41_case()
    meta = on_cuda("get_mla_metadata", args[0], args[3], args[4], args[8], args[9])
    args[10], args[11] = meta  # the V4 kernels' schedule: the V4.1 decode schedules inside
    out, lse = on_cuda("flash_mla_with_kvcache", *args)
    name, call = standin.CALLS[-1]
    assert name == "decode_v41" and call["meta"] is None
    assert call["kv"].shape[3] == 528 and call["extra_kv"].shape[3] == 288
    assert call["kv"].data_ptr() == args[1].data_ptr() and call["indices"].shape[-1] == 64
    want = reference.flash_mla_with_kvcache(*args)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-2)
    torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-6)


def test_batch_invariant_v41_decode_on_sm100_asks_flashmla_for_its_flag(sm100_flashmla):
    """In the mode, FlashMLA's current kernels serve V4.1 interleaved caches with their
    ``enable_batch_invariant``, scheduling inside whatever metadata is passed."""
    args = v41_case()
    args[10], args[11] = on_cuda("get_mla_metadata", args[0], args[3], args[4], args[8], args[9])
    out, lse = on_cuda("flash_mla_with_kvcache", *args, True)
    name, call = standin.CALLS[-1]
    assert name == "decode_v41" and call["enable_batch_invariant"] is True and call["meta"] is None
    on_cuda("flash_mla_with_kvcache", *args)
    assert standin.CALLS[-1][1]["enable_batch_invariant"] is False
    want = reference.flash_mla_with_kvcache(*args)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-2)
    assert dispatch.providers("cuda:0", batch_invariant=True)["flash_mla_with_kvcache"] == "flashmla"


def test_batch_invariant_v4_decode_skips_flashmla_legacy_kernels(provider):
    """The legacy kernels (V4 caches) split a row's keys by the whole batch's schedule and have no
    flag: in the mode their calls go to the next provider, with one warning naming why."""
    args = decode_case(64)
    standin.CALLS.clear()
    with pytest.warns(RuntimeWarning, match=f"batch-invariant mode uses provider 'reference'; skipped .*'{provider}'"):
        out, lse = on_cuda("flash_mla_with_kvcache", *args, "v4", None, True)
    assert standin.CALLS == []
    want = reference.flash_mla_with_kvcache(*args)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    chain = dict(dispatch.provider_chain("cuda:0", batch_invariant=True)["flash_mla_with_kvcache"])
    if provider == "flashmla":  # its current kernels' calls only
        assert "V4.1 interleaved caches on SM100" in chain[provider]
    else:
        assert provider not in chain


@pytest.mark.parametrize("capability,kv_format,extra_format", [
    ((9, 0), "v4.1-fp8-interleaved", "v4.1-fp4-interleaved"),  # SM90: no V4.1 FlashMLA kernel
    ((10, 0), "v4.1-fp8", "v4.1-fp4"),  # block-split: FlashMLA's current kernels read interleaved only
    ((10, 0), "v4.1-fp8-interleaved", "v4.1-fp4"),
])
def test_v41_calls_flashmla_cannot_serve_go_to_the_next_provider(monkeypatch, capability, kv_format, extra_format):
    standin.install(monkeypatch, "flashmla")
    monkeypatch.setattr(flashmla, "_capability", lambda device: capability)
    dispatch.reset()
    standin.CALLS.clear()
    try:
        args = v41_case(kv_format, extra_format)
        with pytest.warns(RuntimeWarning, match="'flashmla' needs kv_format 'v4'"):
            out, lse = on_cuda("flash_mla_with_kvcache", *args)
        assert standin.CALLS == []
        want = reference.flash_mla_with_kvcache(*args)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        assert dispatch.provider_chain("cuda:0")["flash_mla_with_kvcache"][0][0] == "flashmla"
    finally:
        dispatch.reset()


@pytest.mark.parametrize("heads", [64, 8])
def test_prefill_with_576_dim_keys(provider, heads):
    """The V3.2 shape reaches FlashMLA as it is (q, kv with 576 dims; V the first 512)."""
    s_q, s_kv = 4, 30
    args = (torch.randn(s_q, heads, 576, dtype=torch.bfloat16), torch.randn(s_kv, 1, 576, dtype=torch.bfloat16),
            torch.randint(-1, s_kv, (s_q, 1, 20), dtype=torch.int32), 0.05, 512, torch.randn(heads), None)
    got = on_cuda("flash_mla_sparse_fwd", *args)
    want = reference.flash_mla_sparse_fwd(*args)
    assert standin.CALLS[-1][1]["q"].shape[-1] == 576 and got[0].shape == (s_q, heads, 512)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-2)
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)


def test_malformed_unpadded_calls_get_the_checks_errors(provider):
    """At 64 heads FlashMLA's kernels check the call themselves (``flashmla``:
    ``Provider.validates``; the stand-ins check what the real ops check): a malformed call still
    gets the metadata checks' error, naming the argument, from either provider."""
    names = {"decode": "flash_mla_with_kvcache", "prefill": "flash_mla_sparse_fwd"}
    assert_malformed_calls_named(lambda op, *args: on_cuda(names[op], *args), "cpu")


def test_validating_provider_runs_the_checks_only_when_its_kernel_refuses(provider):
    """``flashmla`` (``Provider.validates``): a known call signature goes to FlashMLA unchecked,
    and a malformed one gets the checks' error after FlashMLA refused it; ``sgl_kernel`` is
    checked before FlashMLA sees anything."""
    args = unpadded_call("decode", "cpu")
    on_cuda("flash_mla_with_kvcache", *args)  # the signature's first call: checked, resolved
    args[3] = args[3].long()  # int64 indices: the same call signature
    standin.CALLS.clear()
    with pytest.raises(TypeError, match=r"^dsv4\.flash_mla_with_kvcache: indices must be int32"):
        on_cuda("flash_mla_with_kvcache", *args)
    assert len(standin.CALLS) == (1 if provider == "flashmla" else 0)
