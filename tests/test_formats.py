"""The DSV4.1 cache formats (docs/design.md §2.5) on the reference: geometry, the stores' bytes
against an independent bit-level model (tests/float64_v41.py), decode and prefill over every format
against a float64 computation, bad inputs, opcheck."""

from __future__ import annotations

import math
import re

import pytest
import torch

import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.tolerances import REFERENCE

import float64_v41 as model
from conftest import call
from float64_model import attend
from helpers import GARBAGE_BYTES, decode_args_around_garbage, poisoned_decode_args, rope_table

STORE = torch.ops.dsv4.fused_k_norm_rope_flashmla.default
PLAIN = torch.ops.dsv4.quantize_store.default
DECODE = torch.ops.dsv4.flash_mla_with_kvcache.default
V41 = ["v4.1-fp8", "v4.1-fp8-interleaved", "v4.1-fp4", "v4.1-fp4-interleaved"]


def spec(kv_format: str) -> tuple[str, str]:
    """The model's (format, arrangement) of one of ours."""
    return ("fp4" if "fp4" in kv_format else "fp8"), ("interleaved" if "interleaved" in kv_format else "block")


def token_bytes(kv_format: str, values: list[float]) -> tuple[list[int], list[int]]:
    return (model.v41_fp4_token if spec(kv_format)[0] == "fp4" else model.v41_fp8_token)(values)


def decoded_token(kv_format, data, scales) -> list[float]:
    decode = model.v41_fp4_decode_token if spec(kv_format)[0] == "fp4" else model.v41_fp8_decode_token
    return decode(data, scales)


# --------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_format", V41)
def test_page_geometry_matches_the_model(kv_format):
    fmt = layout.FORMATS[kv_format]
    for page_size in (1, 2, 3, 61, 64, 128, 256):
        assert d4.page_bytes(page_size, kv_format) == model.canonical_page_stride(*spec(kv_format), page_size)
        for offset in (0, page_size // 2, page_size - 1):
            assert (fmt.data_offset(page_size, offset), fmt.scale_offset(page_size, offset)) == \
                model.record_offsets(*spec(kv_format), page_size, offset)


def test_token_sizes_and_memory():
    """Bytes per token: 584 (V4), 528 (V4.1 FP8), 288 (V4.1 FP4)."""
    sizes = {name: fmt.token_bytes for name, fmt in layout.FORMATS.items()}
    assert sizes == {"v4": 584, "v4.1-fp8": 528, "v4.1-fp8-interleaved": 528, "v4.1-fp4": 288,
                     "v4.1-fp4-interleaved": 288}


# --------------------------------------------------------------------------------------------
# The plain store: byte-exact against the model
# --------------------------------------------------------------------------------------------


def hard_values(fp4: bool) -> torch.Tensor:
    """Tokens [8, 512] of fp32 values built to hit every rounding corner of a format: exact ties of
    the element codes, the scale floors (all-zero groups, tiny groups), amax on and just off a power
    of two, negatives that round to zero (FP4), saturation at 6 after a scale rounded down (FP4)."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(512, generator=g) * 10.0 ** torch.randint(-6, 6, (512,), generator=g).float()]
    group = 16 if fp4 else 32
    tie_row = torch.zeros(512)
    for start in range(0, 512, group):
        k = start // group
        if fp4:  # scale s = amax/6 exact (amax = 6 * 2^j): elements at code midpoints times s
            s = 2.0 ** (k % 8 - 4)
            mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.1, -5.0, 0.75, 2.5, 5.0, 3.5, 1.25])
            tie_row[start] = 6 * s
            tie_row[start + 1 : start + group] = mids[: group - 1] * s
        else:  # amax = 448 * 2^j: scale exactly 2^j; the others exact midpoints of adjacent e4m3 codes
            s = 2.0 ** (k % 9 - 4)
            grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            mids = (grid[1:] + grid[:-1]) / 2  # 126 ties, both parities of the lower code
            pick = mids[(torch.arange(group - 1) * 4 + k) % mids.numel()]
            tie_row[start] = 448 * s
            tie_row[start + 1 : start + group] = pick * s * torch.where(torch.arange(group - 1) % 3 == 0, -1.0, 1.0)
    rows.append(tie_row)
    rows.append(torch.zeros(512))  # every group at the floor
    rows.append(torch.full((512,), 3e-7) * torch.where(torch.rand(512, generator=g) < 0.5, -1.0, 1.0))
    off_power = torch.randn(512, generator=g)
    off_power[::group] = (448.0 if not fp4 else 6.0) * 2.0**3
    off_power[1::group] = torch.tensor(448.0 * 8 if not fp4 else 6.0 * 8).nextafter(torch.tensor(1e9))
    rows.append(off_power)
    rows.append(-torch.rand(512, generator=g) * 1e-3)  # small negatives (FP4: many round to -0)
    rows.append(torch.randn(512, generator=g).to(torch.bfloat16).float() * 100)
    sat = torch.randn(512, generator=g)
    sat[::group] = 0.1  # FP4: amax/6 = 0.01666: subnormal e4m3 scale rounds down, x/s > 6 saturates
    rows.append(sat)
    return torch.stack(rows)


@pytest.mark.parametrize("kv_format", V41)
def test_plain_store_bytes_equal_the_model(kv_format):
    fp4 = spec(kv_format)[0] == "fp4"
    values = hard_values(fp4)
    page_size = 3
    cache = d4.alloc_cache(4, page_size, kv_format=kv_format)
    slots = torch.tensor([0, 4, 11, 5, 7, 2, 9, 10])
    call(PLAIN, values, slots, cache, page_size, kv_format)
    expected = torch.zeros_like(cache)
    for t, slot in enumerate(slots.tolist()):
        model.write_token(expected, *spec(kv_format), page_size, slot, *token_bytes(kv_format, values[t].tolist()))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("kv_format", V41)
def test_dequantization_equals_the_model(kv_format):
    values = hard_values(spec(kv_format)[0] == "fp4")
    cache = d4.alloc_cache(3, 4, kv_format=kv_format)
    slots = torch.arange(8) + 2
    d4.quantize_store(values, slots, cache, 4, kv_format)
    got = d4.gather_dequant(cache, 4, slots, torch.float32, kv_format)
    want = torch.tensor([decoded_token(kv_format, *model.read_token(cache, *spec(kv_format), 4, s))
                         for s in slots.tolist()])
    assert torch.equal(got, want.float())
    assert torch.equal(d4.gather_dequant(cache, 4, slots, torch.bfloat16, kv_format).float(), got)  # exact in bf16


@pytest.mark.parametrize("kv_format", V41)
def test_non_finite_tokens_are_nan_tokens(kv_format):
    values = torch.randn(3, 512)
    values[1, 100] = math.nan
    values[2, 511] = -math.inf
    cache = d4.alloc_cache(1, 4, kv_format=kv_format)
    d4.quantize_store(values, torch.tensor([0, 1, 2]), cache, 4, kv_format)
    fmt = layout.FORMATS[kv_format]
    for slot in (1, 2):
        data, scales = model.read_token(cache, *spec(kv_format), 4, slot)
        assert (tuple(data), tuple(scales)) == (fmt.nan_data, fmt.nan_scales)
        assert d4.gather_dequant(cache, 4, torch.tensor([slot]), torch.float32, kv_format).isnan().all()
    assert d4.gather_dequant(cache, 4, torch.tensor([0]), torch.float32, kv_format).isfinite().all()


def test_v4_plain_store_bytes():
    """V4 plain store (no norm, no RoPE): dims 0..447 in tiles of 64 with the V4 scale rule, dims
    448..511 as bf16, by the float64 model's codec."""
    from float64_model import bf16_bytes, fp8_encode

    values = hard_values(False)[:, :512]
    cache = d4.alloc_cache(2, 4)
    slots = torch.tensor([0, 5, 2, 7, 1, 3, 6, 4])
    d4.quantize_store(values, slots, cache, 4)
    for t, slot in enumerate(slots.tolist()):
        v = values[t].double().tolist()
        data, scales = [], []
        for tile in range(7):
            chunk = v[tile * 64 : (tile + 1) * 64]
            scale = max(1e-4, max(abs(x) for x in chunk)) / 448  # fp32 rounding: checked for ties below
            m, e = math.frexp(float(torch.tensor(scale, dtype=torch.float32)))
            e = e - 1 if m == 0.5 else e
            data += [fp8_encode(x / 2.0**e) for x in chunk]
            scales.append(e + 127)
        for x in v[448:]:
            data += bf16_bytes(x)
        page, off = divmod(slot, 4)
        assert cache[page, off * 576 : off * 576 + 576].tolist() == data
        assert cache[page, 4 * 576 + off * 8 : 4 * 576 + off * 8 + 8].tolist() == scales + [0]


# --------------------------------------------------------------------------------------------
# The fused K store
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_format", V41)
def test_fused_store_bytes_on_exact_inputs(kv_format):
    """x = +-1 (rms exactly 1, eps = 0): y = bf16(w) exactly, and RoPE with cos/sin in {0, 1} is
    exact, so every byte is determined by the model."""
    fp4 = spec(kv_format)[0] == "fp4"
    w = hard_values(fp4)[1].to(torch.bfloat16)
    x = torch.ones(2, 512, dtype=torch.bfloat16)
    x[1, 1::3] = -1.0
    freqs = torch.zeros(2, 64)
    freqs[0, 0::2] = 1.0  # identity
    freqs[1, 1::2] = 1.0  # (a, b) -> (-b, a)
    cache = d4.alloc_cache(2, 2, kv_format=kv_format)
    slots = torch.tensor([3, 0])
    call(STORE, x, w, freqs, torch.tensor([0, 1]), slots, cache, 0.0, 2, kv_format)
    expected = torch.zeros_like(cache)
    for t, slot in enumerate(slots.tolist()):
        data, scales, _ = model.v41_fused_k_token(x[t].double().tolist(), w.double().tolist(),
                                                  freqs[t].double().tolist(), 0.0, fp4=fp4)
        model.write_token(expected, *spec(kv_format), 2, slot, data, scales)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("kv_format", V41)
def test_fused_store_values_on_random_inputs(kv_format):
    """Random inputs: the stored values decode to the model's quantization of its bf16 values
    (the fp32 norm may move a bf16 rounding by one step: a few elements, each within one code)."""
    fp4 = spec(kv_format)[0] == "fp4"
    x = (torch.randn(6, 512) * 3).to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(512)).to(torch.bfloat16)
    freqs = rope_table(64)
    pos = torch.randint(0, 64, (6,))
    cache = d4.alloc_cache(3, 2, kv_format=kv_format)
    slots = torch.tensor([0, 1, 2, 3, 4, 5])
    call(STORE, x, w, freqs, pos, slots, cache, 1e-6, 2, kv_format)
    got = d4.gather_dequant(cache, 2, slots, torch.float64, kv_format)
    mismatched = 0
    for t in range(6):
        data, scales, y = model.v41_fused_k_token(x[t].double().tolist(), w.double().tolist(),
                                                  freqs[pos[t]].double().tolist(), 1e-6, fp4=fp4)
        want = torch.tensor(decoded_token(kv_format, data, scales), dtype=torch.float64)
        step = torch.tensor(y, dtype=torch.float64).abs().max() * (2.0**-2 if fp4 else 2.0**-4)
        assert (got[t] - want).abs().max() <= step
        mismatched += int((got[t] != want).sum())
    assert mismatched <= 6 * 512 // 64, mismatched


# --------------------------------------------------------------------------------------------
# Decode and prefill over every format
# --------------------------------------------------------------------------------------------

PAIRS = [("v4.1-fp8", None), ("v4.1-fp8", "v4.1-fp4"), ("v4.1-fp8-interleaved", "v4.1-fp4-interleaved"),
         ("v4.1-fp8-interleaved", "v4.1-fp8"), ("v4.1-fp8", "v4.1-fp4-interleaved")]


def filled(kv_format, num_pages, page_size):
    """A cache of ``kv_format`` with every slot a random token, and its values decoded by the model."""
    cap = num_pages * page_size
    cache = d4.alloc_cache(num_pages, page_size, kv_format=kv_format)
    d4.quantize_store(torch.randn(cap, 512) * 2, torch.arange(cap), cache, page_size, kv_format)
    table = torch.tensor([decoded_token(kv_format, *model.read_token(cache, *spec(kv_format), page_size, s))
                          for s in range(cap)], dtype=torch.float64)
    return cache, table


@pytest.mark.parametrize("kv_format,extra_format", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_decode_matches_float64(kv_format, extra_format):
    batch, s_q, heads, page_size, extra_page = 3, 2, 8, 5, 2
    cache, table = filled(kv_format, 4, page_size)
    extra_fmt = extra_format or kv_format
    extra, extra_table = filled(extra_fmt, 5, extra_page)
    idx = torch.randint(-1, 4 * page_size, (batch, s_q, 9), dtype=torch.int32)
    eidx = torch.randint(-1, 5 * extra_page, (batch, s_q, 4), dtype=torch.int32)
    lengths, elen = torch.tensor([9, 3, 0], dtype=torch.int32), torch.tensor([4, 0, 2], dtype=torch.int32)
    q = torch.randn(batch, s_q, heads, 512, dtype=torch.bfloat16)
    sink = torch.randn(heads)
    out, lse = call(DECODE, q, cache, page_size, idx, lengths, sink, extra, extra_page, eidx, elen, None, None,
                    0.05, 512, kv_format, extra_format)
    vmax = max(table.abs().max().item(), extra_table.abs().max().item())
    for b in range(batch):
        for s in range(s_q):
            keys = [table[int(i)] for i in idx[b, s, : lengths[b]] if i >= 0]
            keys += [extra_table[int(i)] for i in eidx[b, s, : elen[b]] if i >= 0]
            keys = torch.stack(keys) if keys else torch.zeros(0, 512, dtype=torch.float64)
            want_out, want_lse, _ = attend(q[b, s].double(), keys, 0.05, sink)
            torch.testing.assert_close(out[b, s].double(), want_out, atol=REFERENCE["out"].atol * vmax,
                                       rtol=REFERENCE["out"].rtol)
            torch.testing.assert_close(lse[b, :, s].double(), want_lse, atol=REFERENCE["lse"].atol,
                                       rtol=REFERENCE["lse"].rtol)


@pytest.mark.parametrize("byte", GARBAGE_BYTES, ids=hex)
@pytest.mark.parametrize("kv_format,extra_format", PAIRS[1:3], ids=[f"{a}+{b}" for a, b in PAIRS[1:3]])
def test_decode_reads_nothing_its_row_does_not_reference(kv_format, extra_format, byte):
    args = decode_args_around_garbage(kv_format=kv_format, extra_format=extra_format)
    clean = call(DECODE, *args)
    dirty = call(DECODE, *poisoned_decode_args(args, byte))
    assert clean[0].isfinite().all()
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


@pytest.mark.parametrize("kv_format", V41)
def test_prefill_workspace_of_every_format(kv_format):
    cache, table = filled(kv_format, 3, 4)
    slots = torch.tensor([5, -1, 0, 11])
    ws = d4.dequant_workspace(cache, 4, slots, kv_format)
    assert ws.dtype == torch.bfloat16 and ws.shape == (4, 1, 512)
    assert torch.equal(ws[:, 0].double(), torch.stack([table[5], torch.zeros(512, dtype=torch.float64),
                                                       table[0], table[11]]))
    q = torch.randn(2, 8, 512, dtype=torch.bfloat16)
    out, _, _ = d4.flash_mla_sparse_fwd(q, ws, torch.tensor([[[0, 1, 3]], [[2, -1, 1]]], dtype=torch.int32), 0.05)
    keys = torch.stack([table[5], torch.zeros(512, dtype=torch.float64), table[11]])  # row 1: the hole's zeros
    want, _, _ = attend(q[0].double(), keys, 0.05, None)
    torch.testing.assert_close(out[0].double(), want, atol=REFERENCE["out"].atol * table.abs().max().item(),
                               rtol=REFERENCE["out"].rtol)


# --------------------------------------------------------------------------------------------
# Bad inputs and opcheck
# --------------------------------------------------------------------------------------------


def decode_call(**over):
    cache = d4.alloc_cache(2, 4, kv_format="v4.1-fp8")
    extra = d4.alloc_cache(2, 2, kv_format="v4.1-fp4")
    args = dict(q=torch.randn(2, 1, 8, 512, dtype=torch.bfloat16), k_cache=cache, page_size=4,
                indices=torch.zeros(2, 1, 3, dtype=torch.int32), topk_length=None, attn_sink=None,
                extra_k_cache=extra, extra_page_size=2, extra_indices=torch.zeros(2, 1, 2, dtype=torch.int32),
                extra_topk_length=None, tile_scheduler_metadata=None, num_splits=None, softmax_scale=0.1,
                head_dim_v=512, kv_format="v4.1-fp8", extra_kv_format="v4.1-fp4")
    args.update(over)
    return args


def raw_cache(pages, stride):
    return lambda: torch.zeros(pages, stride, dtype=torch.uint8)


BAD = [  # (op, overrides (callables build tensors in the test), argument named)
    ("decode", dict(kv_format="v4.1-fp4", k_cache=raw_cache(2, 4 * 288)), "kv_format"),
    ("decode", dict(kv_format="fp8"), "kv_format"),
    ("decode", dict(extra_kv_format="v4"), "extra_kv_format"),
    ("decode", dict(k_cache=raw_cache(2, 4 * 527)), "k_cache"),
    ("decode", dict(extra_k_cache=raw_cache(2, 2 * 287)), "extra_k_cache"),
    ("decode", dict(page_size=5), "k_cache"),  # 5 tokens of 528 bytes do not fit a 4-token page
    ("decode", dict(extra_k_cache=None, extra_indices=None), "extra_kv_format"),
    ("store", dict(kv_format="v4.2"), "kv_format"),
    ("store", dict(kvcache=raw_cache(2, 4 * 288)), "kvcache"),  # an FP4-sized cache for FP8 tokens
    ("plain", dict(kvcache=raw_cache(2, 4 * 287)), "kvcache"),
]


@pytest.mark.parametrize("op,over,arg", BAD, ids=[f"{b[0]}-{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_inputs_name_the_argument_and_write_nothing(op, over, arg):
    over = {k: v() if callable(v) else v for k, v in over.items()}
    if op == "decode":
        fn, args = DECODE, decode_call(**over)
        caches = [args["k_cache"]]
    else:
        cache = d4.alloc_cache(2, 4, kv_format="v4.1-fp8")
        kv = torch.randn(3, 512, dtype=torch.bfloat16)
        if op == "store":
            args = dict(kv=kv, kv_weight=torch.ones(512, dtype=torch.bfloat16), freqs=rope_table(8),
                        positions=torch.zeros(3, dtype=torch.int64), out_loc=torch.arange(3), kvcache=cache,
                        eps=1e-6, page_size=4, kv_format="v4.1-fp8")
            fn = STORE
        else:
            args = dict(kv=kv, out_loc=torch.arange(3), kvcache=cache, page_size=4, kv_format="v4.1-fp8")
            fn = PLAIN
        args.update(over)
        caches = [args["kvcache"]]
    before = [c.clone() for c in caches]
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args.values())
    assert re.search(rf"^dsv4\.\w+: {re.escape(arg)} must be .*, got ", str(info.value)), str(info.value)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


def test_unknown_format_in_the_layout_helpers():
    with pytest.raises(ValueError, match="kv_format must be one of"):
        d4.alloc_cache(1, 4, kv_format="v5")
    with pytest.raises(ValueError, match="kv_format must be one of"):
        d4.flashmla_view(d4.alloc_cache(1, 4), 4, "V41")


@pytest.mark.parametrize("kv_format", V41)
def test_opcheck_stores(kv_format):
    cache = d4.alloc_cache(2, 3, kv_format=kv_format)
    kv = torch.randn(4, 512, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5, -1, 2])
    torch.library.opcheck(PLAIN, (kv, slots, cache, 3, kv_format))
    torch.library.opcheck(STORE, (kv, torch.ones(512, dtype=torch.bfloat16), rope_table(8),
                                  torch.tensor([0, 1, 2, 3]), slots, cache, 1e-6, 3, kv_format))


@pytest.mark.parametrize("kv_format,extra_format", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_opcheck_decode(kv_format, extra_format):
    cache, _ = filled(kv_format, 2, 4)
    extra, _ = filled(extra_format or kv_format, 2, 2)
    args = (torch.randn(2, 1, 64, 512, dtype=torch.bfloat16), cache, 4,
            torch.randint(-1, 8, (2, 1, 6), dtype=torch.int32), torch.tensor([6, 2], dtype=torch.int32),
            torch.randn(64), extra, 2, torch.randint(-1, 4, (2, 1, 3), dtype=torch.int32), None, None, None,
            0.05, 512, kv_format, extra_format)
    torch.library.opcheck(DECODE, args)
