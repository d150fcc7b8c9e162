"""``dsv4::indexer_topk``: the reference and the Triton kernel against ``torch.sort``'s stable
descending order, special values, strided rows, bad inputs, empty calls, ``torch.compile``, CUDA
graphs.

The op's choice is exact (no rounding), so every provider must return the same indices bit for
bit: that is what these tests compare. The expected indices are the first ``k`` of
``torch.sort(descending=True, stable=True)`` on CPU (which orders ``-0.0`` as ``0.0`` and every NaN
above ``+inf``, as the op does), in ascending order, not either provider's output. Where the
Triton kernel runs: as in ``test_indexer_logits.py``.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from helpers import patch_triton_interpreter, run_interpreted_child

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    patch_triton_interpreter()

import dsv4_compile as d4  # noqa: E402
from dsv4_compile.providers import reference  # noqa: E402

TRITON_DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=pytest.mark.cuda)]
not_interpreted = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")

#: (rows, width, k): DSV4's 512 of 1024 blocks; odd sizes (k and width not powers of two); every
#: column; one column; the widest row the Triton program takes
CASES = {
    "dsv4": (6, 1024, 512),
    "odd": (5, 37, 5),
    "all": (3, 300, 300),
    "one": (4, 1, 1),
    "widest": (2, 8192, 3000),
}


def make_logits(rows, width, device="cpu"):
    """Logits with what the indexer's rows hold: ``-inf`` past a visible prefix, exact ties
    (zeros, where every head's ReLU is 0, and repeated values), both zeros, NaN of both signs,
    ``+inf``."""
    x = torch.randn(rows, width)
    x[:, 3::5] = x[:, :1]  # repeated values
    x[:, 4::7] = 0.0
    x[:, 6::11] = -0.0
    visible = torch.randint(1, width + 1, (rows, 1))
    x = x.masked_fill(torch.arange(width) >= visible, float("-inf"))
    if width > 20:
        x[0, 9], x[0, 13], x[1, 2] = float("nan"), -float("nan"), float("inf")
    return x.to(device)


def strided(logits):
    """``logits`` as every other column of a table twice as wide whose other columns hold NaN
    (which would rank first if read)."""
    wide = torch.full((logits.shape[0], 2 * logits.shape[1]), float("nan"), device=logits.device)
    wide[:, ::2] = logits
    return wide[:, ::2]


def expected(logits, k):
    """The first ``k`` columns of the stable descending sort, in ascending order."""
    return torch.sort(logits.cpu(), dim=1, descending=True, stable=True).indices[:, :k].sort(dim=1).values


@pytest.mark.parametrize("k, columns", [
    (2, [1, 7]),  # NaN of either sign first
    (3, [1, 7, 8]),  # then +inf
    (4, [1, 5, 7, 8]),  # of two equal values, the lower column
    (7, [0, 1, 2, 5, 6, 7, 8]),  # of -0.0 and 0.0, the lower column
    (9, list(range(9))),  # -inf last
])
def test_special_values_by_hand(k, columns):
    x = torch.tensor([[1.0, float("nan"), -0.0, 0.0, float("-inf"), 2.0, 2.0, -float("nan"), float("inf")]])
    assert reference.indexer_topk(x, k).tolist() == [columns]


@not_interpreted
@pytest.mark.parametrize("case", list(CASES))
def test_reference_against_stable_sort(case):
    rows, width, k = CASES[case]
    logits = make_logits(rows, width)
    assert d4.providers("cpu")["indexer_topk"] == "reference"
    assert torch.equal(d4.indexer_topk(logits, k), expected(logits, k))


@not_interpreted
def test_reference_chunks_rows(monkeypatch):
    """One row per chunk (a tiny :data:`reference.CHUNK_BYTES`), the same indices."""
    logits = make_logits(*CASES["odd"][:2])
    monkeypatch.setattr(reference, "CHUNK_BYTES", 1)
    assert torch.equal(reference.indexer_topk(logits, 5), expected(logits, 5))


@pytest.fixture
def launched(monkeypatch):
    """The names of the Triton kernels launched through ``triton_common.eager``, in order."""
    from dsv4_compile.providers.triton import common as triton_common

    names, eager = [], triton_common.eager
    monkeypatch.setattr(triton_common, "eager", lambda kernel: names.append(kernel.fn.__name__) or eager(kernel))
    return names


def triton_topk(logits, k):
    """The Triton provider's kernel: through the op on CUDA (where it serves), directly when
    interpreted on CPU (where the reference serves the op)."""
    if logits.device.type == "cuda":
        assert d4.providers("cuda")["indexer_topk"] == "triton"
        return d4.indexer_topk(logits, k)
    from dsv4_compile.providers.triton import indexer as triton_indexer

    d4.ops.indexer.check_indexer_topk(logits, k)
    return triton_indexer.indexer_topk(logits, k)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_against_stable_sort(case, device):
    rows, width, k = CASES[case]
    if INTERPRETED and width > 1024:
        pytest.skip("minutes under the interpreter; compiled on CUDA")
    logits = make_logits(rows, width, device)
    assert torch.equal(triton_topk(logits, k).cpu(), expected(logits, k))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("case", ["dsv4", "odd", "all", "one"])
def test_triton_looped_program_against_stable_sort(case, device, launched):
    """The program for rows wider than :data:`~.triton.indexer.TOPK_MAX_WIDTH` with a ``k`` past a
    quarter of a piece, read 256 columns at a time here (several chunks, a partial last one, a row
    within one chunk), and on a strided row: the same indices."""
    from dsv4_compile.providers.triton import indexer as triton_indexer

    triton_indexer._kernels()  # import the kernels (and Triton)
    rows, width, k = CASES[case]
    logits = make_logits(rows, width, device)
    out = torch.empty(rows, k, dtype=torch.int64, device=device)
    triton_indexer.launch_topk(logits, k, out, chunk=256, program="looped")
    assert torch.equal(out.cpu(), expected(logits, k))
    out.fill_(-1)
    triton_indexer.launch_topk(strided(logits), k, out, chunk=256, program="looped")
    assert torch.equal(out.cpu(), expected(logits, k))
    assert launched == ["topk_looped_kernel"] * 2


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("rows, width, k, steps", [(3, 5000, 60, 3), (4, 700, 64, 1), (2, 4096, 1, 1), (5, 37, 5, 0)],
                         ids=["three-steps", "short-last-piece", "k1", "one-piece"])
def test_triton_split_program_against_stable_sort(rows, width, k, steps, device, launched):
    """The program for rows wider than :data:`~.triton.indexer.TOPK_CHUNK`, by 256-column
    pieces here: three steps, the last with a piece narrower than ``k`` (5000 columns: 1200, 300,
    then 104 candidates), one (700 columns: 192 candidates), a row within one piece; a row of equal values
    (the first ``k`` columns, whatever the pieces); a strided row: the same indices."""
    from dsv4_compile.providers.triton import indexer as triton_indexer

    triton_indexer._kernels()
    logits = make_logits(rows, width, device)
    logits[-1] = 0.0
    out = torch.empty(rows, k, dtype=torch.int64, device=device)
    triton_indexer.launch_topk(logits, k, out, chunk=256, program="split")
    assert torch.equal(out.cpu(), expected(logits, k))
    assert out[-1].tolist() == list(range(k))
    assert launched == ["topk_kernel"] * (steps + 1)  # a launch per step, then the last selection
    out.fill_(-1)
    triton_indexer.launch_topk(strided(logits), k, out, chunk=256, program="split")
    assert torch.equal(out.cpu(), expected(logits, k))
    with pytest.raises(ValueError, match="4 k <= chunk"):
        triton_indexer.launch_topk(logits, 65, torch.empty(rows, 65, dtype=torch.int64, device=device),
                                   chunk=256, program="split")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_search_paths(device):
    """The in-register program's three ways to the ``k``-th largest: a row whose ``k``-th value has
    200 copies above the row's smallest (every bit searched; the first copies in column order), a
    row of distinct values (the search stops where exactly ``k`` values reach a probe), a row with
    fewer than ``k`` values above its smallest (no search): the same indices."""
    g = torch.Generator().manual_seed(1)
    ties = torch.randn(600, generator=g)
    ties[torch.randperm(600, generator=g)[:200]] = 0.25
    k = int((ties > 0.25).sum()) + 50  # 50 of the 200 copies
    distinct = torch.randperm(600, generator=g).float()
    few = torch.full((600,), float("-inf"))
    few[torch.randperm(600, generator=g)[: k - 1]] = 1.0
    logits = torch.stack([ties, distinct, few])
    assert torch.equal(triton_topk(logits.to(device), k).cpu(), expected(logits, k))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_takes_strided_rows(device):
    """Every other column of a wider table (:func:`strided`)."""
    logits = make_logits(*CASES["odd"][:2], device)
    assert torch.equal(triton_topk(strided(logits), 5).cpu(), expected(logits, 5))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_empty(device):
    for rows, width, k in ((0, 8, 3), (3, 8, 0), (0, 0, 0)):
        logits = torch.randn(rows, width, device=device)
        assert triton_topk(logits, k).shape == (rows, k)


@not_interpreted
def test_interpreted_suite(request):
    """Run this file's Triton tests on CPU in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__)


@not_interpreted
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda x: (x.double(), 2), "dsv4.indexer_topk: logits must be float32 [*, *], got float64"),
        (lambda x: (x[0], 2), "logits must be float32 [*, *], got float32 [37]"),
        (lambda x: (x, 38), "k must be an int in [0, 37] (logits.shape[1]), got 38"),
        (lambda x: (x, -1), "k must be an int in [0, 37] (logits.shape[1]), got -1"),
        (lambda x: (x[:, :1].expand(5, (1 << 20) + 1), 1), "logits must be at most 1048576 index columns wide"),
    ],
)
def test_bad_inputs_are_named(bad, message):
    args = bad(make_logits(*CASES["odd"][:2]))
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        d4.indexer_topk(*args)


@not_interpreted
def test_grad_is_refused():
    with pytest.raises(RuntimeError, match=r"inference-only.*: logits requires grad"):
        d4.indexer_topk(torch.randn(3, 8, requires_grad=True), 2)


@not_interpreted
def test_compiled_equals_eager_with_dynamic_rows():
    """``torch.compile(fullgraph=True)`` keeps the op as one call through row-count changes."""
    from torch._inductor.utils import run_and_get_code

    counts = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counts.clear()
    fn = torch.compile(lambda x: d4.indexer_topk(x * 2, 7) + 1, fullgraph=True)
    for rows in (3, 5, 9):
        logits = make_logits(rows, 40)
        assert torch.equal(fn(logits), expected(logits * 2, 7) + 1)
    assert counts["stats"]["unique_graphs"] <= 2  # the 0/1 specialisation aside, one dynamic graph
    torch._dynamo.reset()
    _, code = run_and_get_code(fn, logits)
    assert "".join(code).count("torch.ops.dsv4.indexer_topk.default(") == 1


@pytest.mark.cuda
def test_cuda_wide_rows_take_the_rules_program(launched):
    """Past :data:`~.triton.indexer.TOPK_CHUNK` columns (``max_seq_len`` past 16384 at ratio 4)
    by pieces (two launches each here) at any row count; with a ``k`` past a quarter of a piece, in
    registers up to :data:`~.triton.indexer.TOPK_MAX_WIDTH` columns and by the looped program
    beyond: the same indices."""
    from dsv4_compile.providers.triton import indexer as triton_indexer

    chunk, widest = triton_indexer.TOPK_CHUNK, triton_indexer.TOPK_MAX_WIDTH
    launches = {"split": ["topk_kernel"] * 2, "registers": ["topk_kernel"], "looped": ["topk_looped_kernel"]}
    for rows, width, k, program in [(3, chunk + 1, 600, "split"), (3, 5 * chunk + 77, 600, "split"),
                                    (100, widest + 1, 600, "split"), (3, widest, chunk // 4 + 1, "registers"),
                                    (3, widest + 1, chunk // 4 + 1, "looped")]:
        launched.clear()
        assert triton_indexer.topk_program(width, k) == program
        logits = make_logits(rows, width, "cuda")
        assert torch.equal(triton_topk(logits, k).cpu(), expected(logits, k))
        assert launched == launches[program]


@pytest.mark.cuda
@pytest.mark.parametrize("rows, width", [CASES["dsv4"][:2], (3, 4 * 8192 + 5)], ids=["registers", "pieces"])
def test_cuda_graph_replay(rows, width):
    """A captured call follows its input; by pieces too (its candidate buffers allocated in the capture)."""
    logits = make_logits(rows, width, device="cuda")
    before = d4.indexer_topk(logits, 512)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = d4.indexer_topk(logits, 512)
    logits.neg_()
    graph.replay()
    assert torch.equal(out.cpu(), expected(logits, 512))
    assert not torch.equal(out, before)
