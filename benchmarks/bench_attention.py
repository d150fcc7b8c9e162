"""Sparse decode and prefill on CUDA: dsv4 ops vs the raw FlashMLA Python API, eager and CUDA graphs.

    python benchmarks/bench_attention.py [--json out.json]

Decode: H=64, an SWA cache (P=256, 128 keys per row) plus a compressed extra cache (P=64, 512 keys),
T rows in {1, 8, 64, 256}. Reported per call, median of 7 runs of 50 calls:
  raw_wrapper   flash_mla.flash_mla_with_kvcache(use_legacy=True), fresh FlashMLASchedMeta (eager)
  ours_inside   dsv4.flash_mla_with_kvcache, scheduler computed inside (eager)
  ours_hoisted  dsv4.flash_mla_with_kvcache with get_mla_metadata computed once (eager)
  graph_inside / graph_hoisted  the same, replayed from a CUDA graph of 10 calls (per call)
  metadata      dsv4.get_mla_metadata alone (eager)
Prefill: s_q=4096, s_kv=8192, top-k 640 (H=64) and 2048 (H=128): ms and TFLOP/s (4*s_q*H*topk*512).
"""

from __future__ import annotations

import argparse
import json

import torch

import dsv4_compile as d4
from common import DECODE_ROWS, DEV, decode_inputs, graph_timed, timed



def bench_decode(rows: int) -> dict:
    import flash_mla

    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_inputs(rows)
    view, eview = d4.flashmla_view(cache, 256), d4.flashmla_view(ecache, 64)
    scale = 512**-0.5

    def raw():
        sched, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(
            q, view, None, None, 512, sched, softmax_scale=scale, is_fp8_kvcache=True, indices=idx,
            attn_sink=sink, extra_k_cache=eview, extra_indices_in_kvcache=eidx, topk_length=lengths,
            extra_topk_length=elen, use_legacy=True,
        )

    def inside():
        return d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, softmax_scale=scale)

    meta = d4.get_mla_metadata(q, idx, lengths, eidx, elen)

    def hoisted():
        return d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, *meta, softmax_scale=scale)

    def step_hoisted():  # one step's metadata shared by 10 layers, as a model does
        m = d4.get_mla_metadata(q, idx, lengths, eidx, elen)
        for _ in range(10):
            d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, *m, softmax_scale=scale)

    same = torch.equal(raw()[0], inside()[0]) and torch.equal(inside()[0], hoisted()[0])
    return {
        "rows": rows,
        "raw_wrapper_us": timed(raw),
        "ours_inside_us": timed(inside),
        "ours_hoisted_us": timed(hoisted),
        "metadata_us": timed(lambda: d4.get_mla_metadata(q, idx, lengths, eidx, elen)),
        "graph_inside_us": graph_timed(inside),
        "graph_hoisted_us": graph_timed(hoisted),
        "graph_step_10_layers_hoisted_us": graph_timed(step_hoisted, per_graph=1),
        "graph_step_10_layers_inside_us": graph_timed(lambda: [inside() for _ in range(10)], per_graph=1),
        "outputs_bit_identical": same,
    }


def bench_prefill(heads: int, topk: int) -> dict:
    import flash_mla

    s_q, s_kv = 4096, 8192
    q = torch.randn(s_q, heads, 512, dtype=torch.bfloat16, device=DEV)
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32, device=DEV)
    sink = torch.randn(heads, device=DEV)
    flops = 4 * s_q * heads * topk * 512
    ours = timed(lambda: d4.flash_mla_sparse_fwd(q, kv, idx, 0.044, attn_sink=sink), calls=10)
    raw = timed(lambda: flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.044, 512, sink, None, use_legacy=True), calls=10)
    return {"heads": heads, "topk": topk, "ours_ms": ours / 1e3, "raw_ms": raw / 1e3,
            "ours_tflops": flops / ours / 1e6, "raw_tflops": flops / raw / 1e6}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {
        "torch": torch.__version__, "device": torch.cuda.get_device_name(),
        "providers": d4.providers(DEV),
        "decode": [bench_decode(rows) for rows in DECODE_ROWS],
        "prefill": [bench_prefill(64, 640), bench_prefill(128, 2048)],
    }
    try:
        from importlib.metadata import version
        report["sgl_flash_mla"] = version("sgl-flash-mla")
    except Exception:
        pass
    keys = list(report["decode"][0])
    print(" | ".join(keys))
    for row in report["decode"]:
        print(" | ".join(f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    for row in report["prefill"]:
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
