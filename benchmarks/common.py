"""What the attention benchmarks share: the DSV4 decode step of benchmarks/RESULTS.md, CUDA timers.

H heads, ``rows`` query rows; an SWA cache (page size 256, 64 pages) read through 128 indices per
row, and a compressed extra cache (page size 64, 512 pages) read through 512 indices per row.
"""

from __future__ import annotations

import statistics

import torch

from dsv4_compile import layout
from dsv4_compile.providers import reference

DEV = "cuda"
SWA_PAGE, EXTRA_PAGE = 256, 64
#: The decode benchmarks' query-row counts T (:func:`decode_inputs`)
DECODE_ROWS = (1, 8, 64, 256)


def filled(num_pages: int, page_size: int, kv_format: str = "v4") -> torch.Tensor:
    """A cache whose every slot holds a random token (stored by the reference kernel)."""
    cache = layout.alloc_cache(num_pages, page_size, DEV, kv_format=kv_format)
    n = num_pages * page_size
    reference.fused_k_norm_rope_flashmla(
        torch.randn(n, 512, dtype=torch.bfloat16, device=DEV) * 2, torch.ones(512, dtype=torch.bfloat16, device=DEV),
        torch.randn(n, 64, device=DEV), torch.arange(n, device=DEV), torch.arange(n, device=DEV), cache, 1e-6, page_size,
        layout.FORMATS[kv_format],  # providers take the CacheFormat
    )
    return cache


def decode_inputs(rows: int, heads: int = 64, kv_format: str = "v4", extra_format: str | None = None) -> tuple:
    """``(q, cache, idx, lengths, sink, extra_cache, extra_idx, extra_lengths)`` of one decode step
    (the caches in ``kv_format`` / ``extra_format``, default the same)."""
    cache = filled(64, SWA_PAGE, kv_format)
    ecache = filled(512, EXTRA_PAGE, extra_format or kv_format)
    q = torch.randn(rows, 1, heads, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(0, 64 * SWA_PAGE, (rows, 1, 128), dtype=torch.int32, device=DEV)
    eidx = torch.randint(0, 512 * EXTRA_PAGE, (rows, 1, 512), dtype=torch.int32, device=DEV)
    lengths = torch.randint(64, 129, (rows,), dtype=torch.int32, device=DEV)
    elen = torch.randint(256, 513, (rows,), dtype=torch.int32, device=DEV)
    sink = torch.randn(heads, device=DEV)
    return q, cache, idx, lengths, sink, ecache, eidx, elen


def timed(fn, calls=50, runs=7) -> float:
    """Median microseconds per call (CUDA events around ``calls`` calls)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def graph_timed(fn, per_graph=10, replays=50) -> float:
    """Median microseconds per call of ``fn``, captured ``per_graph`` times in one CUDA graph whose
    replays are :func:`timed` (``replays`` per run)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    return timed(graph.replay, calls=replays) / per_graph
