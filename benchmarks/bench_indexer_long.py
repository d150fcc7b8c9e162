"""The indexer at long context (CUDA): a prefill chunk's block logits and a decode row's selection
over one request's paged FP8 (or FP4) indexer key cache, DSV4's 64 heads x 128 dims.

    PYTHONPATH=. python benchmarks/bench_indexer_long.py [--contexts 32768 131072 524288 1048576]
        [--chunk 8192] [--format fp8] [--sweep] [--json F]

Prefill rows (the last ``--chunk`` tokens of a ``context``-token prompt; row ``t`` at position
``p`` sees ``(p + 1) // 4`` blocks; 64 blocks a page, the cache's ``page_size = 256`` tokens):

* ``tiles_ms``: ``providers.triton.indexer.table_logits`` (the logits ``dsv4::indexer_cache_topk``
  selects from): the tile kernel, keys read once per tile of queries of the request;
* ``rows_ms``: the same logits by the per-row kernel (what ``batch_invariant`` runs, and every
  row before the tile kernel);
* ``topk_ms``: the whole op, ``dsv4::indexer_cache_topk`` with k = 512 (the logits in groups and
  their selection);
* ``tflops`` / ``share_of_peak``: the tile kernel's ``2 * 64 * 128`` FLOP per visible block and
  query over its time, and that over the H100 SXM's dense FP8 tensor peak (1979 TFLOP/s; the
  H200's is the same).

Decode rows: ``rows`` queries, each at the end of its own ``context``-token request (the
requests share pages: a long cache for each costs no setup), ``dsv4::indexer_cache_topk`` k = 512,
CUDA-graph replays (``common.graph_timed``); ``floor_us``: the FP8 keys those rows read (one
request's: 132 bytes a block) at the device-to-device copy rate (read + written) measured in the
same run.

``--profile``: the GPU kernels of one prefill call and one decode call at the longest context
(``torch.profiler``), time per kernel name. ``--single-programs 2 4 8``: the decode rows at each number of single-query tile programs per SM
(``--no-prefill``: decode rows only). ``--sweep``: the tile kernel at every ``(BLOCK_T, BLOCK_N, warps, stages)`` of a small grid,
at the longest context. ``--accuracy``: the tile kernel's logits against float64 on 256 rows of a
16K-token context (the largest error over ``sum_h |w_h| sum_d |q_hd k_d|``).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from dsv4_compile import layout
from dsv4_compile.providers.triton import indexer as triton_indexer

import dsv4_compile as d4
from bench_step import copy_rate
from common import graph_timed, timed

HEADS, PAGE_BLOCKS, K = 64, 64, 512
PEAK_FP8_TFLOPS = 1979.0


def cache_of(blocks: int, fmt: str, seed: int = 0):
    """One request's indexer key cache of ``blocks`` random keys (pages in shuffled order) and its
    block table ``[1, pages]``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-blocks // PAGE_BLOCKS)
    cache = layout.alloc_index_cache(pages, PAGE_BLOCKS, fmt, device="cuda")
    table = torch.randperm(pages, device="cuda", generator=gen).int()[None]
    step = 1 << 16
    for start in range(0, pages * PAGE_BLOCKS, step):
        n = min(step, pages * PAGE_BLOCKS - start)
        keys = torch.randn(n, layout.INDEX_HEAD_DIM, device="cuda", generator=gen)
        d4.indexer_store(keys, cache, torch.arange(start, start + n, device="cuda"), PAGE_BLOCKS, fmt)
    return cache, table


def queries(rows: int, fmt: str, seed: int = 1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, HEADS, layout.INDEX_HEAD_DIM, device="cuda", generator=gen)
    codes, scales = layout.quantize_index(q, fmt)
    weights = torch.randn(rows, HEADS, device="cuda", generator=gen) / HEADS**0.5
    if fmt == "fp8":
        weights, scales = weights * scales, None
    return codes, weights, scales


def events_ms(fn, runs=5) -> float:
    """Median ms of one call of ``fn`` (:func:`common.timed`, one call a run)."""
    return timed(fn, calls=1, runs=runs) / 1e3


def prefill_case(context: int, chunk: int, fmt_name: str, sweep: bool) -> dict:
    fmt = layout.INDEX_FORMATS[fmt_name]
    blocks = context // 4
    cache, table = cache_of(blocks, fmt_name)
    codes, weights, scales = queries(chunk, fmt_name)
    positions = torch.arange(context - chunk, context, device="cuda")
    lengths = (positions + 1) // 4
    rows = torch.zeros(chunk, dtype=torch.int32, device="cuda")
    width = table.shape[1] * PAGE_BLOCKS
    flop = 2 * HEADS * layout.INDEX_HEAD_DIM * int(lengths.sum())

    def logits(invariant=False, config=None):
        return triton_indexer.table_logits(codes, weights, cache, table, rows, lengths, PAGE_BLOCKS, width, fmt,
                                           scales, invariant, config)

    tiles = events_ms(logits)
    out = {"context": context, "chunk": chunk, "format": fmt_name, "tiles_ms": round(tiles, 3),
           "rows_ms": round(events_ms(lambda: logits(True)), 3),
           "topk_ms": round(events_ms(lambda: d4.indexer_cache_topk(
               codes, weights, cache, table, rows, lengths, PAGE_BLOCKS, K, fmt_name, scales)), 3),
           "tflops": round(flop / tiles / 1e9, 1), "share_of_peak": round(flop / tiles / 1e9 / PEAK_FP8_TFLOPS, 3)}
    if sweep:
        grid = []
        for block_t, block_n, warps, stages in itertools.product((1, 2, 4), (64, 128, 256), (4, 8), (2, 3, 4)):
            if block_t * HEADS * block_n > 128 * 256 * (warps // 4):
                continue  # the product's accumulator past 256 registers a thread
            try:
                ms = events_ms(lambda: logits(config=(block_t, block_n, warps, stages)), runs=3)
            except Exception as exc:  # out of shared memory / registers: say so, go on
                grid.append({"config": [block_t, block_n, warps, stages], "error": str(exc)[:120]})
                continue
            grid.append({"config": [block_t, block_n, warps, stages], "ms": round(ms, 3),
                         "tflops": round(flop / ms / 1e9, 1)})
            print(json.dumps(grid[-1]), flush=True)
        out["sweep"] = grid
    del cache
    return out


def decode_case(context: int, rows: int, rate: float, fmt_name: str) -> dict:
    blocks = context // 4
    cache, table = cache_of(blocks, fmt_name)
    codes, weights, scales = queries(rows, fmt_name)
    table = table.expand(rows, -1).contiguous()  # every request on the same pages
    lengths = torch.full((rows,), blocks, dtype=torch.int32, device="cuda")
    table_rows = torch.arange(rows, dtype=torch.int32, device="cuda")
    us = graph_timed(lambda: d4.indexer_cache_topk(codes, weights, cache, table, table_rows, lengths, PAGE_BLOCKS,
                                                   K, fmt_name, scales), per_graph=10, replays=20)
    key_bytes = blocks * layout.INDEX_FORMATS[fmt_name].token_bytes
    return {"context": context, "rows": rows, "format": fmt_name, "topk_us": round(us, 1),
            "floor_us": round(key_bytes / rate * 1e6, 1)}


def accuracy(fmt_name: str) -> dict:
    """The tile kernel's largest error over ``sum_h |w_h| sum_d |q_hd k_d|`` against float64."""
    fmt = layout.INDEX_FORMATS[fmt_name]
    context, chunk = 16384, 256
    blocks = context // 4
    cache, table = cache_of(blocks, fmt_name)
    codes, weights, scales = queries(chunk, fmt_name)
    lengths = torch.full((chunk,), blocks, device="cuda")
    rows = torch.zeros(chunk, dtype=torch.int32, device="cuda")
    got = triton_indexer.table_logits(codes, weights, cache, table, rows, lengths, PAGE_BLOCKS, blocks, fmt, scales)
    slots = layout.visible_slots(table, rows.long(), lengths, PAGE_BLOCKS, blocks)
    keys = layout.gather_index_keys(cache, PAGE_BLOCKS, slots[0], fmt_name).double()  # every row sees them all
    q = layout.dequant_index(codes, scales, fmt_name).double()
    w = weights.double()
    want = (torch.einsum("thd,md->thm", q, keys).clamp_min(0) * w[:, :, None]).sum(1)
    magnitude = (torch.einsum("thd,md->thm", q.abs(), keys.abs()) * w.abs()[:, :, None]).sum(1)
    ratio = ((got.double() - want).abs() / magnitude).flatten()
    return {"format": fmt_name, "fp8_mma": triton_indexer.fp8_mma(torch.device("cuda")),
            "max_error_over_magnitude": ratio.max().item(), "p99": ratio.quantile(0.99).item(),
            "median": ratio.median().item()}


def profile(context: int, chunk: int, fmt_name: str, decode_rows) -> dict:
    """GPU microseconds per kernel name of one ``dsv4::indexer_cache_topk`` call: the last
    ``chunk`` prefill rows, and each decode size, at ``context``."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    blocks = context // 4
    cache, table = cache_of(blocks, fmt_name)
    cases = {}
    positions = torch.arange(context - chunk, context, device="cuda")
    codes, weights, scales = queries(chunk, fmt_name)
    cases[f"prefill {chunk}"] = (codes, weights, cache, table, torch.zeros(chunk, dtype=torch.int32, device="cuda"),
                                 (positions + 1) // 4)
    for rows in decode_rows:
        codes, weights, scales = queries(rows, fmt_name)
        cases[f"decode {rows}"] = (codes, weights, cache, table.expand(rows, -1).contiguous(),
                                   torch.arange(rows, dtype=torch.int32, device="cuda"),
                                   torch.full((rows,), blocks, dtype=torch.int32, device="cuda"))
    out = {}
    for name, args in cases.items():
        call = lambda: d4.indexer_cache_topk(*args, PAGE_BLOCKS, K, fmt_name, scales if fmt_name == "fp4" else None)
        call()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        kernels = {e.key[:60]: round(e.device_time_total / 5, 1) for e in prof.key_averages() if e.device_time_total > 0}
        out[name] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
        print(name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 524288, 1048576])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--format", default="fp8", choices=("fp8", "fp4"))
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--sweep", action="store_true", help="the tile kernel's geometries at the longest context")
    parser.add_argument("--accuracy", action="store_true", help="the tile kernel's error against float64")
    parser.add_argument("--profile", action="store_true", help="time per GPU kernel at the longest context")
    parser.add_argument("--single-programs", type=int, nargs="*",
                        help="decode at each of these TILE_SINGLE_PROGRAMS_PER_UNIT values (a sweep)")
    parser.add_argument("--no-prefill", action="store_true", help="decode rows only")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "prefill": [], "decode": []}
    if args.accuracy:
        result["accuracy"] = accuracy(args.format)
        print(json.dumps(result["accuracy"]), flush=True)
    if args.profile:
        result["profile"] = profile(max(args.contexts), args.chunk, args.format, args.decode_rows)
        args.contexts = []
    with torch.no_grad():
        for context in [] if args.no_prefill else args.contexts:
            row = prefill_case(context, args.chunk, args.format, args.sweep and context == max(args.contexts))
            result["prefill"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        rate = copy_rate(torch.device("cuda"))
        for context in args.contexts:
            for rows in args.decode_rows:
                for per_unit in args.single_programs or [triton_indexer.TILE_SINGLE_PROGRAMS_PER_UNIT]:
                    default, triton_indexer.TILE_SINGLE_PROGRAMS_PER_UNIT = triton_indexer.TILE_SINGLE_PROGRAMS_PER_UNIT, per_unit
                    try:
                        result["decode"].append(decode_case(context, rows, rate, args.format))
                    finally:
                        triton_indexer.TILE_SINGLE_PROGRAMS_PER_UNIT = default
                    result["decode"][-1]["single_programs_per_unit"] = per_unit
                    print(json.dumps(result["decode"][-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
