"""``dsv4::indexer_cache_topk`` (docs/design.md §2.12): the indexer's selection over the paged
indexer key cache through a block table, without a ``[T, context]`` logits or slots tensor.

Held to the float64 logits of ``test_indexer_cache.py``'s independent model of the formats (the
slots from the block table computed here in plain Python): every row selects its visible blocks in
order when it has at most ``k``, else ``k`` blocks whose float64 logits are the ``k`` largest but at
near-ties (two logits within the sum of their float32 bounds). On one provider the op is exactly
``indexer_topk(indexer_cache_logits(...))`` over the visible slots. Where the Triton provider runs:
interpreted on CPU in a child pytest, compiled on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import patch_triton_interpreter, run_interpreted_child

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    patch_triton_interpreter()

import dsv4_compile as d4  # noqa: E402
from dsv4_compile import layout, tolerances  # noqa: E402
from dsv4_compile.providers import reference  # noqa: E402
from dsv4_compile.providers.triton import indexer as triton_indexer  # noqa: E402
from test_indexer_cache import EPS, FORMATS, float64_logits, poisoned_cache, reference_store  # noqa: E402

TRITON_DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=pytest.mark.cuda)]
not_interpreted = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")
DIM = layout.INDEX_HEAD_DIM


def topk_case(name: str, tokens=9, heads=6, pages=5, page_size=8, requests=3, k=10, device="cpu", grouped=False):
    """A cache whose every slot holds a finite key (random bytes in the page padding), a shuffled
    block table of ``requests`` rows, queries on random rows seeing random lengths (the whole table,
    exactly ``k``, ``k + 1`` and none among them); ``-1`` in the table past the pages any query reads.
    ``grouped``: each request's queries consecutive, as a prefill chunk's (the tile kernel's case)."""
    gen = torch.Generator().manual_seed(11)
    num_pages = requests * pages + 3
    capacity = num_pages * page_size
    keys = torch.randn(capacity, DIM, generator=gen) * torch.rand(capacity, 1, generator=gen) * 4
    cache = poisoned_cache(num_pages, page_size, name)
    reference_store(layout.hadamard(keys) if name != "fp32" else keys, cache, torch.arange(capacity), page_size, name)
    block_table = torch.randperm(num_pages, generator=gen)[: requests * pages].view(requests, pages).int()
    table_rows = torch.randint(0, requests, (tokens,), generator=gen)
    if grouped:
        table_rows = table_rows.sort().values
    lengths = torch.randint(0, pages * page_size + 1, (tokens,), generator=gen)
    lengths[:4] = torch.tensor([pages * page_size, k, k + 1, 0])
    for r in range(requests):  # pages no query of the request reads
        seen = lengths[table_rows == r]
        read = -(-int(seen.max()) // page_size) if seen.numel() else 0
        block_table[r, read:] = -1
    q = torch.randn(tokens, heads, DIM, generator=gen) * 2
    codes, q_scales = layout.quantize_index(layout.hadamard(q) if name != "fp32" else q, name)
    weights = torch.randn(tokens, heads, generator=gen) / heads**0.5
    if name == "fp8":
        weights, q_scales = weights * q_scales, None
    args = (codes, weights, cache, block_table, table_rows, lengths, page_size, k, name, q_scales)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def visible_slots(block_table, table_rows, lengths, page_size) -> torch.Tensor:
    """``[T, P * page_size]``: slot of block ``j`` of each query's request, ``-1`` past its length."""
    width = block_table.shape[1] * page_size
    rows = []
    for row, n in zip(table_rows.tolist(), lengths.tolist()):
        pages = block_table[row].tolist()
        rows.append([pages[j // page_size] * page_size + j % page_size if j < n else -1 for j in range(width)])
    return torch.tensor(rows, dtype=torch.long).view(-1, width)


def float64_table_logits(args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, bound)`` of the case's visible blocks: the float64 model's, with the bound of
    e4m3 tensor-core products (``tolerances.INDEXER_FP8_MMA``) where the Triton provider's tile
    kernel multiplies fp8 so (CUDA, compute capability 8.9 or later), else the float32 one."""
    codes, weights, cache, block_table, table_rows, lengths, page_size, k, name, q_scales = args
    slots = visible_slots(block_table.cpu(), table_rows.cpu(), lengths.cpu(), page_size)
    logits, bound = float64_logits(codes, weights, cache, slots, page_size, name, q_scales)
    if name == "fp8" and codes.device.type == "cuda" and triton_indexer.fp8_mma(codes.device):
        bound = bound / ((DIM + codes.shape[1]) * EPS) * tolerances.INDEXER_FP8_MMA  # the magnitudes' multiple
    return logits, bound


def assert_selects_the_largest_but_at_near_ties(got, args) -> None:
    codes, weights, cache, block_table, table_rows, lengths, page_size, k, name, q_scales = args
    got = got.cpu()
    logits, bound = float64_table_logits(args)
    assert got.shape == (codes.shape[0], k) and got.dtype == torch.int64
    for t, n in enumerate(lengths.tolist()):
        row = got[t].tolist()
        if n <= k:
            assert row == list(range(n)) + [-1] * (k - n), t
            continue
        assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < n, t  # k distinct visible blocks, ascending
        values, margins = logits[t, :n], bound[t, :n]
        kth = int(values.topk(k).indices[-1])
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[row] = True
        slack = margins + margins[kth]  # each of two logits may err by its bound
        assert bool((values[chosen] >= values[kth] - slack[chosen]).all()), f"row {t}: a chosen block is too low"
        assert bool((values[~chosen] <= values[kth] + slack[~chosen]).all()), f"row {t}: a better block was left out"


def composed(run_logits, run_topk, args) -> torch.Tensor:
    """``indexer_topk`` of ``indexer_cache_logits`` over the visible slots, and every visible block
    in order where a row has at most ``k``."""
    codes, weights, cache, block_table, table_rows, lengths, page_size, k, name, q_scales = args
    slots = visible_slots(block_table.cpu(), table_rows.cpu(), lengths.cpu(), page_size).to(codes.device)
    best = run_topk(run_logits(codes, weights, cache, slots, page_size, name, q_scales), k)
    order = torch.arange(k, device=codes.device)
    return torch.where(lengths[:, None] <= k, torch.where(order < lengths[:, None], order, -1), best)


def reference_topk(*args):
    with d4.use_provider("reference"):
        return d4.indexer_cache_topk(*args)


def triton_topk(*args):
    """The Triton provider's selection: through the op on CUDA, directly when interpreted on CPU."""
    if args[0].device.type == "cuda":
        assert d4.providers("cuda")["indexer_cache_topk"] == "triton"
        return d4.indexer_cache_topk(*args)
    args = list(args)
    args[8] = layout.INDEX_FORMATS[args[8]]
    d4.ops.indexer.check_indexer_cache_topk(*args)
    return triton_indexer.indexer_cache_topk(*args)


def triton_parts(device):
    """The Triton provider's logits and top-k, as :func:`triton_topk` reaches them."""
    if device == "cuda":
        return d4.indexer_cache_logits, d4.indexer_topk

    def logits(*args):
        return triton_indexer.indexer_cache_logits(*args[:5], layout.INDEX_FORMATS[args[5]], *args[6:])

    return logits, triton_indexer.indexer_topk


def table_logits(args, batch_invariant=False) -> torch.Tensor:
    """The Triton provider's logits its selection reads (``table_logits``), of every row at once."""
    codes, weights, cache, block_table, table_rows, lengths, page_size, k, name, q_scales = args
    return triton_indexer.table_logits(codes, weights, cache, block_table, table_rows, lengths.long(), page_size,
                                       block_table.shape[1] * page_size, layout.INDEX_FORMATS[name], q_scales,
                                       batch_invariant)


# --------------------------------------------------------------------------------------------
# The selection against the float64 model, and the composition of the two ops
# --------------------------------------------------------------------------------------------


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_reference_selects_the_float64_top_k(name):
    assert d4.providers("cpu")["indexer_cache_topk"] == "reference"
    args = topk_case(name)
    assert_selects_the_largest_but_at_near_ties(d4.indexer_cache_topk(*args), args)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("grouped", [False, True], ids=["interleaved", "grouped"])
@pytest.mark.parametrize("name", FORMATS)
def test_triton_selects_the_float64_top_k(name, grouped, device):
    args = topk_case(name, heads=40, device=device, grouped=grouped)  # 40 heads: two head tiles
    assert_selects_the_largest_but_at_near_ties(triton_topk(*args), args)


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_reference_is_the_top_k_of_its_cache_logits(name):
    args = topk_case(name)
    with d4.use_provider("reference"):
        want = composed(d4.indexer_cache_logits, d4.indexer_topk, args)
    assert torch.equal(reference_topk(*args), want)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("tiles", ["single", "wide"])
def test_triton_is_the_top_k_of_its_table_logits(name, tiles, device, monkeypatch):
    """Default mode: the exact top-k of the logits of ``table_logits`` (tile kernel and per-row
    kernel); batch-invariant: of ``dsv4::indexer_cache_logits`` over the visible slots (the per-row
    kernel alone, bit for bit)."""
    if tiles == "wide":
        monkeypatch.setattr(triton_indexer, "TILE_SINGLE_ROWS", 0)
    args = topk_case(name, tokens=23, heads=40, device=device, grouped=True)
    order = torch.arange(args[7], device=device)
    lengths = args[5][:, None]
    every = torch.where(order < lengths, order, -1)
    want = torch.where(lengths <= args[7], every, triton_indexer.indexer_topk(table_logits(args), args[7]))
    assert torch.equal(triton_topk(*args), want)
    with d4.batch_invariant():
        invariant = d4.indexer_cache_topk(*args) if device == "cuda" else triton_topk(*args[:10], True)
    assert torch.equal(invariant, composed(*triton_parts(device), args))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("tiles", ["single", "wide"])
@pytest.mark.parametrize("heads", [6, 40, 64])
@pytest.mark.parametrize("grouped", [False, True], ids=["interleaved", "grouped"])
@pytest.mark.parametrize("name", FORMATS)
def test_triton_table_logits_within_the_bound(name, grouped, heads, tiles, device, monkeypatch):
    """``table_logits`` in tiles of one query, and (``wide``: as calls of more than
    ``TILE_SINGLE_ROWS`` rows) in wide tiles of one request then single-query tiles for the rest, a
    row count no tile size divides: ``-inf`` exactly past each row's length, the rest within the
    float64 model's bound (:func:`float64_table_logits`). The per-row kernel through the table
    (``fp32``, ``batch_invariant``) is ``indexer_cache_logits`` through the slots, bit for bit."""
    if tiles == "wide":
        monkeypatch.setattr(triton_indexer, "TILE_SINGLE_ROWS", 0)
    args = topk_case(name, tokens=23, heads=heads, device=device, grouped=grouped)
    got = table_logits(args).double().cpu()
    want, bound = float64_table_logits(args)
    seen = want > float("-inf")
    assert torch.equal(got == float("-inf"), ~seen)
    err = (got - want)[seen].abs()
    assert bool((err <= bound[seen]).all()), f"max error {(err / bound[seen]).max().item():.3g} of the bound"
    codes, weights, cache, block_table, table_rows, lengths, page_size, k, _, q_scales = args
    slots = visible_slots(block_table.cpu(), table_rows.cpu(), lengths.cpu(), page_size).to(device)
    per_row = triton_parts(device)[0](codes, weights, cache, slots, page_size, name, q_scales)
    assert torch.equal(table_logits(args, batch_invariant=True), per_row)


@not_interpreted
def test_rows_in_small_groups_select_the_same_blocks(monkeypatch):
    """The groups bound the memory, not the result: groups of one row and of three give the op's
    indices bit for bit."""
    args = topk_case("fp8")
    want = reference_topk(*args)
    width = args[3].shape[1] * args[6]
    for rows in (1, 3):
        monkeypatch.setattr(reference, "CACHE_TOPK_GROUP_BYTES", rows * reference.CACHE_TOPK_ENTRY_BYTES * width)
        assert torch.equal(reference_topk(*args), want), rows


# --------------------------------------------------------------------------------------------
# Garbage, NaN, empty calls, k at its bounds
# --------------------------------------------------------------------------------------------


def assert_reads_only_referenced_pages(select, name, device) -> None:
    """Pages no query reads (the table's other pages, the page padding) and table entries past the
    pages a query reads hold garbage: the indices keep their bits."""
    args = list(topk_case(name, device=device))
    cache, block_table, page_size = args[2], args[3], args[6]
    clean = select(*args)
    read = block_table[block_table >= 0].unique()
    garbage = torch.randint_like(cache, 0, 256)
    dirty = cache.clone()
    unread = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    unread[read.long()] = False
    dirty[unread] = garbage[unread]
    table = torch.where(block_table >= 0, block_table, torch.randint_like(block_table, -5, 1000))
    args[2], args[3] = dirty, table
    assert torch.equal(select(*args), clean)


@not_interpreted
@pytest.mark.parametrize("name", FORMATS)
def test_reference_reads_only_referenced_pages(name):
    assert_reads_only_referenced_pages(reference_topk, name, "cpu")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_triton_reads_only_referenced_pages(name, device):
    assert_reads_only_referenced_pages(triton_topk, name, device)


def assert_edges(select, device) -> None:
    args = list(topk_case("fp8", device=device))
    for k in (0, args[3].shape[1] * args[6]):  # none, and the whole table (every visible block in order)
        got = select(*args[:7], k, *args[8:])
        order = torch.arange(k, device=device)
        assert torch.equal(got, torch.where(order < args[5][:, None], order, -1)), k
    empty = [a[:0] if i in (0, 1, 4, 5) else a for i, a in enumerate(args)]
    assert select(*empty).shape == (0, args[7])


@not_interpreted
def test_reference_edges():
    assert_edges(reference_topk, "cpu")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_edges(device):
    assert_edges(triton_topk, device)


@not_interpreted
def test_interpreted_suite(request):
    """Run this file's Triton tests on CPU in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__)


# --------------------------------------------------------------------------------------------
# Errors, compile
# --------------------------------------------------------------------------------------------


@not_interpreted
@pytest.mark.parametrize(
    "bad, exc, message",
    [
        (lambda a: (*a[:3], a[3].float(), *a[4:]), TypeError, r"block_table must be int32/int64 \[\*, \*\], got float32"),
        (lambda a: (*a[:4], a[4][:2], *a[5:]), ValueError, r"table_rows must be int32/int64 \[9\], got int64 \[2\]"),
        (lambda a: (*a[:5], a[5][:, None], *a[6:]), ValueError, r"lengths must be int32/int64 \[9\], got int64 \[9, 1\]"),
        (lambda a: (*a[:7], 41, *a[8:]), ValueError, r"k must be an int in \[0, 40\] \(block_table's pages \* page_size"),
        (lambda a: (*a[:7], True, *a[8:]), ValueError, r"k must be an int in \[0, 40\]"),
    ],
)
def test_bad_inputs_are_named(bad, exc, message):
    with pytest.raises(exc, match=message):
        d4.indexer_cache_topk(*bad(topk_case("fp8")))


@not_interpreted
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda a: (*a[:4], a[4] + 3, *a[5:]), r"table_rows must be rows of block_table, in \[0, 3\), got values in \[3, 5\]"),
        (lambda a: (*a[:5], a[5] + 1, *a[6:]), r"lengths must be within \[0, 40\]"),
        (lambda a: (*a[:3], torch.where(a[3] >= 0, a[3] + 100, a[3]), *a[4:]),
         r"block_table must be page ids in \[0, 18\) \(index_cache's pages\) for every visible block"),
        (lambda a: (*a[:3], torch.full_like(a[3], -1), *a[4:]), r"block_table must be page ids in \[0, 18\)"),
    ],
)
def test_out_of_range_values_are_named_in_checked_mode(bad, message):
    with d4.checked(), pytest.raises(ValueError, match=message):
        d4.indexer_cache_topk(*bad(topk_case("fp8")))


@not_interpreted
def test_compiled_equals_eager():
    args = topk_case("fp4")
    compiled = torch.compile(d4.indexer_cache_topk, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(*args), d4.indexer_cache_topk(*args))


@pytest.mark.cuda
def test_cuda_graph_replay():
    args = topk_case("fp8", device="cuda")
    want = d4.indexer_cache_topk(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = d4.indexer_cache_topk(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
