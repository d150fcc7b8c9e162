"""The AOTInductor package's decode step against ``torch.compile`` of the same step.

    python benchmarks/bench_export.py [--json out.json]          # CUDA (or CPU: --device cpu)

Builds the small model of ``examples/export.py`` (3 layers, one of each kind) with caches for 64
requests of up to 1024 tokens, packages it (:func:`dsv4_compile.export.build_package`), loads the
packages (:func:`~dsv4_compile.export.load_package`), prefills ``--requests`` prompts of
``--prompt`` tokens into both the model and the package, then times the decode step of the first
``b`` requests: eager, ``torch.compile`` (default mode and ``reduce-overhead``), the package
through :class:`~dsv4_compile.export.PackagedModel` (its input checks included) and the package's
runner called directly. Median over runs of ``--calls`` back-to-back calls, synchronised per run.

On torch older than ``dsv4_compile.export.MIN_TORCH`` the library refuses to build packages (an
exception a ``dsv4`` op raises inside one is swallowed there); ``--allow-old-torch`` builds them
anyway for timing only, and the report says so.

``--self-contained``: time only the decode step, packaged by AOTInductor with its tensors inside
(its default; ``export_step`` + ``aoti_compile_and_package``, loaded with ``aoti_load_package``,
not :func:`~dsv4_compile.export.load_package`): the package keeps its own zeroed state buffers, so
its logits are not compared; for a torch whose loader cannot load the library's code-only
packages.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dsv4_compile import export
from dsv4_compile.generation import Batch, decode_inputs, prefill_prompts, random_prompts
from dsv4_compile.models import CacheConfig, DeepseekV4Model, tiny_config

from bench_step import step_ms, sync


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=300, help="tokens per prompt")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--allow-old-torch", action="store_true", help="build packages on torch < MIN_TORCH, for timing only")
    parser.add_argument("--self-contained", action="store_true", help="only the decode step, tensors inside its package")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    old = not export.packages_supported()
    if old:
        if not args.allow_old_torch:
            raise SystemExit(f"torch {torch.__version__} < {export.MIN_TORCH}: packages refused (see --allow-old-torch)")
        export.require_package_support = lambda: None  # timing only: errors inside a package are swallowed here

    model = DeepseekV4Model(tiny_config(), CacheConfig(max_requests=64, max_seq_len=1024), seed=0, device=device)
    texts = random_prompts(model.config.vocab_size, [args.prompt] * args.requests)
    if args.self_contained:
        return self_contained(args, model, texts, device, batches, old)
    directory = Path(tempfile.mkdtemp(prefix="dsv4_bench_pkg_"))
    start = time.perf_counter()
    paths = export.build_package(model, directory)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    package = export.load_package(directory)
    load_s = time.perf_counter() - start

    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "built_on_unsupported_torch": old,
        "package_mb": {m: round(Path(p).stat().st_size / 2**20, 2) for m, p in paths.items()},
        "build_s": round(build_s, 1),
        "load_s": round(load_s, 2),
        "requests": args.requests,
        "prompt": args.prompt,
    }
    decode = {}
    with torch.no_grad():
        for target in (model, package):
            (target.reset_caches if target is model else target.reset)()
            prefill_prompts(target, texts, device)
        steps = {"eager": model}
        for mode in ("default", "reduce-overhead"):
            if mode == "reduce-overhead" and device.type != "cuda":
                continue
            steps[mode] = torch.compile(model, fullgraph=True, mode=mode)
        steps["package"] = package
        steps["package_runner"] = lambda mode, **inputs: package.packages[mode](**inputs)
        for b in batches:
            inputs = decode_inputs(Batch([t + [1] for t in texts[:b]]), device)
            row, logits = {}, {}
            for name, step in steps.items():
                logits[name] = step(**inputs, mode="decode").clone()
                sync(device)
                row[f"{name}_ms"] = round(step_ms(lambda: step(**inputs, mode="decode"), device, args.calls), 4)
            # the same decode step from the same prefilled state: the package vs eager
            row["package_max_abs_diff_vs_eager"] = (logits["package"] - logits["eager"]).abs().max().item()
            decode[str(b)] = row
    report["decode"] = decode
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return report


def self_contained(args, model, texts, device, batches, old) -> dict:
    """The decode step as one self-contained AOTInductor package, timed against torch.compile."""
    with torch.no_grad():
        program = export.export_step(model, "decode")
        path = Path(tempfile.mkdtemp(prefix="dsv4_bench_pkg_")) / "decode.pt2"
        start = time.perf_counter()
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        runner = torch._inductor.aoti_load_package(str(path))
        load_s = time.perf_counter() - start
        model.reset_caches()
        prefill_prompts(model, texts, device)
        steps = {"eager": model, "default": torch.compile(model, fullgraph=True)}
        if device.type == "cuda":
            steps["reduce-overhead"] = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        steps["package_runner"] = lambda mode, **inputs: runner(**inputs)
        decode = {}
        for b in batches:
            inputs = decode_inputs(Batch([t + [1] for t in texts[:b]]), device)
            decode[str(b)] = {
                f"{name}_ms": round(step_ms(lambda: step(**inputs, mode="decode"), device, args.calls), 4)
                for name, step in steps.items()
            }
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "built_on_unsupported_torch": old, "self_contained": True,
        "package_mb": round(path.stat().st_size / 2**20, 2), "build_s": round(build_s, 1),
        "load_s": round(load_s, 2), "decode": decode,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return report


if __name__ == "__main__":
    main()
