"""DSV4.1 cache formats on CUDA: decode time per format against V4, and the store's bandwidth.

    python benchmarks/bench_formats.py [--json out.json]

Decode (the DSV4 decode step of common.py: H=64, SWA cache P=256 with 128 keys per row, compressed
extra cache P=64 with 512 keys per row; T rows in 1 / 8 / 64 / 256), per call, replayed from a CUDA
graph of 10 calls (common.graph_timed), by the Triton decode for every format and by FlashMLA for
V4; bytes read per call (indices x token bytes) next to the time, so whether time follows bytes is
visible. Store: the Triton fused store, T = 65536 tokens (P = 256), for every format, in GB/s of
(read kv + freqs row + position + slot, write one token) and as a share of a device-to-device copy
of the same bytes.
"""

from __future__ import annotations

import argparse
import json

import torch

import dsv4_compile as d4
from common import DECODE_ROWS, DEV, decode_inputs, graph_timed, timed
from dsv4_compile import layout

#: (main format, extra format) per row of the decode table
PAIRS = [
    ("v4", "v4"),
    ("v4.1-fp8", "v4.1-fp8"),
    ("v4.1-fp8", "v4.1-fp4"),
    ("v4.1-fp8-interleaved", "v4.1-fp8-interleaved"),
    ("v4.1-fp8-interleaved", "v4.1-fp4-interleaved"),
]


def bench_decode(rows: int, kv_format: str, extra_format: str, provider: str) -> dict:
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_inputs(rows, 64, kv_format, extra_format)

    def call():
        return d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen,
                                         kv_format=kv_format, extra_kv_format=extra_format)

    with d4.use_provider(provider, ops=("flash_mla_with_kvcache",)):
        us = graph_timed(call)
    main, extra = layout.FORMATS[kv_format], layout.FORMATS[extra_format]
    read = rows * (int(lengths.float().mean()) * main.token_bytes + int(elen.float().mean()) * extra.token_bytes)
    return {"rows": rows, "kv_format": kv_format, "extra_format": extra_format, "provider": provider,
            "us": us, "key_bytes": read, "key_GBps": read / us / 1e3}


def bench_store(kv_format: str, tokens: int = 65536) -> dict:
    pages = 2 * tokens // 256
    cache = layout.alloc_cache(pages, 256, DEV, kv_format=kv_format)
    kv = torch.randn(tokens, 512, dtype=torch.bfloat16, device=DEV)
    args = (kv, torch.ones(512, dtype=torch.bfloat16, device=DEV), torch.randn(65536, 64, device=DEV),
            torch.randint(0, 65536, (tokens,), device=DEV), torch.randperm(pages * 256, device=DEV)[:tokens],
            cache, 1e-6, 256, kv_format)
    us = timed(lambda: d4.fused_k_norm_rope_flashmla(*args), calls=20)
    moved = tokens * (1024 + 256 + 16 + layout.FORMATS[kv_format].token_bytes)
    src = torch.empty(moved // 2, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    copy_us = timed(lambda: dst.copy_(src), calls=20)
    return {"kv_format": kv_format, "tokens": tokens, "us": us, "GBps": moved / us / 1e3,
            "share_of_copy": copy_us / us}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    decode = []
    for rows in DECODE_ROWS:
        for kv_format, extra_format in PAIRS:
            providers = ["triton"] + (["flashmla"] if kv_format == "v4" else [])
            for provider in providers:
                row = bench_decode(rows, kv_format, extra_format, provider)
                print(row, flush=True)
                decode.append(row)
    store = [bench_store(f) for f in ("v4", "v4.1-fp8", "v4.1-fp8-interleaved", "v4.1-fp4", "v4.1-fp4-interleaved")]
    for row in store:
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "decode": decode,
                       "store": store}, f, indent=1)


if __name__ == "__main__":
    main()
