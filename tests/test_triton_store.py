"""The Triton store kernel (``dsv4_compile/providers/triton/store.py``) against the reference.

Where it runs:

* **CPU, under ``TRITON_INTERPRET=1``** (the ``device="cpu"`` cases and ``@interpreted`` tests).
  Triton reads that variable when a kernel is *decorated*, i.e. when ``dsv4_compile`` is imported,
  which conftest and the other test modules of this pytest process have done already (without
  it). So :func:`test_interpreted_suite` re-runs this file in a child pytest with the variable set,
  and those tests exist only there (or in a run that has ``TRITON_INTERPRET=1`` throughout).
  Setting the variable from here would make the outcome depend on import order and change the
  kernels other modules see.
* **CUDA** (``cuda`` marker; conftest skips it without a GPU): the same tests on the GPU, plus
  ``torch.compile``, opcheck and CUDA-graph checks.
* The rest runs in the plain CPU process: provider loading, and what ``torch.compile`` traces.

A store is compared with the reference run on a copy of the same cache: scale records, pad bytes
and every byte the store must not touch exactly; data records by dequantized value (one fp8 step
of tolerance, :data:`dsv4_compile.tolerances.STORE_FP8_STEP`), and the number of differing data
bytes is bounded (a last-bit difference of ``y`` can move a rounding tie) and reported at the end.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

import dsv4_compile as d4  # noqa: E402
from dsv4_compile import dispatch, layout  # noqa: E402
from dsv4_compile.providers import reference  # noqa: E402
from dsv4_compile.providers.triton import common as triton_common, store as triton_store  # noqa: E402
from dsv4_compile.providers.triton.kernels import store as store_kernels  # noqa: E402
from dsv4_compile.tolerances import STORE_FP8_STEP  # noqa: E402
from helpers import report, run_interpreted_child, store_inputs  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled:UserWarning")
STORE = torch.ops.dsv4.fused_k_norm_rope_flashmla.default
CUDA_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)

interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_interpreted_suite"
)
compiled_triton = pytest.mark.skipif(INTERPRETED, reason="needs compiled (not interpreted) Triton")
#: Devices a kernel test runs on: CPU through the interpreter (in the child only), CUDA for real.
DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=pytest.mark.cuda)]

_diffs = {"calls": 0, "fp8": 0, "fp8_total": 0, "bf16": 0, "bf16_total": 0}


@pytest.fixture(scope="module", autouse=True)
def _provider_and_report(request):
    """Register the provider (idempotent) and jit the kernels; report differing bytes at the end."""
    triton_store.register()
    triton_store._kernels()
    yield
    if _diffs["calls"]:
        report(
            request.config,
            f"triton store vs reference ({'interpreted' if INTERPRETED else 'compiled'}, "
            f"{_diffs['calls']} stores): differing fp8 bytes {_diffs['fp8']}/{_diffs['fp8_total']}, "
            f"differing bf16 bytes {_diffs['bf16']}/{_diffs['bf16_total']}",
        )


# --------------------------------------------------------------------------------------------
# Cases and comparison
# --------------------------------------------------------------------------------------------


def make_case(
    device, num_tokens, page_size, *, page_stride=None, dtype=torch.bfloat16,
    pos_dtype=torch.int64, loc_dtype=torch.int64, row_stride=layout.HEAD_DIM, holes=2,
):
    """Store arguments: ``num_tokens`` random tokens to distinct slots (the first and last slot of
    the cache among them) with ``holes`` negative slots, over a cache of random bytes."""
    kv, weight, freqs, positions = store_inputs(num_tokens, dtype, pos_dtype, max_pos=512)
    if row_stride > layout.HEAD_DIM:  # a slice of a wider projection, last dim contiguous
        wide = torch.randn(num_tokens, row_stride).to(dtype)
        wide[:, -layout.HEAD_DIM:] = kv
        kv = wide[:, -layout.HEAD_DIM:]
    num_pages = max(2, -(-2 * num_tokens // page_size))
    cap = num_pages * page_size
    slots = torch.randperm(cap - 2)[:num_tokens] + 1
    slots[: min(2, num_tokens)] = torch.tensor([cap - 1, 0])[: min(2, num_tokens)]
    slots[2 : 2 + holes] = -torch.arange(1, 1 + len(slots[2 : 2 + holes])) ** 2  # -1, -4, ...
    stride = layout.page_bytes(page_size) if page_stride is None else page_stride
    cache = torch.randint(0, 256, (num_pages, stride), dtype=torch.uint8)
    if row_stride > layout.HEAD_DIM:
        wide = wide.to(device)  # moving the slice itself would make it contiguous
        kv = wide[:, -layout.HEAD_DIM:]
    args = (kv, weight, freqs, positions, slots.to(loc_dtype), cache, 1e-6, page_size)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def written_mask(cache, page_size, slots):
    """Bool like ``cache``: the data and scale records of the non-negative ``slots``."""
    mask = torch.zeros_like(cache, dtype=torch.bool)
    page, off = layout.page_and_offset(slots[slots >= 0].long(), page_size)
    data = off[:, None] * layout.DATA_BYTES + torch.arange(layout.DATA_BYTES, device=cache.device)
    scale = page_size * layout.DATA_BYTES + off[:, None] * layout.SCALE_BYTES
    scale = scale + torch.arange(layout.SCALE_BYTES, device=cache.device)
    mask[page[:, None], data] = True
    mask[page[:, None], scale] = True
    return mask


def run_both(args, store=None):
    """Run the reference on a copy of the cache, then ``store`` (default: the Triton kernel) in
    place; return the reference's cache."""
    expected = args[5].clone()
    reference.fused_k_norm_rope_flashmla(*args[:5], expected, *args[6:])
    (store or triton_store.fused_k_norm_rope_flashmla)(*args)
    return expected


def assert_matches_reference(actual, expected, page_size, slots, max_differing=None):
    """Untouched and scale bytes exact; values within one fp8 step; few differing data bytes."""
    mask = written_mask(actual, page_size, slots)
    assert torch.equal(actual[~mask], expected[~mask]), "bytes outside the written records changed"
    live = slots[slots >= 0].long()
    if live.numel() == 0:
        return
    page, off = layout.page_and_offset(live, page_size)
    scale_cols = page_size * layout.DATA_BYTES + off[:, None] * layout.SCALE_BYTES
    scale_cols = scale_cols + torch.arange(layout.SCALE_BYTES, device=actual.device)
    assert torch.equal(actual[page[:, None], scale_cols], expected[page[:, None], scale_cols])
    assert bool((actual[page, scale_cols[:, -1]] == 0).all()), "pad byte not 0"

    scales = expected[page[:, None], scale_cols[:, :-1]]
    atol = 2.0 ** (int(scales.max()) - layout.UE8M0_BIAS - 9)  # an fp8 subnormal step
    torch.testing.assert_close(
        layout.gather_dequant(actual, page_size, live, torch.float32),
        layout.gather_dequant(expected, page_size, live, torch.float32),
        rtol=STORE_FP8_STEP, atol=atol,
    )
    data_cols = off[:, None] * layout.DATA_BYTES + torch.arange(layout.DATA_BYTES, device=actual.device)
    differ = actual[page[:, None], data_cols] != expected[page[:, None], data_cols]
    fp8, bf16 = int(differ[:, : layout.NOPE_DIM].sum()), int(differ[:, layout.NOPE_DIM :].sum())
    _diffs["calls"] += 1
    _diffs["fp8"] += fp8
    _diffs["bf16"] += bf16
    _diffs["fp8_total"] += live.numel() * layout.NOPE_DIM
    _diffs["bf16_total"] += live.numel() * 2 * layout.ROPE_DIM
    if max_differing is None:  # rounding ties moved by a last-bit difference of y: rare
        max_differing = 2 + live.numel() * layout.HEAD_DIM // 4096
    assert fp8 + bf16 <= max_differing, f"{fp8} fp8 and {bf16} bf16 bytes differ from the reference"


# --------------------------------------------------------------------------------------------
# Kernel against the reference (interpreted on CPU, compiled on CUDA)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 2, 61, 64, 256])
@pytest.mark.parametrize("stride", ["canonical", "unpadded"])
def test_page_geometry(device, page_size, stride):
    page_stride = page_size * layout.TOKEN_BYTES if stride == "unpadded" else None
    args = make_case(device, 12, page_size, page_stride=page_stride)
    expected = run_both(args)
    assert_matches_reference(args[5], expected, page_size, args[4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kv_dtypes(device, dtype):
    args = make_case(device, 12, 64, dtype=dtype)
    expected = run_both(args)
    assert_matches_reference(args[5], expected, 64, args[4])


@pytest.mark.parametrize("device", DEVICES)
def test_kv_row_stride_larger_than_512(device):
    args = make_case(device, 12, 2, row_stride=layout.HEAD_DIM + 136)
    assert args[0].stride() == (layout.HEAD_DIM + 136, 1)
    expected = run_both(args)
    assert_matches_reference(args[5], expected, 2, args[4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "pos_dtype, loc_dtype",
    [(torch.int32, torch.int32), (torch.int32, torch.int64), (torch.int64, torch.int32)],
)
def test_index_dtypes(device, pos_dtype, loc_dtype):
    args = make_case(device, 12, 64, pos_dtype=pos_dtype, loc_dtype=loc_dtype)
    expected = run_both(args)
    assert_matches_reference(args[5], expected, 64, args[4])


@pytest.mark.parametrize("device", DEVICES)
def test_negative_slots_write_nothing(device):
    args = list(make_case(device, 8, 4))
    args[4] = -torch.arange(1, 9, device=device)  # -1 .. -8
    before = args[5].clone()
    triton_store.fused_k_norm_rope_flashmla(*args)
    assert torch.equal(args[5], before)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    args = make_case(device, 0, 64, holes=0)
    before = args[5].clone()
    triton_store.fused_k_norm_rope_flashmla(*args)
    assert torch.equal(args[5], before)


@pytest.fixture(params=["one-token", "format"])
def geometry(request, monkeypatch):
    """The store's launch geometry, whatever the token count: one token per program
    (``"one-token"``, the small stores') or the format's :data:`~triton_store.GEOMETRY`."""
    monkeypatch.setattr(triton_store, "SMALL_TOKENS", 2**31 if request.param == "one-token" else 0)
    return request.param


def test_geometry_by_token_count():
    """One token per one-warp program up to SMALL_TOKENS tokens, the format's geometry beyond."""
    for fmt in layout.FORMATS.values():
        large = triton_store.GEOMETRY[fmt.values]
        assert large != (1, 1)
        assert triton_store.geometry(fmt, 1) == triton_store.geometry(fmt, triton_store.SMALL_TOKENS) == (1, 1)
        assert triton_store.geometry(fmt, triton_store.SMALL_TOKENS + 1) == large


@pytest.mark.parametrize("device", DEVICES)
def test_many_tokens(device, geometry):
    """More tokens than one program handles, with a partial last block, in both geometries."""
    num_tokens = 8191 if device == "cuda" else 61
    args = make_case(device, num_tokens, 256, holes=5)
    expected = run_both(args)
    assert_matches_reference(args[5], expected, 256, args[4])


@pytest.mark.parametrize("device", DEVICES)
def test_exact_bytes_at_rounding_ties(device):
    """x = +-1 (mean(x^2) = 1, eps = 0) makes y = +-w exactly, so every byte is determined: fp8
    round-to-nearest-even ties and their neighbours, subnormals, exact power-of-two scales, the
    1e-4 floor, bf16 ties (through RoPE with cos 1 sin 0, and cos 0 sin 1)."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # every finite non-negative e4m3fn value
    grid = codes.view(torch.float8_e4m3fn).float()
    mid = (grid[1:] + grid[:-1]) / 2  # 126 ties
    w = torch.zeros(layout.NUM_TILES + 1, layout.TILE)
    w[0, 0], w[0, 1:] = 448.0, mid[:63]
    w[1, 0], w[1, 1:] = -448.0, -mid[63:]
    w[2, 0] = 448.0  # and neighbours of ties, below and above
    w[2, 1:32] = mid[::4].nextafter(torch.tensor(0.0))[:31]
    w[2, 32:] = mid[1::4].nextafter(torch.tensor(448.0))
    w[3] = torch.cat([torch.tensor([56.0]), mid[:63] / 8])  # scale exactly 2^-3
    w[4] = torch.randn(64).clamp(-4, 4) * 100
    w[4, 0] = torch.tensor(448.0).nextafter(torch.tensor(1e9))  # scale just above 1: e = 1
    w[5] = 0.0  # amax 0: the 1e-4 floor
    w[6] = torch.rand(64) * 3e-5  # below the floor
    ties = 1 + torch.arange(1, 64, 2) * 2.0**-8  # halfway between bf16 neighbours of [1, 2)
    w[7, 0::2], w[7, 1::2] = ties, -ties.nextafter(torch.tensor(0.0))
    w = w.view(-1)
    signs = torch.ones(4, layout.HEAD_DIM)
    signs[1], signs[2, 1::2] = -1.0, -1.0
    signs[3] = torch.where(torch.rand(layout.HEAD_DIM) < 0.5, -1.0, 1.0)
    freqs = torch.zeros(2, layout.ROPE_DIM)
    freqs[0, 0::2] = 1.0  # cos 1, sin 0: (a, b) -> (a, b)
    freqs[1, 1::2] = 1.0  # cos 0, sin 1: (a, b) -> (-b, a)
    cache = torch.randint(0, 256, (3, layout.page_bytes(2)), dtype=torch.uint8)
    args = (signs, w, freqs, torch.tensor([0, 1, 0, 1]), torch.tensor([5, 0, 3, 2]), cache, 0.0, 2)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    expected = run_both(args)
    assert torch.equal(args[5], expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_huge_and_non_finite_rows(device, dtype):
    """Rows whose sum of squares overflows fp32 are normed as the reference norms them (no
    overflow); a row with NaN/Inf in kv, or one whose values overflow, is the NaN token, byte for
    byte; the rows around them are unaffected."""
    args = list(make_case("cpu", 12, 16, dtype=dtype, holes=0))
    kv = args[0].float()
    kv[0] *= 2.0**60  # |x| ~ 1e18: squares overflow fp32
    kv[1] *= 2.0**-100
    kv[2, 3], kv[3, 100], kv[4, 500] = math.nan, math.inf, -math.inf
    kv[5] = 1e-30  # 1 in one dim of a tiny row: y there is ~22.6 * w, overflowing with w ~ 3e37
    kv[5, 9] = 1.0
    kv[:, 9] = torch.where(torch.arange(12) == 5, kv[:, 9], 0.0)
    args[0] = kv.to(dtype)
    args[1] = args[1].clone()
    args[1][9] = 3e37 if dtype == torch.float32 else 2.0**125
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    expected = run_both(args)
    page, off = layout.page_and_offset(args[4][2:6].long().cpu(), 16)
    for p_, o_ in zip(page.tolist(), off.tolist()):  # the NaN tokens: exactly the reference's bytes
        data = slice(o_ * layout.DATA_BYTES, (o_ + 1) * layout.DATA_BYTES)
        assert torch.equal(args[5][p_, data].cpu(), layout.NAN_DATA_RECORD)
        assert torch.equal(expected[p_, data].cpu(), layout.NAN_DATA_RECORD)
    finite = torch.ones(12, dtype=torch.bool)
    finite[2:6] = False
    slots = args[4].clone()
    slots[~finite.to(device)] = -1
    mask = written_mask(args[5], 16, args[4]) & ~written_mask(args[5], 16, slots)
    assert torch.equal(args[5][mask], expected[mask])  # NaN tokens' data and scale records exact
    actual = args[5].clone()
    actual[mask] = expected[mask]
    assert_matches_reference(actual, expected, 16, slots)


V41 = ["v4.1-fp8", "v4.1-fp8-interleaved", "v4.1-fp4", "v4.1-fp4-interleaved"]


def format_written_mask(cache, page_size, slots, kv_format):
    """Bool like ``cache``: the data and scale records of the non-negative ``slots``."""
    fmt = layout.FORMATS[kv_format]
    mask = torch.zeros_like(cache, dtype=torch.bool)
    for s_ in slots[slots >= 0].tolist():
        page, off = divmod(s_, page_size)
        for start, size in ((fmt.data_offset(page_size, off), fmt.data_bytes),
                            (fmt.scale_offset(page_size, off), fmt.scale_bytes)):
            mask[page, start : start + size] = True
    return mask


#: ``(kv_format, fused)``: every format's store, fused and plain
FORMAT_CASES = [(f, fused) for fused in (True, False) for f in ["v4", *V41]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kv_format, fused", FORMAT_CASES, ids=[f"{f}-{'fused' if fused else 'plain'}" for f, fused in FORMAT_CASES]
)
def test_formats_match_reference(device, kv_format, fused, geometry):
    """Every format's store (V4, V4.1 FP8 / FP4 block-split / interleaved; fused / plain), in both
    launch geometries, at an odd page stride: untouched bytes and NaN tokens exact; the plain store byte-exact (the same
    fp32 operations); the fused store's values within one code of the reference's (a last-bit
    difference of the norm can move a bf16 rounding)."""
    page_size = 5
    args = list(make_case("cpu", 24, page_size, holes=2))
    args[5] = torch.randint(0, 256, (10, layout.page_bytes(page_size, kv_format) + 3), dtype=torch.uint8)
    args[0] = args[0].clone()
    args[0][5, 17] = math.nan  # a NaN token
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    kv, w, freqs, pos, slots, cache = args[:6]
    expected = cache.clone()
    fmt = layout.FORMATS[kv_format]  # what providers receive
    if fused:
        reference.fused_k_norm_rope_flashmla(kv, w, freqs, pos, slots, expected, 1e-6, page_size, fmt)
        triton_store.fused_k_norm_rope_flashmla(kv, w, freqs, pos, slots, cache, 1e-6, page_size, fmt)
    else:
        reference.quantize_store(kv, slots, expected, page_size, fmt)
        triton_store.quantize_store(kv, slots, cache, page_size, fmt)
    mask = format_written_mask(cache.cpu(), page_size, slots.cpu(), kv_format).to(device)
    assert torch.equal(cache[~mask], expected[~mask]), "bytes outside the written records changed"
    if not fused:
        assert torch.equal(cache, expected)
        return
    live = slots[slots >= 0].long()
    got = layout.gather_dequant(cache, page_size, live, torch.float32, kv_format)
    want = layout.gather_dequant(expected, page_size, live, torch.float32, kv_format)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan().any(-1)
    step = want[finite].abs().amax(-1, keepdim=True) * (2.0**-2 if "fp4" in kv_format else 2.0**-4)
    assert ((got[finite] - want[finite]).abs() <= step).all()
    assert int((got[finite] != want[finite]).sum()) <= 2 + live.numel() * 512 // 256


@triton.jit
def _apply_helpers(x_ptr, fp8_ptr, bf16_ptr, exponent_ptr, n, BLOCK: tl.constexpr, HW: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < n)
    tl.store(fp8_ptr + i, store_kernels._e4m3fn_saturated(v, HW), mask=i < n)
    tl.store(bf16_ptr + i, store_kernels._bf16_bits(v, HW), mask=i < n)
    tl.store(exponent_ptr + i, store_kernels._ue8m0_exponent(tl.abs(v)), mask=i < n)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN/inf inputs
@pytest.mark.parametrize("hardware", [False, True], ids=["integer", "cvt"])
@pytest.mark.parametrize("device", DEVICES)
def test_rounding_helpers_are_exact(device, hardware):
    """The kernel's rounding equals torch's casts and ``reference.ue8m0_exponent``, bit for bit:
    every fp8 tie and its neighbours, bf16 ties, inf/NaN, exponents at powers of two; in integer
    arithmetic (every backend) and with the conversion instructions (``cvt``: where
    :func:`~dsv4_compile.providers.triton.common.hardware_conversions` picks them)."""
    if hardware and not (device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("the conversion instructions need an NVIDIA GPU of compute capability 8.9+")
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (grid[1:] + grid[:-1]) / 2
    boundaries = 448.0 * 2.0 ** torch.arange(-30.0, 30.0)  # amax / 448 a power of two
    near = torch.cat([mid, boundaries, torch.tensor([1e-4, 0.0, 2.0**-126, 3e38])])
    ups, downs = near.nextafter(torch.tensor(float("inf"))), near.nextafter(torch.tensor(0.0))
    bf16_ties = (torch.randint(0, 1 << 15, (512,), dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    special = torch.tensor([float("inf"), float("nan"), 3.4028235e38, -0.0])
    spread = torch.randn(4096) * 10.0 ** torch.randint(-8, 8, (4096,)).float()
    x = torch.cat([near, ups, downs, bf16_ties, special, spread])
    x = torch.cat([x, -x]).to(device)
    fp8, bf16, exponent = (torch.empty(x.shape, dtype=torch.int32, device=device) for _ in range(3))
    _apply_helpers[(triton.cdiv(x.numel(), 1024),)](x, fp8, bf16, exponent, x.numel(), BLOCK=1024, HW=hardware)
    number = ~x.isnan()  # NaN is no cache value (the kernel writes 0x7FC0 for bf16)
    finite = x.isfinite()  # a non-finite value makes a NaN token, whose bytes the store writes itself
    want_fp8 = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).int()
    assert torch.equal(fp8[finite], want_fp8[finite])  # values past +-448 too: clamped or saturated
    want_bf16 = x.to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    assert torch.equal(bf16[number], want_bf16[number])
    normal = number & (x.abs() < 3e38)  # amax / 448 a normal fp32 number
    assert torch.equal(exponent[normal], reference.ue8m0_exponent(x.abs())[normal].int())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", V41)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_plain_store_of_float_kv_is_exact(device, dtype, kv_format):
    """The plain V4.1 store of float16 / float32 ``kv`` (values that are not bf16: the FP4 codes
    take the compares of any fp32 value, not the bf16 pairs') equals the reference byte for byte."""
    page_size = 5
    kv, _, _, _, slots, _, _, _ = make_case("cpu", 64, page_size, dtype=dtype)
    cache = torch.randint(0, 256, (30, layout.page_bytes(page_size, kv_format)), dtype=torch.uint8)
    expected = cache.clone()
    fmt = layout.FORMATS[kv_format]  # what providers receive
    reference.quantize_store(kv, slots, expected, page_size, fmt)
    cache = cache.to(device)
    triton_store.quantize_store(kv.to(device), slots.to(device), cache, page_size, fmt)
    assert torch.equal(cache.cpu(), expected)


@triton.jit
def _apply_e2m1(x_ptr, s_ptr, byte_ptr, WIDTH: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * WIDTH + tl.arange(0, WIDTH))
    s = tl.load(s_ptr + row * (WIDTH // 16) + tl.arange(0, WIDTH // 16))
    b = store_kernels._e2m1_bytes(tl.reshape(x, (1, WIDTH)), tl.reshape(s, (1, WIDTH // 16)), WIDTH, 1, BF16)
    tl.store(byte_ptr + row * (WIDTH // 2) + tl.arange(0, WIDTH // 2), tl.reshape(b, (WIDTH // 2,)))


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp4_codes_without_division_are_the_quotients(device, bf16):
    """The FP4 store's code bytes (thresholds times the scale, two values a compare, no division)
    equal ``reference.e2m1_codes(x / s)`` with the IEEE-rounded quotient, the even value's code in
    the low nibble, for every e4m3 scale the store writes (2^-9 .. 448) and values ``x``: bf16 ones
    (``bf16``: the fused store's, and a bf16 ``kv``'s) or any fp32 ones (a plain store of float16 /
    float32 ``kv``). At each threshold times the scale, one ulp either side (bf16 or fp32), values
    spread over the whole range of codes and past it, in either place of a pair; signed zeros too."""
    triton_store._kernels()
    scales = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    scales = scales[scales >= layout.FP4_SCALE_MIN]
    magnitudes = torch.tensor(layout.E2M1_VALUES)
    thresholds = (magnitudes[1:] + magnitudes[:-1]) / 2  # where the code changes: 0.25, 0.75, ... 5
    at = thresholds[:, None] * scales  # exact products, bf16 values too
    assert torch.equal(at.to(torch.bfloat16).float(), at)
    dtype = torch.bfloat16 if bf16 else torch.float32
    bits = at.to(dtype).view(torch.int16 if bf16 else torch.int32)
    near = torch.cat([at, (bits + 1).view(dtype).float(), (bits - 1).view(dtype).float()])
    spread = (torch.rand(27, scales.numel()) * 8 * scales).to(dtype).float()
    x = torch.cat([near, spread, -near, -spread])  # [96, scales]: 6 groups of 16 a scale
    x[0, :2] = torch.tensor([0.0, -0.0])
    groups = x.t().reshape(-1, 16)  # each group one scale
    s = scales.repeat_interleave(x.shape[0] // 16)
    codes = reference.e2m1_codes(groups / s[:, None]).int()
    swapped = groups.view(-1, 8, 2).flip(-1).reshape(-1, 16)  # every value in the other place too
    codes_swapped = reference.e2m1_codes(swapped / s[:, None]).int()
    x_all = torch.cat([groups, swapped]).reshape(-1, 64)  # rows of 4 groups
    s_all = torch.cat([s, s]).reshape(-1, 4)
    codes = torch.cat([codes, codes_swapped]).reshape(-1, 32, 2)
    want = codes[..., 0] | (codes[..., 1] << 4)
    got = torch.empty(want.shape, dtype=torch.int32, device=device)
    x_all, s_all = x_all.to(device).contiguous(), s_all.to(device).contiguous()
    _apply_e2m1[(x_all.shape[0],)](x_all, s_all, got, WIDTH=64, BF16=bf16)
    assert torch.equal(got.cpu(), want)
    assert set(codes.unique().tolist()) == set(range(16))  # every code met


def test_hardware_conversions_only_on_nvidia_gpus_with_fp8_instructions(monkeypatch):
    """The conversion instructions are used on CUDA devices of compute capability 8.9+ with
    compiled kernels; not on SM80, ROCm, CPU, or under the interpreter (whose fp8 casts are
    numpy's). Decided from the device's capability (here a stand-in SM90 and SM80)."""
    triton_store._kernels()
    kernel = triton_store._kernels().store_kernel
    capabilities = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capabilities[device.index])
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(triton_common, "_NVIDIA", {})
    assert triton_common.hardware_conversions(torch.device("cuda", 0), kernel) == (not INTERPRETED)
    assert not triton_common.hardware_conversions(torch.device("cuda", 1), kernel)
    assert not triton_common.hardware_conversions(torch.device("cpu"), kernel)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(triton_common, "_NVIDIA", {})
    assert not triton_common.hardware_conversions(torch.device("cuda", 0), kernel)


# --------------------------------------------------------------------------------------------
# Through the op: the provider trampoline
# --------------------------------------------------------------------------------------------


@interpreted
def test_op_on_the_cuda_key_runs_the_triton_provider():
    """Redispatched to the CUDA key, the op resolves the ``triton`` provider (here interpreted on
    CPU tensors) and stores what the reference stores."""
    assert dispatch.resolve(triton_store.OP, torch.device("cuda", 0))[0] == "triton"
    args = make_case("cpu", 12, 61)
    expected = run_both(args, lambda *a: STORE.redispatch(CUDA_KEY, *a))
    assert_matches_reference(args[5], expected, 61, args[4])


@pytest.mark.cuda
@compiled_triton
def test_op_on_cuda_uses_triton_and_matches_reference():
    assert d4.providers("cuda")[triton_store.OP] == "triton"
    args = make_case("cuda", 4096, 64, holes=7)
    expected = run_both(args, STORE)
    assert_matches_reference(args[5], expected, 64, args[4])


@pytest.fixture
def fast_launch(monkeypatch):
    """Eager launches through the fast launcher (opted in, on the Triton versions it serves)."""
    if not triton.__version__.startswith(triton_common.FAST_LAUNCH_TRITON):
        pytest.skip(f"the fast launcher serves Triton {triton_common.FAST_LAUNCH_TRITON}, not {triton.__version__}")
    monkeypatch.setenv(triton_common.FAST_LAUNCH_ENV, "1")
    triton_common._LAUNCHERS.clear()
    yield
    triton_common._LAUNCHERS.clear()


@pytest.mark.parametrize("module, what", [("store", "store"), ("attention", "attention"), ("indexer", "indexer"),
                                          ("rope", "rope")])
def test_provider_unavailable_names_its_kernels(module, what):
    """A Triton provider asked for a device type Triton does not serve says which of its kernels
    and which device type."""
    import importlib

    provider = importlib.import_module(f"dsv4_compile.providers.triton.{module}")
    with pytest.raises(dispatch.ProviderUnavailable, match=f"^no Triton {what} for device type 'cpu'$"):
        provider.load(torch.device("cpu"))


@pytest.mark.skipif(INTERPRETED, reason="the launchers of interpreted kernels are Triton's")
@pytest.mark.parametrize("env", [None, "0", "1"])
def test_fast_launcher_only_when_opted_in(monkeypatch, env):
    """Eager launches go through Triton's own ``kernel[grid](...)`` unless
    ``DSV4_COMPILE_TRITON_FAST_LAUNCH=1`` opts in, and then only on a Triton version it lists."""
    if env is None:
        monkeypatch.delenv(triton_common.FAST_LAUNCH_ENV, raising=False)
    else:
        monkeypatch.setenv(triton_common.FAST_LAUNCH_ENV, env)
    launcher = triton_common.EagerLauncher(triton_store._kernels().store_kernel)
    assert launcher.enabled == (env == "1" and triton.__version__.startswith(triton_common.FAST_LAUNCH_TRITON))


@pytest.mark.cuda
@compiled_triton
def test_eager_launcher_compiles_per_alignment(fast_launch):
    """Fast eager launches reuse a compiled kernel per specialisation: a kv whose rows start 2
    bytes off 16-byte alignment gets its own kernel, and every call matches the reference."""
    launcher = triton_common.eager(triton_store._kernels().store_kernel)
    assert launcher.enabled
    launcher.plans.clear()
    for offset in (0, 1, 0, 1):  # aligned, misaligned, then each again from the launcher's cache
        args = list(make_case("cuda", 12, 64))
        wide = torch.randn(12, layout.HEAD_DIM + 8, device="cuda").to(args[0].dtype)
        wide[:, offset : offset + layout.HEAD_DIM] = args[0]
        args[0] = wide[:, offset : offset + layout.HEAD_DIM]
        assert (args[0].data_ptr() % 16 == 0) == (offset == 0)
        expected = run_both(args)
        assert_matches_reference(args[5], expected, 64, args[4])
    assert len(launcher.plans) == 2


@pytest.mark.cuda
@compiled_triton
def test_eager_launches_call_launch_hooks_when_set(fast_launch):
    """Without launch hooks a fast eager launch goes straight to the launcher's C entry point; a
    launch hook (what Triton's profiler integration adds) sees every eager launch, with the
    kernel's name, as Triton's own launcher shows it."""
    from triton import knobs

    args = make_case("cuda", 12, 64)
    run_both(args)  # compiles; the next launches reuse the plan
    launcher = triton_common.eager(triton_store._kernels().store_kernel)
    assert launcher.enabled
    entries = {plan: plan.entry for plan in launcher.plans.values()}
    assert None not in entries.values()
    entered = []
    for plan, entry in entries.items():
        plan.entry = lambda *a, entry=entry: (entered.append(1), entry(*a))
    try:
        assert_matches_reference(args[5], run_both(args), 64, args[4])
        assert entered == [1]
        seen = []
        record = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
        hooks = knobs.runtime.launch_enter_hook
        if hasattr(hooks, "add"):  # a chain of hooks (Triton 3.6)
            hooks.add(record)
        else:
            knobs.runtime.launch_enter_hook = record
        try:
            expected = run_both(args)
        finally:
            if hasattr(hooks, "remove"):
                hooks.remove(record)
            knobs.runtime.launch_enter_hook = hooks
        assert_matches_reference(args[5], expected, 64, args[4])
        assert seen == ["store_kernel"] and entered == [1]
    finally:
        for plan, entry in entries.items():
            plan.entry = entry


@pytest.mark.cuda
@compiled_triton
def test_checked_mode_rejects_bad_slot_on_cuda():
    args = list(make_case("cuda", 8, 64))
    args[4][3] = layout.capacity(args[5], 64)
    before = args[5].clone()
    with d4.checked(), pytest.raises(ValueError, match="out_loc"):
        STORE(*args)
    assert torch.equal(args[5], before)


@pytest.mark.cuda
@compiled_triton
def test_cuda_graph_replay_follows_new_inputs():
    """The eager kernel is capture-safe: a captured store replays with the inputs' new values."""
    args = make_case("cuda", 256, 64, holes=3)
    kv, slots, cache = args[0], args[4], args[5]
    STORE(*args)  # warm-up: compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        STORE(*args)
    kv.copy_(torch.randn_like(kv))
    slots.copy_(slots.flip(0))
    expected = run_both(args, lambda *a: graph.replay())
    torch.cuda.synchronize()
    assert_matches_reference(cache, expected, 64, slots)


# --------------------------------------------------------------------------------------------
# torch.compile: the launch is traced into the graph where the triton provider serves
# --------------------------------------------------------------------------------------------


def _store_fn(kv, weight, freqs, positions, out_loc, kvcache, eps, page_size):
    STORE(kv, weight, freqs, positions, out_loc, kvcache, eps, page_size)


def _fake_cuda_case(mode):
    with mode, torch.device("cuda"):
        kv, weight = torch.empty(8, 512, dtype=torch.bfloat16), torch.empty(512, dtype=torch.bfloat16)
        positions, out_loc = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
        cache = torch.empty(3, layout.page_bytes(64), dtype=torch.uint8)
        return kv, weight, torch.empty(64, 64), positions, out_loc, cache, 1e-6, 64


class _Traced(Exception):
    pass


def _aot_forward_graph(args):
    """The forward graph AOTAutograd hands to the backend (traced, never run)."""
    from torch._functorch.aot_autograd import aot_function

    def capture(gm, _):
        raise _Traced(gm)

    with pytest.raises(_Traced) as traced:
        aot_function(lambda *a: _store_fn(*a, *args[6:]), fw_compiler=capture)(*args[:6])
    return traced.value.args[0]


class _Sm90Target:
    """Stands in for the CUDA driver where there is none: the target Triton compiles TTIR for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@compiled_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the CUDA driver: only without a GPU")
def test_functionalization_traces_the_triton_launch(monkeypatch, request):
    """On CUDA tensors (fake ones here: no GPU needed) the op becomes Inductor's user-defined
    Triton kernel node, which mutates only the cache; a forced reference provider or checked mode
    keeps the opaque op."""
    from torch._higher_order_ops.triton_kernel_wrap import (
        kernel_side_table,
        triton_kernel_wrapper_functional,
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90Target())  # TTIR mutation analysis
    monkeypatch.setattr(triton_common, "device_available", lambda device: True)
    dispatch.reset()  # forget a "no cuda device" resolution
    request.addfinalizer(dispatch.reset)
    args = _fake_cuda_case(FakeTensorMode())
    assert triton_store.inlines(triton_store.OP, args[0].device)
    graph = _aot_forward_graph(args).graph
    (node,) = [n for n in graph.nodes if n.target is triton_kernel_wrapper_functional]
    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])  # num_warps wraps it in a Config
    assert getattr(kernel, "fn", kernel) is triton_store._kernels().store_kernel
    assert node.kwargs["tensors_to_clone"] == ["cache_ptr"]
    assert not any(n.target is STORE for n in graph.nodes)

    for context in (d4.use_provider("reference"), d4.checked()):
        with context:
            assert not triton_store.inlines(triton_store.OP, args[0].device)
            code = _aot_forward_graph(args).code
        assert "dsv4.fused_k_norm_rope_flashmla" in code and "triton_kernel_wrapper" not in code


@compiled_triton
def test_cpu_ops_stay_opaque_under_compile():
    """On CPU the rule steps aside: opcheck passes, and compile calls the op in place, no copy."""
    from torch._inductor.utils import run_and_get_code

    args = make_case("cpu", 6, 4)
    torch.library.opcheck(STORE, args)
    expected = args[5].clone()
    _store_fn(*args[:5], expected, *args[6:])
    torch._dynamo.reset()
    compiled = torch.compile(_store_fn, fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True):
        _, (code,) = run_and_get_code(compiled, *args)
    assert torch.equal(args[5], expected)
    assert "torch.ops.dsv4.fused_k_norm_rope_flashmla.default(" in code
    assert "copy_" not in code and "clone" not in code


def _compile_and_get_code(args):
    """Compile ``_store_fn`` afresh (no cache: the provider binding is part of what is tested), run
    it on ``args``; return the compile counter and the generated code without its comments."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_store_fn, fullgraph=True, backend=counter)
    with torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(compiled, *args)
    return counter, "\n".join(line.split("#")[0] for code in codes for line in code.splitlines())


def _assert_no_cache_copy(code, cache):
    assert "copy_" not in code and "clone" not in code
    assert not re.search(rf"empty_strided\w*\(\({cache.shape[0]}, {cache.shape[1]}\)", code)


@pytest.mark.cuda
@compiled_triton
def test_compile_launches_the_triton_kernel_in_place():
    args = make_case("cuda", 300, 64, holes=4)
    expected = args[5].clone()
    STORE(*args[:5], expected, *args[6:])
    counter, code = _compile_and_get_code(args)
    assert counter.frame_count == 1
    assert "store_kernel" in code and "torch.ops.dsv4.fused_k_norm_rope_flashmla" not in code
    _assert_no_cache_copy(code, args[5])
    assert torch.equal(args[5], expected)


@pytest.mark.cuda
@compiled_triton
def test_compile_with_dynamic_token_count():
    """A compile with dynamic shapes serves several token counts, byte-exact at every count, with
    at most one recompile. (Byte-exact because a symbolic token count keeps the opaque op: the
    visible launch traced with one rounds a RoPE value otherwise than the eager launch at 1025
    tokens, ``scripts/repro_triton_symbolic_store.py``.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_store_fn, fullgraph=True, dynamic=True, backend=counter)
    for num_tokens in (37, 300, 1025):  # one-token programs; past SMALL_TOKENS, a partial last block
        args = make_case("cuda", num_tokens, 64, holes=3)
        expected = args[5].clone()
        STORE(*args[:5], expected, *args[6:])
        with torch._inductor.config.patch(force_disable_caches=True):
            compiled(*args)
        assert torch.equal(args[5], expected), f"{num_tokens} tokens"
    assert counter.frame_count <= 2  # at most one recompile (2 frames seen on the H200)


@pytest.mark.cuda
@compiled_triton
def test_compile_under_reference_override_calls_the_op():
    args = make_case("cuda", 64, 64)
    with d4.use_provider("reference"):
        expected = args[5].clone()
        STORE(*args[:5], expected, *args[6:])
        counter, code = _compile_and_get_code(args)
    assert counter.frame_count == 1
    assert "torch.ops.dsv4.fused_k_norm_rope_flashmla.default(" in code and "store_kernel" not in code
    _assert_no_cache_copy(code, args[5])
    assert torch.equal(args[5], expected)


@pytest.mark.cuda
@compiled_triton
def test_opcheck_on_cuda():
    """Includes AOT dispatch, which traces the launch through the FunctionalTensorMode rule."""
    torch.library.opcheck(STORE, make_case("cuda", 16, 64))


# --------------------------------------------------------------------------------------------
# Provider loading; the interpreter child
# --------------------------------------------------------------------------------------------


@compiled_triton
def test_provider_serves_available_cuda_and_xpu_devices(monkeypatch):
    with pytest.raises(dispatch.ProviderUnavailable, match="device type 'cpu'"):
        triton_store.load(torch.device("cpu"))
    monkeypatch.setattr(triton_common, "device_available", lambda device: False)
    with pytest.raises(dispatch.ProviderUnavailable, match="no cuda device"):
        triton_store.load(torch.device("cuda", 0))
    monkeypatch.setattr(triton_common, "device_available", lambda device: True)
    assert set(triton_store.load(torch.device("cuda", 0))) == {triton_store.OP, triton_store.PLAIN}
    assert all("triton" in dispatch.registered_providers(t) for t in ("cuda", "xpu"))


def test_interpreted_suite(request):
    """Run the ``interpreted`` tests in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__, echo=("triton store vs reference",))