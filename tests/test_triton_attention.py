"""The Triton decode / prefill kernels (``dsv4_compile/providers/triton/attention.py``) against the
reference.

Where it runs (as ``test_triton_store.py`` does):

* **CPU, under ``TRITON_INTERPRET=1``** (``device="cpu"`` cases, ``@interpreted`` tests), in a child
  pytest started by :func:`test_interpreted_suite`: Triton reads the variable when it jits the
  kernels, which this process does compiled. Two shims, applied in the child only, work around
  Triton 3.6 interpreter limits the kernels hit (``helpers.patch_triton_interpreter``).
* **CUDA** (``cuda`` marker): the same cases with compiled Triton, DSV4 shapes (max errors appended
  as JSON lines to ``$DSV4_RESULTS``), CUDA-graph replay, ``torch.compile``.
* The rest in the plain CPU process: provider loading, split choice, what ``torch.compile`` traces.

The kernels are reached through a temporary provider (:data:`PROVIDER`, forced per test) or called
directly; tolerances are ``tolerances.DEVICE``, ``out`` scaled by the largest key magnitude.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

from helpers import patch_triton_interpreter  # noqa: E402

if INTERPRETED:
    patch_triton_interpreter()

import dsv4_compile as d4  # noqa: E402
from dsv4_compile import dispatch, layout  # noqa: E402
from dsv4_compile.providers import reference  # noqa: E402
from dsv4_compile.providers.triton import attention as ta, common as triton_common  # noqa: E402
from dsv4_compile.providers.triton.kernels import attention as attention_kernels  # noqa: E402
from dsv4_compile.tolerances import DEVICE as TOL  # noqa: E402
from helpers import (  # noqa: E402
    GARBAGE_BYTES,
    decode_args_around_garbage,
    poisoned_decode_args,
    poisoned_prefill_args,
    prefill_args_around_garbage,
    provider_args,
    run_interpreted_child,
    store_inputs,
)
import triton_offline  # noqa: E402  (this directory's tool)

DECODE = torch.ops.dsv4.flash_mla_with_kvcache.default
PREFILL = torch.ops.dsv4.flash_mla_sparse_fwd.default
PROVIDER = "triton_attention_test"
SCALE = layout.HEAD_DIM**-0.5


def triton_decode(*args):
    """The Triton decode kernel, given the op's arguments (format names resolved as the op does)."""
    return ta.flash_mla_with_kvcache(*provider_args("flash_mla_with_kvcache", args))


def reference_decode(*args):
    """The reference decode, given the op's arguments (format names resolved as the op does)."""
    return reference.flash_mla_with_kvcache(*provider_args("flash_mla_with_kvcache", args))

interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_interpreted_suite"
)
compiled_triton = pytest.mark.skipif(INTERPRETED, reason="needs compiled (not interpreted) Triton")
DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(scope="module", autouse=True)
def _provider():
    """A temporary provider serving the two ops with this module's kernels (forced per test)."""
    ta._kernels()  # import the kernels (interpreted in the child)
    loaders = {"cuda": ta.load}
    if INTERPRETED:  # interpreted kernels run CPU tensors
        loaders["cpu"] = lambda device: dict(ta.KERNELS)
    for device_type, load in loaders.items():  # below the reference: serves only when forced
        dispatch.register_provider(dispatch.Provider(PROVIDER, device_type, load, priority=-2000, ops=ta.OPS))
    yield
    for device_type in loaders:
        dispatch.unregister_provider(PROVIDER, device_type)


@pytest.fixture
def splits(monkeypatch):
    """``splits(n)``: make decode cut each row's keys into up to ``n`` splits of 32-key blocks
    (a case then needs ``32 * n`` index columns for ``n`` splits: see :func:`planned_splits`)."""

    def force(n):
        base = ta.decode_config
        monkeypatch.setattr(ta, "decode_config", lambda device: dataclasses.replace(base(device), block_n=32))
        monkeypatch.setattr(triton_common, "compute_units", lambda device: n * 1_000_000)
        monkeypatch.setattr(ta, "MAX_SPLITS", n)
        monkeypatch.setattr(ta, "MIN_SPLIT_KEYS", 1)

    return force


def planned_splits(args) -> int:
    """The split count the decode launch plans for decode arguments ``args``."""
    q, idx, extra_idx = args[0], args[3], args[8]
    keys = idx.shape[-1] + (0 if extra_idx is None else extra_idx.shape[-1])
    return ta.decode_plan(q.device, q.shape[0] * q.shape[1], q.shape[2], keys)[2]


def record(**row):
    path = os.environ.get("DSV4_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def compare(name, got, want, vmax=1.0, **case):
    """Equal non-finite pattern and values; finite values within tolerances.DEVICE."""
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: non-finite pattern differs"
    assert torch.equal(got[~finite], want[~finite]), f"{name}: non-finite values differ"
    err = (got.float() - want.float())[finite].abs().max().item() if finite.any() else 0.0
    if case:
        record(op=name, err=err, vmax=vmax, **case)
    tol = TOL[name]
    scale = vmax if name == "out" else 1.0
    torch.testing.assert_close(got.float(), want.float(), atol=tol.atol * scale, rtol=tol.rtol)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def filled(device, num_pages, page_size, page_stride=None, kv_format="v4"):
    """A cache whose every slot holds a stored random token (reference store)."""
    cache = layout.alloc_cache(num_pages, page_size, device, page_stride=page_stride, kv_format=kv_format)
    n = num_pages * page_size
    kv, w, freqs, pos = (t.to(device) for t in store_inputs(n, max_pos=256))
    reference.fused_k_norm_rope_flashmla(kv, w, freqs, pos, torch.arange(n, device=device), cache, 1e-6, page_size,
                                         layout.FORMATS[kv_format])
    return cache


def holed_indices(shape, cap, device, holes=0.2):
    idx = torch.randint(0, cap, shape, dtype=torch.int32)
    return torch.where(torch.rand(shape) < holes, -1, idx).to(device)


def sink_of(kind, heads, device):
    return None if kind == "none" else {
        "random": torch.randn(heads) * 2,
        "+inf": torch.full((heads,), math.inf),
        "-inf": torch.full((heads,), -math.inf),
    }[kind].to(device)


def decode_case(device, *, heads=64, s_q=1, batch=3, page_size=64, width=40, extra_page_size=None,
                extra_width=24, lengths=True, sink="random", page_stride=None, kv_format="v4", extra_format=None):
    """Decode arguments over small caches; row 0 is empty (every index a hole, extra length 0)."""
    cache = filled(device, max(2, 96 // page_size), page_size, page_stride, kv_format)
    idx = holed_indices((batch, s_q, width), layout.capacity(cache, page_size), device)
    idx[0] = -1
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, width + 1, (batch,), dtype=torch.int32).to(device)
        topk_length[-1] = width
    ecache = eidx = elen = None
    if extra_page_size is not None:
        ecache = filled(device, max(2, 64 // extra_page_size), extra_page_size, kv_format=extra_format or kv_format)
        eidx = holed_indices((batch, s_q, extra_width), layout.capacity(ecache, extra_page_size), device)
        if lengths:
            elen = torch.randint(1, extra_width + 1, (batch,), dtype=torch.int32).to(device)
            elen[0] = 0
        else:
            eidx[0] = -1
    q = torch.randn(batch, s_q, heads, layout.HEAD_DIM).to(device, torch.bfloat16)
    return (q, cache, page_size, idx, topk_length, sink_of(sink, heads, device),
            ecache, extra_page_size or 1, eidx, elen, None, None, SCALE, layout.HEAD_DIM,
            kv_format, extra_format if ecache is not None else None)


def key_max(args):
    """Largest key magnitude of a decode case (``out`` is a convex combination of keys)."""
    formats = (args[14], args[15] or args[14]) if len(args) > 14 else ("v4", "v4")
    caches = [(args[1], args[2], formats[0])] + ([(args[6], args[7], formats[1])] if args[6] is not None else [])
    return max(
        layout.gather_dequant(c, p, torch.arange(layout.capacity(c, p), device=c.device), torch.float32, f)
        .abs().max().item()
        for c, p, f in caches
    )


def check_decode(args, **case):
    out, lse = triton_decode(*args)
    want_out, want_lse = reference_decode(*args)
    assert (out.shape, out.stride(), out.dtype) == (want_out.shape, want_out.stride(), want_out.dtype)
    assert (lse.shape, lse.stride(), lse.dtype) == (want_lse.shape, want_lse.stride(), want_lse.dtype)
    compare("out", out, want_out, key_max(args), **case)
    compare("lse", lse, want_lse, **case)
    return out, lse


def prefill_case(device, *, s_q=6, heads=64, s_kv=50, width=40, lengths=True, sink="random", d_qk=512):
    """Prefill arguments with holes ``-1``, other negatives and indices ``>= s_kv``; query 0 empty."""
    q = torch.randn(s_q, heads, d_qk).to(device, torch.bfloat16)
    kv = (torch.randn(s_kv, 1, d_qk) * 3).to(device, torch.bfloat16)
    idx = torch.randint(-3, s_kv + 4, (s_q, 1, width), dtype=torch.int32)
    idx[:1] = torch.tensor([-1, s_kv])[torch.arange(width) % 2]
    topk_length = None
    if lengths:
        topk_length = torch.randint(0, width + 1, (s_q,), dtype=torch.int32)
        topk_length[1], topk_length[-1] = 0, width
        topk_length = topk_length.to(device)
    return q, kv, idx.to(device), SCALE, layout.HEAD_DIM, sink_of(sink, heads, device), topk_length


def check_prefill(args, **case):
    got = ta.flash_mla_sparse_fwd(*args)
    want = reference.flash_mla_sparse_fwd(*args)
    for g, w in zip(got, want):
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
    vmax = args[1].abs().max().item() if args[1].numel() else 1.0
    compare("out", got[0], want[0], vmax, **case)
    compare("max_logits", got[1], want[1], **case)
    compare("lse", got[2], want[2], **case)
    return got


# --------------------------------------------------------------------------------------------
# Decode against the reference (interpreted on CPU, compiled on CUDA)
# --------------------------------------------------------------------------------------------

DECODE_CASES = {  # name: (case keywords, splits)
    "h64-p64": (dict(), 1),
    "h64-p2-sq2-extra64-nolen-nosink-split": (
        dict(page_size=2, s_q=2, extra_page_size=64, width=72, extra_width=48, lengths=False, sink="none"), 4),
    "h5-p64-sq2-extra2-sink+inf-split": (dict(heads=5, s_q=2, extra_page_size=2, width=56, sink="+inf"), 3),
    "h5-p2-extra64-sink-inf": (dict(heads=5, page_size=2, extra_page_size=64, sink="-inf"), 1),
    "h64-p64-odd-stride-extra2-split": (
        dict(page_stride=64 * layout.TOKEN_BYTES + 1, extra_page_size=2, width=112), 5),
    "h5-p2-nolen-split": (dict(heads=5, page_size=2, lengths=False), 2),
    "h3-p61-extra69-width100-split": (
        dict(heads=3, page_size=61, width=100, extra_page_size=69, extra_width=70), 5),
}


FORMAT_CASES = {  # name: (case keywords, splits)
    "fp8-block": (dict(kv_format="v4.1-fp8", page_size=5), 1),
    "fp8-block+fp4-block-split": (
        dict(kv_format="v4.1-fp8", extra_format="v4.1-fp4", page_size=5, extra_page_size=3, width=56, heads=5), 3),
    "fp8-inter+fp4-inter": (
        dict(kv_format="v4.1-fp8-interleaved", extra_format="v4.1-fp4-interleaved", extra_page_size=2), 1),
    "fp8-inter+fp8-block-sq2-split": (
        dict(kv_format="v4.1-fp8-interleaved", extra_format="v4.1-fp8", s_q=2, extra_page_size=64, width=72), 2),
}


@pytest.mark.parametrize("name", list(FORMAT_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_decode_formats_match_reference(device, name, splits):
    """V4.1 caches (FP8 main; FP8 or FP4 extra; block-split and interleaved, mixed), split or not."""
    keywords, n = FORMAT_CASES[name]
    splits(n)
    args = decode_case(device, **keywords)
    assert planned_splits(args) == n
    check_decode(args, format=name)


@pytest.mark.parametrize("name", list(DECODE_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_decode_matches_reference(device, name, splits):
    """Holes, lengths (or none), an empty row, sinks random / +inf / -inf / none, heads 64 and odd,
    page sizes 2 / 64 / 61 / 69 and an odd page stride, one split and several."""
    keywords, n = DECODE_CASES[name]
    splits(n)
    args = decode_case(device, **keywords)
    assert planned_splits(args) == n
    out, lse = check_decode(args)
    assert not out[0].any() and torch.isposinf(lse[0]).all()  # the empty row


SMALL_CONFIGS = {
    "small": ta.DECODE_CONFIG_SMALL,  # the non-SM90 geometry
    "h16n32w4s1": ta.Config(block_h=16, block_n=32, num_warps=4, num_stages=1),
    "h16n32w4s2": ta.Config(block_h=16, block_n=32, num_warps=4, num_stages=2),
}


def test_key_blocks_below_32_are_refused():
    """16-key blocks gave wrong decode results compiled for SM90 (scripts/repro_triton_16key_decode.py)."""
    with pytest.raises(ValueError, match="block_n"):
        ta.Config(block_h=16, block_n=16, num_warps=4, num_stages=1)


@pytest.mark.parametrize("config", ["h16n32w4s1"] if INTERPRETED else list(SMALL_CONFIGS))
@pytest.mark.parametrize("device", DEVICES)
def test_decode_small_blocks(device, config, splits, monkeypatch):
    """Several head blocks (40 heads) and small key blocks, split and combined."""
    small = SMALL_CONFIGS[config]
    monkeypatch.setattr(ta, "decode_config", lambda device: small)
    splits(3)
    args = decode_case(device, heads=40, extra_page_size=2, s_q=2, width=72)
    assert planned_splits(args) == 3
    check_decode(args)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_decode_split_decided_at_run_time(device, n, splits, monkeypatch):
    """With a split count known only at run time (symbolic under torch.compile), the kernels decide
    in-kernel whether to write partial results and combine them."""
    monkeypatch.setattr(ta, "_partial_mode", lambda splits: 2)
    splits(n)
    args = decode_case(device, heads=5, s_q=2, extra_page_size=2, width=72)
    assert planned_splits(args) == n
    check_decode(args)


def _rank_kernel(blocks_ptr, rows, out_ptr, ROWS: tl.constexpr, BINS: tl.constexpr):
    """Program ``p`` stores the row of rank ``p`` (:func:`~dsv4_compile.providers.triton.kernels.attention._longest_first`)."""
    r = tl.arange(0, ROWS)
    live = r < rows
    blocks = tl.load(blocks_ptr + r, mask=live, other=0)
    p = tl.program_id(0)
    tl.store(out_ptr + p, attention_kernels._longest_first(p, blocks, live, BINS))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 7, 50])
def test_longest_first(device, rows):
    """Program ``p`` gets the row of rank ``p`` by block count, most first, ties by row: the rows
    sorted so (a permutation: every row once), with empty rows and rows of the top bin."""
    ta._kernels()
    gen = torch.Generator().manual_seed(rows)
    blocks = torch.randint(0, 8, (rows,), generator=gen, dtype=torch.int32)
    blocks[0] = 7
    blocks[-1] = 0
    order = torch.full((rows,), -1, dtype=torch.int32, device=device)
    triton.jit(_rank_kernel)[(rows,)](blocks.to(device), rows, order, ROWS=64, BINS=8)
    want = sorted(range(rows), key=lambda r: (-int(blocks[r]), r))
    assert order.tolist() == want


@pytest.mark.parametrize("device", DEVICES)
def test_decode_order_decided_at_run_time(device, monkeypatch):
    """The order decided in the kernel (``ORDER`` 2, a symbolic row count when traced), where one
    split leaves more rows than a wave: rows of many lengths (empty ones too) each written once,
    and bit for bit as unordered (the order moves a row to another program, not its arithmetic).
    Which row each program takes is :func:`test_longest_first`'s."""
    monkeypatch.setattr(triton_common, "compute_units", lambda device: 4)  # on any device: one split, a wave of 4 of the 18 rows
    args = decode_case(device, heads=5, batch=9, s_q=2, extra_page_size=2, width=72)
    assert planned_splits(args) == 1
    monkeypatch.setattr(ta, "decode_order", lambda *a: (0, 1, 1))
    unordered = triton_decode(*args)
    monkeypatch.setattr(ta, "decode_order", lambda *a: (2, ta.ORDER_MAX_ROWS, 8))
    out, lse = check_decode(args)
    assert torch.equal(out, unordered[0]) and torch.equal(lse, unordered[1])


def random_records(num_pages, page_size, kv_format):
    """A cache of random tokens: every fp8 / fp4 code but NaN, UE8M0 scales 2^-27 .. 2^22 or e4m3
    scales but NaN, bf16 RoPE values (V4), at a page stride 3 bytes past the canonical one."""
    fmt = layout.FORMATS[kv_format]
    cache = torch.randint(0, 256, (num_pages, page_size * fmt.token_bytes + 3), dtype=torch.uint8)
    data = layout.data_records(cache, page_size, kv_format)
    scales = layout.scale_records(cache, page_size, kv_format)
    n = num_pages * page_size
    if fmt.values == "fp4":  # the random data bytes hold every e2m1 code pair
        codes = torch.arange(scales.numel()) % 256
        scales.copy_(torch.where((codes & 0x7F) == 0x7F, 0x7E, codes).view(scales.shape).to(torch.uint8))
        return cache
    fp8_dims = layout.NOPE_DIM if fmt.is_v4 else layout.HEAD_DIM
    codes = torch.arange(n * fp8_dims) % 256
    codes = torch.where((codes & 0x7F) == 0x7F, 0x7E, codes)  # no NaN code
    data[:, :, :fp8_dims] = codes.view(num_pages, page_size, -1).to(torch.uint8)
    if fmt.is_v4:
        rope = torch.randn(num_pages, page_size, layout.ROPE_DIM).to(torch.bfloat16)
        data[:, :, layout.NOPE_DIM :] = rope.view(torch.uint8)
        scales = scales[:, :, : layout.NUM_TILES]  # the pad byte is not read
    scales.copy_(torch.randint(100, 150, scales.shape, dtype=torch.uint8))
    return cache


@pytest.mark.parametrize("kv_format", list(layout.FORMATS))
@pytest.mark.parametrize("device", DEVICES)
def test_decode_single_key_is_the_exact_dequantized_key(device, kv_format):
    """One key per row: ``out`` is that key, bit for bit (dequantization is exact for every cache
    format: every fp8 / fp4 code but NaN, fp8 subnormals included, the scales of
    :func:`random_records`, bf16 RoPE bytes at an odd page stride)."""
    page_size, num_pages = 4, 16
    cache = random_records(num_pages, page_size, kv_format).to(device)
    cap = num_pages * page_size
    q = torch.randn(cap, 1, 16, layout.HEAD_DIM).to(device, torch.bfloat16)
    idx = torch.full((cap, 1, 3), -1, dtype=torch.int32)
    idx[:, 0, 1] = torch.arange(cap)
    idx = idx.to(device)
    args = (q, cache, page_size, idx, None, None, None, 1, None, None, None, None, SCALE, 512, kv_format)
    out, lse = triton_decode(*args)
    keys = layout.gather_dequant(cache, page_size, torch.arange(cap, device=device), torch.float32, kv_format)
    assert torch.equal(out[:, 0], keys[:, None, :].expand(-1, 16, -1).to(torch.bfloat16))
    want_lse = torch.einsum("rhd,rd->rh", q[:, 0].float(), keys) * SCALE
    torch.testing.assert_close(lse[:, :, 0], want_lse, atol=TOL["lse"].atol, rtol=TOL["lse"].rtol)


@pytest.mark.parametrize("kv_format", list(layout.FORMATS))
@pytest.mark.parametrize("device", DEVICES)
def test_decode_rows_attending_a_nan_token_are_nan(device, kv_format):
    """A token stored from non-finite values (the NaN token, every format) makes the rows that
    attend it NaN, as in the reference; rows that do not attend it stay finite and match."""
    page_size = 4
    cache = filled(device, 4, page_size, kv_format=kv_format)
    kv, w, freqs, pos = (t.to(device) for t in store_inputs(1, max_pos=8))
    kv[0, 7] = math.nan
    reference.fused_k_norm_rope_flashmla(kv, w, freqs, pos, torch.tensor([5], device=device), cache, 1e-6, page_size,
                                         layout.FORMATS[kv_format])
    idx = torch.tensor([[[0, 1, 2, 3]], [[4, 5, 6, -1]], [[4, 6, 7, 8]]], dtype=torch.int32, device=device)
    q = torch.randn(3, 1, 16, layout.HEAD_DIM).to(device, torch.bfloat16)
    args = (q, cache, page_size, idx, None, None, None, 1, None, None, None, None, SCALE, 512, kv_format)
    out, lse = triton_decode(*args)
    want_out, want_lse = reference_decode(*args)
    assert want_out[1].isnan().all() and want_lse[1].isnan().all()
    assert out[1].isnan().all() and lse[1].isnan().all()
    vmax = layout.gather_dequant(cache, page_size, idx[[0, 2]].flatten(), torch.float32, kv_format).abs().max().item()
    compare("out", out[[0, 2]], want_out[[0, 2]], vmax)
    compare("lse", lse[[0, 2]], want_lse[[0, 2]])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_degenerate_shapes(device):
    """No rows, no heads, no index columns: the outputs' geometry, nothing attended."""
    for batch, heads, width in ((0, 64, 8), (2, 0, 8), (2, 7, 0)):
        q = torch.randn(batch, 1, heads, 512).to(device, torch.bfloat16)
        cache = layout.alloc_cache(2, 4, device)
        idx = torch.zeros(batch, 1, width, dtype=torch.int32, device=device)
        args = (q, cache, 4, idx, None, None, None, 1, None, None, None, None, SCALE, 512)
        out, lse = triton_decode(*args)
        # out [B, 1, H, 512] contiguous; lse [B, H, 1] stored as [B, 1, H] (FlashMLA's layout)
        assert (out.shape, out.stride()) == ((batch, 1, heads, 512), torch.empty(batch, 1, heads, 512).stride())
        assert (lse.shape, lse.stride()) == ((batch, heads, 1), torch.empty(batch, 1, heads).transpose(1, 2).stride())
        assert not out.any() and torch.isposinf(lse).all()


FORMAT_PAIRS = [dict(), dict(kv_format="v4.1-fp8-interleaved", extra_format="v4.1-fp4")]


@pytest.mark.parametrize("byte", GARBAGE_BYTES, ids=hex)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_decode_reads_nothing_its_row_does_not_reference(device, n, byte, splits):
    """Garbage (NaN/Inf patterns) in every unreferenced cache byte changes no output bit, split
    (V4.1 caches) or not (V4)."""
    splits(n)
    args = decode_args_around_garbage(heads=16, device=device, width=64, **FORMAT_PAIRS[n - 1])
    assert planned_splits(args) == n
    clean = triton_decode(*args)
    dirty = triton_decode(*poisoned_decode_args(args, byte))
    assert clean[0].isfinite().all()
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


@pytest.mark.parametrize("byte", GARBAGE_BYTES, ids=hex)
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_reads_nothing_its_row_does_not_reference(device, byte):
    args = prefill_args_around_garbage(heads=16, device=device)
    clean = ta.flash_mla_sparse_fwd(*args)
    dirty = ta.flash_mla_sparse_fwd(*poisoned_prefill_args(args, byte))
    assert clean[0].isfinite().all()
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))


# --------------------------------------------------------------------------------------------
# Prefill against the reference
# --------------------------------------------------------------------------------------------

PREFILL_CASES = {
    "h64-len-sink": dict(),
    "h5-nolen-sink+inf": dict(heads=5, lengths=False, sink="+inf"),
    "h5-len-sink-inf": dict(heads=5, sink="-inf"),
    "h64-nosink-width70": dict(lengths=False, sink="none", width=70),
    "h64-d576": dict(d_qk=576),
    "h5-d576-nolen": dict(d_qk=576, heads=5, lengths=False),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_matches_reference(device, name):
    """Indices -1, other negatives and >= s_kv are holes; lengths (or none); an empty query."""
    out, max_logits, lse = check_prefill(prefill_case(device, **PREFILL_CASES[name]))
    assert not out[0].any() and torch.isneginf(max_logits[0]).all() and torch.isposinf(lse[0]).all()


PREFILL_GEOMETRIES = {
    "sm100": ta.PREFILL_CONFIG_SM100, "small": ta.PREFILL_CONFIG_SMALL, "low-shared": ta.PREFILL_CONFIG_LOW_SHARED,
}


@pytest.mark.parametrize("config", list(PREFILL_GEOMETRIES))
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_geometries_off_sm90(device, config, monkeypatch):
    """The geometries GPUs other than SM90 get: 64 heads, and 40 heads with 576-dim queries (at 32
    heads per program, a second head block partly masked)."""
    monkeypatch.setattr(ta, "prefill_config", lambda device: PREFILL_GEOMETRIES[config])
    check_prefill(prefill_case(device))
    check_prefill(prefill_case(device, heads=40, d_qk=576, lengths=False, sink="none"))


@pytest.mark.parametrize("capability,decode,prefill", [
    ((9, 0), "DECODE_CONFIG", "PREFILL_CONFIG"),
    ((10, 0), "DECODE_CONFIG_SMALL", "PREFILL_CONFIG_SM100"),
    ((8, 0), "DECODE_CONFIG_SMALL", "PREFILL_CONFIG_SMALL"),
    ((8, 9), "DECODE_CONFIG_SMALL", "PREFILL_CONFIG_LOW_SHARED"),
    ((12, 0), "DECODE_CONFIG_SMALL", "PREFILL_CONFIG_LOW_SHARED"),
    (None, "DECODE_CONFIG_SMALL", "PREFILL_CONFIG_SMALL"),
], ids=["sm90", "sm100", "sm80", "sm89", "sm120", "unknown"])
def test_geometry_rules(capability, decode, prefill, monkeypatch):
    """SM90 takes 64 heads per decode program and two stages of 64 keys per prefill step; SM100 32
    decode heads (64 compile to a trap) and one prefill stage (shared memory); other GPUs 32
    decode heads and 32 prefill keys, with 32 prefill heads per program where a program may take
    less shared memory than that needs (99 KB per block on SM86 / SM89 / SM120); unknown devices
    (ROCm, XPU) the 32-key geometries."""
    limit = triton_offline.SHARED_PER_BLOCK.get(capability)  # the limit CUDA reports per block
    monkeypatch.setattr(ta, "_geometry_capability", lambda device: capability)
    monkeypatch.setattr(triton_common, "shared_memory_per_block", lambda device: limit)
    cuda = torch.device("cuda")
    assert ta.decode_config(cuda) is getattr(ta, decode)
    assert ta.prefill_config(cuda) is getattr(ta, prefill)
    if limit is not None:
        assert getattr(ta, prefill).shared_bytes <= limit


@compiled_triton
def test_gpus_before_sm80_are_not_served(monkeypatch):
    """On an SM75 GPU the attention provider is unavailable, naming the capability (the
    dispatcher then falls back to the reference, with a warning)."""
    monkeypatch.setattr(triton_common, "require_device", lambda *args: None)
    monkeypatch.setattr(ta, "_geometry_capability", lambda device: (7, 5))
    with pytest.raises(dispatch.ProviderUnavailable, match=r"capability 8\.0 or later, got 7\.5"):
        ta.load(torch.device("cuda"))
    monkeypatch.setattr(ta, "_geometry_capability", lambda device: (8, 0))
    assert ta.load(torch.device("cuda"))[ta.DECODE] is ta.KERNELS[ta.DECODE]


def test_interpreter_takes_sm90_geometries():
    assert ta.decode_config(torch.device("cpu")) is ta.DECODE_CONFIG
    assert ta.prefill_config(torch.device("cpu")) is ta.PREFILL_CONFIG


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_degenerate_shapes(device):
    """An empty workspace, no index columns, no queries."""
    for s_q, s_kv, width in ((3, 0, 8), (3, 10, 0), (0, 10, 8)):
        args = prefill_case(device, s_q=s_q, heads=5, s_kv=s_kv, width=width, lengths=False)
        args = args[:2] + (args[2].clamp(-1, max(s_kv - 1, -1)),) + args[3:]
        out, max_logits, lse = ta.flash_mla_sparse_fwd(*args)
        assert (out.shape, out.stride()) == ((s_q, 5, 512), torch.empty(s_q, 5, 512).stride())
        assert max_logits.shape == lse.shape == (s_q, 5) and lse.stride() == torch.empty(s_q, 5).stride()
        assert not out.any() and torch.isneginf(max_logits).all() and torch.isposinf(lse).all()


# --------------------------------------------------------------------------------------------
# Through the op, with the provider forced
# --------------------------------------------------------------------------------------------


@interpreted
def test_ops_dispatch_to_the_triton_kernels():
    """``torch.ops.dsv4.*`` on CPU, with the provider forced, run these kernels (interpreted): the
    results are the kernels' own and match the reference; both ops pass opcheck's fake/real
    geometry checks."""
    decode_args = decode_case("cpu", heads=5, extra_page_size=2)
    prefill_args = prefill_case("cpu", heads=5)
    with d4.use_provider(PROVIDER, ops=ta.OPS):
        assert dispatch.resolve(ta.DECODE, torch.device("cpu"))[1] is ta.flash_mla_with_kvcache
        got = DECODE(*decode_args), PREFILL(*prefill_args)
        for op, args in ((DECODE, decode_args), (PREFILL, prefill_args)):
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    assert all(torch.equal(a, b) for a, b in zip(got[0], triton_decode(*decode_args)))
    assert all(torch.equal(a, b) for a, b in zip(got[1], ta.flash_mla_sparse_fwd(*prefill_args)))
    check_decode(decode_args)
    check_prefill(prefill_args)


# --------------------------------------------------------------------------------------------
# Plain CPU process: provider loading, split choice, what torch.compile traces
# --------------------------------------------------------------------------------------------


@compiled_triton  # interpreted, the provider serves CPU tensors on every key (tests)
def test_provider_serves_available_cuda_and_xpu_devices(monkeypatch):
    with pytest.raises(dispatch.ProviderUnavailable, match="device type 'cpu'"):
        ta.load(torch.device("cpu"))
    monkeypatch.setattr(triton_common, "device_available", lambda device: False)
    with pytest.raises(dispatch.ProviderUnavailable, match="no cuda device"):
        ta.load(torch.device("cuda", 0))
    monkeypatch.setattr(triton_common, "device_available", lambda device: True)
    assert set(ta.load(torch.device("cuda", 0))) == {*ta.OPS, "get_mla_metadata", "get_mla_metadata_stacked"}
    assert ta.load(torch.device("cuda", 0))[ta.DECODE] is ta.flash_mla_with_kvcache


def test_decode_splits_fill_the_device_once(monkeypatch):
    """Splits fill the device once, each with at least MIN_SPLIT_KEYS keys, at most MAX_SPLITS."""
    monkeypatch.setattr(triton_common, "compute_units", lambda device: 132)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(ta, "MIN_SPLIT_KEYS", 128)
    assert ta.decode_splits(cuda, 1, 640, 32) == 5  # capped by the keys per split
    assert ta.decode_splits(cuda, 8, 640, 32) == 5
    assert ta.decode_splits(cuda, 64, 640, 32) == 2  # 128 programs
    monkeypatch.setattr(ta, "MIN_SPLIT_KEYS", 64)
    assert ta.decode_splits(cuda, 1, 640, 32) == 10
    assert ta.decode_splits(cuda, 256, 640, 32) == 1
    assert ta.decode_splits(cuda, 1, 64 * 1024, 32) == ta.MAX_SPLITS
    assert ta.decode_splits(cuda, 1, 0, 32) == 1


@pytest.mark.parametrize("rows, stages", [(1, (1, 1)), (8, (1, 1)), (64, (None, 1)), (256, (None, 1))])
def test_decode_loop_stages(rows, stages):
    """As launched for an H200 (132 SMs): both key loops at one stage where every split holds one
    key block (T = 1 and 8 over 128 + 512 keys: 10 splits), else the main loop at the launch's
    ``num_stages`` (None) and the extra-cache loop at ``DECODE_CONFIG.extra_stages``."""
    ta._kernels()
    cache, extra = layout.alloc_cache(4, 256, "cpu"), layout.alloc_cache(16, 64, "cpu")
    q = torch.randn(rows, 1, 64, 512, dtype=torch.bfloat16)
    idx = torch.zeros(rows, 1, 100, dtype=torch.int32)  # padded to 128: two 64-key blocks
    x_idx = torch.zeros(rows, 1, 512, dtype=torch.int32)
    with triton_offline.recorded((9, 0), 132) as launches:
        triton_decode(q, cache, 256, idx, None, None, extra, 64, x_idx, None, None, None, SCALE, 512)
    kernel, _, kwargs = launches[0]
    assert kernel.fn.__name__ == "decode_kernel"
    assert (kwargs["STAGES"], kwargs["X_STAGES"]) == stages
    assert ta.decode_loop_stages(ta.DECODE_CONFIG, 10, 100, 513) == (None, ta.DECODE_CONFIG.extra_stages)


@pytest.mark.parametrize("rows, lengths, order", [
    (256, True, 1),  # two waves of one-split rows on 132 SMs: ordered
    (256, False, 0),  # no lengths: every row alike
    (100, True, 0),  # one wave
    (64, True, 0),  # split rows
    (ta.ORDER_MAX_ROWS + 1, True, 0),  # too many rows to rank in every program
])
def test_decode_order(rows, lengths, order):
    """As launched for an H200 (132 SMs): rows taken longest first exactly where one-split rows
    with lengths fill more than one wave, with a rank vector of whole rows and a bin per block
    count (0 .. 10 here: 16 bins)."""
    ta._kernels()
    cache, extra = layout.alloc_cache(4, 256, "cpu"), layout.alloc_cache(16, 64, "cpu")
    q = torch.randn(rows, 1, 64, 512, dtype=torch.bfloat16)
    idx = torch.zeros(rows, 1, 128, dtype=torch.int32)
    x_idx = torch.zeros(rows, 1, 512, dtype=torch.int32)
    length = torch.full((rows,), 128, dtype=torch.int32) if lengths else None
    with triton_offline.recorded((9, 0), 132) as launches:
        triton_decode(q, cache, 256, idx, length, None, extra, 64, x_idx, None, None, None, SCALE, 512)
    kwargs = launches[0][2]
    assert kwargs["ORDER"] == order
    if order:
        assert (kwargs["ORDER_ROWS"], kwargs["ORDER_BINS"]) == (256, 16)


@pytest.mark.parametrize("capability, pdl", [((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False)])
def test_eager_decode_launches_are_programmatic_on_sm90_and_later(capability, pdl):
    """Eager decode and combine launches on SM90+ carry ``launch_pdl`` and wait for their
    predecessor in-kernel (``PDL``); elsewhere neither (``griddepcontrol`` needs SM90)."""
    ta._kernels()
    cache, extra = layout.alloc_cache(4, 256, "cpu"), layout.alloc_cache(16, 64, "cpu")
    q = torch.randn(2, 1, 64, 512, dtype=torch.bfloat16)
    idx, x_idx = torch.zeros(2, 1, 128, dtype=torch.int32), torch.zeros(2, 1, 512, dtype=torch.int32)
    with triton_offline.recorded(capability, 132) as launches:
        triton_decode(q, cache, 256, idx, None, None, extra, 64, x_idx, None, None, None, SCALE, 512)
    assert [k.fn.__name__ for k, _, _ in launches] == ["decode_kernel", "combine_kernel"]
    for _, _, kwargs in launches:
        assert kwargs["PDL"] is pdl and kwargs.get("launch_pdl", False) is pdl


def test_decode_launch_is_guard_free_for_symbolic_rows():
    """Traced with a symbolic row count (dynamic shapes), the launcher installs no guard: the
    split count stays symbolic and both kernels are launched, deciding in-kernel (PARTIAL=2)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)

    def fake(t):
        dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (t.dim() - 1)
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid, kwargs.get("PARTIAL")))

    q = fake(torch.empty(5, 1, 64, 512, dtype=torch.bfloat16))
    idx = fake(torch.zeros(5, 1, 640, dtype=torch.int32))
    with mode:
        out, lse = ta._decode(Recorder, q, fake(layout.alloc_cache(4, 64)), 64, idx, None, None,
                              None, 1, None, None, SCALE, 512)
    assert [(name, partial) for name, _, partial in launches] == [
        ("decode_kernel", 2), ("combine_kernel", None)]
    assert isinstance(launches[0][1][2], torch.SymInt)  # the split count
    assert not env.guards
    assert lse.stride() == (64, 1, 64)


def test_page_addressing_by_shift_only_for_power_of_two_page_sizes():
    """A power-of-two page size takes the shift-and-mask addressing (``POW2``, the shift passed at
    run time); other sizes, and a symbolic one (traced), the integer division: no guard on it."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert [ta._page_shift(p) for p in (1, 2, 64, 256)] == [(0, True), (1, True), (6, True), (8, True)]
    assert [ta._page_shift(p) for p in (3, 61, 69, 96)] == [(0, False)] * 4
    env = ShapeEnv()
    assert ta._page_shift(env.create_unbacked_symint()) == (0, False)
    assert not env.guards


class _Traced(Exception):
    pass


class _Sm90Target:
    """Stands in for the CUDA driver where there is none: the target Triton compiles TTIR for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def _aot_forward_graph(fn, args):
    """The forward graph AOTAutograd hands to the backend (traced, never run)."""
    from torch._functorch.aot_autograd import aot_function

    def capture(gm, _):
        raise _Traced(gm)

    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def call(*ts):
        full = list(args)
        for i, t in zip(tensors, ts):
            full[i] = t
        return fn(*full)

    with pytest.raises(_Traced) as traced:
        aot_function(call, fw_compiler=capture)(*[args[i] for i in tensors])
    return traced.value.args[0].graph


@compiled_triton
@pytest.mark.parametrize("rows,launches", [(2, ["decode_kernel", "combine_kernel"]), (512, ["decode_kernel"])])
def test_functionalization_traces_the_triton_launches(monkeypatch, rows, launches):
    """On CUDA tensors (fake ones: no GPU needed) with these kernels serving, decode becomes the
    split and combine launches (one launch when unsplit) and prefill one launch, writing only
    buffers allocated in the graph; a forced reference provider keeps the opaque ops."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90Target())  # TTIR mutation analysis
    monkeypatch.setattr(triton_common, "device_available", lambda device: True)
    monkeypatch.setattr(triton_common, "compute_units", lambda device: 132)
    with FakeTensorMode(), torch.device("cuda"):
        q = torch.empty(rows, 1, 64, 512, dtype=torch.bfloat16)
        cache = torch.empty(4, layout.page_bytes(64), dtype=torch.uint8)
        ecache = torch.empty(8, layout.page_bytes(2), dtype=torch.uint8)
        idx, eidx = torch.empty(rows, 1, 128, dtype=torch.int32), torch.empty(rows, 1, 64, dtype=torch.int32)
        lengths, sink = torch.empty(rows, dtype=torch.int32), torch.empty(64)
        pq, kv = torch.empty(16, 64, 512, dtype=torch.bfloat16), torch.empty(64, 1, 512, dtype=torch.bfloat16)
        pidx = torch.empty(16, 1, 64, dtype=torch.int32)
    decode = (q, cache, 64, idx, lengths, sink, ecache, 2, eidx, lengths, None, None, SCALE, 512)
    prefill = (pq, kv, pidx, SCALE, 512, sink, None)

    def kernels(graph):
        nodes = [n for n in graph.nodes if n.target is triton_kernel_wrapper_functional]
        names = []
        for node in nodes:  # they write only the outputs and workspace (no copy of q or a cache)
            assert set(node.kwargs["tensors_to_clone"]) <= {
                "out_ptr", "lse_ptr", "max_logits_ptr", "part_ptr", "part_lse_ptr"}, node.kwargs["tensors_to_clone"]
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            while hasattr(kernel, "fn"):  # Autotuner -> JITFunction -> function
                kernel = kernel.fn
            names.append(kernel.__name__)
        return names

    with d4.use_provider(PROVIDER, ops=ta.OPS):
        assert ta.inlines(ta.DECODE, q.device) and ta.inlines(ta.PREFILL, q.device)
        decode_graph = _aot_forward_graph(DECODE, decode)
        assert kernels(decode_graph) == launches
        assert kernels(_aot_forward_graph(PREFILL, prefill)) == ["prefill_kernel"]
        assert not any(n.target in (DECODE, PREFILL) for n in decode_graph.nodes)
    with d4.use_provider("reference"):
        assert not ta.inlines(ta.DECODE, q.device)
        graph = _aot_forward_graph(DECODE, decode)
        assert any(n.target is DECODE for n in graph.nodes) and not kernels(graph)


# --------------------------------------------------------------------------------------------
# CUDA only: DSV4 shapes, CUDA graphs, torch.compile
# --------------------------------------------------------------------------------------------


def dsv4_decode_args(rows, heads, device="cuda"):
    """DSV4 decode: SWA window 128 (page 256) + c4 compressed top-512 (page 64)."""
    cache, ecache = filled(device, 16, 256), filled(device, 64, 64)
    q = torch.randn(rows, 1, heads, 512, device=device, dtype=torch.bfloat16)
    idx = holed_indices((rows, 1, 128), 16 * 256, device, holes=0.05)
    eidx = holed_indices((rows, 1, 512), 64 * 64, device, holes=0.05)
    lengths = torch.randint(1, 129, (rows,), dtype=torch.int32, device=device)
    elen = torch.randint(0, 513, (rows,), dtype=torch.int32, device=device)
    sink = torch.randn(heads, device=device)
    return (q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, None, None, SCALE, 512)


@pytest.mark.cuda
@compiled_triton
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("rows", [1, 8, 64, 256])
def test_decode_dsv4_shapes(heads, rows):
    torch.manual_seed(rows + heads)
    args = dsv4_decode_args(rows, heads)
    splits = ta.decode_plan(args[0].device, rows, heads, 640)[2]
    check_decode(args, kind="triton_decode", heads=heads, rows=rows, splits=splits)


@pytest.mark.cuda
@compiled_triton
@pytest.mark.parametrize("heads,topk", [(64, 640), (128, 512)])
def test_prefill_dsv4_shape(heads, topk):
    torch.manual_seed(topk)
    s_q, s_kv = 4096, 8192
    q = torch.randn(s_q, heads, 512, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, 512, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, s_kv, (s_q, 1, topk), dtype=torch.int32, device="cuda")
    lengths = torch.randint(topk // 2, topk + 1, (s_q,), dtype=torch.int32, device="cuda")
    args = (q, kv, idx, SCALE, 512, torch.randn(heads, device="cuda"), lengths)
    check_prefill(args, kind="triton_prefill", heads=heads, topk=topk, s_q=s_q)


@pytest.mark.cuda
@compiled_triton
def test_cuda_graph_replay_follows_new_lengths():
    """Split decode and prefill are capture-safe: a replay with new lengths equals an eager call."""
    args = list(dsv4_decode_args(8, 64))
    prefill_args = prefill_case("cuda", s_q=64, s_kv=300, width=200)
    triton_decode(*args), ta.flash_mla_sparse_fwd(*prefill_args)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = triton_decode(*args)
        pout = ta.flash_mla_sparse_fwd(*prefill_args)
    for _ in range(2):
        args[4].copy_(torch.randint(0, 129, args[4].shape, dtype=torch.int32, device="cuda"))
        args[9].copy_(torch.randint(0, 513, args[9].shape, dtype=torch.int32, device="cuda"))
        prefill_args[6].copy_(torch.randint(0, 201, prefill_args[6].shape, dtype=torch.int32, device="cuda"))
        graph.replay()
        want, pwant = triton_decode(*args), ta.flash_mla_sparse_fwd(*prefill_args)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        assert all(torch.equal(a, b) for a, b in zip(pout, pwant))


class DecodeLayer(torch.nn.Module):
    """A decode step: the attention op between Inductor-generated elementwise work."""

    def __init__(self, cache, ecache):
        super().__init__()
        self.register_buffer("cache", cache)
        self.register_buffer("ecache", ecache)

    def forward(self, q, idx, lengths, sink, eidx, elen):
        out, lse = d4.flash_mla_with_kvcache((q * 1.5).to(torch.bfloat16), self.cache, 256, idx, lengths, sink,
                                             self.ecache, 64, eidx, elen)
        return out.float() * 2, lse


@pytest.mark.cuda
@compiled_triton
@pytest.mark.parametrize("rows", [8, 256])  # split + combine; one launch
def test_compiled_decode_step_launches_the_kernels(rows):
    from torch._inductor.utils import run_and_get_code

    q, cache, _, idx, lengths, sink, ecache, _, eidx, elen = dsv4_decode_args(rows, 64)[:10]
    layer = DecodeLayer(cache, ecache)
    inputs = (q, idx, lengths, sink, eidx, elen)
    with d4.use_provider(PROVIDER, ops=ta.OPS), torch.no_grad():
        explanation = torch._dynamo.explain(layer)(*inputs)
        assert explanation.graph_count == 1 and explanation.graph_break_count == 0
        want = layer(*inputs)
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True):
            got, codes = run_and_get_code(torch.compile(layer, fullgraph=True), *inputs)
    code = "\n".join(codes)
    assert "decode_kernel" in code and "torch.ops.dsv4.flash_mla_with_kvcache" not in code
    assert ("combine_kernel" in code) == (rows == 8)
    record(kind="triton_compiled_decode", rows=rows, graphs=explanation.graph_count,
           breaks=explanation.graph_break_count, equal=torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    assert got[1].stride() == want[1].stride()


@pytest.mark.cuda
@compiled_triton
def test_reduce_overhead_records_no_cudagraph_skip():
    from torch._dynamo.utils import counters

    q, cache, _, idx, lengths, sink, ecache, _, eidx, elen = dsv4_decode_args(8, 64)[:10]
    layer, inputs = DecodeLayer(cache, ecache), (q, idx, lengths, sink, eidx, elen)
    torch._dynamo.reset()
    counters.clear()
    with d4.use_provider(PROVIDER, ops=ta.OPS), torch.no_grad():
        want = layer(*inputs)
        compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            got = compiled(*inputs)
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    record(kind="triton_reduce_overhead_decode", cudagraph_skips=skips)
    assert skips == 0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.cuda
@compiled_triton
def test_compiled_decode_with_dynamic_rows_recompiles_at_most_once():
    """Dynamic row counts: at most one recompile across them, equal to eager, on both sides of the
    split threshold. Counted on fresh compiles: a graph loaded from the compile caches brings
    guards of its own (AOTAutograd's cache entry of the 8-row graph held ``132 // rows >= 10``, one
    more recompile), so a warm cache from an earlier process would change the count."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    _, cache, _, _, _, _, ecache = dsv4_decode_args(1, 64)[:7]
    layer = DecodeLayer(cache, ecache)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    with (d4.use_provider(PROVIDER, ops=ta.OPS), torch.no_grad(),
          torch._inductor.config.patch(force_disable_caches=True)):
        for rows in (8, 24, 300):
            q, _, _, idx, lengths, sink, _, _, eidx, elen = dsv4_decode_args(rows, 64)[:10]
            got, want = compiled(q, idx, lengths, sink, eidx, elen), layer(q, idx, lengths, sink, eidx, elen)
            # the same math, though the traced kernels are compiled for a run-time split decision
            torch.testing.assert_close(got[0], want[0], atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)
    record(kind="triton_compiled_decode_dynamic", frames=counter.frame_count)
    assert counter.frame_count <= 2  # at most one recompile (seen on the H200: 2 frames)


# --------------------------------------------------------------------------------------------
# The interpreter child
# --------------------------------------------------------------------------------------------


def test_interpreted_suite(request):
    """Run the ``device="cpu"`` and ``interpreted`` tests in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__)