"""Ship the small DSV4 model as AOTInductor packages and run them without the model's code.

Builds the 3-layer model of ``examples/generate.py`` (random weights, seed 0) on CUDA if present,
else CPU; exports its prefill and decode steps (``torch.export``, dynamic token and request
counts) and compiles each into a ``.pt2`` package (``dsv4_compile.export.build_package``); then
starts a fresh Python process that imports only ``dsv4_compile`` (never ``dsv4_compile.models``),
loads the packages (``load_package``: ``torch._inductor.aoti_load_package`` underneath) and runs
prefill + greedy decode. Reports whether its tokens equal the eager model's, the package sizes,
build and load times, and the ``dsv4`` ops the packages call.

    python examples/export.py [--device cpu|cuda] [--out DIR] [--steps 8] [--json]
    python examples/export.py --load DIR [--steps 8]      # the fresh process's part

Building compiles C++ (and on CUDA, kernels): minutes on a small CPU machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsv4_compile.generation import random_prompts  # the step helpers only: no model code

PROMPT_LENGTHS = (5, 37, 150)  # as examples/generate.py: the ratio-128 layer gets a block


def prompts(vocab_size: int) -> list[list[int]]:
    return random_prompts(vocab_size, PROMPT_LENGTHS)


def run_packages(directory: str, steps: int) -> dict:
    """The fresh process: load the packages and generate, importing only ``dsv4_compile``."""
    import dsv4_compile  # noqa: F401  (registers the dsv4 ops the packages call)
    from dsv4_compile.export import load_package
    from dsv4_compile.generation import generate

    start = time.perf_counter()
    model = load_package(directory)
    load_s = time.perf_counter() - start
    tokens = generate(model, model, prompts(model.vocab_size), steps, model.device)
    return {
        "tokens": tokens,
        "load_s": load_s,
        "model_code_imported": "dsv4_compile.models" in sys.modules,
        "providers": dsv4_compile.providers(model.device),
    }


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="where to write prefill.pt2 and decode.pt2 (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps")
    parser.add_argument("--load", metavar="DIR", help="only load DIR's packages and generate (prints JSON)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.load:
        report = run_packages(args.load, args.steps)
        print(json.dumps(report))
        return report

    from dsv4_compile.export import build_package, load_package
    from dsv4_compile.generation import generate
    from dsv4_compile.models import CacheConfig, DeepseekV4Model, tiny_config

    device = torch.device(args.device)
    config = tiny_config()
    model = DeepseekV4Model(config, CacheConfig(max_requests=4, max_seq_len=512), seed=0, device=device)
    with torch.no_grad():
        want = generate(model, model, prompts(config.vocab_size), args.steps, device)

    out = Path(args.out or tempfile.mkdtemp(prefix="dsv4_package_"))
    start = time.perf_counter()
    paths = build_package(model, out)
    build_s = time.perf_counter() - start

    child = subprocess.run(
        [sys.executable, __file__, "--load", str(out), "--steps", str(args.steps)],
        capture_output=True, text=True,
    )
    if child.returncode != 0:
        sys.exit(f"the fresh process failed:\n{child.stderr[-4000:]}")
    got = json.loads(child.stdout.strip().splitlines()[-1])
    loaded = load_package(out)
    report = {
        "device": str(device),
        "package_dir": str(out),
        "package_mb": {mode: round(Path(p).stat().st_size / 2**20, 1) for mode, p in paths.items()},
        "build_s": round(build_s, 1),
        "load_s": round(got["load_s"], 2),
        "ops": {mode: meta["ops"] for mode, meta in loaded.meta.items()},
        "dynamic": {"tokens": [1, loaded.max_tokens], "requests": [1, loaded.max_requests]},
        "fresh_process_imported_model_code": got["model_code_imported"],
        "providers": got["providers"],
        "tokens_equal_eager": got["tokens"] == want,
    }
    if args.json:
        print(json.dumps(report))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
        for prompt, tokens in zip(prompts(config.vocab_size), got["tokens"]):
            print(f"  prompt of {len(prompt):>3} tokens -> {tokens}")
    if not report["tokens_equal_eager"] or got["model_code_imported"]:
        sys.exit("the packaged model did not reproduce the eager model's tokens without its code")
    return report


if __name__ == "__main__":
    main()
