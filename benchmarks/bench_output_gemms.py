"""The attention layer's output projection, ``wo_a`` (grouped) then ``wo_b``, in two layouts.

What it answers: does writing ``wo_a``'s batched GEMM output transposed (``[G, r, T]``, which
``wo_b`` reads as a column-major ``[T, G * r]`` operand) beat the ``[G, T, r]`` output and the
copy to ``[T, G * r]`` between the two GEMMs (benchmarks/RESULTS.md, "Model decode step")? Both layouts
give the same bits (printed: the largest difference).

Shapes of the benchmarked slice: ``G = 8`` groups, ``r = 1024``, ``H * D / G = 4096``, ``wo_b``
8192 -> 4096; ``T`` = 1, 8, 64 rows. A small in-place kernel on the attention output runs before
the GEMMs each call, as in the step (the ``rope_`` before ``wo_a``). Each call reads another of 4
weight copies (537 MB), so L2 holds none of it; times are CUDA-graph replays of 8 calls, the
median of 6 runs per layout (3 rounds in the order copied, transposed, transposed, copied).

Usage (on a CUDA machine): ``cd benchmarks && PYTHONPATH=..:. python bench_output_gemms.py`` (~1 minute)
"""

from __future__ import annotations

import itertools
import statistics

import torch

from common import graph_timed

G, R, K, N, COPIES = 8, 1024, 4096, 4096, 4


def main() -> None:
    torch.manual_seed(0)
    wa = [torch.randn(G * R, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(COPIES)]
    wb = [torch.randn(N, G * R, device="cuda", dtype=torch.bfloat16) * (G * R) ** -0.5 for _ in range(COPIES)]
    for rows in (1, 8, 64):
        out = torch.randn(rows, G * K // 512, 512, device="cuda", dtype=torch.bfloat16)
        turn = itertools.count()

        def copied(c=None):  # [G, T, r], then a copy to [T, G * r]
            c = next(turn) % COPIES if c is None else c
            out.mul_(1.0)
            grouped = out.view(rows, G, K).transpose(0, 1)
            low = torch.bmm(grouped, wa[c].view(G, R, K).transpose(1, 2)).transpose(0, 1).flatten(1)
            return low @ wb[c].t()

        def transposed(c=None):  # [G, r, T] = [G * r, T], read by wo_b as [T, G * r] column-major
            c = next(turn) % COPIES if c is None else c
            out.mul_(1.0)
            low_t = torch.bmm(wa[c].view(G, R, K), out.view(rows, G, K).permute(1, 2, 0)).flatten(0, 1)
            return low_t.t() @ wb[c].t()

        diff = (copied(0).float() - transposed(0).float()).abs().max().item()  # the same weights
        times = {"copied": [], "transposed": []}
        for _ in range(3):
            for name, fn in (("copied", copied), ("transposed", transposed), ("transposed", transposed), ("copied", copied)):
                times[name].append(graph_timed(fn, per_graph=8, replays=30))
        old, new = (statistics.median(times[k]) for k in ("copied", "transposed"))
        print(f"T={rows:3d}: copied {old:.2f} us, transposed {new:.2f} us ({new / old:.3f}); "
              f"largest difference {diff:.3g}")


if __name__ == "__main__":
    main()
