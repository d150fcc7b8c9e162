"""torch.library.opcheck (schema, fake, aot-dispatch dynamic, autograd registration) for every op.

Cases are listed at collection as ids and parameters; their tensors are built inside each test
(seeded per test by conftest), so collecting builds nothing.
"""

import itertools

import pytest
import torch

import dsv4_compile as d4

from helpers import filled_cache, random_indices, sink, store_inputs

DECODE_CASES = {
    f"H{heads}-sq{s_q}-extra{int(extra)}-sink{sink_kind}-len{int(lengths)}": (heads, s_q, extra, sink_kind, lengths)
    for heads, s_q, extra, sink_kind, lengths in itertools.product(
        (64, 128), (1, 2), (False, True), ("random", "+inf", "-inf", "none"), (False, True)
    )
}

PREFILL_CASES = {
    f"H{heads}-sink{sink_kind}-len{int(lengths)}": (heads, sink_kind, lengths)
    for heads, sink_kind, lengths in itertools.product((64, 128), ("random", "+inf", "none"), (False, True))
}
PREFILL_CASES.update({f"H{heads}-d576": (heads, "random", True, 576) for heads in (64, 128)})

STORE_CASES = {
    f"P{p}-pad{int(padded)}-{dtype}-{index_dtype}": (p, padded, dtype, index_dtype)
    for p, padded, dtype, index_dtype in [
        (1, True, torch.bfloat16, torch.int64), (2, True, torch.bfloat16, torch.int32),
        (16, False, torch.float16, torch.int64), (61, True, torch.float32, torch.int32),
        (64, False, torch.bfloat16, torch.int64), (128, True, torch.bfloat16, torch.int32),
        (256, True, torch.bfloat16, torch.int64), (256, False, torch.float32, torch.int64),
    ]
}
STORE_CASES["empty"] = None

METADATA_CASES = ["plain", "extra"]

#: (tokens, heads, dim, width, slot dtype): DSV4's 64 x 128, odd sizes, no tokens, no columns
INDEXER_CASES = {
    f"T{t}-H{h}-D{d}-M{m}-{str(dtype).removeprefix('torch.')}": (t, h, d, m, dtype)
    for t, h, d, m, dtype in [
        (3, 64, 128, 40, torch.int64), (5, 3, 20, 7, torch.int32), (0, 4, 16, 8, torch.int64),
        (2, 4, 16, 0, torch.int64),
    ]
}


def decode_sample(heads, s_q, extra, sink_kind, lengths):
    batch, page_size = 2, 16
    cache, _ = filled_cache(2, page_size, num_tokens=20)
    idx = random_indices((batch, s_q, 8), 32)
    ln = torch.tensor([8, 3], dtype=torch.int32) if lengths else None
    ecache, eidx, eln = None, None, None
    if extra:
        ecache, _ = filled_cache(2, 2)
        eidx = random_indices((batch, s_q, 4), 4)
        eln = torch.tensor([0, 4], dtype=torch.int32) if lengths else None
    q = torch.randn(batch, s_q, heads, 512, dtype=torch.bfloat16)
    return (q, cache, page_size, idx, ln, sink(sink_kind, heads), ecache, 2, eidx, eln, None, None, 0.04, 512)


def prefill_sample(heads, sink_kind, lengths, d_qk=512):
    s_q, s_kv = 5, 12
    q = torch.randn(s_q, heads, d_qk, dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, d_qk, dtype=torch.bfloat16)
    idx = torch.randint(-2, s_kv + 3, (s_q, 1, 8), dtype=torch.int32)  # -1/-2 and >= s_kv included
    ln = torch.randint(0, 9, (s_q,), dtype=torch.int32) if lengths else None
    return (q, kv, idx, 0.05, 512, sink(sink_kind, heads), ln)


def store_sample(case):
    if case is None:  # no tokens
        return (*store_inputs(0, max_pos=8), torch.zeros(0, dtype=torch.int64), d4.alloc_cache(1, 4), 1e-6, 4)
    page_size, padded, dtype, index_dtype = case
    stride = d4.page_bytes(page_size) if padded else page_size * 584
    cache = d4.alloc_cache(2, page_size, page_stride=stride)
    kv, w, freqs, pos = store_inputs(6, dtype, index_dtype, max_pos=64)
    slots = torch.tensor([0, page_size - 1, -1, 2 * page_size - 1, -1, page_size], dtype=index_dtype)
    return (kv, w, freqs, pos, slots, cache, 1e-6, page_size)


def metadata_sample(case):
    q = torch.randn(3, 1, 64, 512, dtype=torch.bfloat16)
    idx = random_indices((3, 1, 8), 32)
    if case == "plain":
        return (q, idx, None, None, None)
    return (q, idx, torch.tensor([1, 2, 3], dtype=torch.int32), random_indices((3, 1, 4), 8),
            torch.tensor([0, 4, 4], dtype=torch.int32))


def indexer_sample(tokens, heads, dim, width, dtype):
    num_slots = 9
    slots = torch.randint(-1, num_slots, (tokens, width), dtype=dtype)  # -1: not visible
    return (torch.randn(tokens, heads, dim), torch.randn(tokens, heads), torch.randn(num_slots, dim), slots)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode(case):
    torch.library.opcheck(torch.ops.dsv4.flash_mla_with_kvcache.default, decode_sample(*DECODE_CASES[case]))


@pytest.mark.parametrize("op", ["decode", "prefill", "indexer_logits", "indexer_cache_logits", "indexer_cache_topk"])
def test_batch_invariant_calls(op):
    """The ops that take ``batch_invariant``, called with it (the mode's kernels, one row at a
    time on CPU)."""
    overload, args = {
        "decode": (torch.ops.dsv4.flash_mla_with_kvcache.default, (*decode_sample(64, 2, True, "random", True), "v4", None)),
        "prefill": (torch.ops.dsv4.flash_mla_sparse_fwd.default, prefill_sample(64, "random", True)),
        "indexer_logits": (torch.ops.dsv4.indexer_logits.default, indexer_sample(3, 64, 128, 40, torch.int64)),
        "indexer_cache_logits": (torch.ops.dsv4.indexer_cache_logits.default,
                                 index_cache_sample("fp4", 3, 5, 9, torch.int64)[1]),
        "indexer_cache_topk": (torch.ops.dsv4.indexer_cache_topk.default,
                               cache_topk_sample("fp4", 3, 5, 2, 4, torch.int64)),
    }[op]
    torch.library.opcheck(overload, (*args, True))


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill(case):
    torch.library.opcheck(torch.ops.dsv4.flash_mla_sparse_fwd.default, prefill_sample(*PREFILL_CASES[case]))


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_store(case):
    torch.library.opcheck(torch.ops.dsv4.fused_k_norm_rope_flashmla.default, store_sample(STORE_CASES[case]))


@pytest.mark.parametrize("case", METADATA_CASES)
def test_metadata(case):
    torch.library.opcheck(torch.ops.dsv4.get_mla_metadata.default, metadata_sample(case))


#: (batch, [(topk, lengths given, extra_topk, extra lengths given)]): the model's three layer
#: kinds; one schedule; none; no request
METADATA_STACKED_CASES = {
    "kinds": (3, [(128, True, 0, False), (128, True, 512, True), (128, True, 32, True)]),
    "one-no-lengths": (2, [(64, False, 64, False)]),
    "none": (3, []),
    "empty-batch": (0, [(128, True, 64, True)]),
}


@pytest.mark.parametrize("case", list(METADATA_STACKED_CASES))
def test_metadata_stacked(case):
    batch, entries = METADATA_STACKED_CASES[case]
    q = torch.randn(batch, 1, 64, 512, dtype=torch.bfloat16)
    lengths = torch.arange(batch, dtype=torch.int32)
    args = (q, [e[0] for e in entries], [lengths if e[1] else None for e in entries],
            [e[2] for e in entries], [lengths if e[3] else None for e in entries])
    torch.library.opcheck(torch.ops.dsv4.get_mla_metadata_stacked.default, args)


@pytest.mark.parametrize("case", list(INDEXER_CASES))
def test_indexer_logits(case):
    torch.library.opcheck(torch.ops.dsv4.indexer_logits.default, indexer_sample(*INDEXER_CASES[case]))


#: (format, keys / query rows, heads, width, int dtype): each format; no key and no row; no column
INDEX_CACHE_CASES = {
    f"{name}-N{n}-H{h}-M{m}-{str(dtype).removeprefix('torch.')}": (name, n, h, m, dtype)
    for name, n, h, m, dtype in [
        ("fp32", 5, 4, 12, torch.int64), ("fp8", 7, 64, 40, torch.int32), ("fp4", 3, 5, 9, torch.int64),
        ("fp8", 0, 4, 6, torch.int64), ("fp4", 2, 4, 0, torch.int32),
    ]
}


def index_cache_sample(name, count, heads, width, dtype):
    """Store and logits arguments: keys at distinct slots (a skipped one) of a cache whose every
    slot holds a key, queries quantized."""
    page_size = 8
    cache = d4.layout.alloc_index_cache(3, page_size, name)
    d4.indexer_store(torch.randn(3 * page_size, 128), cache, torch.arange(3 * page_size), page_size, name)
    slots = torch.randperm(3 * page_size)[:count].to(dtype)
    if count:
        slots[0] = -1
    codes, scales = d4.layout.quantize_index(torch.randn(count, heads, 128), name)
    weights = torch.randn(count, heads)
    if name == "fp8":
        weights, scales = weights * scales, None
    block_slots = torch.randint(-1, 3 * page_size, (count, width), dtype=dtype)
    store = (torch.randn(count, 128), cache, slots, page_size, name)
    return store, (codes, weights, cache, block_slots, page_size, name, scales)


@pytest.mark.parametrize("case", list(INDEX_CACHE_CASES))
def test_indexer_store(case):
    torch.library.opcheck(torch.ops.dsv4.indexer_store.default, index_cache_sample(*INDEX_CACHE_CASES[case])[0])


@pytest.mark.parametrize("case", list(INDEX_CACHE_CASES))
def test_indexer_cache_logits(case):
    args = index_cache_sample(*INDEX_CACHE_CASES[case])[1]
    # opcheck's schema test compares the inputs before and after with torch.allclose, which has no
    # float8 kernel on CPU: the fp8 cases skip it (the fp32 and fp4 cases run it on this op)
    utils = [u for u in torch.library._OPCHECK_DEFAULT_UTILS if not (u == "test_schema" and args[5] == "fp8")]
    torch.library.opcheck(torch.ops.dsv4.indexer_cache_logits.default, args, test_utils=utils)


#: (format, query rows, heads, block-table pages, k, int dtype): each format; k past the widest
#: visible row; no row; k = 0
CACHE_TOPK_CASES = {
    f"{name}-T{t}-H{h}-P{p}-k{k}-{str(dtype).removeprefix('torch.')}": (name, t, h, p, k, dtype)
    for name, t, h, p, k, dtype in [
        ("fp32", 5, 4, 2, 6, torch.int64), ("fp8", 7, 64, 3, 10, torch.int32), ("fp4", 3, 5, 2, 16, torch.int64),
        ("fp8", 0, 4, 2, 4, torch.int64), ("fp4", 2, 4, 1, 0, torch.int32),
    ]
}


def cache_topk_sample(name, tokens, heads, pages, k, dtype):
    """``indexer_cache_topk`` arguments over :func:`index_cache_sample`'s cache: two requests'
    pages, queries on either seeing up to every block of their request."""
    page_size = 8
    (_, cache, _, _, _), (codes, weights, _, _, _, _, scales) = index_cache_sample(name, tokens, heads, 0, dtype)
    block_table = torch.stack([torch.randperm(3)[:pages], torch.randperm(3)[:pages]]).to(dtype)
    rows = torch.randint(0, 2, (tokens,), dtype=dtype)
    lengths = torch.randint(0, pages * page_size + 1, (tokens,), dtype=dtype)
    return codes, weights, cache, block_table, rows, lengths, page_size, k, name, scales


@pytest.mark.parametrize("case", list(CACHE_TOPK_CASES))
def test_indexer_cache_topk(case):
    args = cache_topk_sample(*CACHE_TOPK_CASES[case])
    utils = [u for u in torch.library._OPCHECK_DEFAULT_UTILS if not (u == "test_schema" and args[8] == "fp8")]
    torch.library.opcheck(torch.ops.dsv4.indexer_cache_topk.default, args, test_utils=utils)


#: (rows, width, k): DSV4's selection; k = width; empty rows; k = 0
TOPK_CASES = {f"T{t}-M{m}-k{k}": (t, m, k) for t, m, k in [(3, 1024, 512), (4, 37, 37), (0, 8, 3), (2, 8, 0)]}


@pytest.mark.parametrize("case", list(TOPK_CASES))
def test_indexer_topk(case):
    rows, width, k = TOPK_CASES[case]
    torch.library.opcheck(torch.ops.dsv4.indexer_topk.default, (torch.randn(rows, width), k))


#: x shape, dtype, inverse: the attention output's [T, H, 512] bf16 (inverse); a 2-D float32 row
#: of 100 dims; no token
ROPE_CASES = {
    "T5-H4-D512-bf16-inverse": ((5, 4, 512), torch.bfloat16, True),
    "T3-D100-fp32": ((3, 100), torch.float32, False),
    "T0-H2-D64-bf16": ((0, 2, 64), torch.bfloat16, False),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_(case):
    shape, dtype, inverse = ROPE_CASES[case]
    args = (torch.randn(shape, dtype=dtype), torch.randn(16, 64), torch.randint(0, 16, shape[:1]), inverse)
    torch.library.opcheck(torch.ops.dsv4.rope_.default, args)


def test_sample_set_size():
    """Documented in the README: keep the sample set representative, not shrinking silently."""
    sets = (DECODE_CASES, PREFILL_CASES, STORE_CASES, METADATA_CASES, METADATA_STACKED_CASES, INDEXER_CASES,
            TOPK_CASES, ROPE_CASES, INDEX_CACHE_CASES, CACHE_TOPK_CASES)
    assert [len(c) for c in sets] == [64, 14, 9, 2, 4, 4, 4, 3, 5, 5]
