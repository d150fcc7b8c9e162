"""Does prefetching a weight into L2 while small kernels run speed up the GEMM after them? (SM90)

Between the decode step's weight GEMMs run small, latency-bound kernels (norms, RoPE, the store,
the attention) that leave DRAM mostly idle. The question: if a kernel issues L2 prefetches of the
next GEMM's weight before them, does the GEMM then run faster, and does the prefetch cost less
than it saves?

Each case is one CUDA graph over 8 weights of ``wq_b``'s shape (32768 x 1024 bf16, 64 MiB each:
together far more than the 50 MB L2), and per weight: optionally a prefetch kernel over its first
``MB`` MiB, ``fill`` small kernels (an in-place multiply of 64 KB), then ``x @ W^T`` with
``rows`` rows. Reported per weight (µs, median of 30 replays / 8): ``all`` (the whole sequence),
``fill`` (the same without the GEMM) and their difference, the GEMM's share. Prefetch kinds (one
Triton program per 128 chunks, each thread issuing one instruction by inline PTX):

* ``bulk``: ``cp.async.bulk.prefetch.L2.global`` of a ``chunk``-byte block (4 KiB or 64 KiB);
* ``line``: ``prefetch.global.L2::evict_last`` of one 128-byte line;
* ``line_n``: ``prefetch.global.L2`` of one 128-byte line.

Last, the GEMM over a 32 MiB weight already in L2 (8 calls in a row), for the L2-hot rate.

    python benchmarks/experiments/bench_l2_prefetch.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

#: inline PTX per prefetch kind: ``$1`` the address, ``$2`` whether the chunk exists, ``$3`` its bytes
ASM = {
    "bulk": "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
    "line": "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, $3; }",
    "line_n": "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, $3; }",
}
KINDS = (("bulk", 4096), ("bulk", 65536), ("line", 128), ("line_n", 128))
K, N, COPIES, MB = 1024, 32768, 8, 1 << 20


@triton.jit
def _prefetch_kernel(ptr, n_chunks, chunk_bytes, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n_chunks
    p = ptr + offs.to(tl.int64) * chunk_bytes
    tl.inline_asm_elementwise(ASM, "=r,l,r,r", [p, live.to(tl.int32), tl.full([BLOCK], 0, tl.int32) + chunk_bytes],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, nbytes: int, kind: str, chunk: int) -> None:
    """L2 prefetches of the first ``nbytes`` of ``w``, ``chunk`` bytes per instruction."""
    nbytes = min(nbytes, w.numel() * w.element_size())
    n = triton.cdiv(nbytes, chunk)
    _prefetch_kernel[(triton.cdiv(n, 128),)](w.view(torch.uint8).view(-1), n, chunk, ASM=ASM[kind], BLOCK=128,
                                             num_warps=4)


def per_weight_us(fn, rows: int, reps: int = 30) -> float:
    """Median µs per weight of ``fn(x)`` (which walks all :data:`COPIES` weights) in a CUDA graph."""
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / COPIES)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
    small = torch.randn(16384, device="cuda")
    out = {}

    def sequence(nbytes, kind, chunk, fill, gemm=True):
        def fn(x):
            for w in weights:
                if nbytes:
                    prefetch(w, nbytes, kind, chunk)
                for _ in range(fill):
                    small.mul_(1.0001)
                if gemm:
                    torch.mm(x, w.t())
        return fn

    for rows in (1, 64):
        for fill in (0, 10, 20):
            base_fill = per_weight_us(sequence(0, None, 0, fill, gemm=False), rows)
            base = per_weight_us(sequence(0, None, 0, fill), rows)
            out[f"r{rows} f{fill} none"] = (round(base, 2), round(base_fill, 2), round(base - base_fill, 2))
            print(f"rows {rows} fill {fill:2d} no prefetch: all {base:.2f} fill {base_fill:.2f} gemm {base - base_fill:.2f}",
                  flush=True)
            for kind, chunk in KINDS:
                for mb in (16, 32, 48, 64):
                    fill_only = per_weight_us(sequence(mb * MB, kind, chunk, fill, gemm=False), rows)
                    whole = per_weight_us(sequence(mb * MB, kind, chunk, fill), rows)
                    out[f"r{rows} f{fill} {kind}{chunk} {mb}MB"] = (
                        round(whole, 2), round(fill_only, 2), round(whole - fill_only, 2)
                    )
                    print(f"rows {rows} fill {fill:2d} {kind:6s} chunk {chunk:6d} {mb:2d} MB: all {whole:.2f} "
                          f"(vs {base:.2f}) prefetch+fill {fill_only:.2f} (vs {base_fill:.2f}) gemm {whole - fill_only:.2f}",
                          flush=True)
    hot = torch.randn(16384, K, device="cuda", dtype=torch.bfloat16)

    def hot_gemms(x):
        for _ in range(COPIES):
            torch.mm(x, hot.t())

    out["hot 32MB gemm"] = per_weight_us(hot_gemms, 1)
    print("32 MB weight, L2-hot gemm:", out["hot 32MB gemm"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
