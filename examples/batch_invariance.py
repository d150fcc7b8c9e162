"""Check the batch-invariant mode: a row's outputs do not depend on what else is in the batch.

Two checks, each in the batch-invariant mode and in the default mode (where the default is not
invariant, the second shows it):

* **op**: the sparse decode (``dsv4::flash_mla_with_kvcache``, a window cache plus a compressed
  extra cache, random lengths) of one probe row alone, then at every position of batches of other
  sizes whose other rows are drawn afresh; the probe's ``out`` and ``lse`` compared bit for bit.
* **model**: a 3-layer random DSV4 model (one layer of each kind) generates for a probe prompt
  alone, then with the probe at each position of a batch of three prompts, fed the same tokens
  (``generate(..., follow=...)``); each layer's attention output on the probe's rows compared bit
  for bit, at the prefill and at every decode step. The model's other computations (its GEMMs, its
  norms) are not part of the mode: where they round a row differently in a batch (cuBLAS picks
  kernels by the batch's shape), the attention inputs differ and so do its outputs; the report says
  which by checking the layers' *inputs* too.

On CUDA it also times the Triton decode in the mode against its default (T = 1, 8, 64, 256 rows,
DSV4 shapes, CUDA-graph replays) and reports the mode's cost.

    python examples/batch_invariance.py [--device cpu|cuda] [--provider auto|reference|triton] [--json]

``--provider triton`` on CPU runs the Triton kernels interpreted (``TRITON_INTERPRET=1``, with the
test suite's interpreter shims; slow: about a minute).
Printed (``--json``: one object): ``device``, ``provider``, ``rows``, ``bitwise_equal_rows`` (the
op check in the mode), ``default_bitwise_equal_rows`` (in the default mode), ``model`` (per mode:
rows compared and equal at the prefill and decode steps, and how many had equal inputs) and, on a
GPU, ``cost_ratio`` (per row count: the Triton decode's mode time / default time, and the default
mode's provider's time).
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

import dsv4_compile as d4
from dsv4_compile import dispatch, layout
from dsv4_compile.generation import generate, random_prompts
from dsv4_compile.models import CacheConfig, DeepseekV4Model, tiny_config
from dsv4_compile.providers import reference

DECODE = "flash_mla_with_kvcache"
#: Batch sizes the probe is placed in, at every position.
SIZES = {"cpu": (1, 4, 16), "cuda": (1, 8, 64, 256)}
#: Rows timed on a GPU.
TIMED_ROWS = (1, 8, 64, 256)


def decode_pool(rows: int, device, heads: int, window: int, extra: int) -> list:
    """Decode arguments (schema order) of ``rows`` random rows: a window cache (P = 256) read through
    ``window`` indices per row and a compressed cache (P = 64) through ``extra``; lengths from 0 to
    the full widths, holes among the indices."""
    def filled(pages, page_size):
        cache = layout.alloc_cache(pages, page_size, device)
        n = pages * page_size
        reference.fused_k_norm_rope_flashmla(
            torch.randn(n, 512, device=device).to(torch.bfloat16) * 2, torch.ones(512, dtype=torch.bfloat16, device=device),
            torch.randn(n, 64, device=device), torch.arange(n, device=device), torch.arange(n, device=device),
            cache, 1e-6, page_size, layout.V4)
        return cache

    def indices(width, cap):
        idx = torch.randint(0, cap, (rows, 1, width), dtype=torch.int32, device=device)
        return torch.where(torch.rand(idx.shape, device=device) < 0.1, -1, idx)

    def lengths(width):
        return torch.randint(0, width + 1, (rows,), dtype=torch.int32, device=device)

    q = torch.randn(rows, 1, heads, 512, device=device).to(torch.bfloat16)
    return [q, filled(16, 256), 256, indices(window, 16 * 256), lengths(window), torch.randn(heads, device=device),
            filled(64, 64), 64, indices(extra, 64 * 64), lengths(extra), None, None, 512**-0.5, 512, "v4", None]


def select(pool: list, rows: list[int]) -> list:
    index = torch.tensor(rows, device=pool[0].device)
    return [a[index] if i in (0, 3, 4, 8, 9) else a for i, a in enumerate(pool)]


def decode_call(provider: str):
    """``call(args, batch_invariant)``: the decode through the op, or, for the Triton kernels on
    CPU (interpreted), the provider kernel directly."""
    if provider == "triton-interpreted":
        from dsv4_compile.ops import registry
        from dsv4_compile.providers.triton import attention

        def call(args, batch_invariant):
            return attention.flash_mla_with_kvcache(*registry.DEFINED[DECODE].arguments(args)[:-1], batch_invariant)
        return call

    def call(args, batch_invariant):
        if provider == "auto":
            return d4.flash_mla_with_kvcache(*args[:15], batch_invariant=batch_invariant)
        with d4.use_provider(provider, ops=(DECODE,)):
            return d4.flash_mla_with_kvcache(*args[:15], batch_invariant=batch_invariant)
    return call


def op_check(call, pool: list, sizes, batch_invariant: bool) -> tuple[int, int]:
    """``(rows, bitwise_equal_rows)``: the probe (pool row 0) alone against the probe at every
    position of a batch of each size (neighbours drawn afresh)."""
    rng = random.Random(0)
    out, lse = call(select(pool, [0]), batch_invariant)
    rows = equal = 0
    for size in sizes:
        for position in range(size):
            members = [rng.randrange(1, pool[0].shape[0]) for _ in range(size - 1)]
            members.insert(position, 0)
            got_out, got_lse = call(select(pool, members), batch_invariant)
            rows += 1
            equal += bool(torch.equal(got_out[position], out[0]) and torch.equal(got_lse[position], lse[0]))
    return rows, equal


@torch.no_grad()
def model_check(device, batch_invariant: bool, steps: int = 3) -> dict:
    """The probe prompt alone against the probe at each position of a batch of three prompts
    (fed the same tokens); per step kind, the rows compared, the rows whose attention output is
    bit-identical, and the rows whose attention *input* is (where it is not, the model's own
    GEMMs and norms differ in the batch, which the mode does not cover)."""
    model = DeepseekV4Model(tiny_config(), CacheConfig(max_requests=4, max_seq_len=512), seed=0, device=device)
    probe, *others = random_prompts(model.config.vocab_size, (37, 150, 5))
    captured = []
    hooks = [layer.attn.register_forward_hook(lambda m, args, out: captured.append((args[0].clone(), out.clone())))
             for layer in model.layers]
    layers = len(model.layers)

    def run(prompts, follow=None):
        captured.clear()
        model.reset_caches()
        with d4.batch_invariant(batch_invariant):
            tokens = generate(model, model, prompts, steps, device, follow=follow)
        return tokens, list(captured)

    tokens, alone = run([probe])
    report = {kind: {"rows": 0, "bitwise_equal_rows": 0, "equal_input_rows": 0} for kind in ("prefill", "decode")}
    for position in range(3):
        prompts = others[:position] + [probe] + others[position:]
        follow = [tokens[0] if p is probe else [0] * (steps + 1) for p in prompts]
        _, batched = run(prompts, follow)
        start = sum(len(p) for p in prompts[:position])  # the probe's first row in the prefill step
        for call, ((x_alone, y_alone), (x_batch, y_batch)) in enumerate(zip(alone, batched)):
            prefill = call < layers
            rows = slice(start, start + len(probe)) if prefill else slice(position, position + 1)
            entry = report["prefill" if prefill else "decode"]
            n = rows.stop - rows.start
            entry["rows"] += n
            entry["bitwise_equal_rows"] += int((y_batch[rows] == y_alone).all(-1).sum())
            entry["equal_input_rows"] += int((x_batch[rows] == x_alone).all(-1).sum())
    for hook in hooks:
        hook.remove()
    return report


def cost_ratios() -> dict:
    """Per row count, the Triton decode's time in the mode / in the default mode at DSV4 shapes (64
    heads, window 128 + 512 compressed keys), CUDA-graph replays, medians, in one run; and the time
    of the default mode's own provider (FlashMLA on SM90)."""
    timings = {}
    triton, auto = decode_call("triton"), decode_call("auto")
    for rows in TIMED_ROWS:
        pool = decode_pool(rows, "cuda", 64, 128, 512)
        default, invariant = graph_us(lambda: triton(pool, False)), graph_us(lambda: triton(pool, True))
        timings[rows] = {"triton_default_us": default, "triton_invariant_us": invariant, "ratio": invariant / default,
                         "default_provider_us": graph_us(lambda: auto(pool, False))}
    return timings


def graph_us(fn) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph (Triton's timer)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--provider", default="auto", choices=("auto", "reference", "triton"),
                        help="the decode's provider (auto: the one the mode picks)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    provider = args.provider
    if provider == "triton" and device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--provider triton on CPU runs the Triton kernels interpreted: set TRITON_INTERPRET=1")
        provider = "triton-interpreted"
        # the test suite's shims for two Triton 3.6 interpreter bugs (tests/helpers.py)
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from helpers import patch_triton_interpreter

        patch_triton_interpreter()
    served = dispatch.providers(device, batch_invariant=True)[DECODE] if provider == "auto" else provider
    small = device.type == "cpu"
    pool = decode_pool(300, device, 16 if small else 64, 64 if small else 128, 128 if small else 512)
    call = decode_call(provider)
    rows, equal = op_check(call, pool, SIZES[device.type], True)
    _, default_equal = op_check(call, pool, SIZES[device.type], False)
    report = {
        "device": str(device),
        "provider": served,
        "rows": rows,
        "bitwise_equal_rows": equal,
        "default_bitwise_equal_rows": default_equal,
        "model": {"batch_invariant": model_check(device, True), "default": model_check(device, False)},
        "providers": dispatch.providers(device, batch_invariant=True),
    }
    if device.type == "cuda":
        report["cost_ratio"] = cost_ratios()
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:<28} {value}")
    return report


if __name__ == "__main__":
    main()
