"""Ship the small DSV4 model as AOTInductor packages and run them without the model's code.

Builds the 3-layer model of ``examples/generate.py`` (random weights, seed 0) on CUDA if present,
else CPU; exports its prefill and decode steps (``torch.export``, dynamic token and request
counts) and compiles each into a ``.pt2`` package (``dsv4_compile.export.build_package``); then
starts a fresh Python process that imports only ``dsv4_compile`` (never ``dsv4_compile.models``),
loads the packages (``load_package``: ``torch._inductor.aoti_load_package`` underneath) and runs
prefill + greedy decode, fed the eager model's tokens. Reports whether the package's greedy
choices and logits are the eager model's (``tokens_equal_eager``, ``max_abs_err_vs_eager``; where
a choice differs, ``margin_where_tokens_differ``: how far below eager's top logit it lies, which
for a near-tie that compiled code rounds the other way is within the logits' error), the package
sizes, build and load times, and the ``dsv4`` ops the packages call. Exits with an error if a
choice differs by more than :data:`NEAR_TIE` or the fresh process imported the model's code.

    python examples/export.py [--device cpu|cuda] [--out DIR] [--steps 8] [--json]
    python examples/export.py --load DIR [--steps 8] [--follow FILE]   # the fresh process's part

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
#: the largest margin below eager's top logit at which the package may choose another token
NEAR_TIE = 0.2


def prompts(vocab_size: int) -> list[list[int]]:
    return random_prompts(vocab_size, PROMPT_LENGTHS)


def run_packages(directory: str, steps: int, follow: list[list[int]] | None = None) -> dict:
    """The fresh process: load the packages and generate (fed ``follow``'s tokens if given),
    importing only ``dsv4_compile``; returns its greedy tokens and the logits of every step."""
    import dsv4_compile  # noqa: F401  (registers the dsv4 ops the packages call)
    from dsv4_compile.export import load_package
    from dsv4_compile.generation import generate

    start = time.perf_counter()
    model = load_package(directory)
    load_s = time.perf_counter() - start
    logits = []
    tokens = generate(model, model, prompts(model.vocab_size), steps, model.device, follow=follow,
                      on_step=lambda s, l: logits.append(l.float().cpu().tolist()))
    return {
        "tokens": tokens,
        "logits": logits,
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
    parser.add_argument("--follow", metavar="FILE", help="with --load: feed the tokens of FILE (JSON, one list per prompt)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.load:
        follow = json.loads(Path(args.follow).read_text()) if args.follow else None
        report = run_packages(args.load, args.steps, follow)
        print(json.dumps(report))
        return report

    from dsv4_compile.export import build_package, load_package
    from dsv4_compile.generation import choice_margins, generate
    from dsv4_compile.models import CacheConfig, DeepseekV4Model, tiny_config

    device = torch.device(args.device)
    config = tiny_config()
    model = DeepseekV4Model(config, CacheConfig(max_requests=4, max_seq_len=512), seed=0, device=device)
    want_logits = []
    with torch.no_grad():
        want = generate(model, model, prompts(config.vocab_size), args.steps, device,
                        on_step=lambda s, l: want_logits.append(l.float().cpu()))

    out = Path(args.out or tempfile.mkdtemp(prefix="dsv4_package_"))
    start = time.perf_counter()
    paths = build_package(model, out)
    build_s = time.perf_counter() - start

    follow = out / "eager_tokens.json"
    follow.write_text(json.dumps(want))
    child = subprocess.run(
        [sys.executable, __file__, "--load", str(out), "--steps", str(args.steps), "--follow", str(follow)],
        capture_output=True, text=True,
    )
    if child.returncode != 0:
        sys.exit(f"the fresh process failed:\n{child.stderr[-4000:]}")
    got = json.loads(child.stdout.strip().splitlines()[-1])
    margins = choice_margins(want_logits, want, got["tokens"])
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
        "margin_where_tokens_differ": max(margins, default=0.0),
        "max_abs_err_vs_eager": max(
            (torch.tensor(g) - w).abs().max().item() for g, w in zip(got["logits"], want_logits)
        ),
    }
    if args.json:
        print(json.dumps(report))
    else:
        width = max(map(len, report))
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
        for prompt, tokens in zip(prompts(config.vocab_size), got["tokens"]):
            print(f"  prompt of {len(prompt):>3} tokens -> {tokens}")
    if report["margin_where_tokens_differ"] > NEAR_TIE or got["model_code_imported"]:
        sys.exit("the packaged model did not reproduce the eager model's choices without its code")
    return report


if __name__ == "__main__":
    main()
