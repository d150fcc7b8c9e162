"""The small DSV4 model: one graph per step, compiled decode == eager decode, greedy generation
over prompts of different lengths, and prefill/decode consistency."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import dsv4_compile as d4
from torch._inductor.utils import run_and_get_code

from dsv4_compile.generation import Batch, choice_margins, random_prompts
from dsv4_compile.models import (
    CacheConfig,
    DeepseekV4Model,
    decode_inputs,
    generate,
    prefill_chunks,
    prefill_inputs,
    prefill_prompts,
    step_inputs,
    tiny_config,
)
from dsv4_compile.models.model import residual_add
from dsv4_compile.tolerances import regrouped_atol, reordered_atol, rerounded_atol
from helpers import assert_same_choices_but_near_ties, assert_steps_close
from test_block import assert_no_cache_copy

CFG = tiny_config(sliding_window=32)
CACHE = CacheConfig(max_requests=4, max_seq_len=512, page_size=256)
PROMPT_LENGTHS = (5, 37, 150)
STEPS = 5


def prompts() -> list[list[int]]:
    return random_prompts(CFG.vocab_size, PROMPT_LENGTHS, seed=3)


#: The caches' formats the model tests run (CacheConfig's arguments), by a test id.
CACHES = {
    "v4": {},
    "v4.1-fp8": dict(kv_format="v4.1-fp8"),
    "v4.1-fp8-interleaved,c4-fp4": dict(kv_format="v4.1-fp8-interleaved", c4_kv_format="v4.1-fp4-interleaved"),
}


def make_model(device="cpu", **formats) -> DeepseekV4Model:
    cache = CacheConfig(max_requests=4, max_seq_len=512, page_size=256, **formats)
    return DeepseekV4Model(CFG, cache, seed=0, device=device)


def run_generation(model, decode, device="cpu", follow=None):
    """Greedy tokens and per-step logits; prefill eager, decode through ``decode`` (fed
    ``follow``'s tokens if given)."""
    logits = []
    with torch.no_grad():
        tokens = generate(model, decode, prompts(), STEPS, device, on_step=lambda s, l: logits.append(l), follow=follow)
    return tokens, logits


@pytest.mark.parametrize("caches", CACHES)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_step_is_one_graph_without_breaks(mode, caches):
    model = make_model("cpu", **CACHES[caches])
    batch = Batch(prompts())
    inputs = prefill_inputs(batch.tokens, "cpu") if mode == "prefill" else decode_inputs(batch, "cpu")
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(**inputs, mode=mode)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_step_in_the_batch_invariant_mode_is_one_graph_without_breaks(mode):
    model = make_model("cpu")
    batch = Batch(prompts())
    inputs = prefill_inputs(batch.tokens, "cpu") if mode == "prefill" else decode_inputs(batch, "cpu")
    with torch.no_grad(), d4.batch_invariant():
        explanation = torch._dynamo.explain(model)(**inputs, mode=mode)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    invariant = [n for g in explanation.graphs for n in g.graph.nodes
                 if n.op == "call_function" and "dsv4" in str(n.target) and n.kwargs.get("batch_invariant", n.args[-1]) is True]
    assert invariant, "no dsv4 call in the graph asks for the mode"


def test_one_prefill_equals_prefill_then_decode_steps():
    """Generating token by token and prefilling the generated text give the same last logits:
    the compressor state ring, the window and the indexer see the same tokens either way."""
    model = make_model()
    tokens, logits = run_generation(model, model)
    text = [p + t[:-1] for p, t in zip(prompts(), tokens)]
    for mode in ("prefill", "decode"):  # decode mode also runs multi-token (extend) steps
        model.reset_caches()
        with torch.no_grad():
            again = model(**prefill_inputs(text, "cpu"), mode=mode)
        # one prompt regrouped: tolerances.REGROUPED_ULPS
        torch.testing.assert_close(again, logits[-1], atol=regrouped_atol(logits[-1]), rtol=0)


def test_extend_in_chunks_equals_one_prefill():
    model = make_model()
    text = prompts()
    with torch.no_grad():
        want = model(**prefill_inputs(text, "cpu"), mode="prefill")
        model.reset_caches()
        cut = [n // 3 for n in PROMPT_LENGTHS]
        model(**step_inputs([t[:c] for t, c in zip(text, cut)], [0] * len(text), "cpu"), mode="prefill")
        got = model(**step_inputs([t[c:] for t, c in zip(text, cut)], cut, "cpu"), mode="decode")
    # the same tokens in two steps instead of one: tolerances.REGROUPED_ULPS
    torch.testing.assert_close(got, want, atol=regrouped_atol(want), rtol=0)


def test_prefill_chunks_pack_requests_in_order_within_the_budget():
    assert prefill_chunks([[1] * 5, [2] * 3, [3] * 9], 4) == [
        [(0, 0, 4)], [(0, 4, 1), (1, 0, 3)], [(2, 0, 4)], [(2, 4, 4)], [(2, 8, 1)],
    ]
    assert prefill_chunks([[1] * 2, [2]], 8) == [[(0, 0, 2), (1, 0, 1)]]
    for bad, match in (((([1],), 0), "chunk_tokens must be >= 1, got 0"), ((([1], []), 4), "empty prompts at \\[1\\]")):
        with pytest.raises(ValueError, match=match):
            prefill_chunks(*bad)


@pytest.mark.parametrize("chunk_tokens", [1, 16, 64])
def test_chunked_prefill_equals_one_prefill(chunk_tokens):
    """Steps of at most ``chunk_tokens`` tokens (a prompt split across steps, several prompts in
    one step) give each prompt's last logits of one prefill step within bf16 noise (the steps
    round the same values in other groupings: ``tolerances.REGROUPED_ULPS``); decoding from the
    caches and states those steps wrote, fed the same tokens, gives the one-step run's logits within
    the FP8 step of a cached value that a regrouped rounding carried across a rounding boundary
    (``tolerances.FP8_STEP_SHARE``), and its greedy choices but where two logits lie within twice
    that of each other (near-ties)."""
    model = make_model()
    want_logits = []
    with torch.no_grad():
        want = prefill_prompts(model, prompts(), "cpu")
        model.reset_caches()
        want_tokens = generate(model, model, prompts(), STEPS, "cpu", on_step=lambda s, l: want_logits.append(l))
        model.reset_caches()
        got = prefill_prompts(model, prompts(), "cpu", chunk_tokens=chunk_tokens)
        model.reset_caches()
        got_logits = []
        got_tokens = generate(model, model, prompts(), STEPS, "cpu", chunk_tokens=chunk_tokens, follow=want_tokens,
                              on_step=lambda s, l: got_logits.append(l))
    torch.testing.assert_close(got, want, atol=regrouped_atol(want), rtol=0)
    assert_steps_close(got_logits, want_logits, rerounded_atol)
    assert_same_choices_but_near_ties(want_logits, want_tokens, got_tokens, rerounded_atol)


def test_residual_add_has_the_bits_of_the_bf16_add():
    """The layers' residual add, written through float32, equals PyTorch's bf16 ``h + delta`` bit
    for bit, eagerly and compiled: magnitudes spread over 2^-40..2^40, exact cancellations, exact
    rounding ties."""
    gen = torch.Generator().manual_seed(0)

    def spread(n):
        return torch.randn(n, generator=gen) * 2.0 ** torch.randint(-40, 41, (n,), generator=gen)

    h, delta = spread(1 << 16).bfloat16(), spread(1 << 16).bfloat16()
    delta[:1024] = -h[:1024]
    _, exponent = torch.frexp(h[1024:2048].float())
    delta[1024:2048] = torch.ldexp(torch.ones(1024), exponent - 9).bfloat16()  # half of h's ulp: ties
    want = (h + delta).view(torch.int16)
    assert torch.equal(residual_add(h, delta).view(torch.int16), want)
    assert torch.equal(torch.compile(residual_add, fullgraph=True)(h, delta).view(torch.int16), want)


def test_generate_follows_given_tokens():
    """``follow``: fed its own greedy tokens, a run repeats itself exactly (the same computation);
    fed other tokens, each step sees them (its logits are those of a run whose greedy choices they
    were) and the greedy choices are still returned. Too few tokens to follow is an error."""
    model = make_model()
    tokens, logits = run_generation(model, model)
    logits_again = []
    with torch.no_grad():
        model.reset_caches()
        again = generate(model, model, prompts(), STEPS, "cpu", follow=tokens, on_step=lambda s, l: logits_again.append(l))
    assert again == tokens
    for got, want in zip(logits_again, logits):
        torch.testing.assert_close(got, want, atol=0, rtol=0)

    other = [[(t + 1) % CFG.vocab_size for t in row] for row in tokens]
    fed = []
    with torch.no_grad():
        model.reset_caches()
        chosen = generate(model, model, prompts(), STEPS, "cpu", follow=other, on_step=lambda s, l: fed.append(l))
    torch.testing.assert_close(fed[0], logits[0], atol=0, rtol=0)  # the prefill does not depend on follow
    assert [row[0] for row in chosen] == [row[0] for row in tokens]
    assert any(not torch.equal(a, b) for a, b in zip(fed[1:], logits[1:]))  # fed other tokens from step 1
    assert chosen == [[int(step[r].argmax()) for step in fed] for r in range(len(chosen))]
    with torch.no_grad(), pytest.raises(ValueError, match="follow must hold at least steps \\(5\\) tokens"):
        generate(model, model, prompts(), STEPS, "cpu", follow=[row[:2] for row in tokens])


def test_choice_margins_say_how_far_below_the_top_a_differing_choice_lies():
    logits = [torch.tensor([[0.0, 1.0, 0.9]]), torch.tensor([[2.0, 0.0, 1.5]])]
    assert choice_margins(logits, [[1, 0]], [[1, 0]]) == []
    assert choice_margins(logits, [[1, 0]], [[2, 2]]) == pytest.approx([0.1, 0.5])


@pytest.mark.parametrize("caches", CACHES)
def test_compiled_decode_generates_what_eager_generates(caches):
    """Inductor: the decode step calls the dsv4 ops, copies no cache, and, fed the eager run's
    tokens, gives its logits within the FP8 step of a cached value (Inductor keeps in float32 values
    eager code rounds to bf16, which moves some across the caches' rounding boundaries:
    ``tolerances.FP8_STEP_SHARE``) and its greedy choices but where two logits lie within twice
    that of each other, for every cache format. The test below bounds the compiled step tightly."""
    eager = make_model("cpu", **CACHES[caches])
    compiled_model = copy.deepcopy(eager)
    want_tokens, want_logits = run_generation(eager, eager)

    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, fullgraph=True)
    codes = []

    def decode(**inputs):
        if codes:
            return compiled(**inputs)
        out, code = run_and_get_code(compiled, **inputs)
        codes.extend(code)
        return out

    got_tokens, got_logits = run_generation(compiled_model, decode, follow=want_tokens)
    code = "\n".join(codes)
    for op in ("fused_k_norm_rope_flashmla", "flash_mla_with_kvcache"):
        assert f"torch.ops.dsv4.{op}.default" in code, op
    # every layer kind's schedule from one call per step
    assert code.count("torch.ops.dsv4.get_mla_metadata_stacked.default(") == len(codes), codes
    assert "torch.ops.dsv4.get_mla_metadata.default(" not in code
    for layer in compiled_model.layers:
        assert_no_cache_copy(code, layer.attn)
    assert_steps_close(got_logits, want_logits, rerounded_atol)
    assert_same_choices_but_near_ties(want_logits, want_tokens, got_tokens, rerounded_atol)


#: torch 2.10's CPU Inductor fails to generate code with emulated casts (``CppVecOverrides.to_dtype()
#: got an unexpected keyword argument 'use_compute_types'``); 2.13 does it
@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 13),
                    reason="before torch 2.13 Inductor's CPU code cannot emulate eager's precision casts")
@pytest.mark.parametrize("caches", CACHES)
def test_compiled_decode_with_eager_roundings_gives_the_eager_logits(caches):
    """With Inductor rounding where eager code rounds (``emulate_precision_casts``; by default a
    fused kernel skips a cast to bf16 whose result it reads back in float32), the compiled decode,
    fed the eager run's tokens, gives the eager logits of every step within
    ``tolerances.REORDERED_ULPS`` bf16 ulps of their largest magnitude, for every cache format: what
    is left is the summation order of reductions.

    Without the emulation the difference is far larger (up to ~0.2 at a scale of ~3 on random models
    of this shape, benchmarks/RESULTS.md): the skipped roundings move values across FP8 / FP4
    rounding boundaries of the compressed caches. This test bounds the compiled step's own error
    tightly (on 17 random models: bit for bit in 15, at most 1.5 ulps off in the others), where the
    default-config test above needs a tolerance for that noise."""
    eager = make_model("cpu", **CACHES[caches])
    compiled_model = copy.deepcopy(eager)
    want_tokens, want_logits = run_generation(eager, eager)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, fullgraph=True, options={"emulate_precision_casts": True})
    _, got_logits = run_generation(compiled_model, compiled, follow=want_tokens)
    assert_steps_close(got_logits, want_logits, reordered_atol)


def test_decode_schedules_every_kind_at_once_from_what_its_layers_pass(monkeypatch):
    """A decode step computes every layer kind's schedule with one ``get_mla_metadata_stacked``
    call, planned from the widths and lengths each layer of the kind then passes for its decode (a
    schedule for other widths or lengths would be wrong on FlashMLA)."""
    from dsv4_compile.models import metadata

    model = make_model()
    stacked, passed = [], {}
    real_stacked, real_scheduler = metadata.ops.get_mla_metadata_stacked, metadata.StepMetadata.scheduler

    def record_stacked(*args):
        stacked.append(args)
        return real_stacked(*args)

    def record_scheduler(self, kind, q, indices, lengths, extra_indices, extra_lengths):
        passed.setdefault(kind, []).append((
            indices.shape[-1], lengths, 0 if extra_indices is None else extra_indices.shape[-1], extra_lengths,
        ))
        return real_scheduler(self, kind, q, indices, lengths, extra_indices, extra_lengths)

    monkeypatch.setattr(metadata.ops, "get_mla_metadata_stacked", record_stacked)
    monkeypatch.setattr(metadata.StepMetadata, "scheduler", record_scheduler)
    with torch.no_grad():
        model(**prefill_inputs(prompts(), "cpu"), mode="prefill")
        assert not stacked and not passed
        model(**decode_inputs(Batch([p + [1] for p in prompts()]), "cpu"), mode="decode")
    assert len(stacked) == 1
    _, widths, lengths, extra_widths, extra_lengths = stacked[0]
    assert sorted(passed) == sorted(model.extra_widths) == [0, 4, 128]
    for k, kind in enumerate(model.extra_widths):
        for width, layer_lengths, extra_width, layer_extra_lengths in passed[kind]:  # every layer of the kind
            assert (widths[k], extra_widths[k]) == (width, extra_width), kind
            assert torch.equal(lengths[k], layer_lengths), kind
            if layer_extra_lengths is None:
                assert extra_lengths[k] is None and kind == 0
            else:
                assert torch.equal(extra_lengths[k], layer_extra_lengths), kind


def test_decode_batch_size_changes_recompile_at_most_once():
    torch._dynamo.reset()
    model = make_model()
    counter = CompileCounter()
    step = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for rows in (3, 2, 4, 3):
            batch = Batch([[1] * (10 + 7 * b) for b in range(rows)])
            step(**decode_inputs(batch, "cpu"), mode="decode")
    assert counter.frame_count <= 2, counter.frame_count


def reduce_overhead_decode(caches: str, index_format: str = "fp32", **options) -> tuple[list, list, int]:
    """The eager logits of every step, the ``reduce-overhead`` decode's (Inductor ``options``),
    fed the eager run's tokens (teacher forcing: free-running greedy decoding can flip on a
    near-tie of two logits), and the cudagraph skips it recorded; on CUDA. The indexer scores
    exactly by default (``"fp32"``): a quantized one turns the compiled code's float32 rounding
    differences into whole FP8 / FP4 steps of a query, whose selection can then differ from
    eager's at a near-tie of two blocks."""
    from torch._dynamo.utils import counters

    eager = make_model("cuda", **CACHES[caches], index_format=index_format)
    compiled_model = copy.deepcopy(eager)
    want_tokens, want_logits = run_generation(eager, eager, "cuda")
    torch._dynamo.reset()
    counters.clear()
    # torch.compile takes a mode or options: "reduce-overhead" is Inductor's triton.cudagraphs
    how = {"options": {"triton.cudagraphs": True, **options}} if options else {"mode": "reduce-overhead"}
    compiled = torch.compile(compiled_model, fullgraph=True, **how)
    got_logits = []
    with torch.no_grad():
        compiled_model(**prefill_inputs(prompts(), "cuda"), mode="prefill")
        batch = Batch([p + [t[0]] for p, t in zip(prompts(), want_tokens)])
        for step in range(1, STEPS + 1):
            got_logits.append(compiled(**decode_inputs(batch, "cuda"), mode="decode").clone())
            for tokens, want in zip(batch.tokens, want_tokens):
                tokens.append(want[step])
    return got_logits, want_logits[1:], dict(counters["inductor"]).get("cudagraph_skips", 0)


@pytest.mark.cuda
@pytest.mark.parametrize("caches", CACHES)
def test_cuda_reduce_overhead_decode_has_no_cudagraph_skips(caches):
    """``mode="reduce-overhead"`` decode records no cudagraph skip and gives the eager logits at
    every step within the FP8 step of a cached value (``tolerances.FP8_STEP_SHARE``: the compiled
    code skips bf16 roundings), for every cache format."""
    got_logits, want_logits, skips = reduce_overhead_decode(caches)
    assert skips == 0
    assert_steps_close(got_logits, want_logits, rerounded_atol, first_step=1)


@pytest.mark.cuda
@pytest.mark.parametrize("index_format", ["fp8", "fp4"])
def test_cuda_reduce_overhead_decode_with_a_quantized_indexer(index_format):
    """With the FP8 / FP4 indexer key cache: no cudagraph skip, finite logits, and at every step
    most rows within the test above's tolerance of eager (a row whose indexer selection flips at
    a near-tie is not)."""
    got_logits, want_logits, skips = reduce_overhead_decode("v4.1-fp8", index_format)
    assert skips == 0
    for got, want in zip(got_logits, want_logits):
        assert bool(got.isfinite().all())
        close = ((got - want).abs() <= rerounded_atol(want)).all(dim=-1)
        assert close.float().mean().item() >= 0.5, close


@pytest.mark.cuda
def test_cuda_reduce_overhead_decode_in_the_batch_invariant_mode():
    """In the batch-invariant mode (eager and compiled): no cudagraph skip, and the eager logits
    within the FP8 step, as in the default mode."""
    with d4.batch_invariant():
        got_logits, want_logits, skips = reduce_overhead_decode("v4")
    assert skips == 0
    assert_steps_close(got_logits, want_logits, rerounded_atol, first_step=1)


@pytest.mark.cuda
@pytest.mark.parametrize("caches", ["v4", "v4.1-fp8-interleaved,c4-fp4"])
def test_cuda_reduce_overhead_with_eager_roundings_gives_the_eager_logits(caches):
    """The CUDA counterpart of ``test_compiled_decode_with_eager_roundings_gives_the_eager_logits``:
    with ``emulate_precision_casts`` the ``reduce-overhead`` decode gives the eager logits of every
    step within ``tolerances.REORDERED_ULPS`` bf16 ulps of their largest magnitude, where the test
    above needs a tolerance for the skipped roundings (measured on the H200: benchmarks/RESULTS.md).
    Two of :data:`CACHES`: in a decode step the formats live inside the opaque ops, which run the
    same kernels eager and compiled, so V4 and the format farthest from it (interleaved V4.1, FP4
    compressed) cover the compiled code around them (each compile costs ~30 s of the GPU suite)."""
    got_logits, want_logits, skips = reduce_overhead_decode(caches, emulate_precision_casts=True)
    assert skips == 0
    assert_steps_close(got_logits, want_logits, reordered_atol, first_step=1)


@pytest.mark.cuda
def test_cuda_reduce_overhead_warm_up_can_be_the_first_decode_of_a_process():
    """In a fresh process whose first decode is a ``reduce-overhead`` warm-up (the ops' first calls,
    provider resolution included, run inside the CUDA-graph pool), nothing the call creates
    outlives it: the graph records (it refused with "tensors in the cudagraph pool not tracked as
    outputs" while a refused provider's stored exception held the warm-up's frames)."""
    script = textwrap.dedent("""
        import torch
        from torch._dynamo.utils import counters
        from dsv4_compile.generation import Batch, random_prompts
        from dsv4_compile.models import CacheConfig, DeepseekV4Model, decode_inputs, prefill_prompts, tiny_config
        config = tiny_config(sliding_window=32)
        cache = CacheConfig(max_requests=4, max_seq_len=512, page_size=256)
        model = DeepseekV4Model(config, cache, seed=0, device="cuda")
        texts = random_prompts(config.vocab_size, [40, 90], seed=3)
        with torch.no_grad():
            prefill_prompts(model, texts, "cuda", 512)
            step = torch.compile(model, fullgraph=True, mode="reduce-overhead")
            inputs = decode_inputs(Batch([t + [1] for t in texts]), "cuda")
            for _ in range(3):  # warm-up, recording, replay
                step(**inputs, mode="decode")
            torch.cuda.synchronize()
        # recorded, not skipped: a skipped graph runs without the pool and would pass regardless
        assert counters["inductor"].get("cudagraph_skips", 0) == 0, dict(counters["inductor"])
    """)
    child = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(__file__)),
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
