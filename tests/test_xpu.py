"""The XPU provider (sgl-kernel-xpu adapters) against the reference, on CPU.

The library is replaced by a stand-in (``sgl_kernel_xpu_standin``) with its Python API and input
checks; the ops are redispatched to the XPU dispatch key, so the ``"xpu"`` providers serve CPU
tensors. Each test asserts the values equal the reference's and the call reached the library in the
form it requires.
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch

import dsv4_compile  # noqa: F401  (registers the ops)
import sgl_kernel_xpu_standin
from dsv4_compile import dispatch, layout, tolerances
from dsv4_compile.providers import reference, sgl_kernel_xpu as xpu_kernels
from dsv4_compile.providers.triton import store as triton_store
from dsv4_compile.ops.decode import decode_outputs
from dsv4_compile.ops.prefill import prefill_outputs
from helpers import (
    GARBAGE_BYTES,
    assert_calls_keep_no_new_tensor,
    assert_garbage_is_invisible,
)

XPU_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.XPU)
SCALE = layout.HEAD_DIM**-0.5
EPS = 1e-6


def on_xpu(op: str, *args):
    """Run ``dsv4.<op>`` through the XPU dispatch key (arguments positional, schema order)."""
    return getattr(torch.ops.dsv4, op).default.redispatch(XPU_KEY, *args)


@pytest.fixture(autouse=True)
def xpu_provider(monkeypatch):
    monkeypatch.delenv(dispatch.PROVIDER_ENV, raising=False)
    xpu_kernels.register()
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.fixture
def standin(monkeypatch):
    """sgl-kernel-xpu's ``sgl_kernel`` replaced by the stand-in; its calls recorded afresh."""
    sgl_kernel_xpu_standin.calls.clear()
    monkeypatch.setitem(sys.modules, "sgl_kernel", sgl_kernel_xpu_standin)
    dispatch.reset()
    yield sgl_kernel_xpu_standin
    dispatch.reset()


@pytest.fixture
def registry():
    """The provider registry without any Triton provider for XPU; restored after the test."""
    saved = list(dispatch._registry.providers)
    dispatch._registry.providers[:] = [
        p for p in saved if (p.name, p.device_type) != (triton_store.NAME, "xpu")
    ]
    dispatch.reset()
    yield dispatch._registry
    dispatch._registry.providers[:] = saved
    dispatch.reset()


def only_call(standin, name):
    """The one call the stand-in received; it must have come with keywords only."""
    assert [c.name for c in standin.calls] == [name]
    call = standin.calls[0]
    assert call.args == (), "sgl_kernel must be called by keyword"
    return call.kwargs


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def filled_cache(num_pages: int, page_size: int, seed: int) -> torch.Tensor:
    """A base cache with every slot written by the reference store."""
    g = torch.Generator().manual_seed(seed)
    cache = layout.alloc_cache(num_pages, page_size)
    tokens = num_pages * page_size
    kv = torch.randn(tokens, layout.HEAD_DIM, generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(layout.HEAD_DIM, generator=g)).bfloat16()
    freqs = torch.randn(tokens, layout.ROPE_DIM, generator=g)
    slots = torch.arange(tokens)
    reference.fused_k_norm_rope_flashmla(kv, weight, freqs, slots, slots, cache, EPS, page_size)
    return cache


def slots(shape, capacity: int, g: torch.Generator, holes: float = 0.2) -> torch.Tensor:
    """int32 slots in ``[0, capacity)`` with a fraction of ``-1`` holes."""
    idx = torch.randint(0, capacity, shape, generator=g, dtype=torch.int32)
    return idx.masked_fill(torch.rand(shape, generator=g) < holes, -1)


def decode_args(heads, s_q, extra, lengths_and_sink, batch=2, width=24, extra_width=8, seed=0):
    """Schema-ordered arguments of ``dsv4.flash_mla_with_kvcache``."""
    g = torch.Generator().manual_seed(seed)
    page_size, extra_page_size = 16, 2
    k_cache = filled_cache(3, page_size, seed)
    q = torch.randn(batch, s_q, heads, layout.HEAD_DIM, generator=g).bfloat16()
    indices = slots((batch, s_q, width), 3 * page_size, g)
    topk_length = attn_sink = None
    if lengths_and_sink:
        topk_length = torch.tensor([width - 5, 3], dtype=torch.int32)[:batch]
        # entries past a row's length are not counted: any value is allowed there
        indices[1, :, 3:] = torch.tensor([-7, 10**6], dtype=torch.int32).repeat(width)[: width - 3]
        attn_sink = torch.randn(heads, generator=g)
        attn_sink[0] = math.inf
    extra_k_cache = extra_indices = extra_topk_length = None
    if extra:
        extra_k_cache = filled_cache(5, extra_page_size, seed + 1)
        extra_indices = slots((batch, s_q, extra_width), 5 * extra_page_size, g)
        if lengths_and_sink:
            extra_topk_length = torch.tensor([extra_width, 0], dtype=torch.int32)[:batch]
    return [
        q, k_cache, page_size, indices, topk_length, attn_sink,
        extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
        None, None, SCALE, layout.HEAD_DIM,
    ]


def prefill_args(heads, lengths_and_sink, s_q=5, s_kv=40, width=16, seed=0, d_qk=layout.HEAD_DIM):
    """Schema-ordered arguments of ``dsv4.flash_mla_sparse_fwd``; some indices are ``>= s_kv``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, heads, d_qk, generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk, generator=g).bfloat16()
    indices = torch.randint(-1, s_kv + 8, (s_q, 1, width), generator=g, dtype=torch.int32)
    attn_sink = topk_length = None
    if lengths_and_sink:
        attn_sink = torch.randn(heads, generator=g)
        topk_length = torch.randint(0, width + 1, (s_q,), generator=g, dtype=torch.int32)
    return [q, kv, indices, SCALE, layout.HEAD_DIM, attn_sink, topk_length]


def store_args(page_size, out_loc_dtype, tokens=10, seed=0):
    """Schema-ordered arguments of ``dsv4.fused_k_norm_rope_flashmla``; ``kv`` has strided rows."""
    g = torch.Generator().manual_seed(seed)
    num_pages = -(-tokens // page_size) + 1
    fused = torch.randn(tokens, 2 * layout.HEAD_DIM, generator=g).bfloat16()
    kv = fused[:, : layout.HEAD_DIM]  # a slice of a fused projection: row stride 1024
    weight = (1 + 0.1 * torch.randn(layout.HEAD_DIM, generator=g)).bfloat16()
    freqs = torch.randn(64, layout.ROPE_DIM, generator=g)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    capacity = num_pages * page_size
    out_loc = torch.randperm(capacity, generator=g)[:tokens]
    out_loc[1], out_loc[4] = -1, -5
    if out_loc_dtype == torch.int64:
        out_loc[7] = -(2**40)  # an int64 skip that would wrap to a valid int32 slot if narrowed
    cache = layout.alloc_cache(num_pages, page_size)
    return [kv, weight, freqs, positions, out_loc.to(out_loc_dtype), cache, EPS, page_size]


def padded_reference(op: str, args: list):
    """The reference on what the adapter hands the library (heads of ``q`` and ``attn_sink``
    zero-padded to a multiple of 8), sliced back to the real heads. The stand-in computes exactly
    this, so the comparison is bitwise; the unpadded reference may round differently (a batched
    matmul's summation order can depend on its row count, e.g. MKL on AVX-512)."""
    head_dim = 2 if op == "flash_mla_with_kvcache" else 1
    heads = args[0].shape[head_dim]
    padded = xpu_kernels.padded_heads(heads)
    args = list(args)
    args[0] = torch.nn.functional.pad(args[0], [0, 0] * (args[0].dim() - 1 - head_dim) + [0, padded - heads])
    if args[5] is not None:
        args[5] = torch.nn.functional.pad(args[5], [0, padded - heads])
    result = getattr(reference, op)(*args)
    if op == "flash_mla_with_kvcache":
        return result[0][:, :, :heads], result[1][:, :heads]
    return tuple(r[:, :heads] for r in result)


# --------------------------------------------------------------------------------------------
# Provider resolution
# --------------------------------------------------------------------------------------------


def test_sgl_kernel_xpu_serves_every_op_it_has(standin):
    served = dispatch.providers("xpu")
    assert served.pop("quantize_store") != xpu_kernels.NAME  # sgl-kernel-xpu has no plain store
    # nor the indexer's ops, nor RoPE
    indexer = ("indexer_logits", "indexer_topk", "indexer_store", "indexer_cache_logits", "indexer_cache_topk", "rope_")
    assert all(served.pop(op) != xpu_kernels.NAME for op in indexer)
    assert served == {op: xpu_kernels.NAME for op in dispatch.OPS if op not in ("quantize_store", *indexer)}


def test_missing_sgl_kernel_falls_back_to_reference_with_install_hint(monkeypatch, registry):
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)  # import sgl_kernel raises
    args = decode_args(heads=8, s_q=1, extra=False, lengths_and_sink=False)
    with pytest.warns(RuntimeWarning, match="sgl-kernel-xpu is not installed: build it from source"):
        out, lse = on_xpu("flash_mla_with_kvcache", *args)
    ref_out, ref_lse = reference.flash_mla_with_kvcache(*args)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert dispatch.providers("xpu") == {op: dispatch.REFERENCE for op in dispatch.OPS}


def test_sgl_kernel_without_the_dsv4_exports_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    with pytest.raises(dispatch.ProviderUnavailable, match="not an sgl-kernel-xpu build"):
        xpu_kernels.load(torch.device("xpu", 0))


def test_importing_the_package_never_imports_sgl_kernel():
    script = textwrap.dedent(
        """
        import sys

        class Trap:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "sgl_kernel":
                    raise AssertionError("sgl_kernel was imported")

        sys.meta_path.insert(0, Trap())
        import torch, dsv4_compile
        from dsv4_compile.providers import sgl_kernel_xpu as xpu
        xpu.register()
        dsv4_compile.providers("cpu")
        q = torch.zeros(1, 1, 8, 512, dtype=torch.bfloat16)
        dsv4_compile.get_mla_metadata(q, torch.zeros(1, 1, 4, dtype=torch.int32))
        assert "sgl_kernel" not in sys.modules
        """
    )
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


def test_adapters_read_no_tensor_values(standin):
    """Meta tensors have no values: a host read (``.item()``, boolean-mask indexing) would raise."""

    def meta(args):
        return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]

    out, lse = on_xpu("flash_mla_with_kvcache", *meta(decode_args(12, 2, True, True)))
    assert out.is_meta and out.shape == (2, 2, 12, layout.HEAD_DIM) and lse.shape == (2, 12, 2)
    out, max_logits, lse = on_xpu("flash_mla_sparse_fwd", *meta(prefill_args(12, True)))
    assert out.is_meta and out.shape == (5, 12, layout.HEAD_DIM) and lse.shape == (5, 12)
    on_xpu("fused_k_norm_rope_flashmla", *meta(store_args(64, torch.int64)))
    assert [c.name for c in standin.calls] == [
        "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "fused_k_norm_rope_flashmla",
    ]


def test_calls_leave_no_new_tensor_behind(standin):
    decode = decode_args(12, 2, True, True)

    def calls():
        yield from on_xpu("get_mla_metadata", decode[0], decode[3], decode[4], decode[8], decode[9])
        yield from on_xpu("flash_mla_with_kvcache", *decode)
        yield from on_xpu("flash_mla_sparse_fwd", *prefill_args(12, True))
        on_xpu("fused_k_norm_rope_flashmla", *store_args(64, torch.int64))

    assert_calls_keep_no_new_tensor(lambda: list(calls()), forget=standin.calls.clear)


# --------------------------------------------------------------------------------------------
# get_mla_metadata and flash_mla_with_kvcache (decode)
# --------------------------------------------------------------------------------------------


def test_metadata_on_xpu_is_two_empty_int32_tensors(standin):
    args = decode_args(heads=64, s_q=1, extra=True, lengths_and_sink=True)
    q, indices, topk_length, extra_indices, extra_topk_length = (args[i] for i in (0, 3, 4, 8, 9))
    meta, splits = on_xpu("get_mla_metadata", q, indices, topk_length, extra_indices, extra_topk_length)
    assert meta.dtype == splits.dtype == torch.int32
    assert meta.shape == splits.shape == (0,)
    assert standin.calls == []


@pytest.mark.parametrize("heads", [64, 12], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("s_q", [1, 2], ids=lambda s: f"s_q{s}")
@pytest.mark.parametrize("extra", [False, True], ids=["swa", "swa+extra"])
@pytest.mark.parametrize("lengths_and_sink", [False, True], ids=["all", "lengths+sink"])
def test_decode_equals_reference(standin, heads, s_q, extra, lengths_and_sink):
    args = decode_args(heads, s_q, extra, lengths_and_sink)
    out, lse = on_xpu("flash_mla_with_kvcache", *args)
    only_call(standin, "flash_mla_with_kvcache")  # served by sgl-kernel-xpu, not a fallback
    ref_out, ref_lse = padded_reference("flash_mla_with_kvcache", args)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    fake_out, fake_lse = decode_outputs(args[0], layout.HEAD_DIM)  # the geometry the fake promises
    assert (out.shape, out.stride()) == (fake_out.shape, fake_out.stride())
    assert (lse.shape, lse.stride()) == (fake_lse.shape, fake_lse.stride())


@pytest.mark.parametrize("heads", [64, 12], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("s_q", [1, 2], ids=lambda s: f"s_q{s}")
def test_decode_reaches_sgl_kernel_as_padded_single_query_rows(standin, heads, s_q):
    args = decode_args(heads, s_q, extra=True, lengths_and_sink=True)
    q, k_cache, page_size, indices, topk_length, attn_sink = args[:6]
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length = args[6:10]
    on_xpu("flash_mla_with_kvcache", *args)
    kw = only_call(standin, "flash_mla_with_kvcache")
    rows, padded = 2 * s_q, xpu_kernels.padded_heads(heads)
    assert padded % 8 == 0 and padded >= heads

    assert kw["tile_scheduler_metadata"] is None and kw["num_splits"] is None
    assert kw["block_table"] is None and kw["cache_seqlens"] is None and kw["causal"] is False
    assert kw["is_fp8_kvcache"] is True
    assert kw["softmax_scale"] == SCALE and kw["head_dim_v"] == layout.HEAD_DIM

    xq = kw["q"]
    assert xq.dtype == torch.bfloat16 and xq.shape == (rows, 1, padded, layout.HEAD_DIM)
    assert xq.is_contiguous()
    assert torch.equal(xq[:, 0, :heads], q.reshape(rows, heads, -1))
    assert not xq[:, :, heads:].any()  # padded heads are zeros
    sink = kw["attn_sink"]
    assert sink.dtype == torch.float32 and sink.shape == (padded,)
    assert torch.equal(sink[:heads], attn_sink) and not sink[heads:].any()

    for cache_kw, cache, size in (("k_cache", k_cache, page_size),
                                  ("extra_k_cache", extra_k_cache, extra_page_size)):
        view = kw[cache_kw]  # the 4-D float8 view of our base cache, no copy
        assert view.dtype == torch.float8_e4m3fn
        assert view.shape == (cache.shape[0], size, 1, layout.TOKEN_BYTES)
        assert view.stride(0) == cache.stride(0) and view.data_ptr() == cache.data_ptr()
    for idx_kw, idx in (("indices", indices), ("extra_indices_in_kvcache", extra_indices)):
        assert kw[idx_kw].dtype == torch.int32 and kw[idx_kw].is_contiguous()
        assert torch.equal(kw[idx_kw], idx.reshape(rows, 1, -1))
    for len_kw, lengths in (("topk_length", topk_length), ("extra_topk_length", extra_topk_length)):
        assert kw[len_kw].dtype == torch.int32 and kw[len_kw].shape == (rows,)
        assert torch.equal(kw[len_kw], lengths.repeat_interleave(s_q))  # one per query row


def test_decode_ignores_scheduler_metadata(standin):
    args = decode_args(heads=64, s_q=1, extra=False, lengths_and_sink=True)
    ref_out, ref_lse = reference.flash_mla_with_kvcache(*args)
    meta = on_xpu("get_mla_metadata", args[0], args[3], args[4], None, None)
    cuda_like = (torch.zeros(4, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    for metadata in (meta, cuda_like):
        args[10], args[11] = metadata
        out, lse = on_xpu("flash_mla_with_kvcache", *args)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert len(standin.calls) == 2
    assert all(c.kwargs["tile_scheduler_metadata"] is None for c in standin.calls)


def test_decode_with_no_index_columns_gives_empty_rows_without_a_launch(standin):
    args = decode_args(heads=12, s_q=2, extra=False, lengths_and_sink=False, width=0)
    out, lse = on_xpu("flash_mla_with_kvcache", *args)
    assert out.shape == (2, 2, 12, layout.HEAD_DIM) and lse.shape == (2, 12, 2)
    assert not out.any() and bool((lse == math.inf).all())  # rows with no valid key
    assert standin.calls == []


def test_decode_checks_indices_before_launching_in_checked_mode(standin):
    args = decode_args(heads=64, s_q=1, extra=False, lengths_and_sink=False)
    args[3][0, 0, 0] = 3 * 16  # == capacity: outside the contract (the library would skip it)
    with dsv4_compile.checked(), pytest.raises(ValueError, match="indices must be -1 or a slot in"):
        on_xpu("flash_mla_with_kvcache", *args)
    assert standin.calls == []
    on_xpu("flash_mla_with_kvcache", *args)  # unchecked: no sync, the library's own rule applies
    assert len(standin.calls) == 1


@pytest.mark.parametrize("byte", GARBAGE_BYTES, ids=hex)
def test_outputs_read_nothing_their_row_does_not_reference(standin, byte):
    """Garbage in every unreferenced cache byte / workspace row changes no output bit."""
    assert_garbage_is_invisible(on_xpu, heads=12, byte=byte)
    assert {c.name for c in standin.calls} == {"flash_mla_with_kvcache", "flash_mla_sparse_fwd"}


@pytest.mark.parametrize("batch,s_q", [(0, 1), (2, 0)])
def test_empty_decode_batches_launch_nothing(standin, batch, s_q):
    args = decode_args(heads=12, s_q=max(s_q, 1), extra=True, lengths_and_sink=True)
    args[0], args[3], args[8] = args[0][:batch, :s_q], args[3][:batch, :s_q], args[8][:batch, :s_q]
    args[4], args[9] = args[4][:batch], args[9][:batch]
    out, lse = on_xpu("flash_mla_with_kvcache", *args)
    assert out.shape == (batch, s_q, 12, layout.HEAD_DIM) and lse.shape == (batch, 12, s_q)
    assert standin.calls == []


# --------------------------------------------------------------------------------------------
# flash_mla_sparse_fwd (prefill)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_qk", [512, 576])
@pytest.mark.parametrize("heads", [64, 12], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("lengths_and_sink", [False, True], ids=["all", "lengths+sink"])
def test_prefill_equals_reference_with_three_outputs(standin, heads, lengths_and_sink, d_qk):
    args = prefill_args(heads, lengths_and_sink, d_qk=d_qk)
    result = on_xpu("flash_mla_sparse_fwd", *args)
    only_call(standin, "flash_mla_sparse_fwd")  # served by sgl-kernel-xpu, not a fallback
    expected = padded_reference("flash_mla_sparse_fwd", args)
    assert len(result) == 3
    fakes = prefill_outputs(args[0], layout.HEAD_DIM)
    for got, want, fake in zip(result, expected, fakes):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (got.shape, got.stride()) == (fake.shape, fake.stride())


@pytest.mark.parametrize("heads", [64, 12], ids=lambda h: f"H{h}")
def test_prefill_reaches_sgl_kernel_with_padded_heads(standin, heads):
    q, kv, indices, _, _, attn_sink, topk_length = args = prefill_args(heads, lengths_and_sink=True)
    on_xpu("flash_mla_sparse_fwd", *args)
    kw = only_call(standin, "flash_mla_sparse_fwd")
    padded = xpu_kernels.padded_heads(heads)
    assert kw["q"].shape == (q.shape[0], padded, layout.HEAD_DIM) and kw["q"].is_contiguous()
    assert torch.equal(kw["q"][:, :heads], q) and not kw["q"][:, heads:].any()
    assert kw["attn_sink"].shape == (padded,) and torch.equal(kw["attn_sink"][:heads], attn_sink)
    assert kw["kv"] is kv and kw["indices"] is indices and kw["topk_length"] is topk_length
    assert kw["sm_scale"] == SCALE and kw["d_v"] == layout.HEAD_DIM


def test_prefill_with_no_index_columns_gives_empty_rows_without_a_launch(standin):
    args = prefill_args(heads=8, lengths_and_sink=False, width=0)
    out, max_logits, lse = on_xpu("flash_mla_sparse_fwd", *args)
    assert out.shape == (5, 8, layout.HEAD_DIM) and lse.shape == max_logits.shape == (5, 8)
    assert not out.any()  # rows with no valid key
    assert bool((max_logits == -math.inf).all()) and bool((lse == math.inf).all())
    assert standin.calls == []


# --------------------------------------------------------------------------------------------
# fused_k_norm_rope_flashmla (store)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_loc_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("page_size", [64, 2], ids=lambda p: f"P{p}")
def test_store_equals_reference(standin, registry, page_size, out_loc_dtype):
    """Power-of-two page sizes reach sgl-kernel-xpu (other sizes: the fallback tests below)."""
    args = store_args(page_size, out_loc_dtype)
    expected = args[5].clone()
    reference.fused_k_norm_rope_flashmla(*args[:5], expected, *args[6:])
    on_xpu("fused_k_norm_rope_flashmla", *args)
    only_call(standin, "fused_k_norm_rope_flashmla")
    assert torch.equal(args[5], expected)


@pytest.mark.parametrize("out_loc_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_store_reaches_sgl_kernel_with_int32_slots_and_the_base_cache(standin, out_loc_dtype):
    kv, weight, freqs, positions, out_loc, cache, eps, page_size = args = store_args(64, out_loc_dtype)
    on_xpu("fused_k_norm_rope_flashmla", *args)
    kw = only_call(standin, "fused_k_norm_rope_flashmla")
    assert kw["out_loc"].dtype == torch.int32
    expected_slots = out_loc.clamp_min(-1) if out_loc_dtype == torch.int64 else out_loc
    assert torch.equal(kw["out_loc"].long(), expected_slots.long())
    assert kw["kvcache"] is cache  # the uint8 2-D base, never a view
    assert kw["kv"] is kv and kw["kv"].stride(0) == 2 * layout.HEAD_DIM  # strided rows passed as is
    assert kw["freqs_cis"] is freqs and kw["positions"] is positions
    assert kw["eps"] == eps and kw["page_size"] == page_size


def test_store_with_a_page_size_not_a_power_of_two_uses_the_reference_and_warns_once(standin, registry):
    with pytest.warns(RuntimeWarning, match=r"uses provider 'reference'; skipped 'sgl_kernel_xpu' needs page_size a power of two .*\(page_size=61"):
        on_xpu("fused_k_norm_rope_flashmla", *store_args(61, torch.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on_xpu("fused_k_norm_rope_flashmla", *store_args(61, torch.int64))
    assert standin.calls == []


def test_store_with_a_page_size_not_a_power_of_two_prefers_a_triton_provider(standin, registry):
    served = []

    def store_by_triton(*args):
        served.append(args[7])
        reference.fused_k_norm_rope_flashmla(*args)

    dispatch.register_provider(dispatch.Provider(
        name=triton_store.NAME, device_type="xpu", load=lambda device: {xpu_kernels.STORE: store_by_triton},
    ))
    with pytest.warns(RuntimeWarning, match="uses provider 'triton'; skipped 'sgl_kernel_xpu' needs page_size a power of two"):
        for page_size in (61, 64):
            on_xpu("fused_k_norm_rope_flashmla", *store_args(page_size, torch.int32))
    assert served == [61]
    assert [c.kwargs["page_size"] for c in standin.calls] == [64]


def test_store_fallback_skips_an_unavailable_triton_provider(standin, registry):
    def unavailable(device):
        raise dispatch.ProviderUnavailable("triton is not installed")

    dispatch.register_provider(
        dispatch.Provider(name=triton_store.NAME, device_type="xpu", load=unavailable)
    )
    args = store_args(61, torch.int32)
    expected = args[5].clone()
    reference.fused_k_norm_rope_flashmla(*args[:5], expected, *args[6:])
    with pytest.warns(RuntimeWarning, match="uses provider 'reference'; skipped 'sgl_kernel_xpu' needs .*; 'triton': triton is not installed"):
        on_xpu("fused_k_norm_rope_flashmla", *args)
    assert torch.equal(args[5], expected)


# --------------------------------------------------------------------------------------------
# On an Intel GPU with sgl-kernel-xpu installed (skipped elsewhere)
# --------------------------------------------------------------------------------------------

HAS_XPU = hasattr(torch, "xpu") and torch.xpu.is_available()
needs_xpu = pytest.mark.skipif(not HAS_XPU, reason="needs an XPU device")


def to_xpu(args):
    return [a.to("xpu") if isinstance(a, torch.Tensor) else a for a in args]


def assert_close_to_reference(name, got, want, max_v=1.0):
    tol = tolerances.DEVICE[name]
    scale = max_v if name == "out" else 1.0
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol.atol * scale, rtol=tol.rtol)


@pytest.mark.xpu
@needs_xpu
@pytest.mark.parametrize("heads", [64, 12], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("s_q", [1, 2], ids=lambda s: f"s_q{s}")
def test_decode_on_xpu_matches_reference(heads, s_q):
    pytest.importorskip("sgl_kernel")
    args = decode_args(heads, s_q, extra=True, lengths_and_sink=True)
    out, lse = torch.ops.dsv4.flash_mla_with_kvcache.default(*to_xpu(args))
    assert dispatch.providers("xpu")["flash_mla_with_kvcache"] == xpu_kernels.NAME
    ref_out, ref_lse = reference.flash_mla_with_kvcache(*args)
    max_v = float(layout.gather_dequant(args[1], args[2], torch.arange(3 * args[2])).abs().max())
    assert_close_to_reference("out", out, ref_out, max_v)
    assert_close_to_reference("lse", lse, ref_lse)
    assert lse.stride() == decode_outputs(args[0], layout.HEAD_DIM)[1].stride()


@pytest.mark.xpu
@needs_xpu
@pytest.mark.parametrize("heads", [64, 12], ids=lambda h: f"H{h}")
def test_prefill_on_xpu_matches_reference(heads):
    pytest.importorskip("sgl_kernel")
    args = prefill_args(heads, lengths_and_sink=True)
    result = torch.ops.dsv4.flash_mla_sparse_fwd.default(*to_xpu(args))
    expected = reference.flash_mla_sparse_fwd(*args)
    max_v = float(args[1].abs().max())
    for name, got, want in zip(("out", "max_logits", "lse"), result, expected):
        assert_close_to_reference(name, got, want, max_v)


@pytest.mark.xpu
@needs_xpu
@pytest.mark.parametrize("page_size", [64, 61], ids=lambda p: f"P{p}")
@pytest.mark.filterwarnings("ignore:.*power-of-two page_size:RuntimeWarning")
def test_store_on_xpu_matches_reference(page_size):
    pytest.importorskip("sgl_kernel")
    args = store_args(page_size, torch.int64)
    expected = args[5].clone()
    reference.fused_k_norm_rope_flashmla(*args[:5], expected, *args[6:])
    device_args = to_xpu(args)
    torch.ops.dsv4.fused_k_norm_rope_flashmla.default(*device_args)
    written = args[4][args[4] >= 0]
    got = layout.gather_dequant(device_args[5].cpu(), page_size, written, torch.float32)
    want = layout.gather_dequant(expected, page_size, written, torch.float32)
    # fp8 codes may differ by one step at rounding ties: 2**-3 of the tile's magnitude at most
    bound = tolerances.STORE_FP8_STEP * want.abs().amax(-1, keepdim=True)
    assert bool(((got - want).abs() <= bound).all())


def test_batch_invariant_calls_skip_sgl_kernel_xpu(standin):
    """sgl-kernel-xpu's decode and prefill are not known to be batch-invariant: in the mode their
    calls go to the next provider (Triton on an XPU; the reference here), with one warning."""
    args = decode_args(16, 1, True, True)
    with pytest.warns(RuntimeWarning, match="batch-invariant mode uses provider 'reference'; skipped 'sgl_kernel_xpu'"):
        out, lse = on_xpu("flash_mla_with_kvcache", *args, "v4", None, True)
    pargs = prefill_args(16, True)
    with pytest.warns(RuntimeWarning, match="skipped 'sgl_kernel_xpu'"):
        on_xpu("flash_mla_sparse_fwd", *pargs, True)
    assert standin.calls == []
    want = reference.flash_mla_with_kvcache(*args)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert dispatch.providers("xpu", batch_invariant=True)["flash_mla_with_kvcache"] != "sgl_kernel_xpu"
