"""Quickstart: store tokens into a paged V4 FP8 cache, decode, prefill, compile — on any device.

Runs on CUDA if present, else CPU. Prints the provider serving each op, the max error of decode and
prefill against an independent float64 computation, and the torch.compile result of a
store -> decode step (graph count, graph breaks, max difference compiled vs eager).

    python examples/quickstart.py [--device cpu|cuda|xpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import dsv4_compile as d4

PAGE_SIZE, NUM_PAGES, HEADS = 64, 8, 64


def rope_table(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    inv = theta ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.stack([ang.cos(), ang.sin()], -1).flatten(-2).float()


def float64_attention(q, keys, valid, scale, sink):
    """Dense float64 attention over the valid keys of each row, sink in the denominator."""
    s = torch.einsum("nhd,nkd->nhk", q.double(), keys.double()) * scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("nhk,nkd->nhd", p, keys.double()) / (1 + torch.exp(sink.double() - lse))[..., None]
    return out, lse


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)

    # 1. store 300 tokens (K norm + RoPE + FP8) into a 8-page cache of 64-token pages
    cache = d4.alloc_cache(NUM_PAGES, PAGE_SIZE, device)
    tokens = 300
    kv = torch.randn(tokens, 512, dtype=torch.bfloat16, device=device) * 2
    kv_weight = torch.ones(512, dtype=torch.bfloat16, device=device)
    freqs = rope_table(4096).to(device)
    positions = torch.arange(tokens, device=device)
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, device=device)[:tokens]
    d4.fused_k_norm_rope_flashmla(kv, kv_weight, freqs, positions, slots, cache, 1e-6, PAGE_SIZE)

    # 2. sparse decode: 8 requests, 128 selected slots each (-1 = hole), a learned sink per head
    batch, width = 8, 128
    q = torch.randn(batch, 1, HEADS, 512, dtype=torch.bfloat16, device=device)
    pick = torch.randint(0, tokens, (batch, 1, width), device=device)
    indices = torch.where(torch.rand(pick.shape, device=device) < 0.1, -1, slots[pick]).to(torch.int32)
    sink = torch.randn(HEADS, device=device)
    scale = 512**-0.5
    out, lse = d4.flash_mla_with_kvcache(q, cache, PAGE_SIZE, indices, attn_sink=sink, softmax_scale=scale)
    keys = d4.gather_dequant(cache, PAGE_SIZE, indices.view(batch, width), torch.float64)
    want_out, want_lse = float64_attention(q[:, 0], keys, indices.view(batch, width) >= 0, scale, sink)
    decode_err = (out[:, 0].double() - want_out).abs().max().item()
    decode_lse_err = (lse[..., 0].double() - want_lse).abs().max().item()

    # 3. sparse prefill over a bf16 workspace dequantized from the cache
    workspace = d4.dequant_workspace(cache, PAGE_SIZE, slots)  # [tokens, 1, 512]
    s_q = 32
    pq = torch.randn(s_q, HEADS, 512, dtype=torch.bfloat16, device=device)
    pidx = torch.randint(0, tokens, (s_q, 1, width), dtype=torch.int32, device=device)
    pout, _, plse = d4.flash_mla_sparse_fwd(pq, workspace, pidx, scale, attn_sink=sink)
    pkeys = workspace[pidx[:, 0].long(), 0]
    want_pout, want_plse = float64_attention(pq, pkeys, torch.ones_like(pidx[:, 0], dtype=torch.bool), scale, sink)
    prefill_err = (pout.double() - want_pout).abs().max().item()

    # 4. compile a store -> decode step: one graph, no breaks, same result as eager
    def step(kv, positions, slots, q, indices, cache):
        d4.fused_k_norm_rope_flashmla(kv, kv_weight, freqs, positions, slots, cache, 1e-6, PAGE_SIZE)
        o, l = d4.flash_mla_with_kvcache(q, cache, PAGE_SIZE, indices, attn_sink=sink, softmax_scale=scale)
        return o.float() * 0.5, l

    new = 8
    step_args = (
        torch.randn(new, 512, dtype=torch.bfloat16, device=device), positions[:new] + tokens,
        torch.arange(new, device=device) + (NUM_PAGES - 1) * PAGE_SIZE, q, indices,
    )
    explanation = torch._dynamo.explain(step)(*step_args, cache.clone())
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    with torch.no_grad():
        want = step(*step_args, eager_cache)
        got = torch.compile(step, fullgraph=True)(*step_args, compiled_cache)
    compile_err = max((g - w).abs().max().item() for g, w in zip(got, want))

    report = {
        "device": str(device),
        "providers": d4.providers(device),
        "decode_max_abs_err_vs_float64": decode_err,
        "decode_lse_max_abs_err_vs_float64": decode_lse_err,
        "prefill_max_abs_err_vs_float64": prefill_err,
        "prefill_lse_max_abs_err_vs_float64": (plse.double() - want_plse).abs().max().item(),
        "graph_count": explanation.graph_count,
        "graph_break_count": explanation.graph_break_count,
        "max_abs_err_compiled_vs_eager": compile_err,
        "cache_bytes_equal_compiled_vs_eager": bool(torch.equal(eager_cache, compiled_cache)),
    }
    if args.json:
        print(json.dumps(report))
    else:
        width_ = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width_}}  {value}")
    return report


if __name__ == "__main__":
    main()
