"""The decode step's weight GEMMs alone: cuBLAS against a plain split-K Triton GEMM, at 1 and 64 rows.

What it answers: how close to the copy rate can a GEMM whose weight is read once get, at the sizes
the step has (benchmarks/history/RESULTS-notebook.md, "The step's GEMMs alone")? Shapes (``G``
groups of ``[N, K]`` bf16 weights, ``K`` contiguous, as ``nn.Linear`` stores them): ``lm_head``
4096 -> 32000, ``wq_b`` 1024 -> 32768, ``wo_a`` 8 x (4096 -> 1024), ``wo_b`` 8192 -> 4096, the
stacked input projections of a ratio-4 / ratio-0 layer 4096 -> 4096 / 1536, the indexer's ``wq_b``
1024 -> 8192.

* cuBLAS: ``torch.bmm`` into a bf16 output;
* Triton: one program per ``BLOCK_N`` output columns and per ``1/split`` of ``K``
  (``tl.dot`` over ``BLOCK_K`` steps, software-pipelined); with ``split > 1`` the parts are
  added into a zeroed float32 output by atomics (the zeroing is timed too). A sweep of
  ``BLOCK_N`` 64/128, ``BLOCK_K`` 64/128/256, 3-5 stages and splits that give 2-4 programs per
  SM; the three fastest are printed.

Each call reads another copy of the weight (copies enough to exceed 400 MB), so L2 holds none of
it between calls; times are CUDA-graph replays of 2 rounds over the copies, median of 7 runs of 10.

Usage (on a CUDA machine): ``PYTHONPATH=. python benchmarks/experiments/bench_gemm.py`` (~2.5
minutes on the H200)
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: the modules imported below
from bench_step import copy_rate  # noqa: E402
from common import graph_timed  # noqa: E402

SHAPES = {  # name: (G, N, K)
    "lm_head": (1, 32000, 4096), "wq_b": (1, 32768, 1024), "wo_a": (8, 1024, 4096), "wo_b": (1, 4096, 8192),
    "x_proj ratio 4": (1, 4096, 4096), "x_proj ratio 0": (1, 1536, 4096), "indexer wq_b": (1, 8192, 1024),
}
SMS = 132


@triton.jit
def split_k_gemm(x_ptr, w_ptr, out_ptr, M, k_split, sxg, sxm, sxk, swg, swn, swk, sog, som, son,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * k_split
    g = tl.program_id(2).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k0, k0 + k_split, BLOCK_K):
        x = tl.load(x_ptr + g * sxg + m[:, None] * sxm + (k + kk)[None, :] * sxk, mask=m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + g * swg + n[:, None] * swn + (k + kk)[None, :] * swk)
        acc = tl.dot(x, tl.trans(w), acc)
    ptrs = out_ptr + g * sog + m[:, None] * som + n[None, :] * son
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=m[:, None] < M, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=m[:, None] < M)


def triton_gemm(x, w, out, block_n, block_k, split, stages):
    """``out = x @ w^T`` per group (``x [G, M, K]``, ``w [G, N, K]``, ``out [G, M, N]``)."""
    groups, rows, depth = x.shape
    if split > 1:
        out.zero_()
    split_k_gemm[(w.shape[1] // block_n, split, groups)](
        x, w, out, rows, depth // split, *x.stride(), *w.stride(), *out.stride(),
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        ATOMIC=split > 1, num_warps=4, num_stages=stages,
    )


def graph_us(calls) -> float:
    """µs per call of ``calls`` replayed in one CUDA graph (median of 7 runs of 10 replays)."""
    def each():
        for c in calls:
            c()

    return graph_timed(each, per_graph=1, replays=10) / len(calls)


def splits(groups: int, n: int, block_n: int, depth: int, block_k: int) -> list[int]:
    """1 and the powers of two that give ~2 and ~4 programs per SM, where ``K`` divides evenly."""
    tiles = groups * n // block_n
    wanted = {1, max(1, 2 * SMS // tiles), max(1, 4 * SMS // tiles)}
    powers = {1 << (s.bit_length() - 1) for s in wanted}  # rounded down to powers of two
    return sorted(p for p in powers if depth % (p * block_k) == 0)


def main() -> None:
    rate = copy_rate(torch.device("cuda"))
    print(f"copy rate {rate / 1e12:.2f} TB/s")
    for (name, (groups, n, depth)), rows in itertools.product(SHAPES.items(), (1, 64)):
        nbytes = groups * n * depth * 2
        weights = [torch.randn(groups, n, depth, device="cuda", dtype=torch.bfloat16)
                   for _ in range(max(1, -(-400_000_000 // nbytes)))]
        x = torch.randn(groups, rows, depth, device="cuda", dtype=torch.bfloat16)
        exact = torch.bmm(x.float(), weights[0].float().transpose(1, 2))
        out16 = torch.empty(groups, rows, n, device="cuda", dtype=torch.bfloat16)
        out32 = torch.empty(groups, rows, n, device="cuda", dtype=torch.float32)
        cublas = graph_us([lambda w=w: torch.bmm(x, w.transpose(1, 2), out=out16) for w in weights] * 2)
        print(f"{name}, {rows} rows, {nbytes / 1e6:.1f} MB: cuBLAS {cublas:.1f} us ({nbytes / cublas / 1e6:.2f} TB/s; "
              f"the copy rate: {nbytes / rate * 1e6:.1f} us)", flush=True)
        timings, refused = [], 0
        for block_n, block_k, stages in itertools.product((64, 128), (64, 128, 256), (3, 4, 5)):
            for split in splits(groups, n, block_n, depth, block_k):
                out = out32 if split > 1 else out16
                try:
                    triton_gemm(x, weights[0], out, block_n, block_k, split, stages)
                except triton.runtime.errors.OutOfResources:
                    refused += 1  # shared memory
                    continue
                torch.testing.assert_close(out.float(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())
                us = graph_us([lambda w=w: triton_gemm(x, w, out, block_n, block_k, split, stages) for w in weights] * 2)
                timings.append((us, f"{block_n}x{block_k} split {split}, {stages} stages"))
        for us, what in sorted(timings)[:3]:
            print(f"   Triton {what}: {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s; cuBLAS / Triton {cublas / us:.2f})")
        print(f"   ({refused} geometries over the shared memory)", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
