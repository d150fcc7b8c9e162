"""The paged indexer key cache (docs/design.md §2.11): ``dsv4::indexer_store`` and
``dsv4::indexer_cache_logits`` in the ``"fp32"``, ``"fp8"`` and ``"fp4"`` formats.

The stored bytes are held to an independent bit-level model of each format written here in plain
Python (float32 arithmetic by rounding doubles through ``struct``, the e4m3 codec of
``float64_model.py``, the e2m1 codes by searching their value table), not to
``layout.quantize_index``; the logits to a float64 sum over
the keys and queries that model decodes. Where the Triton kernels run: as in
``test_indexer_logits.py`` (interpreted on CPU in a child pytest, compiled on CUDA).
"""

from __future__ import annotations

import math
import os
import re
import struct

import pytest
import torch

from float64_model import fp8_decode as e4m3_value, fp8_encode as e4m3_code
from helpers import patch_triton_interpreter, report, run_interpreted_child, sylvester_hadamard

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    patch_triton_interpreter()

import dsv4_compile as d4  # noqa: E402
from dsv4_compile import dispatch, layout  # noqa: E402

FORMATS = list(layout.INDEX_FORMATS)
EPS = torch.finfo(torch.float32).eps
TRITON_DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=pytest.mark.cuda)]
not_interpreted = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")
DIM = 128


# --------------------------------------------------------------------------------------------
# The independent model of the formats
# --------------------------------------------------------------------------------------------


def f32(x: float) -> float:
    """``x`` rounded to float32 (nearest even); exact for a float32 ``x``. Rounding a double result
    of ``+ - * /`` on float32 operands gives the float32 operation's result."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_code(v: float) -> int:
    """The e2m1 code nearest to ``v`` (at most 6 in magnitude), exact ties to the smaller
    magnitude; the sign bit only on a nonzero code."""
    a = abs(v)
    code = min(range(8), key=lambda c: (abs(E2M1[c] - a), c))
    return code | (8 if v < 0 and code else 0)


def ceil_log2(x: float) -> int:
    mantissa, exponent = math.frexp(x)
    return exponent - 1 if mantissa == 0.5 else exponent


def model_key(values: list[float], name: str) -> tuple[bytes, bytes]:
    """``(data, scale)`` bytes of one 128-value key (or query) in format ``name``."""
    if name == "fp32":
        return struct.pack("<128f", *values), b""
    finite = all(math.isfinite(v) for v in values)
    if name == "fp8":
        if not finite:
            return bytes([0x7F] * DIM), struct.pack("<f", math.nan)
        scale = f32(max(max(abs(v) for v in values), f32(1e-4)) / 448.0)
        inv = f32(1.0 / scale)
        return bytes(e4m3_code(f32(v * inv)) for v in values), struct.pack("<f", scale)
    if not finite:
        return bytes(DIM // 2), bytes([255] * 4)
    codes, exponents = [], []
    for g in range(4):
        group = values[32 * g : 32 * g + 32]
        e = ceil_log2(max(f32(max(abs(v) for v in group) / 6.0), f32(1e-4)))  # the floor after the division
        exponents.append(e + 127)
        codes += [e2m1_code(v * 2.0**-e) for v in group]
    return bytes(codes[i] | codes[i + 1] << 4 for i in range(0, DIM, 2)), bytes(exponents)


def model_decode(data: bytes, scale: bytes, name: str) -> list[float]:
    """The 128 values of a key's (or query's) bytes in format ``name``."""
    if name == "fp32":
        return list(struct.unpack("<128f", data))
    if name == "fp8":
        s = struct.unpack("<f", scale)[0] if scale else 1.0
        return [e4m3_value(c) * s for c in data]
    values = []
    for i, byte in enumerate(data):
        s = 2.0 ** (scale[i // 16] - 127) if scale[i // 16] != 255 else math.nan
        for code in (byte & 15, byte >> 4):
            v = E2M1[code & 7] * (-1.0 if code & 8 else 1.0)
            values.append(v * s if not math.isnan(s) else math.nan)
    return values


def model_store(cache: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, page_size: int, name: str) -> torch.Tensor:
    """``cache`` (a copy) with each key's bytes at its slot, by the model; negative slots skipped."""
    fmt = layout.INDEX_FORMATS[name]
    out = bytearray(bytes(cache.cpu().flatten().tolist()))
    stride = cache.shape[1]
    for key, slot in zip(keys.cpu().tolist(), slots.cpu().tolist()):
        if slot < 0:
            continue
        page, offset = divmod(slot, page_size)
        data, scale = model_key(key, name)
        at = page * stride + offset * fmt.data_bytes
        out[at : at + len(data)] = data
        at = page * stride + page_size * fmt.data_bytes + offset * fmt.scale_bytes
        out[at : at + len(scale)] = scale
    return torch.tensor(list(out), dtype=torch.uint8).view(cache.shape)


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


def make_keys(count: int, device="cpu") -> torch.Tensor:
    """Keys of varied magnitudes (a few tiny, below the 1e-4 amax floor), outlier channels,
    values on rounding ties of the formats, a zero key, a NaN key and an Inf key."""
    keys = torch.randn(count, DIM) * torch.rand(count, 1) * 4
    keys[:, 5] *= 30  # an outlier channel
    if count > 6:
        keys[1] *= 1e-6
        keys[2] = 0.0
        keys[3, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 4) * 2.0**-3
        keys[3, 32:] = 6.0 * 2.0**-3  # amax 0.75: the FP4 scale 2^-3 exactly, ties in the first group
        keys[4, 9] = float("nan")
        keys[5, 0] = float("-inf")
    return keys.to(device)


def poisoned_cache(num_pages: int, page_size: int, name: str, device="cpu") -> torch.Tensor:
    """A cache of the canonical stride plus 12 bytes of padding per page, full of random bytes
    (NaN and Inf patterns among them)."""
    fmt = layout.INDEX_FORMATS[name]
    return torch.randint(0, 256, (num_pages, fmt.page_bytes(page_size) + 12), dtype=torch.uint8, device=device)


def store_case(name: str, count: int = 23, page_size: int = 8, num_pages: int = 4, device="cpu"):
    keys = make_keys(count, device)
    slots = torch.randperm(num_pages * page_size)[:count]
    slots[::5] = -1  # skipped
    return keys, poisoned_cache(num_pages, page_size, name, device), slots.to(device), page_size


def triton_store(keys, cache, slots, page_size, name):
    """The Triton provider's store: through the op on CUDA, directly when interpreted on CPU."""
    if keys.device.type == "cuda":
        assert d4.providers("cuda")["indexer_store"] == "triton"
        return d4.indexer_store(keys, cache, slots, page_size, name)
    from dsv4_compile.providers.triton import indexer as triton_indexer

    triton_indexer.indexer_store(keys, cache, slots, page_size, layout.INDEX_FORMATS[name])


def triton_cache_logits(*args):
    if args[0].device.type == "cuda":
        assert d4.providers("cuda")["indexer_cache_logits"] == "triton"
        return d4.indexer_cache_logits(*args)
    from dsv4_compile.providers.triton import indexer as triton_indexer

    args = list(args)
    args[5] = layout.INDEX_FORMATS[args[5]]
    d4.ops.indexer.check_indexer_cache_logits(*args)
    return triton_indexer.indexer_cache_logits(*args)


def reference_store(*args):
    with d4.use_provider("reference"):
        d4.indexer_store(*args)


def reference_cache_logits(*args):
    with d4.use_provider("reference"):
        return d4.indexer_cache_logits(*args)


STORES = {"reference": reference_store, "triton": triton_store}
LOGITS = {"reference": reference_cache_logits, "triton": triton_cache_logits}


def logits_case(name: str, tokens=5, heads=6, width=40, page_size=8, num_pages=4, device="cpu"):
    """A filled cache (random bytes where nothing is stored), quantized queries, weights (with
    the fp8 queries' scales), block slots with holes and ``-1`` tails."""
    keys, cache, slots, page_size = store_case(name, 2 * page_size, page_size, num_pages)
    keys[4:6] = torch.randn(2, DIM)  # finite keys here
    keys, slots = keys.to(device), slots.to(device)
    cache = cache.to(device)
    reference_store(keys, cache, slots, page_size, name)
    written = slots[slots >= 0]
    q = torch.randn(tokens, heads, DIM, device=device) * 2
    codes, q_scales = layout.quantize_index(layout.hadamard(q) if name != "fp32" else q, name)
    weights = torch.randn(tokens, heads, device=device) / heads**0.5
    if name == "fp8":
        weights, q_scales = weights * q_scales, None
    block_slots = written[torch.randint(0, written.numel(), (tokens, width), device=device)]
    visible = torch.randint(0, width + 1, (tokens, 1), device=device)
    visible[:1] = width
    block_slots = torch.where(torch.arange(width, device=device) < visible, block_slots, -1)
    block_slots[:, 1] = -1
    return codes, weights, cache, block_slots, page_size, name, q_scales


def float64_logits(q, weights, cache, block_slots, page_size, name, q_scales):
    """``(logits, bound)``: float64 logits over the model's decoding of the queries and the
    cache's bytes, and the float32 bound ``(D + H) * eps * sum_h |w_h| sum_d |q_hd k_d|``."""
    fmt = layout.INDEX_FORMATS[name]
    cache, block_slots = cache.cpu(), block_slots.cpu()
    stride = cache.shape[1]
    flat = bytes(cache.flatten().tolist())

    def key(slot):
        page, offset = divmod(slot, page_size)
        at = page * stride + offset * fmt.data_bytes
        s_at = page * stride + page_size * fmt.data_bytes + offset * fmt.scale_bytes
        return model_decode(flat[at : at + fmt.data_bytes], flat[s_at : s_at + fmt.scale_bytes], name)

    q_bytes = q.cpu().contiguous().view(torch.uint8).view(q.shape[0], q.shape[1], -1)
    queries = torch.tensor([
        [model_decode(bytes(q_bytes[t, h].tolist()),
                      b"" if q_scales is None else bytes(q_scales[t, h].cpu().tolist()), name)
         for h in range(q.shape[1])]
        for t in range(q.shape[0])
    ], dtype=torch.float64)
    keys = torch.tensor([key(s) for s in range(layout.capacity(cache, page_size))], dtype=torch.float64)
    gathered = keys[block_slots.clamp_min(0)]
    w = weights.double().cpu()
    logits = (torch.einsum("thd,tmd->thm", queries, gathered).clamp_min(0) * w[:, :, None]).sum(1)
    magnitude = (torch.einsum("thd,tmd->thm", queries.abs(), gathered.abs()) * w.abs()[:, :, None]).sum(1)
    hidden = block_slots < 0
    bound = (DIM + q.shape[1]) * EPS * magnitude
    return logits.masked_fill(hidden, float("-inf")), bound.masked_fill(hidden, 0.0)


def assert_within_bound(got, *args):
    want, bound = float64_logits(*args)
    got = got.double().cpu()
    block_slots = args[3].cpu()
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert torch.equal(got == float("-inf"), block_slots < 0), "-inf exactly where the slot is -1"
    seen = block_slots >= 0
    err = (got - want)[seen].abs()
    assert bool((err <= bound[seen]).all()), f"max error {err.max().item():.3g} over the float32 bound"
    return (err / bound[seen].clamp_min(1e-30)).max().item() if err.numel() else 0.0


# --------------------------------------------------------------------------------------------
# Formats: geometry, the Hadamard transform, quantization against the model
# --------------------------------------------------------------------------------------------


@not_interpreted
def test_format_geometry():
    """Bytes per key as SGLang allocates them (132 FP8, 68 FP4) and float32's 512; a 64-block page."""
    assert {n: f.token_bytes for n, f in layout.INDEX_FORMATS.items()} == {"fp32": 512, "fp8": 132, "fp4": 68}
    assert layout.alloc_index_cache(3, 64, "fp8").shape == (3, 8448)
    assert layout.alloc_index_cache(2, 64, "fp4").shape == (2, 4352)
    assert layout.INDEX_FP8.rotated and layout.INDEX_FP4.rotated and not layout.INDEX_FP32.rotated
    with pytest.raises(ValueError, match=r"index_format must be one of \['fp32', 'fp8', 'fp4'\], got 'v4'"):
        layout.alloc_index_cache(1, 64, "v4")


@not_interpreted
def test_hadamard_is_the_normalised_sylvester_matrix():
    h = sylvester_hadamard(DIM)
    x = torch.randn(7, 3, DIM) * 10
    want = x.double() @ h
    got = layout.hadamard(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    bound = 8 * EPS * (x.double().abs() @ h.abs())  # 7 additions and a product
    assert bool(((got.double() - want).abs() <= bound).all())
    torch.testing.assert_close(layout.hadamard(got), x, atol=1e-5, rtol=1e-5)  # its own inverse
    compiled = torch.compile(layout.hadamard, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x), got)  # the same bits under torch.compile


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_index_matches_the_model(name):
    """:func:`layout.quantize_index`'s codes and scales are the model's bytes, and
    :func:`layout.dequant_index` decodes them as the model does."""
    keys = make_keys(40)
    codes, scales = layout.quantize_index(keys, name)
    data = codes.contiguous().view(torch.uint8).view(40, -1)
    scale = torch.zeros(40, 0, dtype=torch.uint8) if scales is None else scales.contiguous().view(torch.uint8).view(40, -1)
    for i, key in enumerate(keys.tolist()):
        want_data, want_scale = model_key(key, name)
        assert bytes(data[i].tolist()) == want_data, (name, i)
        assert bytes(scale[i].tolist()) == want_scale, (name, i)
        decoded = torch.tensor(model_decode(want_data, want_scale, name))
        torch.testing.assert_close(layout.dequant_index(codes[i], None if scales is None else scales[i], name),
                                   decoded.float(), equal_nan=True, atol=0, rtol=0)


@not_interpreted
def test_model_rounding_rules():
    """The model itself: e4m3 ties to even, saturation at 448; e2m1 ties toward zero; -0 as +0."""
    assert e4m3_code(448.0) == 0x7E and e4m3_code(1000.0) == 0x7E and e4m3_code(-1000.0) == 0xFE
    assert e4m3_value(e4m3_code(1.0625)) == 1.0 and e4m3_value(e4m3_code(1.1875)) == 1.25  # ties to even
    assert [E2M1[e2m1_code(v)] for v in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)] == [0, 0.5, 1, 1.5, 2, 3, 4]
    assert e2m1_code(-0.1) == 0 and e2m1_code(-7.0) == 15


# --------------------------------------------------------------------------------------------
# The store (reference on CPU; Triton interpreted in the child, compiled on CUDA)
# --------------------------------------------------------------------------------------------


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_reference_store_bytes(name):
    keys, cache, slots, page_size = store_case(name)
    want = model_store(cache, keys, slots, page_size, name)
    reference_store(keys, cache, slots, page_size, name)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_store_bytes(name, device):
    """Every byte the model writes, and no other (the page padding and skipped slots keep their
    garbage); int32 slots; a page size that is no power of two."""
    keys, cache, slots, page_size = store_case(name, count=37, page_size=12, num_pages=5, device=device)
    want = model_store(cache, keys, slots, page_size, name)
    triton_store(keys, cache, slots.int(), page_size, name)
    assert torch.equal(cache.cpu(), want)


def assert_fp4_bytes_as_sglang(store, device) -> None:
    """FP4 keys whose groups are all zero, tiny (amax below ``6e-4``) or quiet beside an outlier
    get the UE8M0 bytes SGLang's FP4 indexer quantizer writes, ``127 + ceil(log2(max(amax / 6,
    1e-4)))`` (the floor after the division: ``2^-13``, byte 114), and their codes against that
    scale. The bytes are written out by hand here."""
    keys = torch.zeros(4, DIM)  # key 0: zero
    keys[1] = 3e-4  # amax / 6 = 5e-5 < 1e-4: 2^-13; codes of 3e-4 * 2^13 = 2.46: e2m1 2.0 (code 4)
    keys[2] = 1e-5  # quiet groups beside an outlier: 2^-13
    keys[2, 0] = 40.0  # 40 / 6 = 6.7: 2^3 (byte 130)
    keys[3] = 0.75  # 0.75 / 6 = 2^-3 exactly (byte 124): a floor-free group, as before
    cache = torch.zeros(1, layout.INDEX_FP4.page_bytes(4), dtype=torch.uint8, device=device)
    store(keys.to(device), cache, torch.arange(4, device=device), 4, "fp4")
    data, scales = (r[0].cpu() for r in layout.index_records(cache, 4, "fp4"))
    assert scales.tolist() == [[114] * 4, [114] * 4, [130, 114, 114, 114], [124] * 4]
    assert data[0].tolist() == [0] * 64 and data[1].tolist() == [0x44] * 64


@not_interpreted
def test_reference_fp4_store_writes_sglangs_bytes_for_zero_tiny_and_quiet_groups():
    assert_fp4_bytes_as_sglang(reference_store, "cpu")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_fp4_store_writes_sglangs_bytes_for_zero_tiny_and_quiet_groups(device):
    assert_fp4_bytes_as_sglang(triton_store, device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_store_takes_strided_keys(name, device):
    keys, cache, slots, page_size = store_case(name, device=device)
    wide = torch.full((keys.shape[0], 2 * DIM), float("nan"), device=device)
    wide[:, :DIM] = keys
    other = cache.clone()
    triton_store(keys, cache, slots, page_size, name)
    triton_store(wide[:, :DIM], other, slots, page_size, name)
    assert torch.equal(cache, other)


def strided(args):
    """The same values in views with other strides: ``q``'s heads (and ``q_scales``') every other
    of a wider tensor full of garbage, ``weights`` transposed storage, ``block_slots`` every other
    column of a wider table."""
    q, weights, cache, block_slots, page_size, name, q_scales = args

    def every_other_head(t):
        shape = (t.shape[0], 2 * t.shape[1], t.shape[2])
        if t.element_size() == 1:  # uint8 or float8 codes: 0x7F bytes (an e4m3 NaN) between the heads
            wide = torch.full(shape, 0x7F, dtype=torch.uint8, device=t.device).view(t.dtype)
        else:
            wide = torch.full(shape, float("nan"), dtype=t.dtype, device=t.device)
        wide.view(torch.uint8)[:, ::2] = t.view(torch.uint8)
        return wide[:, ::2]

    wide_slots = torch.full((block_slots.shape[0], 2 * block_slots.shape[1]), 10**6, dtype=block_slots.dtype,
                            device=block_slots.device)
    wide_slots[:, ::2] = block_slots
    return (every_other_head(q), weights.t().contiguous().t(), cache, wide_slots[:, ::2], page_size, name,
            None if q_scales is None else every_other_head(q_scales))


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_reference_takes_strided_inputs(name):
    args = logits_case(name)
    assert torch.equal(reference_cache_logits(*strided(args)), reference_cache_logits(*args))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_takes_strided_inputs(name, device):
    args = logits_case(name, device=device)
    assert torch.equal(triton_cache_logits(*strided(args)), triton_cache_logits(*args))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_empty(device):
    for name in FORMATS:
        keys, cache, slots, page_size = store_case(name, device=device)
        before = cache.clone()
        triton_store(keys[:0], cache, slots[:0], page_size, name)
        assert torch.equal(cache, before)
        args = logits_case(name, device=device)
        for tokens, width in ((0, 8), (3, 0)):
            q, w, c, s = args[0][:tokens], args[1][:tokens], args[2], args[3][:tokens, :width]
            qs = None if args[6] is None else args[6][:tokens]
            assert triton_cache_logits(q, w, c, s, args[4], name, qs).shape == (tokens, width)


# --------------------------------------------------------------------------------------------
# The logits
# --------------------------------------------------------------------------------------------


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_reference_logits_against_float64(name):
    assert d4.providers("cpu")["indexer_cache_logits"] == "reference"
    args = logits_case(name)
    assert_within_bound(d4.indexer_cache_logits(*args), *args)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_logits_against_float64(name, device, request):
    args = logits_case(name, tokens=4, heads=40, width=150, device=device)  # 40 heads: two head tiles
    worst = assert_within_bound(triton_cache_logits(*args), *args)
    report(request.config, f"indexer cache logits triton {name} ({device}): worst error {worst:.3f} of the float32 bound")


def assert_reads_only_referenced_keys(logits, name, device):
    """Every byte of the cache no row references (other keys, scales, page padding) replaced by
    random bytes and by 0xFF (NaN patterns): the logits keep their bits."""
    args = list(logits_case(name, device=device))
    cache, block_slots, page_size = args[2], args[3], args[4]
    fmt = layout.INDEX_FORMATS[name]
    clean = logits(*args)
    referenced = torch.zeros_like(cache, dtype=torch.bool)
    for slot in block_slots[block_slots >= 0].unique().tolist():
        page, offset = divmod(slot, page_size)
        referenced[page, offset * fmt.data_bytes : (offset + 1) * fmt.data_bytes] = True
        at = page_size * fmt.data_bytes + offset * fmt.scale_bytes
        referenced[page, at : at + fmt.scale_bytes] = True
    for garbage in (torch.randint_like(cache, 0, 256), torch.full_like(cache, 0xFF)):
        args[2] = torch.where(referenced, cache, garbage)
        assert torch.equal(logits(*args), clean)


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_reference_reads_only_referenced_keys(name):
    assert_reads_only_referenced_keys(reference_cache_logits, name, "cpu")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_reads_only_referenced_keys(name, device):
    assert_reads_only_referenced_keys(triton_cache_logits, name, device)


def assert_nan_key_gives_nan_logits(logits, name, device):
    """A key stored from a NaN value scores NaN wherever a row sees it (as ``relu`` keeps NaN)."""
    args = list(logits_case(name, device=device))
    keys = make_keys(8, device)  # key 4 holds a NaN
    nan_slot = int(args[3][0, 0])
    reference_store(keys[4:5], args[2], torch.tensor([nan_slot], device=device), args[4], name)
    assert torch.equal(logits(*args).isnan(), args[3] == nan_slot)


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_reference_nan_key_gives_nan_logits(name):
    assert_nan_key_gives_nan_logits(reference_cache_logits, name, "cpu")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_nan_key_gives_nan_logits(name, device):
    assert_nan_key_gives_nan_logits(triton_cache_logits, name, device)


@not_interpreted
def test_interpreted_suite(request):
    """Run this file's Triton tests on CPU in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__, echo=("indexer cache logits triton",))


# --------------------------------------------------------------------------------------------
# The ops: errors, nothing written on a rejected call, compile
# --------------------------------------------------------------------------------------------


@not_interpreted
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda a: (a[0].double(), *a[1:]), "dsv4.indexer_store: keys must be float32 [*, 128], got float64"),
        (lambda a: (a[0][:, :64], *a[1:]), "keys must be float32 [*, 128], got float32 [23, 64]"),
        (lambda a: (a[0], a[1], a[2][:3], *a[3:]), "slots must be int32/int64 [23], got int64 [3]"),
        (lambda a: (a[0], a[1][:, :-12][:, :100], *a[2:]), "page_stride >= page_size*132=1056 (fp8)"),
        (lambda a: (a[0], a[1][:, :-2].contiguous(), *a[2:]), "a multiple of 4"),
        (lambda a: (a[0], a[1].view(torch.int8), *a[2:]), "a contiguous uint8 index cache"),
        (lambda a: (*a[:3], 0, a[4]), "page_size must be a positive int, got 0"),
        (lambda a: (*a[:4], "v4"), "index_format must be one of ['fp32', 'fp8', 'fp4'], got 'v4'"),
        (lambda a: (a[0], a[1], a[2] + 40, *a[3:]), "slots must be negative (skip) or a slot in [0, 32)"),
    ],
)
def test_store_bad_inputs_are_named_and_write_nothing(bad, message):
    keys, cache, slots, page_size = store_case("fp8")
    args = bad((keys, cache, slots, page_size, "fp8"))
    before = cache.clone()
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        d4.indexer_store(*args)
    assert torch.equal(cache, before)


@not_interpreted
@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("fp8", lambda a: (a[0].float(), *a[1:]), "q must be float8_e4m3fn [*, *, 128], got float32"),
        ("fp4", lambda a: (*a[:6], None), "q_scales must be a tensor uint8 [5, 6, 4], got None"),
        ("fp8", lambda a: (*a[:6], torch.zeros(5, 6, 4, dtype=torch.uint8)), "q_scales must be None with index_format 'fp8'"),
        ("fp32", lambda a: (a[0], a[1][:, :2], *a[2:]), "weights must be float32 [5, 6], got float32 [5, 2]"),
        ("fp4", lambda a: (a[0][..., :32], *a[1:]), "q must be uint8 [*, *, 64]"),
        ("fp8", lambda a: (*a[:3], a[3] + 32, *a[4:]), "block_slots must be -1 or a slot in [0, 32)"),
        ("fp32", lambda a: (a[0].transpose(1, 2).contiguous().transpose(1, 2), *a[1:]),
         "q must be last-dim contiguous (stride(2) == 1)"),
        ("fp4", lambda a: (*a[:6], a[6].transpose(1, 2).contiguous().transpose(1, 2)),
         "q_scales must be last-dim contiguous (stride(2) == 1)"),
    ],
)
def test_logits_bad_inputs_are_named(name, bad, message):
    args = bad(logits_case(name))
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        d4.indexer_cache_logits(*args)


@not_interpreted
def test_grad_is_refused():
    keys, cache, slots, page_size = store_case("fp8")
    with pytest.raises(RuntimeError, match=r"inference-only.*: keys requires grad"):
        d4.indexer_store(keys.requires_grad_(), cache, slots, page_size)


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_compiled_equals_eager(name):
    """``torch.compile(fullgraph=True, dynamic=True)`` of rotate + quantize + store + logits: the
    same cache bytes and logits as eager, the ops one call each."""
    from torch._inductor.utils import run_and_get_code

    def step(keys, cache, slots, q, weights, block_slots):
        if name != "fp32":
            keys, q = layout.hadamard(keys), layout.hadamard(q)
        torch.ops.dsv4.indexer_store(keys, cache, slots, 8, name)
        codes, scales = layout.quantize_index(q, name)
        if name == "fp8":
            weights, scales = weights * scales, None
        return torch.ops.dsv4.indexer_cache_logits(codes, weights, cache, block_slots, 8, name, scales)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for tokens in (3, 5):
        keys, cache, slots, _ = store_case(name, count=16)
        keys[4:6] = torch.randn(2, DIM)
        q, weights = torch.randn(tokens, 6, DIM), torch.randn(tokens, 6)
        block_slots = torch.where(slots >= 0, slots, -1)[torch.randint(0, 16, (tokens, 20))]
        eager_cache = cache.clone()
        want = step(keys, eager_cache, slots, q, weights, block_slots)
        got = compiled(keys, cache, slots, q, weights, block_slots)
        assert torch.equal(cache, eager_cache)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-4, rtol=1e-5)
    _, code = run_and_get_code(compiled, keys, cache, slots, q, weights, block_slots)
    code = "".join(code)
    assert code.count("torch.ops.dsv4.indexer_store.default(") == 1
    assert code.count("torch.ops.dsv4.indexer_cache_logits.default(") == 1


@pytest.mark.cuda
@pytest.mark.parametrize("name", FORMATS)
def test_cuda_graph_replay(name):
    args = list(logits_case(name, tokens=8, heads=64, width=256, device="cuda"))
    keys = torch.randn(4, DIM, device="cuda")
    slots = args[3][0, :4].clone()
    slots[slots < 0] = 0
    d4.indexer_store(keys, args[2], slots, args[4], name)
    expected = d4.indexer_cache_logits(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d4.indexer_store(keys, args[2], slots, args[4], name)
        out = d4.indexer_cache_logits(*args)
    keys.mul_(-3)
    graph.replay()
    assert torch.equal(out, d4.indexer_cache_logits(*args))
    assert not torch.equal(out, expected)


@pytest.mark.cuda
def test_cuda_checked_mode_rejects_bad_slot():
    args = list(logits_case("fp8", device="cuda"))
    args[3] = args[3].clone()
    args[3][1, 0] = layout.capacity(args[2], args[4])
    with d4.checked(), pytest.raises(ValueError, match="block_slots must be -1 or a slot"):
        d4.indexer_cache_logits(*args)
    assert dispatch.resolve("indexer_cache_logits", torch.device("cuda", torch.cuda.current_device()))[0] == "triton"
