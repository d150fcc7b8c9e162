"""Can a weight GEMM of the decode step hide its ramp behind the kernel before it? (SM90+)

At b = 1 the step's weight GEMMs take ~348 µs where reading their weights at the copy rate takes
~273 µs: each kernel loses ~3–5 µs to its ramp and tail (benchmarks/history/RESULTS-notebook.md,
"the step's GEMMs alone"). With programmatic dependent launch (PDL), a kernel launched with the
attribute may start while the kernel before it drains, and waits (``griddepcontrol.wait``) before it
reads that kernel's output. A GEMM's weights do not depend on the kernel before it, so their first
tiles can be loaded before the wait.

Each case times a chain of ``--links`` links in one CUDA graph, each link a small kernel (an
RMSNorm of the previous link's output, as in the step) and then ``x @ W_i^T`` with a weight of its
own (the weights together exceed L2). Variants, µs per link (graph replays, median):

* ``cublas``: the norm, then ``torch.mm``;
* ``triton``: the norm, then a weight-streaming Triton GEMM (one program per ``BLOCK_N`` outputs,
  whole K, ``tl.dot`` with M padded to 16), plain launches;
* ``triton_pdl_wait_first``: both kernels launched with PDL, the GEMM waiting before any load;
* ``triton_pdl``: both launched with PDL, the GEMM loading its first ``PRE`` weight tiles before
  the wait.

The floor of a link is its weight bytes at the copy rate measured in the same run. Outputs are
checked against ``torch.mm`` (float32 accumulation; a tolerance, since the summation order differs).

    python benchmarks/experiments/bench_gemm_pdl.py [--rows 1 8] [--links 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: the modules imported below
from bench_step import copy_rate  # noqa: E402
from common import graph_timed  # noqa: E402

#: (name, K, N, BLOCK_N): the step's weights of ~67 MB and the LM head
SHAPES = [("wq_b", 1024, 32768, 64), ("wo_b", 8192, 4096, 32), ("lm_head", 4096, 32000, 64)]
BLOCK_K = 128
#: weight bytes a program loads before it waits (registers: 128 per thread at 4 warps)
PRE_BYTES = 16384


@triton.jit
def _norm_kernel(src, dst, N, K, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """``dst[m, :K] = v / rms(v)`` with ``v[j] = src[m, j % N]`` (one program per row)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    m = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    v = tl.load(src + m * N + j % N, mask=j < K, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, 0) / K + 1e-6)
    tl.store(dst + m * K + j, (v * r).to(tl.bfloat16), mask=j < K)


@triton.jit
def _gemm_kernel(x, w, out, M, N, K, PDL: tl.constexpr, PRE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[:M, n-block] = x[:M] @ w[n-block]^T``, bf16 in, float32 accumulation, bf16 out."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    start = 0
    if PRE > 0:  # the first PRE tiles of this program's weights, loaded before waiting
        kp = tl.arange(0, PRE * BLOCK_K)
        w0 = tl.load(w + n[:, None] * K + kp[None, :])
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        x0 = tl.load(x + m[:, None] * K + kp[None, :], mask=m[:, None] < M, other=0.0)
        acc = tl.dot(x0, tl.trans(w0), acc)
        start = PRE * BLOCK_K
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()
    k = tl.arange(0, BLOCK_K)
    for k0 in range(start, K, BLOCK_K):
        wv = tl.load(w + n[:, None] * K + (k0 + k)[None, :])
        xv = tl.load(x + m[:, None] * K + (k0 + k)[None, :], mask=m[:, None] < M, other=0.0)
        acc = tl.dot(xv, tl.trans(wv), acc)
    tl.store(out + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=m[:, None] < M)


def norm(src, dst, pdl):
    M, K = dst.shape
    _norm_kernel[(M,)](src, dst, src.shape[1], K, PDL=pdl, BLOCK=triton.next_power_of_2(K),
                       num_warps=8, launch_pdl=pdl)


def gemm(x, w, out, block_n, pdl, pre):
    M, K = x.shape
    _gemm_kernel[(w.shape[0] // block_n,)](
        x, w, out, M, w.shape[0], K, PDL=pdl, PRE=pre, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        num_warps=4, num_stages=4, launch_pdl=pdl,
    )


def run_case(name, K, N, block_n, rows, links, rate, device):
    g = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(N, K, device=device, generator=g, dtype=torch.bfloat16) * K**-0.5 for _ in range(links)]
    first = torch.randn(rows, N, device=device, dtype=torch.bfloat16)
    xs = [torch.empty(rows, K, device=device, dtype=torch.bfloat16) for _ in range(links)]
    outs = [torch.empty(rows, N, device=device, dtype=torch.bfloat16) for _ in range(links)]

    def chain(variant):
        def step():
            prev = first
            for x, w, out in zip(xs, weights, outs):
                pdl = variant.startswith("triton_pdl")
                norm(prev, x, pdl)
                if variant == "cublas":
                    torch.mm(x, w.t(), out=out)
                else:
                    gemm(x, w, out, block_n, pdl, pre=pre if variant == "triton_pdl" else 0)
                prev = out
        return step

    pre = max(1, PRE_BYTES // (block_n * BLOCK_K * 2))  # tiles held in registers before the wait
    result = {"pre_tiles": pre, "shape": name, "K": K, "N": N, "rows": rows, "links": links,
              "floor_us": round(N * K * 2 / rate * 1e6, 2)}
    reference = None
    for variant in ("cublas", "triton", "triton_pdl_wait_first", "triton_pdl"):
        step = chain(variant)
        step()
        torch.cuda.synchronize()
        got = outs[-1].float()
        if reference is None:
            reference = got.clone()
        else:
            torch.testing.assert_close(got, reference, atol=3e-2, rtol=2e-2)
        result[variant + "_us"] = round(graph_timed(step, per_graph=1, replays=20) / links, 2)
    norm_alone = lambda: norm(first, xs[0], False)  # noqa: E731
    result["norm_us"] = round(graph_timed(norm_alone, per_graph=20), 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--links", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    rate = copy_rate(device)
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    results = []
    for rows in args.rows:
        for name, K, N, block_n in SHAPES:
            r = run_case(name, K, N, block_n, rows, args.links, rate, device)
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tb_s": round(rate / 1e12, 3), "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
