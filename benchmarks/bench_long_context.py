"""Long-context prefill of one request: time, throughput and the transient memory peak (CUDA).

    python benchmarks/bench_long_context.py [--contexts 131072 524288] [--chunk 8192] [--json out.json]

The model is a 3-layer slice at DSV4-Flash widths, one layer of each kind (ratios 0, 4, 128), a
32000-token vocabulary, FP8 indexer keys; ``CacheConfig(max_requests=1, max_seq_len=context,
page_size=256)``. One random prompt of ``context`` tokens is prefilled in chunks of ``--chunk``
tokens (``generation.prefill_prompts``), eagerly. Fields per context: ``context``, ``prefill_s``
(the whole prompt, after a warm-up prefill of one chunk), ``tokens_per_s``, ``peak_gib_above``
(the allocator's peak during the prefill above what the weights and caches hold before it).
``--quick``: a tiny model at 1024 tokens on any device (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dsv4_compile.generation import prefill_prompts, random_prompts
from dsv4_compile.models import CacheConfig, DeepseekV4Config, DeepseekV4Model, tiny_config

GIB = 1 << 30


def build(context: int, quick: bool, device) -> DeepseekV4Model:
    if quick:
        config = tiny_config(max_position_embeddings=max(4096, context))
    else:
        config = DeepseekV4Config(num_hidden_layers=3, vocab_size=32000, compress_ratios=(0, 4, 128))
    cache = CacheConfig(max_requests=1, max_seq_len=context, page_size=256, index_format="fp8")
    return DeepseekV4Model(config, cache, seed=0, device=device)


def measure(context: int, chunk: int, quick: bool, device) -> dict:
    model = build(context, quick, device)
    prompt = random_prompts(model.config.vocab_size, [context], seed=1)
    on_cuda = torch.device(device).type == "cuda"
    with torch.no_grad():
        prefill_prompts(model, [prompt[0][:chunk]], device, chunk)  # warm-up: first calls, Triton compiles
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
    return {"context": context, "chunk": chunk, "prefill_s": round(seconds, 3),
            "tokens_per_s": round(context / seconds), "peak_gib_above": None if peak is None else round(peak, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--json", help="write the rows to this file")
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


if __name__ == "__main__":
    main()
