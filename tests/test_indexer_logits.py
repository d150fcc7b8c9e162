"""``dsv4::indexer_logits``: the reference and the Triton kernel against float64, garbage where a
row does not look, bad inputs, empty calls, ``torch.compile``.

Where the Triton kernel runs (as ``test_triton_store.py``): on CPU under ``TRITON_INTERPRET=1`` in
the child pytest of :func:`test_interpreted_suite` (``device="cpu"`` cases of the ``triton``
tests), and compiled on CUDA (``cuda`` marker). Both providers compute in float32 with their own
summation order, so each is held to a float32 error bound around an independent float64 sum, not
to the other's bits.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from helpers import patch_triton_interpreter, report, run_interpreted_child

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    patch_triton_interpreter()

import dsv4_compile as d4  # noqa: E402
from dsv4_compile import dispatch  # noqa: E402
from dsv4_compile.providers import reference  # noqa: E402
from dsv4_compile.tolerances import INDEXER_ULPS_PER_TERM  # noqa: E402

OP = torch.ops.dsv4.indexer_logits.default
EPS = torch.finfo(torch.float32).eps
#: Devices the Triton kernel runs on: CPU through the interpreter (the child only), CUDA for real.
TRITON_DEVICES = ["cpu"] if INTERPRETED else [pytest.param("cuda", marks=pytest.mark.cuda)]
not_interpreted = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")

#: (tokens, heads, dim, width, slots): DSV4's 64 x 128 heads; odd sizes that pad every tile; a
#: dim past 128 (the narrow geometry); one head
CASES = {
    "dsv4": (6, 64, 128, 300, 500),
    "odd": (5, 3, 20, 37, 11),
    "wide_dim": (3, 17, 200, 40, 60),
    "max_dim": (2, 4, 512, 20, 30),
    "one_head": (4, 1, 16, 33, 8),
}


def make_case(tokens, heads, dim, width, num_slots, device="cpu", dtype=torch.int64):
    """Queries, weights and keys of varied magnitudes; each row sees a prefix of its blocks (as the
    model's rows do), with a hole inside it, then ``-1``."""
    q = torch.randn(tokens, heads, dim, device=device) * 3
    weights = torch.randn(tokens, heads, device=device) / heads**0.5
    keys = torch.randn(num_slots, dim, device=device) * torch.rand(num_slots, 1, device=device) * 4
    slots = torch.randint(0, num_slots, (tokens, width), device=device, dtype=dtype)
    visible = torch.randint(0, width + 1, (tokens, 1), device=device)
    visible[:1] = width  # one row sees every block
    slots = torch.where(torch.arange(width, device=device) < visible, slots, -1)
    if width > 3:
        slots[:, 1] = -1  # a hole inside the visible prefix
    return q, weights, keys, slots


def float64_logits(q, weights, keys, slots):
    """``(logits, bound)``: the float64 logits (``-inf`` where ``slot == -1``) and a float32 error
    bound for either provider (``tolerances.INDEXER_ULPS_PER_TERM``):
    ``(dim + heads) * eps * sum_h |w_h| * sum_d |q_hd k_d|``."""
    q, weights, keys = q.double().cpu(), weights.double().cpu(), keys.double().cpu()
    slots = slots.cpu()
    gathered = keys[slots.clamp_min(0)]  # [T, M, D]
    scores = torch.einsum("thd,tmd->thm", q, gathered)
    logits = (scores.clamp_min(0) * weights[:, :, None]).sum(1)
    magnitude = (torch.einsum("thd,tmd->thm", q.abs(), gathered.abs()) * weights.abs()[:, :, None]).sum(1)
    hidden = slots < 0
    bound = INDEXER_ULPS_PER_TERM * (q.shape[2] + q.shape[1]) * EPS * magnitude
    return logits.masked_fill(hidden, float("-inf")), bound.masked_fill(hidden, 0.0)


def assert_within_bound(got, q, weights, keys, slots):
    expected, bound = float64_logits(q, weights, keys, slots)
    got = got.double().cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got == float("-inf"), slots.cpu() < 0), "-inf exactly where the slot is -1"
    finite = slots.cpu() >= 0
    err = (got - expected)[finite].abs()
    assert bool((err <= bound[finite]).all()), f"max error {err.max().item():.3g} over the float32 bound"
    return (err / bound[finite].clamp_min(1e-30)).max().item() if err.numel() else 0.0


# --------------------------------------------------------------------------------------------
# The reference (the CPU provider)
# --------------------------------------------------------------------------------------------


@not_interpreted
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_reference_against_float64(case, dtype):
    args = make_case(*CASES[case], dtype=dtype)
    assert d4.providers("cpu")["indexer_logits"] == "reference"
    assert_within_bound(d4.indexer_logits(*args), *args)


@not_interpreted
def test_reference_chunks_rows_and_columns(monkeypatch):
    """Chunked over both rows and columns (a tiny :data:`reference.CHUNK_BYTES`: 5 entries per
    step), the reference still computes every entry (within the bound: BLAS may sum a smaller
    batch in another order)."""
    args = make_case(*CASES["odd"])
    monkeypatch.setattr(reference, "CHUNK_BYTES", 4 * (20 + 3) * 5)
    assert_within_bound(reference.indexer_logits(*args), *args)


# --------------------------------------------------------------------------------------------
# The Triton kernel (interpreted on CPU in the child, compiled on CUDA)
# --------------------------------------------------------------------------------------------


@not_interpreted
def test_tf32x3_only_on_nvidia_gpus_with_tensor_cores(monkeypatch):
    """3xTF32 scores on CUDA devices of compute capability 8.0+ with compiled kernels; float32
    FMAs on older GPUs, ROCm and CPU (here stand-in SM80 and SM75 devices)."""
    from dsv4_compile.providers.triton import common as triton_common, indexer as triton_indexer

    pytest.importorskip("triton")
    triton_indexer._kernels()
    capabilities = {0: (8, 0), 1: (7, 5)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capabilities[device.index])
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(triton_common, "_NVIDIA", {})
    assert triton_indexer.precision(torch.device("cuda", 0)) == "tf32x3"
    assert triton_indexer.precision(torch.device("cuda", 1)) == "ieee"
    assert triton_indexer.precision(torch.device("cpu")) == "ieee"
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(triton_common, "_NVIDIA", {})
    assert triton_indexer.precision(torch.device("cuda", 0)) == "ieee"


def triton_logits(args):
    """The Triton provider's kernel on ``args``: through the op on CUDA (where it serves), directly
    when interpreted on CPU (where the reference serves the op)."""
    if args[0].device.type == "cuda":
        assert d4.providers("cuda")["indexer_logits"] == "triton"
        return d4.indexer_logits(*args)
    from dsv4_compile.providers.triton import indexer as triton_indexer

    d4.ops.indexer.check_indexer_logits(*args)
    return triton_indexer.indexer_logits(*args)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_against_float64(case, device, request):
    args = make_case(*CASES[case], device=device, dtype=torch.int32 if case == "odd" else torch.int64)
    worst = assert_within_bound(triton_logits(args), *args)
    report(request.config, f"indexer logits triton {case} ({device}): worst error {worst:.3f} of the float32 bound")


def assert_reads_only_referenced_keys(logits, device):
    """Key rows no row references, and the keys' padding past ``dim`` in a wider buffer, hold NaN
    and Inf: every output of ``logits(q, weights, keys, slots)`` is bit for bit the same as with
    clean keys."""
    q, weights, keys, slots = make_case(*CASES["odd"], device=device)
    wide = torch.randn(keys.shape[0] + 3, keys.shape[1] + 5, device=device)
    wide[:, keys.shape[1]:] = float("nan")
    wide[keys.shape[0]:] = float("inf")
    unreferenced = torch.ones(wide.shape[0], dtype=torch.bool, device=device)
    unreferenced[slots[slots >= 0]] = False
    wide[: keys.shape[0], : keys.shape[1]] = keys
    clean = logits((q, weights, wide[:, : keys.shape[1]].clone(), slots))
    wide[unreferenced] = float("nan")
    poisoned = logits((q, weights, wide[:, : keys.shape[1]], slots))
    assert torch.equal(poisoned, clean)


@not_interpreted
def test_reference_reads_only_referenced_keys():
    assert_reads_only_referenced_keys(lambda args: d4.indexer_logits(*args), "cpu")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_reads_only_referenced_keys(device):
    assert_reads_only_referenced_keys(triton_logits, device)


def strided(args):
    """The same values in views with other strides: heads and dims of ``q`` interleaved with
    garbage, ``weights`` transposed storage, ``block_slots`` every other column of a wider table."""
    q, weights, keys, slots = args
    wide_q = torch.full((q.shape[0], q.shape[1], 2 * q.shape[2]), float("nan"), device=q.device)
    wide_q[..., ::2] = q
    wide_slots = torch.full((slots.shape[0], 2 * slots.shape[1]), 10**6, dtype=slots.dtype, device=slots.device)
    wide_slots[:, ::2] = slots
    return wide_q[..., ::2], weights.t().contiguous().t(), keys, wide_slots[:, ::2]


@not_interpreted
def test_reference_takes_strided_inputs():
    args = make_case(*CASES["odd"])
    assert torch.equal(d4.indexer_logits(*strided(args)), d4.indexer_logits(*args))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_takes_strided_inputs(device):
    args = make_case(*CASES["odd"], device=device)
    assert torch.equal(triton_logits(strided(args)), triton_logits(args))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_nan_stays_nan(device):
    """A NaN query yields NaN where its row sees a block (as ``relu`` keeps NaN), ``-inf`` where not."""
    q, weights, keys, slots = make_case(*CASES["odd"], device=device)
    q[2, 1, 0] = float("nan")
    got = triton_logits((q, weights, keys, slots))
    assert torch.equal(got[2].isnan(), slots[2] >= 0)
    assert torch.equal(got[2] == float("-inf"), slots[2] < 0)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_programs_per_row_change_no_bit(device):
    """However many programs share a row's column blocks (one takes all five; two take three and
    two; five take one each), every logit has the same bits, within the float32 bound."""
    from dsv4_compile.providers.triton import common as triton_common, indexer as triton_indexer

    args = make_case(3, 5, 32, 300, 400, device=device)  # 5 blocks of 64 columns per row
    triton_indexer._kernels()
    outs = []
    for programs in (1, 2, 5):
        out = torch.full((3, 300), 7.0, device=device)
        with triton_common.device_guard(args[0].device):
            triton_indexer.launch(*args, out, programs=programs)
        outs.append(out)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert_within_bound(outs[0], *args)


@not_interpreted
def test_programs_per_row_fill_the_device_once(monkeypatch):
    """The rule: PROGRAMS_PER_UNIT programs per SM over the rows, at least 1 and at most the
    row's column blocks (H200: 132 SMs)."""
    from dsv4_compile.providers.triton import common as triton_common, indexer as triton_indexer

    monkeypatch.setattr(triton_common, "compute_units", lambda device: 132)
    cuda = torch.device("cuda")
    assert triton_indexer.PROGRAMS_PER_UNIT == 2
    assert triton_indexer.programs_per_row(cuda, 64, 16) == 4  # decode b = 64, 1024 columns: 256 programs
    assert triton_indexer.programs_per_row(cuda, 1, 16) == 16  # decode b = 1: a program per block
    assert triton_indexer.programs_per_row(cuda, 8, 128) == 33
    assert triton_indexer.programs_per_row(cuda, 8192, 16) == 1  # prefill: a program per row


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_empty(device):
    for tokens, width in ((0, 8), (3, 0)):
        q, weights, keys, slots = make_case(tokens, 4, 16, width, 5, device=device)
        assert triton_logits((q, weights, keys, slots)).shape == (tokens, width)


@not_interpreted
def test_interpreted_suite(request):
    """Run this file's Triton tests on CPU in a child pytest with ``TRITON_INTERPRET=1``."""
    run_interpreted_child(request.config, __file__, echo=("indexer logits triton",))


# --------------------------------------------------------------------------------------------
# The op: errors, checked mode, compile
# --------------------------------------------------------------------------------------------


@not_interpreted
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda a: (a[0].double(), *a[1:]), "dsv4.indexer_logits: q must be float32 [*, *, *], got float64"),
        (lambda a: (a[0][..., :0].contiguous(), *a[1:]), "q must be float32 [T, H, D] with 1 <= D <= 512"),
        (lambda a: (torch.randn(5, 3, 513), a[1], torch.randn(11, 513), a[3]), "1 <= D <= 512"),
        (lambda a: (a[0], a[1][:, :2], *a[2:]), "weights must be float32 [5, 3], got float32 [5, 2]"),
        (lambda a: (a[0], a[1], a[2][:, :4], a[3]), "keys must be float32 [*, 20], got float32 [11, 4]"),
        (lambda a: (*a[:3], a[3].float()), "block_slots must be int32/int64 [5, *], got float32"),
        (lambda a: (*a[:3], a[3][:, :1].expand(5, (1 << 20) + 1)),
         "block_slots must be at most 1048576 index columns wide"),
        (lambda a: (*a[:3], a[3] + 11), "block_slots must be -1 or a slot in [0, 11) (keys.shape[0])"),
        (lambda a: (*a[:3], a[3] - 2), "block_slots must be -1 or a slot in [0, 11) (keys.shape[0])"),
    ],
)
def test_bad_inputs_are_named(bad, message):
    args = bad(make_case(*CASES["odd"]))
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        d4.indexer_logits(*args)


@not_interpreted
def test_grad_is_refused():
    q, weights, keys, slots = make_case(*CASES["odd"])
    with pytest.raises(RuntimeError, match=r"inference-only.*: weights requires grad"):
        d4.indexer_logits(q, weights.requires_grad_(), keys, slots)


@not_interpreted
def test_compiled_equals_eager_with_dynamic_tokens():
    """``torch.compile(fullgraph=True)`` keeps the op as one call through token-count changes."""
    from torch._inductor.utils import run_and_get_code

    counts = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counts.clear()
    fn = torch.compile(lambda q, w, k, s: d4.indexer_logits(q * 1, w, k, s).relu(), fullgraph=True)
    for tokens in (3, 5, 9):
        args = make_case(tokens, 4, 16, 12, 7)
        assert torch.equal(fn(*args), d4.indexer_logits(*args).relu())
    assert counts["stats"]["unique_graphs"] <= 2  # the 0/1 specialisation aside, one dynamic graph
    torch._dynamo.reset()
    _, code = run_and_get_code(fn, *args)
    assert "".join(code).count("torch.ops.dsv4.indexer_logits.default(") == 1


@pytest.mark.cuda
def test_cuda_checked_mode_rejects_bad_slot():
    """The slot range is a data check: in checked mode a slot past the keys is refused on CUDA
    (where the Triton kernel would read it unchecked)."""
    q, weights, keys, slots = make_case(*CASES["odd"], device="cuda")
    bad = slots.clone()
    bad[1, 0] = keys.shape[0]
    with d4.checked(), pytest.raises(ValueError, match="block_slots must be -1 or a slot"):
        d4.indexer_logits(q, weights, keys, bad)
    assert dispatch.resolve("indexer_logits", torch.device("cuda", torch.cuda.current_device()))[0] == "triton"


@pytest.mark.cuda
def test_cuda_graph_replay():
    q, weights, keys, slots = make_case(*CASES["dsv4"], device="cuda")
    expected = d4.indexer_logits(q, weights, keys, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = d4.indexer_logits(q, weights, keys, slots)
    keys.mul_(2)
    graph.replay()
    assert torch.equal(out, d4.indexer_logits(q, weights, keys, slots))
    assert not torch.equal(out, expected)
