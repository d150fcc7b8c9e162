"""transformers' DeepSeek V4 against the same model with our attention, at DSV4-Flash's dimensions,
on CUDA.

    PYTHONPATH=. python benchmarks/bench_transformers.py [--prefill 4096 32768] [--batch 1 32]
        [--context 1024] [--json out.json]
    PYTHONPATH=. python benchmarks/bench_transformers.py --generate [--generate-prompts 4096 32768]
        [--generate-batch 1 8] [--new 32] [--prefill-chunk N] [--json out.json]

The model: transformers' ``DeepseekV4ForCausalLM`` with its default (DSV4-Flash) dimensions —
hidden 4096, 64 heads of 512, q / o LoRA ranks 1024, 8 output groups, window 128, indexer 64 heads
of 128 picking 512 blocks, vocabulary 129280 — cut to a slice: three layers, one of each kind
(sliding, ratio 4 with the indexer, ratio 128), and 8 routed experts instead of 256 (the MoE is
transformers' own code both ways). Random bf16 weights (``random_hf_model``), eager attention.

* **Prefill** of one request of ``N`` tokens: time of one call (after a warm-up call of the same
  size) and peak memory. transformers: ``model(ids, use_cache=True)`` (its dense attention
  and its cache); ours: one prefill step of :class:`TransformersDSV4` (V4 caches, FP8 indexer
  keys), eager. Peak memory: the allocator's peak above what was allocated before the call; ours
  adds the bytes its caches hold for those ``N`` tokens (``CacheConfig.bytes_per_token``), as
  its caches are allocated up front for every request. An out-of-memory is reported as such.
* **Decode** at batch ``B``: ``B`` requests of ``--context`` random tokens prefilled, then the time
  per decode step (medians of :data:`STEPS` steps after :data:`WARMUP`): transformers eager with
  its cache; ours eager and compiled (``fullgraph=True, mode="reduce-overhead"``: CUDA graphs).
  Only the model call is timed (synchronized before and after), not building the step's inputs.

**generate()** (``--generate``; ``--generate-prompts``, ``--generate-batch``, ``--new``): transformers'
own ``model.generate(input_ids, max_new_tokens=--new, do_sample=False)`` on ``B`` random prompts
of ``N`` tokens (no padding): theirs; ours through the same call after the switch, eager and with
``model.forward = torch.compile(model.forward)``; and ours through
``dsv4_compile.generation.generate`` with the step compiled (``fullgraph=True``, default mode).
Per case: ``prefill_ms`` (a call of one new token), ``ms_per_token`` (the rest of a ``--new``-token
call per further token), ``peak_gib`` (the allocator's peak above the start of the call; ours
without its caches, allocated up front: ``ours_cache_bytes_per_token``); each call after a
warm-up call of the same shape. ``--prefill-chunk N``: every way prefills in chunks of at most ``N``
tokens (transformers' ``prefill_chunk_size``; ``chunk_tokens`` of ``generation.generate``), which
bounds the prefill's activations (without it a prompt batch is one forward). ``--device cpu
--tiny``: the tiny test config, a smoke run.

Also a check that both run the same model: the prefill's last logits, ours against theirs, as a
share of their largest magnitude (``last_logits_err_share``): both round at other places (theirs
bf16 activations and dense keys, ours FP8 caches), and where the indexer chooses among more blocks
than its top-k, a near-tie may pick another block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config as HFConfig

from dsv4_compile.generation import Batch, decode_inputs, prefill_inputs, random_prompts
from dsv4_compile.integrations.transformers import (
    LAYER_KINDS, TransformersDSV4, hf_cached_forward, random_hf_model, tiny_hf_config,
)
from dsv4_compile.models import CacheConfig

DEV = torch.device("cuda")
WARMUP, STEPS = 3, 20
GIB = 2**30


def flash_slice() -> HFConfig:
    config = HFConfig(num_hidden_layers=len(LAYER_KINDS), layer_types=list(LAYER_KINDS), n_routed_experts=8)
    config._attn_implementation = "eager"
    return config


def measure(fn) -> dict:
    """The time (ms) of ``fn()``'s second call (the first compiles what this size needs) and the
    allocator's peak above its start (GiB), or the error if it runs out of memory; ``out``: its
    result."""
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"error": "out of memory: " + str(e).split("\n")[0][:160]}
    return {"ms": (time.perf_counter() - start) * 1e3,
            "peak_gib": (torch.cuda.max_memory_allocated() - start_bytes) / GIB, "out": out}


def timed_call(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


@torch.no_grad()
def transformers_decode(model, batch: int, context: int, vocab: int) -> float:
    """Median ms per decode step of their model at ``batch`` requests of ``context`` tokens."""
    ids = torch.tensor(random_prompts(vocab, [context] * batch, seed=1), device=DEV)
    logits, cache = hf_cached_forward(model, ids)
    token = logits[:, -1:].argmax(-1)
    del logits
    ms = []
    for _ in range(WARMUP + STEPS):
        result = {}
        ms.append(timed_call(lambda: result.update(out=hf_cached_forward(model, token, cache))))
        logits, cache = result["out"]
        token = logits[:, -1:].argmax(-1)
    return statistics.median(ms[WARMUP:])


@torch.no_grad()
def our_decode(model: TransformersDSV4, step, batch: int, context: int, vocab: int) -> float:
    """Median ms per decode step through ``step`` (the model or its compiled form)."""
    model.reset_caches()
    prompts = random_prompts(vocab, [context] * batch, seed=1)
    logits = model(**prefill_inputs(prompts, DEV), mode="prefill")
    state = Batch([p + [t] for p, t in zip(prompts, logits.argmax(-1).tolist())])
    ms = []
    for _ in range(WARMUP + STEPS):
        inputs, result = decode_inputs(state, DEV), {}
        ms.append(timed_call(lambda: result.update(logits=step(**inputs, mode="decode"))))
        for tokens, t in zip(state.tokens, result["logits"].argmax(-1).tolist()):
            tokens.append(t)
    return statistics.median(ms[WARMUP:])


def generate_timing(call, new: int) -> dict:
    """``call(max_new_tokens)`` timed at 1 and ``new`` tokens (each after a warm-up call of the same
    size): ``prefill_ms``, ``ms_per_token`` over the further tokens, ``peak_gib`` of the longer
    call, or the error if out of memory."""
    def sync():
        if DEV.type == "cuda":
            torch.cuda.synchronize()

    out = {}
    try:
        for tokens in (1, new):
            call(tokens)  # warm-up: compiles, allocates
            sync()
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                start_bytes = torch.cuda.memory_allocated()
            start = time.perf_counter()
            call(tokens)
            sync()
            out[tokens] = (time.perf_counter() - start) * 1e3
        peak = (torch.cuda.max_memory_allocated() - start_bytes) / GIB if DEV.type == "cuda" else None
    except torch.OutOfMemoryError as e:
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": "out of memory: " + str(e).split("\n")[0][:160]}
    return {"prefill_ms": out[1], "ms_per_token": (out[new] - out[1]) / max(new - 1, 1), "peak_gib": peak}


@torch.no_grad()
def generate_cases(config, cache_rows: int, prompt_lengths, batches, new: int, chunk: int | None = None) -> dict:
    """transformers' generate() on their model, then on ours (eager, compiled forward), and ours
    through dsv4_compile.generation.generate, prefilling in chunks of ``chunk`` tokens if given:
    ``{"N x B": {way: timing}}``."""
    from dsv4_compile.generation import generate as our_generate

    vocab = config.vocab_size
    model = random_hf_model(config, seed=0, device=DEV, dtype=torch.bfloat16)
    cases = {(n, b): torch.tensor(random_prompts(vocab, [n] * b, seed=3), device=DEV)
             for n in prompt_lengths for b in batches}
    report = {f"{n}x{b}": {} for n, b in cases}

    chunking = {"prefill_chunk_size": chunk} if chunk else {}

    def hf_generate(ids):
        return lambda tokens: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                             min_new_tokens=tokens, do_sample=False, pad_token_id=0, **chunking)

    for (n, b), ids in cases.items():
        report[f"{n}x{b}"]["transformers"] = generate_timing(hf_generate(ids), new)
        print("transformers generate", n, b, report[f"{n}x{b}"]["transformers"], flush=True)
    longest = -(-(max(prompt_lengths) + new) // 256) * 256
    ours = TransformersDSV4(model, CacheConfig(max_requests=cache_rows, max_seq_len=longest, kv_format="v4",
                                               index_format="fp8"))
    report["ours_cache_bytes_per_token"] = sum(ours.cache.bytes_per_token(r)["total"]
                                               for r in ours.config.compress_ratios)
    for (n, b), ids in cases.items():
        report[f"{n}x{b}"]["ours_eager"] = generate_timing(hf_generate(ids), new)
        print("ours generate eager", n, b, report[f"{n}x{b}"]["ours_eager"], flush=True)
    forward = model.forward
    model.forward = torch.compile(forward)
    for (n, b), ids in cases.items():
        report[f"{n}x{b}"]["ours_compiled"] = generate_timing(hf_generate(ids), new)
        print("ours generate compiled", n, b, report[f"{n}x{b}"]["ours_compiled"], flush=True)
    model.forward = forward
    step = torch.compile(ours, fullgraph=True)
    for (n, b), ids in cases.items():
        prompts = ids.tolist()
        report[f"{n}x{b}"]["ours_steps"] = generate_timing(
            lambda tokens: (ours.reset_caches(), our_generate(ours, step, prompts, tokens - 1, DEV, chunk_tokens=chunk)),
            new)
        print("ours steps", n, b, report[f"{n}x{b}"]["ours_steps"], flush=True)
    return report


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--generate", action="store_true", help="only the generate() cases")
    parser.add_argument("--generate-prompts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--generate-batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new", type=int, default=32, help="new tokens a generate() call")
    parser.add_argument("--prefill-chunk", type=int, help="generate(): prefill in chunks of at most this many tokens")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny test config (a smoke run)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=1024, help="tokens per request before the decode steps")
    parser.add_argument("--json")
    args = parser.parse_args()
    global DEV
    DEV = torch.device(args.device)
    torch.manual_seed(0)
    config = tiny_hf_config() if args.tiny else flash_slice()
    if args.generate:
        report = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__,
                  "transformers": transformers.__version__, "prefill_chunk": args.prefill_chunk,
                  "generate": generate_cases(config, max(args.generate_batch), args.generate_prompts,
                                             args.generate_batch, args.new, args.prefill_chunk)}
        print(json.dumps(report, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return report
    vocab = config.vocab_size
    model = random_hf_model(config, seed=0, device=DEV, dtype=torch.bfloat16)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "weights_gib": torch.cuda.memory_allocated() / GIB,
              "prefill": {}, "decode": {}}
    prompts = {n: random_prompts(vocab, [n], seed=2) for n in args.prefill}

    # transformers first: our layers replace theirs in place
    with torch.no_grad():
        hf_cached_forward(model, torch.tensor(random_prompts(vocab, [512]), device=DEV))
        theirs_last = {}
        for n in args.prefill:
            r = measure(lambda: hf_cached_forward(model, torch.tensor(prompts[n], device=DEV))[0][0, -1].float())
            if "out" in r:
                theirs_last[n] = r.pop("out")
            report["prefill"][n] = {"transformers": r}
            print("transformers prefill", n, r, flush=True)
        for b in args.batch:
            try:
                report["decode"][b] = {"transformers_ms": transformers_decode(model, b, args.context, vocab)}
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                report["decode"][b] = {"transformers_ms": "out of memory"}
            print("transformers decode", b, report["decode"][b], flush=True)

    longest = max(max(args.prefill), args.context + WARMUP + STEPS + 1)
    cache = CacheConfig(max_requests=max(args.batch), max_seq_len=-(-longest // 256) * 256, kv_format="v4",
                        index_format="fp8")
    ours = TransformersDSV4(model, cache)
    per_token = sum(cache.bytes_per_token(r)["total"] for r in ours.config.compress_ratios)
    report["ours_cache_bytes_per_token"] = per_token
    with torch.no_grad():
        ours(**prefill_inputs(random_prompts(vocab, [512]), DEV), mode="prefill")
        def our_prefill(n: int) -> torch.Tensor:  # from empty caches, as a new request finds them
            ours.reset_caches()
            return ours(**prefill_inputs(prompts[n], DEV), mode="prefill")[0]

        for n in args.prefill:
            r = measure(lambda: our_prefill(n))
            if "out" in r:
                got = r.pop("out")
                r["peak_gib"] += per_token * n / GIB
                if n in theirs_last:
                    want = theirs_last[n]
                    r["last_logits_err_share"] = ((got - want).abs().max() / want.abs().max()).item()
            report["prefill"][n]["ours"] = r
            print("ours prefill", n, r, flush=True)
        compiled = torch.compile(ours, fullgraph=True, mode="reduce-overhead")
        for b in args.batch:
            report["decode"][b]["ours_eager_ms"] = our_decode(ours, ours, b, args.context, vocab)
            try:
                report["decode"][b]["ours_compiled_ms"] = our_decode(ours, compiled, b, args.context, vocab)
            except Exception as e:  # reported, so that one failure does not lose the other figures
                report["decode"][b]["ours_compiled_ms"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print("ours decode", b, report["decode"][b], flush=True)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
