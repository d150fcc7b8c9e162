"""The decode step tensor-parallel over N GPUs (``torch.distributed``), against one GPU.

    torchrun --standalone --nproc-per-node N benchmarks/bench_tp.py [--json out.json]   # CUDA, NCCL
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --quick             # CPU smoke, gloo
    python benchmarks/bench_tp.py table tp1.json tp2.json [...]                         # a markdown table

Each rank builds bench_step.py's DSV4-Flash-sized 4-layer slice with ``tp`` over the launched
ranks (:mod:`dsv4_compile.models.parallel`: 1/N of the query heads, output groups, indexer heads
and MLP width per rank; KV, caches and compressors replicated), caches
``CacheConfig(max_requests=max(--batches), max_seq_len=2048, page_size=256)``, prefills
``max(--batches)`` prompts of ``--prompt`` tokens in chunks, then times the decode step of the
first ``b`` requests under ``torch.compile`` (default mode and ``reduce-overhead``: CUDA graphs
with the NCCL all-reduces captured), one compiled function per mode across the batch sizes.
Launched with one process it is the TP = 1 baseline of the same model.

Rank 0 reports: per batch size and mode the median ms per step (over runs of ``--calls``
back-to-back calls, synchronised per run; every rank steps in lockstep through the all-reduces),
each rank's memory roofline (its weights + attended cache bytes / its measured copy rate), the
graphs compiled, the all-reduces in the decode graph and the cudagraph skips; and the greedy tokens
of one compiled step per batch, which ``table`` compares across TP sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from dsv4_compile.generation import Batch, decode_inputs, prefill_prompts, random_prompts
from dsv4_compile.models import CacheConfig, DeepseekV4Model, tiny_config
from dsv4_compile.models.parallel import all_reduces_in, torchrun_group

from bench_step import copy_rate, decode_bytes, slice_config, step_ms, sync  # this directory's benchmark

MODES = {"default": {}, "reduce-overhead": {"mode": "reduce-overhead"}}


def build(args, device, tp) -> DeepseekV4Model:
    requests = max(args.batches)
    if args.quick:
        config = tiny_config(compress_ratios=(0, 0, 4, 128), num_hidden_layers=4)
        cache = CacheConfig(max_requests=requests, max_seq_len=512, page_size=256)
    else:
        config = slice_config()
        cache = CacheConfig(max_requests=requests, max_seq_len=2048, page_size=256)
    return DeepseekV4Model(config, cache, seed=0, device=device, tp=tp)


@torch.no_grad()
def run(args, device, tp) -> dict:
    model = build(args, device, tp)
    texts = random_prompts(model.config.vocab_size, [args.prompt] * max(args.batches))
    report = {
        "world_size": tp.size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters_m_per_rank": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "requests": len(texts),
        "prompt": args.prompt,
    }
    rate = copy_rate(device) if device.type == "cuda" else 0.0
    report["copy_tb_s"] = round(rate / 1e12, 3)
    start = time.perf_counter()
    prefill_prompts(model, texts, device, args.chunk)
    sync(device)
    report["prefill_s"] = round(time.perf_counter() - start, 2)

    decode = {b: {} for b in args.batches}
    inputs = {b: decode_inputs(Batch([t + [1] for t in texts[:b]]), device) for b in args.batches}
    report["all_reduce_count"] = all_reduces_in(torch._dynamo.explain(model)(**inputs[args.batches[0]], mode="decode").graphs)
    for mode, kwargs in MODES.items():
        if mode == "reduce-overhead" and device.type != "cuda":
            continue
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        step = torch.compile(model, fullgraph=True, **kwargs)
        for b in args.batches:
            start = time.perf_counter()
            logits = step(**inputs[b], mode="decode")
            sync(device)
            row = decode[b]
            row[f"{mode}_first_call_s"] = round(time.perf_counter() - start, 2)
            row[f"{mode}_tokens"] = logits.argmax(-1).tolist()
            row[f"{mode}_ms"] = round(step_ms(lambda: step(**inputs[b], mode="decode"), device, args.calls), 3)
            if rate:
                seq_lens = [len(t) + 1 for t in texts[:b]]
                row["roofline_ms_per_rank"] = round(decode_bytes(model, seq_lens) / rate * 1e3, 4)
        report[f"{mode}_graphs_compiled"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if mode == "reduce-overhead":
            report["cudagraph_skips"] = dict(torch._dynamo.utils.counters["inductor"]).get("cudagraph_skips", 0)
        if tp.rank == 0:
            print(json.dumps({"mode": mode, "decode": decode}), flush=True)  # progress
    report["decode"] = {str(b): row for b, row in decode.items()}
    return report


def table(paths: list[str]) -> str:
    """A markdown table of step times from reports of several TP sizes (same batches)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    base = reports[0]
    modes = [m for m in MODES if f"{m}_ms" in next(iter(base["decode"].values()))]
    head = "| T (rows) | " + " | ".join(f"TP={r['world_size']} {m} ms" for r in reports for m in modes)
    head += " | " + " | ".join(f"TP={r['world_size']} roofline ms" for r in reports) + " | tokens equal TP=1 |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for b, row in base["decode"].items():
        cells = [str(r["decode"][b].get(f"{m}_ms", "")) for r in reports for m in modes]
        cells += [str(r["decode"][b].get("roofline_ms_per_rank", "")) for r in reports]
        same = all(r["decode"][b][f"{m}_tokens"] == row[f"{m}_tokens"] for r in reports for m in modes)
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


def main() -> dict | None:
    if len(sys.argv) > 1 and sys.argv[1] == "table":
        print(table(sys.argv[2:]))
        return None
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model on CPU over gloo: a smoke run, no figures")
    parser.add_argument("--batches", default="1,64,256", help="decode rows per step")
    parser.add_argument("--prompt", type=int, default=1024, help="tokens per prompt")
    parser.add_argument("--chunk", type=int, default=8192, help="chunked prefill: tokens per step")
    parser.add_argument("--calls", type=int, default=20, help="calls per timing run")
    parser.add_argument("--json", help="rank 0 writes the report here")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun: torchrun --nproc-per-node N benchmarks/bench_tp.py")
    if args.quick:
        args.device, args.prompt, args.chunk, args.calls, args.batches = "cpu", 150, 128, 2, "1,2"
    args.batches = [int(b) for b in args.batches.split(",")]
    with torchrun_group(args.device) as (device, tp):
        report = run(args, device, tp)
        if tp.rank == 0:
            text = json.dumps(report, indent=1)
            print(text, flush=True)
            if args.json:
                Path(args.json).write_text(text)
    return report


if __name__ == "__main__":
    main()
