"""The model's decode step against its memory roofline, and the prefill's peak memory.

    python benchmarks/bench_step.py [--json out.json] [--plot out.png] [--profile DIR]   # CUDA
    python benchmarks/bench_step.py --quick                                             # CPU smoke (CI)
    python benchmarks/bench_step.py plot out.json out.png [before.json]                 # a saved run

The model is a DSV4-Flash-sized slice: ``DeepseekV4Config(num_hidden_layers=4,
vocab_size=32000)`` (layer kinds 0, 0, 4, 128; 64 heads; hidden 4096), caches
``CacheConfig(max_requests=64, max_seq_len=4096, page_size=256)``. It prefills ``--requests``
prompts of ``--prompt`` tokens, once in one step and once in steps of ``--chunk`` tokens, recording
the peak memory above the model's weights and caches; then times the decode step of the first
``b`` requests (``--batches``) eagerly, under ``torch.compile`` (default mode; default mode with
Inductor's C++ wrapper; ``reduce-overhead``: CUDA graphs), one compiled function per variant across
the batch sizes (so the recompiles of a changing batch size are counted), and reports the time of each first call
(compilation). Step time: median over runs of ``--calls`` back-to-back calls, synchronised per run.

Roofline of a decode step: the bytes it must read at least — every weight once (the embedding:
only its ``b`` rows) and, per layer and request, the cache tokens it attends (window keys; the
compressed keys selected, and on ratio-4 layers the indexer's keys of every visible block) —
divided by the device-to-device copy rate measured in the same run (bytes read + written per
second). ``roofline_share`` = roofline time / step time.

``--inductor KEY=VALUE`` (repeatable) adds an Inductor option to every compiled variant (e.g.
``max_autotune_gemm=True``); the report lists them (``inductor_options``).

``--profile DIR``: for each batch size, a ``torch.profiler`` table of the compiled (default mode)
step's GPU kernels, grouped by layer part (from the kernels' names), its GEMMs by operand shapes
(with their largest operand: mostly the weight), the host ops that issued its device copies
(``Memcpy`` activities, found through the trace's correlation ids), Inductor's code and the Chrome
trace of that step (``DIR/b<batch>/``), and the Python functions its host time goes to
(``cProfile``).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.generation import Batch, decode_inputs, prefill_prompts, random_prompts
from dsv4_compile.models import CacheConfig, DeepseekV4Config, DeepseekV4Model, tiny_config

#: the step's variants: eager, and torch.compile's keyword arguments for each compiled one
#: (``cpp-wrapper``: default mode with Inductor's C++ wrapper, which launches the kernels from C++)
MODES = {
    "eager": None,
    "default": {},
    "cpp-wrapper": {"options": {"cpp_wrapper": True}},
    "reduce-overhead": {"mode": "reduce-overhead"},
}


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def step_ms(fn, device, calls: int, runs: int = 5) -> float:
    """Median wall milliseconds per call over ``runs`` runs of ``calls`` back-to-back calls."""
    fn()
    sync(device)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples)


def copy_rate(device: torch.device) -> float:
    """Device-to-device copy rate, bytes read + written per second (1 GiB copies)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = step_ms(lambda: dst.copy_(src), device, calls=5)
    return 2 * src.numel() / (ms / 1e3)


def model_bytes(model: DeepseekV4Model) -> tuple[int, int]:
    """(weight bytes, cache and state bytes) of the model."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(b.numel() * b.element_size() for b in model.state_buffers().values())
    return weights, states


def decode_bytes(model: DeepseekV4Model, seq_lens: list[int]) -> int:
    """The least bytes a decode step of requests at ``seq_lens`` (after the step) reads."""
    cfg, cache = model.config, model.cache
    embed = model.embed.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    weights += len(seq_lens) * embed.shape[1] * embed.element_size()
    cached = 0
    for layer in model.layers:
        attn = layer.attn
        token = layout.FORMATS[attn.kv_format].token_bytes
        for n in seq_lens:
            cached += min(n, cfg.sliding_window) * token
            if attn.compress_ratio:
                blocks = n // attn.compress_ratio
                ctoken = layout.FORMATS[attn.compressed_format].token_bytes
                selected = min(blocks, cfg.index_topk) if attn.compress_ratio == 4 else blocks
                cached += selected * ctoken
                if attn.compress_ratio == 4:  # the indexer scores every visible block
                    cached += blocks * attn.indexer.format.token_bytes
    return weights + cached


def inductor_option(item: str) -> tuple[str, object]:
    """``KEY=VALUE`` as ``(key, value)``: the value a Python literal where it parses as one."""
    key, sep, text = item.partition("=")
    if not sep:
        raise SystemExit(f"--inductor {item!r}: expected KEY=VALUE")
    try:
        return key, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return key, text


def compile_kwargs(kwargs: dict, options: dict) -> dict:
    """``torch.compile`` keyword arguments of a variant with Inductor ``options`` added (a ``mode``
    becomes its options: ``torch.compile`` takes one or the other)."""
    if not options:
        return kwargs
    kwargs = dict(kwargs)
    mode = kwargs.pop("mode", None)
    merged = {**(torch._inductor.list_mode_options(mode) if mode else {}), **kwargs.pop("options", {}), **options}
    return {**kwargs, "options": merged}


def slice_config() -> DeepseekV4Config:
    """The benchmarks' DSV4-Flash-sized slice of the model: 4 layers (ratios 0, 0, 4, 128), a
    32000-token vocabulary, DSV4-Flash's widths."""
    return DeepseekV4Config(num_hidden_layers=4, vocab_size=32000)


def build(args, device) -> DeepseekV4Model:
    if args.quick:
        config = tiny_config(intermediate_size=0, compress_ratios=(0, 0, 4, 128), num_hidden_layers=4)
        cache = CacheConfig(max_requests=args.requests, max_seq_len=512, page_size=256, index_format=args.index_format)
    else:
        config = slice_config()
        cache = CacheConfig(max_requests=64, max_seq_len=4096, page_size=256, index_format=args.index_format)
    return DeepseekV4Model(config, cache, seed=0, device=device)


def prompts(args, vocab: int) -> list[list[int]]:
    return random_prompts(vocab, [args.prompt] * args.requests)


def peak_prefill_mb(model, texts, device, chunk_tokens) -> tuple[float, float]:
    """(peak MB above what was allocated before, seconds) of prefilling ``texts``; CUDA only."""
    model.reset_caches()
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    prefill_prompts(model, texts, device, chunk_tokens)
    sync(device)
    seconds = time.perf_counter() - start
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20, seconds


def graph_kernels(step, steps: int, device, directory: Path) -> dict:
    """GPU time per kernel of one compiled step under ``torch.profiler``, grouped by layer part."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
        sync(device)
    rows = {}
    for e in prof.key_averages():  # GPU kernels and copies; not the "## ... ##" annotation ranges
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0 and not e.key.startswith("##"):
            rows[e.key] = (e.device_time_total / steps, e.count // steps)
    gemms = []  # each GEMM call site by its operand shapes (the last: the output), with its kernels' time
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in GEMM_OPS and e.device_time_total > 0:
            largest = max((math.prod(s) for s in e.input_shapes[:-1] if s), default=0)  # the weight, mostly
            gemms.append({"op": e.key, "shapes": e.input_shapes, "calls": e.count // steps,
                          "us": round(e.device_time_total / steps, 2), "largest_operand": largest})
    directory.mkdir(parents=True, exist_ok=True)
    trace = directory / "decode_step_trace.json"
    prof.export_chrome_trace(str(trace))
    parts = {}
    for name, (us, _) in rows.items():
        parts[part_of(name)] = parts.get(part_of(name), 0.0) + us
    top = sorted(rows.items(), key=lambda kv: -kv[1][0])[:30]
    return {
        "gpu_us_per_step": sum(us for us, _ in rows.values()),
        "kernels_per_step": sum(n for _, n in rows.values()),
        "parts_us": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": n[:160], "us": round(us, 2), "calls": c} for n, (us, c) in top],
        "gemms": sorted(gemms, key=lambda g: -g["us"]),
        "copies": copy_sources(json.loads(trace.read_text()), steps),
    }


def copy_sources(trace: dict, steps: int) -> list[dict]:
    """Which host ops issued the step's device copies (``Memcpy`` activities of a Chrome trace of
    ``steps`` steps): each copy's runtime call, found by its correlation id, and the CPU ops that
    enclose that call on its thread, innermost first; per step, with the bytes of one copy."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    runtime = {e["args"]["correlation"]: e for e in spans
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = [e for e in spans if e.get("cat") == "cpu_op"]
    found: dict[tuple, int] = {}
    for e in spans:
        if not e.get("name", "").startswith("Memcpy"):
            continue
        call = runtime.get(e.get("args", {}).get("correlation"))
        enclosing = [] if call is None else sorted(
            (op for op in ops if op["tid"] == call["tid"] and op["ts"] <= call["ts"]
             and op["ts"] + op["dur"] >= call["ts"] + call["dur"]),
            key=lambda op: op["dur"])
        key = (e["name"], " < ".join(op["name"] for op in enclosing[:4]) or "?", e.get("args", {}).get("bytes"))
        found[key] = found.get(key, 0) + 1
    return [{"copy": name, "issued_by": source, "bytes": size, "per_step": n / steps}
            for (name, source, size), n in sorted(found.items(), key=lambda kv: -kv[1])]


#: the aten GEMMs Inductor calls (``extern_kernels``); their device time includes split-K reductions
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def profile_step(model, texts, b: int, device, directory: Path, options: dict) -> dict:
    """The compiled (default mode, Inductor ``options``) decode step of ``b`` requests: Inductor's
    code, its GPU kernels (:func:`graph_kernels`) and its host time (:func:`host_functions`),
    under ``directory``."""
    from torch._inductor.utils import run_and_get_code

    inputs = decode_inputs(Batch([t + [1] for t in texts[:b]]), device)
    torch._dynamo.reset()
    named = torch.compile(model, fullgraph=True, **compile_kwargs({}, options))
    _, code = run_and_get_code(named, **inputs, mode="decode")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "decode_step_code.py").write_text("\n\n".join(code))
    result = graph_kernels(lambda: named(**inputs, mode="decode"), 10, device, directory)
    result["host"] = host_functions(lambda: named(**inputs, mode="decode"), 20, device)
    print(json.dumps({"batch": b, **result}), flush=True)  # progress
    return result


def host_functions(step, steps: int, device, top: int = 25) -> list[dict]:
    """The Python functions a compiled step spends its host time in (``cProfile``, which inflates
    every call: compare shares, not absolute µs), per step, by own time."""
    import cProfile
    import pstats

    step()
    sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    sync(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls // steps,
             "own_us": round(own / steps * 1e6, 1), "cum_us": round(cum / steps * 1e6, 1)}
            for (file, line, name), (_, calls, own, cum, _) in rows]


#: the layer part a GPU kernel belongs to, from its name (Inductor names kernels after the aten ops they fuse)
PARTS = (
    ("attention op", ("sparse_decode", "flash_fwd", "flashmla", "flash_mla", "splitkv", "combine", "decode_kernel", "_combine")),
    ("cache store", ("_store", "store_kernel", "quant")),
    ("scheduler", ("sched", "metadata")),
    ("indexer", ("indexer", "logits_kernel", "topk")),
    ("compressor", ("compressor",)),
    ("projections (GEMM)", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitk", "gemv", "wgmma")),
    ("lm head / norm", ("lm_head", "norm")),
)


def part_of(name: str) -> str:
    low = name.lower()
    for part, keys in PARTS:
        if any(k in low for k in keys):
            return part
    return "other (" + low.split("_")[0] + ")" if low.startswith("triton") else "other"


def run(args) -> dict:
    device = torch.device(args.device)
    model = build(args, device)
    texts = prompts(args, model.config.vocab_size)
    weights, states = model_bytes(model)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "providers": d4.providers(device),
        "index_format": model.cache.index_format,
        "layers": model.config.num_hidden_layers,
        "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "weights_mb": round(weights / 2**20, 1),
        "states_mb": round(states / 2**20, 1),
        "requests": args.requests,
        "inductor_options": args.inductor,
        "prompt": args.prompt,
        "chunk": args.chunk,
    }
    with torch.no_grad():
        if device.type == "cuda":
            report["copy_tb_s"] = round(copy_rate(device) / 1e12, 3)
        if device.type == "cuda" and "prefill" not in args.skip:
            prefill = {}
            for name, chunk in (("one_step", None), (f"chunks_of_{args.chunk}", args.chunk)):
                mb, seconds = peak_prefill_mb(model, texts, device, chunk)
                tokens = args.requests * args.prompt
                prefill[name] = {"peak_mb": round(mb, 1), "mb_per_token": round(mb / tokens, 4), "s": round(seconds, 2)}
            report["prefill"] = prefill
            print(json.dumps(prefill), flush=True)  # progress
        model.reset_caches()
        prefill_prompts(model, texts, device, args.chunk)  # the state every decode step starts from
        sync(device)

        rate = report.get("copy_tb_s", 0) * 1e12
        decode = {b: {} for b in args.batches}
        for mode, kwargs in MODES.items():
            if mode in args.skip or (mode == "reduce-overhead" and device.type != "cuda"):
                continue
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            step = model if kwargs is None else torch.compile(
                model, fullgraph=True, **compile_kwargs(kwargs, args.inductor))
            for b in args.batches:
                batch = Batch([t + [1] for t in texts[:b]])
                inputs = decode_inputs(batch, device)
                start = time.perf_counter()
                step(**inputs, mode="decode")
                sync(device)
                first_s = time.perf_counter() - start
                ms = step_ms(lambda: step(**inputs, mode="decode"), device, args.calls)
                row = decode[b]
                row[f"{mode}_ms"] = round(ms, 3)
                if mode != "eager":
                    row[f"{mode}_first_call_s"] = round(first_s, 2)
                if rate:
                    row["roofline_ms"] = round(decode_bytes(model, batch.seq_lens) / rate * 1e3, 4)
                    row[f"{mode}_roofline_share"] = round(row["roofline_ms"] / ms, 3)
            if mode != "eager":
                report[f"{mode}_graphs_compiled"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                skips = dict(torch._dynamo.utils.counters["inductor"]).get("cudagraph_skips", 0)
                if mode == "reduce-overhead":
                    report["cudagraph_skips"] = skips
            print(json.dumps({"mode": mode, "decode": decode}), flush=True)  # progress
            if args.profile and mode == "default":
                report["profiles"] = {
                    str(b): profile_step(model, texts, b, device, Path(args.profile) / f"b{b}", args.inductor)
                    for b in args.batches
                }
        report["decode"] = {str(b): row for b, row in decode.items()}
    return report


def plot(report: dict, path: str, before: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = dict(zip(MODES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for label, data, style in (("", report, "-"), ("before, ", before, ":")):
        if not data:
            continue
        batches = [int(b) for b in data["decode"]]
        for mode in MODES:
            ms = [data["decode"][str(b)].get(f"{mode}_ms") for b in batches]
            if all(m is not None for m in ms):
                ax.plot(batches, ms, style, marker="o", color=colors[mode], label=f"{label}{mode}")
    batches = [int(b) for b in report["decode"]]
    roof = [report["decode"][str(b)].get("roofline_ms") for b in batches]
    if all(r is not None for r in roof):
        ax.plot(batches, roof, "k--", label="memory roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (requests)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"DSV4 {report['layers']}-layer slice, {report['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> dict:
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        after = json.loads(Path(sys.argv[2]).read_text())
        before = json.loads(Path(sys.argv[4]).read_text()) if len(sys.argv) > 4 else None
        plot(after, sys.argv[3], before)
        return after
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model on CPU: a smoke run, no figures")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=1024, help="tokens per prompt")
    parser.add_argument("--chunk", type=int, default=8192, help="chunked prefill: tokens per step")
    parser.add_argument("--batches", default="1,8,64", help="decode batch sizes")
    parser.add_argument("--calls", type=int, default=20, help="calls per timing run")
    parser.add_argument("--skip", default="", help="what not to run, comma-separated (of: " + ", ".join(MODES)
                        + "; prefill: the prefill memory measurement)")
    parser.add_argument("--index-format", default="fp8", choices=list(layout.INDEX_FORMATS),
                        help="the indexer key cache's format")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="write a PNG of step time vs batch here")
    parser.add_argument("--profile", help="write the compiled step's kernel profile here (CUDA)")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="an Inductor option for every compiled variant (repeatable; VALUE a Python "
                             "literal or a string), e.g. max_autotune_gemm=True")
    args = parser.parse_args()
    args.inductor = dict(inductor_option(item) for item in args.inductor)
    if args.quick:
        args.device, args.requests, args.prompt, args.chunk, args.calls = "cpu", 4, 150, 128, 2
        args.batches, args.profile = "2", None
    args.batches = [int(b) for b in args.batches.split(",")]
    args.skip = [m for m in args.skip.split(",") if m]
    if args.quick:
        args.skip.append("cpp-wrapper")
    report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
