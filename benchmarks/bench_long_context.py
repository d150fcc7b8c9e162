"""Long context on one GPU: a request's chunked prefill (time, throughput, transient memory peak),
the indexer's share of the tensor cores there, and the decode step after it (CUDA).

    python benchmarks/bench_long_context.py [--contexts 32768 131072 524288 1048576] [--chunk 8192]
        [--json out.json] [--plot out.png]
    python benchmarks/bench_long_context.py plot out.json out.png        # a saved run

The model is a 3-layer slice at DSV4-Flash widths, one layer of each kind (ratios 0, 4, 128), a
32000-token vocabulary, FP8 indexer keys; ``CacheConfig(max_requests=8, max_seq_len=context,
page_size=256)``. One random prompt of ``context - 1`` tokens is prefilled in chunks of
``--chunk`` tokens (``generation.prefill_prompts``), eagerly. Fields per context: ``context``,
``prefill_s`` (the whole prompt, after a warm-up prefill of the same prompt), ``tokens_per_s``,
``peak_gib_above`` (the allocator's peak during the prefill above what the weights and caches hold
before it); ``indexer_tflops`` / ``indexer_share_of_peak``: the indexer's block logits of the
last chunk's rows (``bench_indexer_long.py``'s tile kernel case at this context) over the dense
FP8 tensor peak; ``decode_ms`` / ``decode_ms_b8``: the decode step at position ``context - 1``
of 1 and 8 requests (the other 7 requests' page-table rows point at the first's pages, so each
reads a whole context), the eager step captured in a CUDA graph, median replay. ``--plot``: prefill
time against context, log-log, with the time the indexer's FLOPs take at the FP8 peak.
``--quick``: a tiny model at 1024 tokens on any device (a smoke run: prefill fields only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench_indexer_long import PEAK_FP8_TFLOPS, prefill_case
from common import graph_timed
from dsv4_compile.generation import prefill_prompts, random_prompts, step_inputs
from dsv4_compile.models import CacheConfig, DeepseekV4Config, DeepseekV4Model, tiny_config

GIB = 1 << 30


def build(context: int, quick: bool, device) -> DeepseekV4Model:
    if quick:
        config = tiny_config(max_position_embeddings=max(4096, context))
    else:
        config = DeepseekV4Config(num_hidden_layers=3, vocab_size=32000, compress_ratios=(0, 4, 128))
    cache = CacheConfig(max_requests=8, max_seq_len=context, page_size=256, index_format="fp8")
    return DeepseekV4Model(config, cache, seed=0, device=device)


def measure(context: int, chunk: int, quick: bool, device) -> dict:
    model = build(context, quick, device)
    prompt = random_prompts(model.config.vocab_size, [context - 1], seed=1)
    on_cuda = torch.device(device).type == "cuda"
    with torch.no_grad():
        prefill_prompts(model, prompt, device, chunk)  # warm-up: every shape's first call (Triton compiles)
        model.reset_caches()
        if on_cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        logits = prefill_prompts(model, prompt, device, chunk)
        if on_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() - base) / GIB if on_cuda else None
        assert bool(logits.isfinite().all())
        row = {"context": context, "chunk": chunk, "prefill_s": round(seconds, 3),
               "tokens_per_s": round((context - 1) / seconds),
               "peak_gib_above": None if peak is None else round(peak, 3)}
        if on_cuda:
            token = int(logits[-1].argmax())
            row["decode_ms"] = round(decode_ms(model, token, context, 1, device), 3)
            row["decode_ms_b8"] = round(decode_ms(model, token, context, 8, device), 3)
    del model
    if on_cuda:
        torch.cuda.empty_cache()
        indexer = prefill_case(context, min(chunk, context), "fp8", sweep=False)
        row["indexer_tflops"], row["indexer_share_of_peak"] = indexer["tflops"], indexer["share_of_peak"]
    return row


def indexer_flop(context: int) -> float:
    """The ratio-4 layer's indexer FLOPs over a ``context``-token prefill: every token scores each
    block it sees (``(p + 1) // 4`` at position ``p``) with 64 heads x 128 dims."""
    q, r = divmod(context, 4)  # sum of n // 4 over n = 1 .. context
    return 2 * 64 * 128 * (4 * q * (q - 1) // 2 + (r + 1) * q)


def plot(json_path: str, png: str) -> None:
    """Prefill time against context (log-log), and the indexer's FLOPs at the FP8 dense peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        run = json.load(f)
    rows = run["rows"]
    contexts = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.loglog(contexts, [r["prefill_s"] for r in rows], "o-", label="prefill (3-layer slice, 8192-token chunks)")
    floor = [indexer_flop(c) / (PEAK_FP8_TFLOPS * 1e12) for c in contexts]
    ax.loglog(contexts, floor, "k--", label="its indexer's FLOPs at the dense FP8 peak")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("seconds")
    ax.set_title(f"Long-context prefill, {run['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def decode_ms(model: DeepseekV4Model, token: int, context: int, requests: int, device) -> float:
    """The decode step of ``requests`` requests at position ``context - 1`` (requests past the first
    read its pages), eager, captured in a CUDA graph: median ms of runs of 20 replays
    (``common.graph_timed``)."""
    model.page_table[1:requests] = model.page_table[0]
    inputs = step_inputs([[token]] * requests, [context - 1] * requests, device)
    return graph_timed(lambda: model(**inputs), per_graph=1, replays=20) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if sys.argv[1:2] == ["plot"]:
        plot(*sys.argv[2:4])
        return
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 524288, 1048576])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--plot", help="draw prefill time against context here (PNG)")
    parser.add_argument("--quick", action="store_true", help="a tiny model at 1024 tokens, any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    contexts, chunk = ([1024], 256) if args.quick else (args.contexts, args.chunk)
    rows = []
    for context in contexts:
        rows.append(measure(context, chunk, args.quick, device))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
        if args.plot:
            plot(args.json, args.plot)


if __name__ == "__main__":
    main()
