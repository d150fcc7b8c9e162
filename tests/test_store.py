"""dsv4.fused_k_norm_rope_flashmla on the reference: bytes, layout and values against float64."""

import math

import pytest
import torch

import dsv4_compile as d4

from conftest import call
from float64_model import fp8_decode, store_token
from helpers import rope_table, store_inputs

STORE = torch.ops.dsv4.fused_k_norm_rope_flashmla.default


def expected_writes(page_size, stride, slot, data, scales):
    """``{flat byte offset: value}`` written for one token, by docs/design.md §2.2's offsets."""
    page, off = divmod(slot, page_size)
    base = page * stride
    writes = {base + off * 576 + i: b for i, b in enumerate(data)}
    writes.update({base + page_size * 576 + off * 8 + i: b for i, b in enumerate(scales)})
    return writes


def token_bytes(cache, page_size, slot):
    """``(data, scales)`` of the token at ``slot``, as lists of bytes, read at docs/design.md §2.2's
    offsets (as :func:`expected_writes`; not through ``layout.data_records``, whose offsets these
    tests check)."""
    page, off = divmod(slot, page_size)
    row, scales = cache[page], page_size * 576 + off * 8
    return row[off * 576 : off * 576 + 576].tolist(), row[scales : scales + 8].tolist()


def test_exact_bytes_on_representable_inputs():
    """x = 1 (so the norm is exactly 1, eps = 0) makes y = w exactly: every byte is predictable,
    including fp8 round-to-nearest-even ties and saturation-free exact tile maxima."""
    w = torch.zeros(512, dtype=torch.float64)
    codes = torch.randint(0, 0x7E, (448,))
    for t in range(7):
        tile = torch.tensor([fp8_decode(int(c)) for c in codes[t * 64 : (t + 1) * 64]], dtype=torch.float64)
        tile[0] = 448.0  # pins the scale to exactly 2**(t-3)
        tile[1:9] = torch.tensor([1.0625, 1.1875, 3.25, 0.015625 * 1.5, 2.5 * 2**-9, 13.0, 26.0, 208.0])  # ties
        tile *= torch.where(torch.rand(64) < 0.5, -1.0, 1.0)
        tile[0] = 448.0
        w[t * 64 : (t + 1) * 64] = tile * 2.0 ** (t - 3)
    w[448:] = torch.randn(64).to(torch.bfloat16).double()
    kv = torch.ones(2, 512, dtype=torch.bfloat16)
    freqs = torch.zeros(2, 64)
    freqs[0, 0::2] = 1.0  # position 0: cos 1, sin 0 -> identity
    freqs[1, 1::2] = 1.0  # position 1: cos 0, sin 1 -> (a, b) -> (-b, a)
    cache = d4.alloc_cache(2, 4)
    slots = torch.tensor([1, 6])
    call(STORE, kv, w.to(torch.bfloat16), freqs, torch.tensor([0, 1]), slots, cache, 0.0, 4)

    expected = torch.zeros(cache.numel(), dtype=torch.uint8)
    for t, slot in enumerate(slots.tolist()):
        data, scales, _ = store_token([1.0] * 512, w.tolist(), freqs[t].double().tolist(), 0.0)
        for k, v in expected_writes(4, cache.shape[1], slot, data, scales).items():
            expected[k] = v
    assert torch.equal(cache.view(-1), expected)


@pytest.mark.parametrize(
    "dtype,magnitude",
    # 1e20 (bf16) and 1.5e18 (fp32): sum(x^2) overflows fp32; the RMS must not
    [(torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.float32, 1.0), (torch.bfloat16, 1e20),
     (torch.float32, 1.5e18)],
)
def test_random_values_match_float64(dtype, magnitude):
    kv, w, freqs, pos = store_inputs(24, dtype)
    kv = (kv.double() / kv.double().abs().amax() * magnitude * 3).to(dtype)
    page_size = 8
    cache = d4.alloc_cache(4, page_size)
    slots = torch.randperm(32)[:24]
    call(STORE, kv, w, freqs, pos, slots, cache, 1e-6, page_size)
    fp8_mismatch = 0
    for t, slot in enumerate(slots.tolist()):
        data, scales, y = store_token(kv[t].double().tolist(), w.double().tolist(), freqs[pos[t]].double().tolist(), 1e-6)
        got_data, got_scales = token_bytes(cache, page_size, slot)
        assert got_scales == scales  # exponents and the zero pad byte
        for i in range(448):
            if got_data[i] != data[i]:  # only where the fp32 value sits on a rounding tie
                fp8_mismatch += 1
                step = 2.0 ** (scales[i // 64] - 127)
                assert abs(fp8_decode(got_data[i]) * step - y[i]) <= 0.0625 * abs(y[i]) + 2**-9 * step
        rope = torch.tensor(got_data[448:], dtype=torch.uint8).view(torch.bfloat16).double()
        torch.testing.assert_close(rope, torch.tensor(y[448:], dtype=torch.float64), atol=1e-6, rtol=2**-8)
    assert fp8_mismatch <= 2, fp8_mismatch


@pytest.mark.parametrize("page_size", [1, 2, 16, 61, 64, 128, 256])
@pytest.mark.parametrize("padded", [True, False])
def test_page_boundaries_touch_only_their_bytes(page_size, padded):
    stride = d4.page_bytes(page_size) if padded else page_size * 584
    cache = torch.randint(0, 256, (3, stride), dtype=torch.uint8)
    before = cache.clone()
    # last slot of page 0, first of page 1, last of the cache
    slots = torch.tensor(sorted({page_size - 1, page_size, 3 * page_size - 1}))
    kv, w, freqs, pos = store_inputs(len(slots))
    call(STORE, kv, w, freqs, pos, slots, cache, 1e-6, page_size)
    touched = set()
    for t, slot in enumerate(slots.tolist()):
        data, scales, _ = store_token(kv[t].double().tolist(), w.double().tolist(), freqs[pos[t]].double().tolist(), 1e-6)
        writes = expected_writes(page_size, stride, slot, data, scales)
        touched |= set(writes)
        flat = cache.view(-1)
        scale_offsets = sorted(writes)[-8:]
        assert [int(flat[k]) for k in scale_offsets] == scales  # incl. pad byte 0
    changed = (cache.view(-1) != before.view(-1)).nonzero().flatten().tolist()
    assert set(changed) <= touched
    mask = torch.ones(cache.numel(), dtype=torch.bool)
    mask[list(touched)] = False
    assert torch.equal(cache.view(-1)[mask], before.view(-1)[mask])


def test_negative_slots_write_nothing():
    cache = torch.randint(0, 256, (2, d4.page_bytes(4)), dtype=torch.uint8)
    before = cache.clone()
    kv, w, freqs, pos = store_inputs(3)
    call(STORE, kv, w, freqs, pos, torch.tensor([-1, -7, -1]), cache, 1e-6, 4)
    assert torch.equal(cache, before)


def test_negative_slots_skipped_among_valid():
    kv, w, freqs, pos = store_inputs(3)
    a, b = d4.alloc_cache(2, 4), d4.alloc_cache(2, 4)
    call(STORE, kv, w, freqs, pos, torch.tensor([5, -1, 2]), a, 1e-6, 4)
    call(STORE, kv[[0, 2]], w, freqs, pos[[0, 2]], torch.tensor([5, 2]), b, 1e-6, 4)
    assert torch.equal(a, b)


def test_empty_batch():
    cache = d4.alloc_cache(2, 4)
    kv, w, freqs, pos = store_inputs(0)
    call(STORE, kv, w, freqs, pos, torch.zeros(0, dtype=torch.int64), cache, 1e-6, 4)
    assert not cache.any()


@pytest.mark.parametrize("index_dtype,other", [(torch.int32, torch.int64), (torch.int64, torch.int32)])
def test_index_dtypes_agree(index_dtype, other):
    kv, w, freqs, pos = store_inputs(5)
    slots = torch.tensor([0, 3, 9, 4, 11])
    a, b = d4.alloc_cache(3, 4), d4.alloc_cache(3, 4)
    STORE(kv, w, freqs, pos.to(other), slots.to(other), a, 1e-6, 4)
    call(STORE, kv, w, freqs, pos.to(index_dtype), slots.to(index_dtype), b, 1e-6, 4)
    assert torch.equal(a, b) and a.any()


def test_strided_kv_rows():
    """kv is often a slice of a fused projection: row stride > 512, last dim contiguous."""
    kv, w, freqs, pos = store_inputs(4)
    fused = torch.randn(4, 1024).to(kv.dtype)
    fused[:, 256:768] = kv
    a, b = d4.alloc_cache(1, 4), d4.alloc_cache(1, 4)
    STORE(kv, w, freqs, pos, torch.arange(4), a, 1e-6, 4)
    call(STORE, fused[:, 256:768], w, freqs, pos, torch.arange(4), b, 1e-6, 4)
    assert torch.equal(a, b)


def test_wrapper_accepts_complex_freqs_cis():
    kv, w, _, pos = store_inputs(4, max_pos=64)
    angles = torch.rand(64, 32, dtype=torch.float64) * 6
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    real = torch.stack([freqs_cis.real, freqs_cis.imag], -1).flatten(-2)
    a, b = d4.alloc_cache(1, 4), d4.alloc_cache(1, 4)
    d4.fused_k_norm_rope_flashmla(kv, w, freqs_cis, pos, torch.arange(4), a, 1e-6, 4)
    d4.fused_k_norm_rope_flashmla(kv, w, real, pos, torch.arange(4), b, 1e-6, 4)
    assert torch.equal(a, b) and a.any()


def test_scale_floor_for_zero_tiles():
    """An all-zero tile uses the 1e-4 floor: exponent ceil(log2(1e-4 / 448)) = -22."""
    kv = torch.zeros(1, 512, dtype=torch.bfloat16)
    kv[0, 448:] = 1.0
    cache = d4.alloc_cache(1, 1)
    STORE(kv, torch.ones(512, dtype=torch.bfloat16), rope_table(1), torch.tensor([0]), torch.tensor([0]), cache, 1e-6, 1)
    floor_exponent = math.ceil(math.log2(1e-4 / 448))  # -22
    assert cache[0, 576:584].tolist() == [127 + floor_exponent] * 7 + [0]
    assert not cache[0, :448].any()


NAN_TOKEN = [0x7F] * 448 + [0xC0, 0x7F] * 64, [0xFF] * 7 + [0]  # docs/design.md §2.1


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "weight-inf", "overflow"])
def test_non_finite_tokens_are_stored_as_nan_tokens(bad):
    """A token whose normed, rotated values are not all finite is the NaN token (fp8 0x7F, bf16
    NaN, UE8M0 0xFF); the other tokens of the call are stored as usual: their scales are the
    float64 model's, and their bytes those of the same call with the bad tokens skipped."""
    kv, w, freqs, pos = store_inputs(3, torch.float32)
    if bad == "weight-inf":
        w[5] = math.inf
        rows = [0, 1, 2]
    else:
        kv[1, 7] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "overflow": 3e38}[bad]
        if bad == "overflow":  # finite, but y = x / rms * w overflows fp32 in that dim
            kv[:, 7] = 0.0  # the other tokens: 0 * 3e38 = 0
            kv[1] = 1e-30
            kv[1, 7] = 1.0
            w[7] = 3e38
        rows = [1]
    cache, clean = d4.alloc_cache(2, 4), d4.alloc_cache(2, 4)
    call(STORE, kv, w, freqs, pos, torch.tensor([2, 5, 6]), cache, 1e-6, 4)
    # the same call with the bad tokens skipped: what the others' bytes must be
    skipped = torch.tensor([-1 if t in rows else slot for t, slot in enumerate([2, 5, 6])])
    call(STORE, kv, w, freqs, pos, skipped, clean, 1e-6, 4)
    for t, slot in enumerate([2, 5, 6]):
        data, scales = token_bytes(cache, 4, slot)
        if t in rows:
            assert (data, scales) == NAN_TOKEN
            assert d4.gather_dequant(cache, 4, torch.tensor([slot])).isnan().all()
        else:
            _, want_scales, _ = store_token(
                kv[t].double().tolist(), w.double().tolist(), freqs[pos[t]].double().tolist(), 1e-6)
            assert scales == want_scales and data != NAN_TOKEN[0]
            assert (data, scales) == token_bytes(clean, 4, slot)
