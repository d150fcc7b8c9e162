"""Generate with a small DeepSeek V4 model whose decode step is one torch.compile graph.

Builds a 3-layer DSV4 model (one layer of each kind: sliding window only, ratio-4 compression with
the lightning indexer, ratio-128 compression) with random weights on CUDA if present, else CPU;
prefills three prompts of different lengths, then runs greedy decode steps eagerly and compiled
(``torch.compile(fullgraph=True)``; on CUDA also ``mode="reduce-overhead"``, CUDA graphs) from the
same prefilled state, and reports the graph count, graph breaks, recompiles, the largest logit
difference compiled vs eager, the provider serving each op, and the time per decode step.

    python examples/generate.py [--device cpu|cuda] [--steps 8] [--kv-format v4] [--c4-kv-format F]
        [--index-format fp8|fp4|fp32] [--chunk N] [--json]

``--kv-format``: the caches' format (``layout.FORMATS``, an FP8 one): ``v4`` (584-byte tokens),
``v4.1-fp8`` (528 bytes, block-split pages) or ``v4.1-fp8-interleaved``. ``--c4-kv-format``: the
ratio-4 compressed cache's, if another of the same generation: e.g. ``v4.1-fp4`` (288-byte FP4
tokens, as DSV4.1 stores its low-ratio compressed caches) with ``--kv-format v4.1-fp8``
(``CacheConfig``'s ``kv_format`` and ``c4_kv_format``). ``--index-format``: the ratio-4 layers'
indexer key cache (``layout.INDEX_FORMATS``): ``fp8`` (132 bytes a block, the default), ``fp4``
(68) or ``fp32`` (512, the exact scores). ``--json`` reports ``indexer_bytes_per_block`` and
``cache_bytes_per_token`` (every layer's caches, as allocated, per token of context).

``--chunk N``: chunked prefill, at most ``N`` tokens per prefill step (bounded memory for any
prompt length; :func:`dsv4_compile.generation.prefill_prompts`).

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
from dsv4_compile import layout
from dsv4_compile.models import CacheConfig, DeepseekV4Model, decode_inputs, generate, tiny_config
from dsv4_compile.generation import Batch, choice_margins, random_prompts

PROMPT_LENGTHS = (5, 37, 150)  # 150 > 128: the ratio-128 layer has a compressed block to attend


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


def run(model, decode, prompts, steps, device, chunk=None, follow=None):
    """Reset the caches, prefill eagerly (in steps of ``chunk`` tokens), decode ``steps`` tokens
    (feeding ``follow``'s tokens if given: :func:`~dsv4_compile.generation.generate`); returns
    (greedy tokens, the logits of every step: 0 = the prefill's last tokens)."""
    model.reset_caches()
    logits = []
    tokens = generate(
        model, decode, prompts, steps, device, on_step=lambda s, l: logits.append(l),
        chunk_tokens=chunk, follow=follow,
    )
    return tokens, logits


@torch.no_grad()
def measure(model, prompts, steps, device, chunk=None) -> tuple[dict, dict]:
    """Eager generation, then compiled generation (default mode; on CUDA also ``reduce-overhead``)
    from the same prefilled state, fed the eager run's tokens (so a near-tie that rounding flips
    does not send the runs apart); returns the report's measured keys (graphs, breaks, recompiles,
    compiled vs eager error, times per decode step) and the details: the eager tokens and logits of
    every step, each mode's median ms, whether every mode chose the eager tokens (and, where one did
    not, how far below eager's top logit its choice lies: ``compiled_margin``), and the decode
    step's traced graphs (``torch._dynamo.explain``)."""
    eager = Timed(model, device)
    want_tokens, want = run(model, eager, prompts, steps, device, chunk)

    modes = ["default"] + (["reduce-overhead"] if device.type == "cuda" else [])
    compiled_ms, compiled_min, err, recompiles, tokens_match, margin = {}, {}, 0.0, 0, True, 0.0
    for mode in modes:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = Timed(torch.compile(model, fullgraph=True, mode=mode), device, clone=True)
        tokens, got = run(model, compiled, prompts, steps, device, chunk, follow=want_tokens)
        compiled_ms[mode] = statistics.median(compiled.ms[1:])  # call 0 compiles
        compiled_min[mode] = min(compiled.ms[1:])
        err = max(err, max((g - w).abs().max().item() for g, w in zip(got, want)))
        recompiles = max(recompiles, torch._dynamo.utils.counters["stats"]["unique_graphs"] - 1)
        tokens_match &= tokens == want_tokens
        margin = max([margin, *choice_margins(want, want_tokens, tokens)])

    batch = Batch([p + t[:1] for p, t in zip(prompts, want_tokens)])
    explanation = torch._dynamo.explain(model)(**decode_inputs(batch, device), mode="decode")
    measured = {
        "graph_count": explanation.graph_count,
        "graph_break_count": explanation.graph_break_count,
        "recompiles": recompiles,
        "max_abs_err_vs_eager": err,
        "eager_ms_per_step": statistics.median(eager.ms[1:]),  # call 0 warms up
        "compiled_ms_per_step": compiled_ms[modes[-1]],
        "compiled_ms_min_step": compiled_min[modes[-1]],
    }
    details = {"tokens": want_tokens, "logits": want, "compiled_ms": compiled_ms,
               "tokens_match": tokens_match, "compiled_margin": margin, "graphs": explanation.graphs}
    return measured, details


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8, help="decode steps (>= 2)")
    parser.add_argument("--kv-format", default="v4", choices=[n for n, f in layout.FORMATS.items() if f.values != "fp4"],
                        help="the caches' format")
    parser.add_argument("--c4-kv-format", choices=list(layout.FORMATS),
                        help="the ratio-4 compressed cache's format (default: --kv-format's)")
    parser.add_argument("--index-format", default="fp8", choices=list(layout.INDEX_FORMATS),
                        help="the ratio-4 layers' indexer key cache's format")
    parser.add_argument("--chunk", type=int, help="chunked prefill: at most this many tokens per prefill step")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def make_model(kv_format: str, device, tp=None, c4_kv_format: str | None = None, index_format: str = "fp8") -> DeepseekV4Model:
    """The example's 3-layer model (random weights, seed 0), caches in ``kv_format`` (the ratio-4
    compressed cache in ``c4_kv_format`` if given, the indexer key cache in ``index_format``)."""
    cache = CacheConfig(max_requests=4, max_seq_len=512, kv_format=kv_format, c4_kv_format=c4_kv_format,
                        index_format=index_format)
    return DeepseekV4Model(tiny_config(), cache, seed=0, device=device, tp=tp)


def main() -> dict:
    args = parser().parse_args()
    device = torch.device(args.device)
    steps = max(args.steps, 2)
    model = make_model(args.kv_format, device, c4_kv_format=args.c4_kv_format, index_format=args.index_format)
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS)

    measured, details = measure(model, prompts, steps, device, args.chunk)
    compiled_ms, tokens_match, want_tokens = details["compiled_ms"], details["tokens_match"], details["tokens"]

    report = {
        "device": str(device),
        "kv_formats": model.cache.cache_formats(),
        "indexer_bytes_per_block": layout.indexer_format(model.cache.index_format).token_bytes,
        # every layer's caches, as allocated, per token of context
        "cache_bytes_per_token": sum(model.cache.bytes_per_token(r)["total"] for r in model.config.compress_ratios),
        "prefill_chunk": args.chunk,
        **measured,
        "providers": d4.providers(device),
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
