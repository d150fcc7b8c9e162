"""The portable Triton decode / prefill kernels against FlashMLA on CUDA.

    PYTHONPATH=. python benchmarks/bench_triton_attention.py [--json out.json] [--sweep]

Decode: H=64, an SWA cache (P=256, 128 keys per row) plus a c4 compressed extra cache (P=64, 512
keys), T rows in {1, 8, 64, 256}, random lengths and sink. Prefill: s_q=4096, s_kv=8192, H=64,
top-k 640: TFLOP/s = 4 * s_q * H * topk * 512 / t.

Times are medians: ``graph`` with ``triton.testing.do_bench_cudagraph`` (GPU time of one call
replayed from a CUDA graph: no host overhead, which eager decode is bound by), ``eager`` with
``triton.testing.do_bench`` (L2 flushed, host overhead visible). FlashMLA is our op under
``use_provider("flashmla")`` (the legacy kernels of sgl-flash-mla) with the scheduler metadata
hoisted (computed once, as a model step does). ``ratio`` = FlashMLA time / Triton time, i.e. the
Triton kernel's share of FlashMLA's throughput (goals: decode >= 0.5 at T >= 64, prefill >= 0.4).
``--sweep`` also times each launch geometry in :data:`DECODE_SWEEP` / :data:`PREFILL_SWEEP`
(``*`` marks the defaults of ``triton_attention``).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

import dsv4_compile as d4
from dsv4_compile import dispatch, layout
from dsv4_compile.kernels import triton_attention as ta
from common import DEV, decode_inputs

SCALE = layout.HEAD_DIM**-0.5
FLASHMLA_OPS = ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata")
#: Launch geometries timed by ``--sweep`` (block_h, block_n, num_warps, num_stages): those that
#: compile for SM90 without register spills (ptxas), around the defaults.
DECODE_SWEEP = [ta.Config(*c) for c in (
    (64, 32, 8, 1), (64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 2), (64, 64, 4, 2), (32, 32, 8, 2), (32, 64, 4, 2),
)]
MIN_SPLIT_KEYS_SWEEP = (32, 64, 128, 256, 640)
PREFILL_SWEEP = [ta.Config(*c) for c in (
    (64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 2), (64, 64, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (32, 32, 4, 2),
)]


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def eager_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def flashmla_available() -> bool:
    try:
        with d4.use_provider("flashmla", ops=FLASHMLA_OPS):
            dispatch.resolve("flash_mla_with_kvcache", torch.device(DEV, torch.cuda.current_device()))
        return True
    except d4.ProviderUnavailable:
        return False


def with_setting(name: str, value, fn):
    """``fn`` run with ``triton_attention.<name>`` set to ``value``."""

    def run():
        saved = getattr(ta, name)
        setattr(ta, name, value)
        try:
            return fn()
        finally:
            setattr(ta, name, saved)

    return run


def sweep(name: str, values, fn) -> list[dict]:
    """Graph time of ``fn`` for each value of ``triton_attention.<name>`` (``*``: the default)."""
    rows = []
    for value in values:
        label = f"{name}={value}{'*' if value == getattr(ta, name) else ''}"
        try:
            us = graph_us(with_setting(name, value, fn))
        except Exception as exc:  # a geometry the GPU cannot hold (shared memory, registers)
            rows.append({"config": label, "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
            continue
        rows.append({"config": label, "us": us})
    return rows


def bench_decode(rows: int, heads: int, flashmla: bool, do_sweep: bool) -> dict:
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_inputs(rows, heads)
    args = (q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, None, None, SCALE, 512)

    def triton_call():
        return ta.flash_mla_with_kvcache(*args)

    result = {
        "rows": rows, "heads": heads, "splits": ta.decode_plan(q.device, rows, heads, 640)[2],
        "triton_graph_us": graph_us(triton_call), "triton_eager_us": eager_us(triton_call),
    }
    if flashmla:
        with d4.use_provider("flashmla", ops=FLASHMLA_OPS):
            meta = d4.get_mla_metadata(q, idx, lengths, eidx, elen)

            def flashmla_call():
                return d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, *meta,
                                                 softmax_scale=SCALE)

            result["flashmla_graph_us"] = graph_us(flashmla_call)
            result["flashmla_eager_us"] = eager_us(flashmla_call)
            want = flashmla_call()
        got = triton_call()
        result["ratio"] = result["flashmla_graph_us"] / result["triton_graph_us"]
        result["max_abs_diff_out"] = (got[0].float() - want[0].float()).abs().max().item()
        result["max_abs_diff_lse"] = (got[1] - want[1]).abs().max().item()
    if do_sweep:
        result["sweep"] = sweep("DECODE_CONFIG", DECODE_SWEEP, triton_call)
        if rows < 256:
            result["sweep"] += sweep("MIN_SPLIT_KEYS", MIN_SPLIT_KEYS_SWEEP, triton_call)
    return result


def bench_prefill(heads: int, topk: int, flashmla: bool, do_sweep: bool) -> dict:
    s_q, s_kv = 4096, 8192
    q = torch.randn(s_q, heads, 512, dtype=torch.bfloat16, device=DEV)
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32, device=DEV)
    sink = torch.randn(heads, device=DEV)
    flops = 4 * s_q * heads * topk * 512

    def triton_call():
        return ta.flash_mla_sparse_fwd(q, kv, idx, SCALE, 512, sink, None)

    t = eager_us(triton_call)
    result = {"s_q": s_q, "s_kv": s_kv, "heads": heads, "topk": topk, "triton_us": t, "triton_tflops": flops / t / 1e6}
    if flashmla:
        with d4.use_provider("flashmla", ops=FLASHMLA_OPS):
            f = eager_us(lambda: d4.flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink))
            want = d4.flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink)
        got = triton_call()
        result.update(flashmla_us=f, flashmla_tflops=flops / f / 1e6, ratio=f / t,
                      max_abs_diff_out=(got[0].float() - want[0].float()).abs().max().item(),
                      max_abs_diff_lse=(got[2] - want[2]).abs().max().item())
    if do_sweep:
        rows = sweep("PREFILL_CONFIG", PREFILL_SWEEP, triton_call)
        for row in rows:
            if "us" in row:
                row["tflops"] = flops / row["us"] / 1e6
        result["sweep"] = rows
    return result


def table(rows: list[dict], keys: list[str]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    keys = [k for k in keys if any(k in r for r in rows)]
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    lines += [" | ".join(cell(r.get(k, "")) for k in keys) for r in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--sweep", action="store_true", help="also time every launch geometry of the sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    flashmla = flashmla_available()
    device = torch.device(DEV, torch.cuda.current_device())
    report = {
        "torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
        "flashmla": flashmla, "decode_config": str(ta.decode_config(device)), "prefill_config": str(ta.prefill_config(device)),
        "min_split_keys": ta.MIN_SPLIT_KEYS,
        "decode": [bench_decode(rows, 64, flashmla, args.sweep) for rows in (1, 8, 64, 256)],
        "prefill": [bench_prefill(64, 640, flashmla, args.sweep)],
    }
    if flashmla:
        report["goals"] = {
            "decode_T>=64_ratio>=0.5": all(r["ratio"] >= 0.5 for r in report["decode"] if r["rows"] >= 64),
            "prefill_ratio>=0.4": report["prefill"][0]["ratio"] >= 0.4,
        }
    print(f"{report['device']}, torch {report['torch']}, triton {report['triton']}")
    print(f"\ndecode (H=64, SWA 128 keys P=256 + c4 512 keys P=64), us per call; {report['decode_config']}")
    print(table(report["decode"], ["rows", "splits", "triton_graph_us", "flashmla_graph_us", "ratio",
                                   "triton_eager_us", "flashmla_eager_us", "max_abs_diff_out", "max_abs_diff_lse"]))
    print(f"\nprefill (s_q 4096, s_kv 8192, H 64, top-k 640); {report['prefill_config']}")
    print(table(report["prefill"], ["heads", "topk", "triton_us", "triton_tflops", "flashmla_us", "flashmla_tflops",
                                    "ratio", "max_abs_diff_out", "max_abs_diff_lse"]))
    if flashmla:
        print(f"\ngoals met: {report['goals']}")
    if args.sweep:
        for row in report["decode"]:
            print(f"\ndecode sweep, T={row['rows']} (graph us)")
            print(table(row["sweep"], ["config", "us", "error"]))
        print("\nprefill sweep (graph us)")
        print(table(report["prefill"][0]["sweep"], ["config", "us", "tflops", "error"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
