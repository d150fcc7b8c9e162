"""torch.compile: a store -> decode -> prefill step is one graph, equals eager, never copies a cache."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import dsv4_compile as d4

from helpers import random_indices, rope_table

P = 8


def step(kv, w, freqs, pos, loc, q, indices, lengths, sink, ws_slots, cache):
    """Store new tokens, decode against the cache, prefill over a dequantized workspace."""
    d4.fused_k_norm_rope_flashmla(kv, w, freqs, pos, loc, cache, 1e-6, P)
    out, lse = d4.flash_mla_with_kvcache(q, cache, P, indices, lengths, sink)
    ws = d4.dequant_workspace(cache, P, ws_slots)
    prefill_idx = torch.arange(ws_slots.shape[0], dtype=torch.int32).expand(q.shape[0], 1, -1)
    pout, _, plse = d4.flash_mla_sparse_fwd(q[:, 0], ws, prefill_idx, 0.05, attn_sink=sink)
    return out * 2 + 1, lse, pout, plse


def inputs(tokens=6, batch=3):
    torch.manual_seed(tokens)
    kv = torch.randn(tokens, 512, dtype=torch.bfloat16)
    w = torch.randn(512, dtype=torch.bfloat16)
    q = torch.randn(batch, 1, 16, 512, dtype=torch.bfloat16)
    return dict(
        kv=kv, w=w, freqs=rope_table(128), pos=torch.arange(tokens), loc=torch.randperm(4 * P)[:tokens],
        q=q, indices=random_indices((batch, 1, 12), 4 * P), lengths=torch.full((batch,), 9, dtype=torch.int32),
        sink=torch.randn(16), ws_slots=torch.arange(10), cache=d4.alloc_cache(4, P),
    )


def test_one_graph_no_breaks():
    explanation = torch._dynamo.explain(step)(**inputs())
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0


def test_compiled_equals_eager_and_calls_ops_without_cache_copy():
    torch._dynamo.reset()
    eager_in, compiled_in = inputs(), inputs()
    with torch.no_grad():
        want = step(**eager_in)
        got, codes = run_and_get_code(torch.compile(step, fullgraph=True), **compiled_in)
    assert torch.equal(eager_in["cache"], compiled_in["cache"])
    # bit for bit: the ops run the same kernels compiled or not, and the graph's own code is exact
    # or rounds once either way (the workspace's dequantization, ``out * 2 + 1``)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    code = "\n".join(codes)
    for op in ("fused_k_norm_rope_flashmla", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"):
        assert f"torch.ops.dsv4.{op}.default" in code
    cache_shape = tuple(compiled_in["cache"].shape)
    # no buffer of the cache's shape is allocated (a clone) and nothing is copied into a cache
    assert not re.search(rf"empty_strided\w*\(\({cache_shape[0]}, {cache_shape[1]}\)", code)
    assert ".copy_(" not in code


def test_token_count_change_recompiles_at_most_once():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch.no_grad():
        for tokens, batch in ((4, 2), (6, 3), (9, 5), (3, 4)):
            compiled(**inputs(tokens, batch))
    assert counter.frame_count <= 2, counter.frame_count


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_compile_modes(mode):
    torch._dynamo.reset()
    a, b = inputs(), inputs()
    with torch.no_grad():
        want = step(**a)
        got = torch.compile(step, fullgraph=True, mode=mode)(**b)
    assert torch.equal(a["cache"], b["cache"])
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):  # bit for bit, as above
        torch.testing.assert_close(g, w, atol=0, rtol=0)
