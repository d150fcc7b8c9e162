"""torch.compile of one DSV4 attention layer (docs/design.md §4): one graph, no breaks, the dsv4 ops
in the generated code, no copy of any cache, compiled == eager, at most one dynamic recompile.

Every layer kind (compress_ratio 0, 4, 128) in both attention modes. A step is "build the step
metadata, run the layer" (:func:`layer_step`), compiled as one function. Inductor compiles are
slow on CPU (tens of seconds each on two cores), so Inductor compiles one layer here (ratio 128
prefill: compressor store, workspace prefill) and the model's decode step in ``test_model.py``
(every layer kind, paged decode, indexer); the other cases use ``aot_eager``, which runs the same
traced, functionalized graph.

On CUDA every case runs under Inductor. A ratio-4 layer's output is compared with eager's on the
rows whose indexer selected the same blocks in both runs (a row attending another block attends
another key: no rounding tolerance covers it), and the selections are compared apart: they may
differ only at near-ties of the logits, within twice the logits' tolerance. One compile per case
serves both tests (:func:`cuda_run`).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import NamedTuple

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._inductor.utils import run_and_get_code

from dsv4_compile import layout
from dsv4_compile.models import (
    CacheConfig,
    DeepseekV4Attention,
    build_step_metadata,
    step_inputs,
    tiny_config,
)
from dsv4_compile.models.metadata import source_window
from dsv4_compile.models.model import init_random_
from dsv4_compile.tolerances import reordered_atol, rerounded_atol

CFG = tiny_config(sliding_window=16, index_topk=8)
CACHE = CacheConfig(max_requests=4, max_seq_len=512, page_size=256)
RATIOS = (0, 4, 128)
REQ_SLOTS = (2, 0, 3)  # batch row b is request REQ_SLOTS[b]
PROMPTS = (5, 37, 150)  # 150 > 128: a c128 block completes in the prompt
#: second steps after the prompts: (mode, tokens per batch row)
STEPS = {"decode": ("decode", (1, 1, 1)), "extend": ("decode", (9, 3, 110)), "prefill": ("prefill", (9, 3, 110))}


def page_table(device="cpu") -> torch.Tensor:
    """A shuffled page table, so slots are not positions."""
    gen = torch.Generator().manual_seed(7)
    pages = torch.randperm(CACHE.num_pages, generator=gen).to(torch.int32)
    return pages.view(CACHE.max_requests, CACHE.pages_per_request).to(device)


def make_layer(ratio: int, device="cpu", seed: int = 0, cache: CacheConfig = CACHE) -> DeepseekV4Attention:
    layer = DeepseekV4Attention(CFG, ratio, cache, device=device)
    init_random_(layer, seed)
    return layer


def layer_step(layer, x, positions, batch_index, seq_lens, req_slots, page_table, mode):
    """One step of one layer: the step metadata, then the layer."""
    meta = build_step_metadata(
        positions, batch_index, seq_lens, req_slots, page_table,
        cache=CACHE, window=CFG.sliding_window,
        ratios=(layer.compress_ratio,) if layer.compress_ratio else (), mode=mode,
    )
    return layer(x, meta)


def step_args(chunks, starts, mode, device="cpu", seed=0) -> dict:
    """Arguments of :func:`layer_step` (without the layer): random bf16 inputs for the tokens."""
    args = step_inputs([[0] * n for n in chunks], starts, device)
    del args["input_ids"]
    args["req_slots"] = torch.tensor(REQ_SLOTS[: len(chunks)], device=device)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(args["positions"].shape[0], CFG.hidden_size, generator=gen)
    return dict(x=x.to(torch.bfloat16).to(device), page_table=page_table(device), mode=mode, **args)


def prompt_args(device="cpu") -> dict:
    return step_args(PROMPTS, (0,) * len(PROMPTS), "prefill", device, seed=1)


def second_args(step: str, device="cpu") -> dict:
    mode, chunks = STEPS[step]
    return step_args(chunks, PROMPTS, mode, device, seed=2)


def prompted_layer(ratio: int, device="cpu") -> DeepseekV4Attention:
    """A layer whose caches hold the prompts (prefilled eagerly)."""
    layer = make_layer(ratio, device)
    with torch.no_grad():
        layer_step(layer, **prompt_args(device))
    return layer


def cache_page_sizes(layer: DeepseekV4Attention) -> dict[str, int]:
    """Page size of each uint8 cache buffer of a layer, by buffer name."""
    sizes = {"swa_cache": layer.page_size}
    if layer.compress_ratio:
        sizes["compressed_cache"] = layer.compressed_page_size
    return sizes


def live_rows(layer: DeepseekV4Attention, name: str) -> int | None:
    """Rows of a buffer that hold state: compressor rings end in scratch rows (targets of the
    writes that are dropped), whose content is unspecified."""
    if name.endswith(("state_kv", "state_score")):
        compressor = layer.get_submodule(name.rsplit(".", 1)[0])
        return -source_window(compressor.ratio)
    return None


def assert_same_state(got: DeepseekV4Attention, want: DeepseekV4Attention, exact: bool) -> None:
    """Caches, compressor states and indexer keys of two layers agree: byte for byte (``exact``),
    else the caches dequantized within one fp8 step and the float32 buffers within fp32 noise."""
    pages = cache_page_sizes(want)
    got_buffers, want_buffers = list(got.named_buffers()), list(want.named_buffers())
    assert [n for n, _ in got_buffers] == [n for n, _ in want_buffers]
    for (name, g), (_, w) in zip(got_buffers, want_buffers):
        g, w = g[: live_rows(want, name)], w[: live_rows(want, name)]
        if exact:
            assert torch.equal(g, w), name
        elif name in pages:
            slots = torch.arange(layout.capacity(g, pages[name]), device=g.device)
            g, w = (layout.gather_dequant(c, pages[name], slots, torch.float32) for c in (g, w))
            torch.testing.assert_close(g, w, atol=1e-3, rtol=2**-3, msg=name)
        elif name.endswith("key_cache"):  # the indexer's keys, dequantized: a rounding step apart at most
            ix = want.indexer
            slots = torch.arange(layout.capacity(g, ix.page_size), device=g.device)
            g, w = (layout.gather_index_keys(c, ix.page_size, slots, ix.format) for c in (g, w))
            step = {"fp32": 0.0, "fp8": 2**-3, "fp4": 2**-1}[ix.format.values] * w.abs().amax(-1, keepdim=True)
            assert bool(((g - w).abs() <= step + 1e-4).all()), name
        else:
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)


def assert_no_cache_copy(code: str, layer: torch.nn.Module) -> None:
    """The generated code allocates no buffer of a cache's shape and copies into nothing."""
    for name, buf in layer.named_buffers():
        states = ("state_kv", "state_score", "state_max", "state_sum", "state_acc")
        if buf.dtype == torch.uint8 or name.endswith(states):
            shape = ", ".join(map(str, buf.shape))
            assert not re.search(rf"empty_strided\w*\(\({shape}\)", code), name
    assert ".copy_(" not in code


# --------------------------------------------------------------------------------------------
# one graph, no breaks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("ratio", RATIOS)
def test_one_graph_no_breaks(ratio, step):
    layer = prompted_layer(ratio)
    with torch.no_grad():
        explanation = torch._dynamo.explain(layer_step)(layer, **second_args(step))
    assert explanation.graph_count == 1, explanation.break_reasons
    assert explanation.graph_break_count == 0, explanation.break_reasons


# --------------------------------------------------------------------------------------------
# compiled == eager
# --------------------------------------------------------------------------------------------


def compiled_and_eager(ratio, step, device="cpu", **compile_kwargs):
    """(compiled layer, its output, eager twin, its output) after the prompts and ``step``."""
    torch._dynamo.reset()
    eager = prompted_layer(ratio, device)
    compiled = copy.deepcopy(eager)
    args = second_args(step, device)
    with torch.no_grad():
        want = layer_step(eager, **args)
        got = torch.compile(layer_step, fullgraph=True, **compile_kwargs)(compiled, **args)
    return compiled, got, eager, want


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("ratio", RATIOS)
def test_traced_graph_equals_eager(ratio, step):
    """aot_eager runs the traced, functionalized graph: bit-identical outputs and cache bytes."""
    compiled, got, eager, want = compiled_and_eager(ratio, step, backend="aot_eager")
    assert torch.equal(got, want)
    assert_same_state(compiled, eager, exact=True)


@pytest.mark.parametrize("ratio, step", [(128, "prefill")])
def test_inductor_calls_ops_without_cache_copy_and_equals_eager(ratio, step):
    """(Decode under Inductor, every layer kind: ``test_model.py``, the model's decode step.)"""
    torch._dynamo.reset()
    eager = prompted_layer(ratio)
    compiled = copy.deepcopy(eager)
    args = second_args(step)
    with torch.no_grad():
        want = layer_step(eager, **args)
        got, codes = run_and_get_code(torch.compile(layer_step, fullgraph=True), compiled, **args)
    code = "\n".join(codes)
    ops = ["fused_k_norm_rope_flashmla"]
    ops += ["flash_mla_with_kvcache", "get_mla_metadata"] if STEPS[step][0] == "decode" else ["flash_mla_sparse_fwd"]
    for op in ops:
        assert f"torch.ops.dsv4.{op}.default" in code, op
    assert code.count("torch.ops.dsv4.fused_k_norm_rope_flashmla.default") == 2  # window + compressed
    assert_no_cache_copy(code, compiled)
    assert_output_gemms_without_copy(code)
    # Inductor reorders float32 reductions (norms, softmax), and the prefill reads the keys it
    # stored as bf16 before the cache: tolerances.REORDERED_ULPS (measured: 0.38 ulp)
    torch.testing.assert_close(got, want, atol=reordered_atol(want), rtol=0)
    assert_same_state(compiled, eager, exact=False)


def assert_output_gemms_without_copy(code: str) -> None:
    """In Inductor's code, ``wo_b``'s GEMM reads ``wo_a``'s batched-GEMM output as it is, a
    column-major ``[T, G * o_lora_rank]`` operand, and no kernel runs between the two GEMMs."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if "extern_kernels.bmm(" in line)
    low = re.search(r"out=(buf\d+)\)", lines[start]).group(1)
    for line in lines[start + 1:]:
        if "extern_kernels.mm(" in line:
            assert re.search(rf"reinterpret_tensor\({low}, \((\w+), \w+\), \(1, \1\), 0\)", line), line
            return
        assert re.match(r"\s*(#|del |assert_size_stride\(|buf\d+ = empty_strided)", line), f"between the GEMMs: {line}"
    raise AssertionError("no GEMM after wo_a's batched GEMM")


@pytest.mark.parametrize("exporting_before_2_13", [False, True])
def test_output_projection_layouts_equal_the_grouped_formula(monkeypatch, exporting_before_2_13):
    """``wo_a``'s grouped low-rank projection: head group ``g`` through its block of ``wo_a``.
    Outside export (and when exporting on torch >= 2.13) the result is the transpose of a
    contiguous ``[G * o_lora_rank, T]``, which ``wo_b`` reads without a copy; exported on older
    torch, a row-major ``[T, G * o_lora_rank]`` (docs/design.md §5). Both equal the float64
    formula within the bf16 rounding of the output."""
    from dsv4_compile.models import attention, metadata

    layer = make_layer(0)
    tokens, groups, rank = 7, layer.groups, layer.o_lora_rank
    out = torch.randn(tokens, layer.heads, layout.HEAD_DIM, dtype=torch.bfloat16)
    blocks = layer.wo_a.weight.view(groups, rank, -1).double()
    want = torch.einsum("tgk,grk->tgr", out.view(tokens, groups, -1).double(), blocks).reshape(tokens, -1)
    if exporting_before_2_13:
        monkeypatch.setattr(attention, "_TRANSPOSED_EXPORT", False)
        with metadata.counts_apart():
            got = layer._grouped_low_rank(out)
        assert got.is_contiguous()
    else:
        got = layer._grouped_low_rank(out)
        assert got.t().is_contiguous()
    assert got.shape == (tokens, groups * rank)
    torch.testing.assert_close(got.double(), want, atol=2**-8 * want.abs().max().item(), rtol=2**-7)


# --------------------------------------------------------------------------------------------
# shapes that change between steps cost at most one (dynamic) recompile
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, batches",
    [
        ("decode", [(1, 1, 1), (1, 1), (1, 1, 1), (1,) * 3]),
        ("decode", [(1, 1, 1), (4, 2), (9, 3, 20), (1, 1)]),
        ("prefill", [(9, 3, 110), (20, 7), (1, 2, 3), (64, 5)]),
    ],
    ids=["decode", "extend", "prefill"],
)
@pytest.mark.parametrize("ratio", [4])
def test_changing_token_and_request_counts_recompiles_at_most_once(ratio, mode, batches):
    """Sizes >= 2: Dynamo specializes sizes 0 and 1 (T = 1 or B = 1 is a graph of its own)."""
    torch._dynamo.reset()
    layer = prompted_layer(ratio)
    counter = CompileCounter()
    compiled = torch.compile(layer_step, backend=counter, fullgraph=True)
    with torch.no_grad():
        for seed, chunks in enumerate(batches):
            starts = PROMPTS[: len(chunks)]
            compiled(layer, **step_args(chunks, starts, mode, seed=seed))
    assert counter.frame_count <= 2, counter.frame_count


# --------------------------------------------------------------------------------------------
# CUDA: the same compile checks, and CUDA graphs (reduce-overhead) without skips
# --------------------------------------------------------------------------------------------


def record_selections(layer: DeepseekV4Attention) -> list:
    """Make ``layer``'s indexer append ``(q, weights, q_scales, rows, lengths, blocks)`` of each
    selection it makes to the returned list, eagerly and in compiled code (a side effect Dynamo
    replays after the graph); an empty list for layers without an indexer."""
    seen = []
    if layer.indexer is not None:
        select = layer.indexer.select

        def recorded(q, weights, q_scales, plan):
            blocks = select(q, weights, q_scales, plan)
            seen.append((q, weights, q_scales, plan.rows, plan.lengths, blocks))
            return blocks

        layer.indexer.select = recorded
    return seen


def selection(layer: DeepseekV4Attention, seen: list, page_table: torch.Tensor) -> tuple | None:
    """``(logits, lengths, blocks)`` on CPU of the first selection ``seen`` recorded, the logits of
    every visible block (``dsv4::indexer_cache_logits`` over the layer's key cache after the
    step, the computation the selection ranks); ``None`` without one."""
    if not seen:
        return None
    q, weights, q_scales, rows, lengths, blocks = seen[0]
    ix = layer.indexer
    slots = layout.visible_slots(page_table, rows, lengths, ix.page_size, CACHE.max_blocks(4))
    logits = torch.ops.dsv4.indexer_cache_logits(q, weights, ix.key_cache, slots, ix.page_size, ix.format.name, q_scales)
    return logits.cpu(), lengths.cpu(), blocks.cpu()


class CudaRun(NamedTuple):
    """A layer compiled and its eager twin after the prompts and one more step on CUDA."""

    compiled: DeepseekV4Attention
    eager: DeepseekV4Attention
    got: torch.Tensor  # the compiled step's output, on CPU
    want: torch.Tensor  # the eager step's output, on CPU
    got_selection: tuple | None  # (logits, lengths, blocks) of the compiled indexer, on CPU
    want_selection: tuple | None  # the same of the eager indexer


@functools.cache
def cuda_run(ratio: int, step: str, emulate_precision_casts: bool = False) -> CudaRun:
    """Compiled (Inductor) and eager steps of a prompted layer, each recording its indexer's
    selection. Cached: the output test and the selection test share one compile."""
    torch._dynamo.reset()
    eager = prompted_layer(ratio, "cuda")
    compiled = copy.deepcopy(eager)
    seen_eager, seen_compiled = record_selections(eager), record_selections(compiled)
    options = {"emulate_precision_casts": True} if emulate_precision_casts else {}
    args = second_args(step, "cuda")
    with torch.no_grad():
        want = layer_step(eager, **args)
        got = torch.compile(layer_step, fullgraph=True, options=options)(compiled, **args)
        got_selection = selection(compiled, seen_compiled, args["page_table"])
        want_selection = selection(eager, seen_eager, args["page_table"])
    return CudaRun(compiled, eager, got.cpu(), want.cpu(), got_selection, want_selection)


def same_selection_rows(run: CudaRun) -> torch.Tensor:
    """Rows whose compiled and eager indexers selected the same block set (every row without an
    indexer), as a bool mask: only there are the two outputs one computation rounded two ways (a
    row that attends another block attends another key). Most rows, asserted."""
    rows = run.want.shape[0]
    if run.want_selection is None:
        return torch.ones(rows, dtype=torch.bool)
    got, want = run.got_selection[2], run.want_selection[2]
    same = torch.tensor([set(g.tolist()) == set(w.tolist()) for g, w in zip(got, want)])
    assert same.float().mean() > 0.75, f"the comparison must cover most rows: {int(same.sum())} of {rows}"
    return same


def finite_scale_atol(logits: torch.Tensor, atol_of) -> float:
    """``atol_of`` of the visible (finite) logits."""
    return atol_of(torch.where(logits.isfinite(), logits, 0))


@pytest.mark.cuda
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("ratio", RATIOS)
def test_cuda_compiled_equals_eager(ratio, step):
    """(``fullgraph=True``: one graph, no breaks.) On the rows that select the same blocks, the
    compiled output is eager's within an FP8 step's share (the compiled code skips bf16 roundings,
    :data:`~dsv4_compile.tolerances.FP8_STEP_SHARE`; the test below is tight); caches and states
    within one fp8 step and fp32 noise."""
    run = cuda_run(ratio, step)
    rows = same_selection_rows(run)
    got, want = run.got[rows], run.want[rows]
    torch.testing.assert_close(got, want, atol=rerounded_atol(want), rtol=0)
    assert_same_state(run.compiled, run.eager, exact=False)


@pytest.mark.cuda
@pytest.mark.parametrize("step", sorted(STEPS))
def test_cuda_compiled_indexer_selects_eagers_blocks_but_at_near_ties(step):
    """The compiled indexer's logits are eager's within an FP8 step's share of their scale (its
    queries, head weights and this step's keys round at other places before their FP8
    quantization: :data:`~dsv4_compile.tolerances.FP8_STEP_SHARE`); so its selection is eager's
    but where a block it swaps lies within twice that tolerance of eager's k-th logit (a near-tie
    the roundings may break either way)."""
    run = cuda_run(4, step)
    (got_logits, _, got_blocks), (logits, lengths, blocks) = run.got_selection, run.want_selection
    atol = finite_scale_atol(logits, rerounded_atol)
    torch.testing.assert_close(got_logits, logits, atol=atol, rtol=0)
    k = blocks.shape[1]
    kth = logits.topk(min(k, logits.shape[1]), dim=-1).values[:, -1]
    for t in range(blocks.shape[0]):
        swapped = set(got_blocks[t].tolist()) ^ set(blocks[t].tolist())
        far = {b: (logits[t, b] - kth[t]).item() for b in swapped if (logits[t, b] - kth[t]).abs() > 2 * atol}
        assert not far, f"row {t} (of {int(lengths[t])} blocks): blocks {far} beyond a near-tie (2 * {atol:.3g})"


@pytest.mark.cuda
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("ratio", RATIOS)
def test_cuda_compiled_with_eager_roundings_equals_eager(ratio, step):
    """With Inductor rounding where eager code rounds (``emulate_precision_casts``), the compiled
    layer's output is eager's within ``tolerances.REORDERED_ULPS`` bf16 ulps of its largest
    magnitude on the rows that select the same blocks, where the test above allows an FP8 step's
    share of it for the skipped roundings (measured: benchmarks/RESULTS.md)."""
    run = cuda_run(ratio, step, emulate_precision_casts=True)
    rows = same_selection_rows(run)
    got, want = run.got[rows], run.want[rows]
    torch.testing.assert_close(got, want, atol=reordered_atol(want), rtol=0)
    assert_same_state(run.compiled, run.eager, exact=False)


@pytest.mark.cuda
@pytest.mark.parametrize("ratio", RATIOS)
def test_cuda_reduce_overhead_decode_has_no_cudagraph_skips(ratio):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = prompted_layer(ratio, "cuda")
    compiled = copy.deepcopy(eager)
    step = torch.compile(layer_step, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(3):  # warm-up, record, replay
            args = step_args((1, 1, 1), [n + i for n in PROMPTS], "decode", "cuda", seed=i)
            want = layer_step(eager, **args)
            got = step(compiled, **args).clone()
            torch.testing.assert_close(got, want, atol=rerounded_atol(want), rtol=0)  # skipped roundings
    assert dict(counters["inductor"]).get("cudagraph_skips", 0) == 0
    assert_same_state(compiled, eager, exact=False)
