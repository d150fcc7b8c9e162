"""The indexer key cache's formats: selection accuracy against the exact indexer, and speed.

Accuracy (any device): queries and keys scored exactly (``"fp32"``: float32 keys, unrotated) and
through each quantized format (``"fp8"``, ``"fp4"``: Hadamard-rotated, quantized as
``layout.quantize_index``), and the same formats without the rotation, to show what it buys. Per
format: the mean and worst top-k overlap with the exact selection, and at each disagreement (a
block the exact top-k holds and the quantized one does not) the exact logit gap to the block that
replaced it, relative to the row's spread of exact logits (the standard deviation), with the
largest error of the quantized logits on the same scale. On two kinds of data: Gaussian
(``random``) and Gaussian with 4 outlier channels 30x larger in keys and queries (``outliers``,
where the rotation matters).

Speed (``--speed``, CUDA): ``dsv4::indexer_cache_logits`` per format at decode (T = 1, 64 rows)
and prefill (T = 4096), H = 64, each row seeing ``--blocks`` blocks of a ratio-4 cache; median of
CUDA-event timings over CUDA-graph replays, the formats in turns; the share of HBM bandwidth is
the bytes of the keys (each distinct key once) and queries over the time.

    python benchmarks/bench_indexer_formats.py --device cpu [--json out.json]
    python benchmarks/bench_indexer_formats.py --device cuda --speed [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import dsv4_compile as d4
from dsv4_compile import layout

PAGE = 64  # compressed blocks a page (a 256-token page of the c4 cache)
HEADS, DIM = 64, layout.INDEX_HEAD_DIM


def make_data(kind: str, rows: int, blocks: int, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(rows, HEADS, DIM, generator=g)
    keys = torch.randn(blocks, DIM, generator=g)
    weights = torch.randn(rows, HEADS, generator=g) * HEADS**-0.5
    if kind == "outliers":
        channels = torch.randperm(DIM, generator=g)[:4]
        q[..., channels] *= 30
        keys[:, channels] *= 30
    return q.to(device), keys.to(device), weights.to(device)


def scored(q, keys, weights, name: str, rotate: bool) -> torch.Tensor:
    """Every row's logits over every block through the cache in format ``name``."""
    blocks = keys.shape[0]
    cache = layout.alloc_index_cache(-(-blocks // PAGE), PAGE, name, device=keys.device)
    slots = torch.arange(blocks, device=keys.device)
    if rotate:
        keys, q = layout.hadamard(keys), layout.hadamard(q)
    d4.indexer_store(keys, cache, slots, PAGE, name)
    codes, scales = layout.quantize_index(q, name)
    if name == "fp8":
        weights, scales = weights * scales, None
    block_slots = slots.expand(q.shape[0], -1)
    return d4.indexer_cache_logits(codes, weights, cache, block_slots, PAGE, name, scales)


def agreement(exact: torch.Tensor, quantized: torch.Tensor, k: int) -> dict:
    """Top-k overlap and the exact logit gaps of the swapped blocks (relative to each row's std)."""
    want = d4.indexer_topk(exact, k)
    got = d4.indexer_topk(quantized, k)
    overlaps, gaps = [], []
    spread = exact.std(dim=1)
    for row in range(exact.shape[0]):
        a, b = set(want[row].tolist()), set(got[row].tolist())
        overlaps.append(len(a & b) / k)
        dropped, added = sorted(a - b), sorted(b - a)
        if dropped:
            # each dropped block against the weakest block the quantized selection took instead
            weakest = min(exact[row, added].tolist())
            gaps += [(exact[row, i].item() - weakest) / spread[row].item() for i in dropped]
    err = ((quantized - exact).abs().amax(dim=1) / spread).max().item()
    return {
        "mean_overlap": statistics.mean(overlaps),
        "worst_overlap": min(overlaps),
        "swaps": len(gaps),
        "max_swap_gap_in_std": max(gaps, default=0.0),
        "max_logit_error_in_std": err,
    }


def accuracy(device, rows: int, blocks: int, k: int) -> list[dict]:
    out = []
    for kind in ("random", "outliers"):
        q, keys, weights = make_data(kind, rows, blocks, device)
        exact = scored(q, keys, weights, "fp32", False)
        for name in ("fp8", "fp4"):
            for rotate in (True, False):
                row = {"data": kind, "format": name, "rotated": rotate, **agreement(exact, scored(q, keys, weights, name, rotate), k)}
                out.append(row)
                print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                               for key, value in row.items()), flush=True)
    return out


def speed(device, blocks: int, rounds: int = 15) -> list[dict]:
    """Median µs per call of each format's logits, CUDA-graph replays, the formats in turns. Decode
    rows (1, 64) are requests of their own, each seeing its own ``blocks`` blocks (a batch reads
    ``rows * blocks`` keys from HBM); the 4096 prefill rows are one request's, sharing them."""
    out = []
    for rows in (1, 64, 4096):
        requests = rows if rows <= 64 else 1
        g = torch.Generator(device="cpu").manual_seed(rows)
        q = torch.randn(rows, HEADS, DIM, generator=g).to(device)
        weights = (torch.randn(rows, HEADS, generator=g) * HEADS**-0.5).to(device)
        keys = torch.randn(requests * blocks, DIM, device=device)
        slots = torch.arange(requests * blocks, device=device)
        # each row sees its request's blocks in a random order (a gather, as in the model)
        order = torch.argsort(torch.rand(rows, blocks, device=device), dim=1)
        block_slots = order + (torch.arange(rows, device=device)[:, None] % requests) * blocks
        calls = {}
        for name in ("fp32", "fp8", "fp4"):
            cache = layout.alloc_index_cache(-(-requests * blocks // PAGE), PAGE, name, device=device)
            d4.indexer_store(layout.hadamard(keys), cache, slots, PAGE, name)
            codes, scales = layout.quantize_index(layout.hadamard(q), name)
            w = weights * scales if name == "fp8" else weights
            args = (codes, w, cache, block_slots, PAGE, name, scales if name == "fp4" else None)
            d4.indexer_cache_logits(*args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    d4.indexer_cache_logits(*args)
            read = requests * blocks * layout.INDEX_FORMATS[name].token_bytes + codes.numel() * codes.element_size()
            calls[name] = (graph, read, args)  # the graph reads args' memory: keep it alive
        times = {name: [] for name in calls}
        for _ in range(rounds):
            for name, (graph, _, _) in calls.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) * 1000 / 10)
        for name, (graph, read, _) in calls.items():
            us = statistics.median(times[name])
            row = {"rows": rows, "blocks": blocks, "format": name, "us": us, "TB_per_s": read / us / 1e6,
                   "vs_fp32": us / statistics.median(times["fp32"])}
            out.append(row)
            print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                           for key, value in row.items()), flush=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4096, help="visible blocks per row (16384 tokens at ratio 4)")
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--speed", action="store_true", help="time the logits per format (CUDA)")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"torch": torch.__version__, "device": str(device),
              "accuracy": accuracy(device, args.rows, args.blocks, args.k)}
    if args.speed:
        report["gpu"] = torch.cuda.get_device_name(device)
        report["speed"] = speed(device, args.blocks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
