"""Generate with a small DeepSeek V4 model whose decode step is one torch.compile graph.

Builds a 3-layer DSV4 model (one layer of each kind: sliding window only, ratio-4 compression with
the lightning indexer, ratio-128 compression) with random weights on CUDA if present, else CPU;
prefills three prompts of different lengths, then runs greedy decode steps eagerly and compiled
(``torch.compile(fullgraph=True)``; on CUDA also ``mode="reduce-overhead"``, CUDA graphs) from the
same prefilled state, and reports the graph count, graph breaks, recompiles, the largest logit
difference compiled vs eager, the provider serving each op, and the time per decode step.

    python examples/generate.py [--device cpu|cuda] [--steps 8] [--kv-format v4] [--json]

``--kv-format``: the caches' format: ``v4`` (584-byte tokens), ``v4.1`` (528-byte FP8, block-split
pages), ``v4.1-interleaved``, and ``v4.1-fp4`` / ``v4.1-fp4-interleaved`` (the ratio-4 compressed
cache in 288-byte FP4, as DSV4.1 stores its low-ratio compressed caches).

The first compiled step includes compilation (tens of seconds on a small CPU machine, cached on
disk for the next run); the reported compiled time per step (median, and the fastest step)
excludes it. On a small shared CPU machine another busy process can stretch every step 10-70x
(PyTorch's OpenMP threads wait for each other at each parallel region): compare the fastest steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dsv4_compile as d4
from dsv4_compile.models import CacheConfig, DeepseekV4Model, decode_inputs, generate, tiny_config
from dsv4_compile.generation import Batch

PROMPT_LENGTHS = (5, 37, 150)  # 150 > 128: the ratio-128 layer has a compressed block to attend
#: --kv-format: (CacheConfig.kv_format, CacheConfig.fp4_ratios)
KV_FORMATS = {
    "v4": ("v4", ()),
    "v4.1": ("v4.1", ()),
    "v4.1-interleaved": ("v4.1-interleaved", ()),
    "v4.1-fp4": ("v4.1", (4,)),
    "v4.1-fp4-interleaved": ("v4.1-interleaved", (4,)),
}


class Timed:
    """Wraps a step function; records its wall time per call (synchronizing the device)."""

    def __init__(self, fn, device: torch.device, clone: bool = False):
        self.fn, self.device, self.clone, self.ms = fn, device, clone, []

    def __call__(self, **inputs):
        self._sync()
        start = time.perf_counter()
        out = self.fn(**inputs)
        out = out.clone() if self.clone else out  # CUDA-graph outputs are overwritten by replays
        self._sync()
        self.ms.append((time.perf_counter() - start) * 1e3)
        return out

    def _sync(self):
        if self.device.type != "cpu":  # CUDA, XPU: time the work, not its launch
            torch.get_device_module(self.device).synchronize(self.device)


def run(model, decode, prompts, steps, device):
    """Reset the caches, prefill eagerly, decode ``steps`` tokens; returns (tokens, decode logits)."""
    model.reset_caches()
    logits = []
    tokens = generate(
        model, decode, prompts, steps, device, on_step=lambda s, l: logits.append(l) if s else None
    )
    return tokens, logits


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8, help="decode steps (>= 2)")
    parser.add_argument("--kv-format", default="v4", choices=sorted(KV_FORMATS), help="the caches' format")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    device = torch.device(args.device)
    steps = max(args.steps, 2)

    config = tiny_config()
    kv_format, fp4_ratios = KV_FORMATS[args.kv_format]
    cache = CacheConfig(max_requests=4, max_seq_len=512, kv_format=kv_format, fp4_ratios=fp4_ratios)
    model = DeepseekV4Model(config, cache, seed=0, device=device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]

    with torch.no_grad():
        eager = Timed(model, device)
        want_tokens, want = run(model, eager, prompts, steps, device)

        modes = ["default"] + (["reduce-overhead"] if device.type == "cuda" else [])
        compiled_ms, compiled_min, err, recompiles, tokens_match = {}, {}, 0.0, 0, True
        for mode in modes:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled = Timed(torch.compile(model, fullgraph=True, mode=mode), device, clone=True)
            tokens, got = run(model, compiled, prompts, steps, device)
            compiled_ms[mode] = statistics.median(compiled.ms[1:])  # call 0 compiles
            compiled_min[mode] = min(compiled.ms[1:])
            err = max(err, max((g - w).abs().max().item() for g, w in zip(got, want)))
            recompiles = max(recompiles, torch._dynamo.utils.counters["stats"]["unique_graphs"] - 1)
            tokens_match &= tokens == want_tokens

        batch = Batch([p + t[:1] for p, t in zip(prompts, want_tokens)])
        explanation = torch._dynamo.explain(model)(**decode_inputs(batch, device), mode="decode")

    report = {
        "device": str(device),
        "kv_format": args.kv_format,
        "graph_count": explanation.graph_count,
        "graph_break_count": explanation.graph_break_count,
        "recompiles": recompiles,
        "max_abs_err_vs_eager": err,
        "providers": d4.providers(device),
        "eager_ms_per_step": statistics.median(eager.ms[1:]),  # call 0 warms up
        "compiled_ms_per_step": compiled_ms[modes[-1]],
        "compiled_ms_min_step": compiled_min[modes[-1]],
    }
    if args.json:
        print(json.dumps(report))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
        for mode, ms in compiled_ms.items():
            print(f"{'  compiled (' + mode + ')':<{width}}  {ms:.2f} ms/step")
        print(f"{'tokens (eager == compiled)':<{width}}  {tokens_match}")
        for prompt, tokens in zip(prompts, want_tokens):
            print(f"  prompt of {len(prompt):>3} tokens -> {tokens}")
    return report


if __name__ == "__main__":
    main()
