"""Host cost of an eager ``dsv4`` call against the raw library call on the same inputs.

    python benchmarks/bench_overhead.py [--json out.json] [--plot out.png]   # on a CUDA machine
    python benchmarks/bench_overhead.py --quick                              # CPU smoke (CI)
    python benchmarks/bench_overhead.py --launcher [--json out.json]         # Triton's launcher vs the fast one
    python benchmarks/bench_overhead.py plot after.json out.png [before.json]  # a plot of saved runs

Host time per call is the wall time of a long loop of non-blocking calls divided by the calls
(200 calls, synchronised once after the loop): at these sizes the launches, not the GPU, bound the
loop, so this is what an eager engine step pays per call. The variants of a case (ours, the raw op,
the library's wrapper) take turns, one loop each per round, and each reports its median over 15
rounds: drift of the machine (clocks, other processes) falls on all of them alike, so their
ratios compare like with like. Per op and size:

* decode (H=64, SWA 128 + c4 512 keys per row, T rows in 1 / 8 / 64 / 256; scheduler computed
  inside): ``ours`` = ``dsv4_compile.flash_mla_with_kvcache``; ``raw_op`` =
  ``torch.ops.flash_mla_legacy.sparse_decode_fwd`` on the 4-D views; ``wrapper`` =
  ``flash_mla.flash_mla_with_kvcache(..., use_legacy=True)`` with a fresh ``get_mla_metadata()``;
* prefill (H=64, top-k 640, s_q in 64 / 4096): ``ours`` = ``dsv4_compile.flash_mla_sparse_fwd``;
  ``raw_op`` = ``torch.ops.flash_mla_legacy.sparse_prefill_fwd``; ``wrapper`` =
  ``flash_mla.flash_mla_sparse_fwd(..., use_legacy=True)``;
* store (T tokens in 1 / 64 / 4096, page size 256): ``ours`` =
  ``dsv4_compile.fused_k_norm_rope_flashmla`` (the ``triton`` provider); ``raw_op`` = our Triton
  kernel launched directly (there is no library store on CUDA).

``--launcher`` times ``ours`` with every op served by the ``triton`` provider, its eager launches
through ``kernel[grid](...)`` (the default) and through :class:`EagerLauncher`'s fast path
(``DSV4_COMPILE_TRITON_FAST_LAUNCH=1``), in turns as above.

``--quick`` runs the same op path on CPU, FlashMLA's adapter included, with FlashMLA's ops and the
store kernel replaced by stubs that return preallocated outputs (``raw_op`` = calling the stub):
the wrappers, trampolines, checks, provider lookup and adapter, without a GPU, so a regression of
the per-call path shows up in CI. It asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import dsv4_compile as d4
from dsv4_compile import dispatch, layout
from dsv4_compile.ops.decode import decode_outputs
from dsv4_compile.ops.prefill import prefill_outputs

SCALE = layout.HEAD_DIM**-0.5


def host_us(variants: dict, sync, calls: int = 200, rounds: int = 15) -> dict:
    """``{name: median wall microseconds per call}`` of each of ``variants`` (``{name: fn}``),
    timed in turns (see the module docstring)."""
    for fn in variants.values():
        for _ in range(20):
            fn()
    sync()
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def decode_inputs(rows: int, device: str) -> tuple:
    """``(q, cache, idx, lengths, sink, extra_cache, extra_idx, extra_lengths)``: zeroed caches
    (values do not change host cost), random valid slots."""
    cache, ecache = layout.alloc_cache(64, 256, device), layout.alloc_cache(512, 64, device)
    q = torch.randn(rows, 1, 64, 512, dtype=torch.bfloat16, device=device)
    idx = torch.randint(0, 64 * 256, (rows, 1, 128), dtype=torch.int32, device=device)
    eidx = torch.randint(0, 512 * 64, (rows, 1, 512), dtype=torch.int32, device=device)
    lengths = torch.randint(64, 129, (rows,), dtype=torch.int32, device=device)
    elen = torch.randint(256, 513, (rows,), dtype=torch.int32, device=device)
    return q, cache, idx, lengths, torch.randn(64, device=device), ecache, eidx, elen


def prefill_inputs(s_q: int, device: str) -> tuple:
    q = torch.randn(s_q, 64, 512, dtype=torch.bfloat16, device=device)
    kv = torch.randn(8192, 1, 512, dtype=torch.bfloat16, device=device)
    idx = torch.randint(0, 8192, (s_q, 1, 640), dtype=torch.int32, device=device)
    return q, kv, idx, torch.randn(64, device=device)


def store_inputs(tokens: int, device: str) -> tuple:
    pages = max(2, -(-2 * tokens // 256))
    return (
        torch.randn(tokens, 512, dtype=torch.bfloat16, device=device),
        torch.ones(512, dtype=torch.bfloat16, device=device),
        torch.randn(8192, 64, device=device),
        torch.randint(0, 8192, (tokens,), device=device),
        torch.randperm(pages * 256, device=device)[:tokens],
        layout.alloc_cache(pages, 256, device),
        1e-6,
        256,
    )


def cases(device: str, raw: dict):
    """``(op, size, ours, {name: raw call})`` for every case; ``raw`` maps op to a function of the
    inputs returning the raw calls to time."""
    for rows in (1, 8, 64, 256):
        q, cache, idx, lengths, sink, ecache, eidx, elen = args = decode_inputs(rows, device)
        ours = lambda: d4.flash_mla_with_kvcache(  # noqa: E731
            q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, softmax_scale=SCALE)
        yield "flash_mla_with_kvcache", f"T={rows}", ours, raw["decode"](*args)
    for s_q in (64, 4096):
        q, kv, idx, sink = args = prefill_inputs(s_q, device)
        ours = lambda: d4.flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink)  # noqa: E731
        yield "flash_mla_sparse_fwd", f"s_q={s_q}", ours, raw["prefill"](*args)
    for tokens in (1, 64, 4096):
        args = store_inputs(tokens, device)
        yield "fused_k_norm_rope_flashmla", f"T={tokens}", lambda: d4.fused_k_norm_rope_flashmla(*args), \
            raw["store"](*args)


def cuda_raw_calls() -> dict:
    import flash_mla

    from dsv4_compile.providers.triton import store as triton_store

    legacy = torch.ops.flash_mla_legacy

    def decode(q, cache, idx, lengths, sink, ecache, eidx, elen):
        view, eview = d4.flashmla_view(cache, 256), d4.flashmla_view(ecache, 64)

        def raw_op():
            return legacy.sparse_decode_fwd.default(q, view, idx, lengths, sink, None, None, eview, eidx, elen, 512, SCALE)

        def wrapper():
            sched, _ = flash_mla.get_mla_metadata()
            return flash_mla.flash_mla_with_kvcache(
                q, view, None, None, 512, sched, softmax_scale=SCALE, is_fp8_kvcache=True, indices=idx,
                attn_sink=sink, extra_k_cache=eview, extra_indices_in_kvcache=eidx, topk_length=lengths,
                extra_topk_length=elen, use_legacy=True,
            )

        return {"raw_op": raw_op, "wrapper": wrapper}

    def prefill(q, kv, idx, sink):
        return {
            "raw_op": lambda: legacy.sparse_prefill_fwd.default(q, kv, idx, SCALE, 512, sink, None, False, True),
            "wrapper": lambda: flash_mla.flash_mla_sparse_fwd(q, kv, idx, SCALE, 512, sink, None, use_legacy=True),
        }

    def store(*args):  # the jitted kernel launched as is (Triton's own launcher)
        return {"raw_op": lambda: triton_store._launch(lambda kernel: kernel, *args, layout.V4, True)}

    return {"decode": decode, "prefill": prefill, "store": store}


def cpu_stub_calls() -> dict:
    """The CPU smoke: the ``flashmla`` provider's adapter (``providers.flashmla.adapter.FlashMLAKernels``)
    over stand-ins of FlashMLA's ops that return preallocated outputs, declared to check their
    calls as FlashMLA's do (``Provider.validates``: the stand-ins check nothing, and this benchmark
    makes well-formed calls only), so the timed decode and prefill take the path FlashMLA's calls
    take on a GPU; a stub store kernel for the store. ``raw_op`` = the stand-in op."""
    from types import SimpleNamespace

    from dsv4_compile.providers.flashmla import adapter as flashmla

    outputs = {}

    def decode_op(*args):
        return outputs["decode"]

    def prefill_op(*args):
        return outputs["prefill"]

    def store_kernel(*args):
        return None

    namespace = SimpleNamespace(sparse_decode_fwd=SimpleNamespace(default=decode_op),
                                sparse_prefill_fwd=SimpleNamespace(default=prefill_op))
    kernels = flashmla.FlashMLAKernels("overhead_stub", namespace, torch.device("cpu"), prefill_log2=False,
                                       prefill_has_stats_flags=True, validates=flashmla.FLASHMLA_VALIDATES).kernels()
    dispatch.register_provider(dispatch.Provider(
        name="overhead_stub", device_type="cpu", priority=10, validates=flashmla.FLASHMLA_VALIDATES,
        load=lambda device: {"flash_mla_with_kvcache": kernels["flash_mla_with_kvcache"],
                             "flash_mla_sparse_fwd": kernels["flash_mla_sparse_fwd"],
                             "fused_k_norm_rope_flashmla": store_kernel},
    ))

    def decode(q, cache, idx, lengths, sink, ecache, eidx, elen):
        outputs["decode"] = (*decode_outputs(q, 512), None, None)
        view, eview = d4.flashmla_view(cache, 256), d4.flashmla_view(ecache, 64)
        return {"raw_op": lambda: decode_op(q, view, idx, lengths, sink, None, None, eview, eidx, elen, 512, SCALE)}

    def prefill(q, kv, idx, sink):
        outputs["prefill"] = prefill_outputs(q, 512)
        return {"raw_op": lambda: prefill_op(q, kv, idx, SCALE, 512, sink, None, False, True)}

    def store(*args):
        return {"raw_op": lambda: store_kernel(*args)}

    return {"decode": decode, "prefill": prefill, "store": store}


def launcher_rows(sync) -> list[dict]:
    """Per case, ``ours`` with the ``triton`` provider: host µs per call through Triton's own
    launcher and through the fast one, timed in turns (the launchers' switch flipped per turn)."""
    import triton

    from dsv4_compile.providers.triton import common as triton_common

    if not triton.__version__.startswith(triton_common.FAST_LAUNCH_TRITON):
        raise SystemExit(f"the fast launcher serves Triton {triton_common.FAST_LAUNCH_TRITON}, not {triton.__version__}")

    rows = []
    none = {"decode": lambda *a: {}, "prefill": lambda *a: {}, "store": lambda *a: {}}
    with d4.use_provider("triton", ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "fused_k_norm_rope_flashmla")):
        for op, size, ours, _ in cases("cuda", none):
            ours()  # creates the kernels' launchers
            samples = {"triton_launcher": [], "fast_launcher": []}
            for _ in range(15):
                for name, enabled in (("triton_launcher", False), ("fast_launcher", True)):
                    for launcher in triton_common._LAUNCHERS.values():
                        launcher.enabled = enabled
                    samples[name].append(host_us({name: ours}, sync, rounds=1)[name])
            row = {"op": op, "size": size, **{f"{k}_us": statistics.median(v) for k, v in samples.items()}}
            row["ratio"] = row["fast_launcher_us"] / row["triton_launcher_us"]
            rows.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="CPU, stubbed kernels (a smoke test)")
    parser.add_argument("--launcher", action="store_true", help="Triton's eager launcher vs the fast one (CUDA)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.launcher:
        import triton

        with torch.inference_mode():
            rows = launcher_rows(torch.cuda.synchronize)
        report = {"torch": torch.__version__, "triton": triton.__version__,
                  "device": torch.cuda.get_device_name(), "rows": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return report
    if args.quick:
        device, sync, raw = "cpu", lambda: None, cpu_stub_calls()
    else:
        device, sync, raw = "cuda", torch.cuda.synchronize, cuda_raw_calls()
    rows = []
    with torch.inference_mode():
        for op, size, ours, raws in cases(device, raw):
            timed = host_us({"ours": ours, **raws}, sync)
            row = {"op": op, "size": size, **{f"{name}_us": us for name, us in timed.items()}}
            rows.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    report = {"torch": torch.__version__, "device": device if args.quick else torch.cuda.get_device_name(),
              "providers": d4.providers(device), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return report


def plot(report: dict, path: str, before: dict | None = None) -> None:
    """Bars per case: ours (and ``before``'s ours, a report of an earlier version from the same
    run), and each raw call measured next to it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    series = []
    if before is not None:
        series.append(("before", [r["ours_us"] for r in before["rows"]]))
    series.append(("ours", [r["ours_us"] for r in rows]))
    for name in ("raw_op_us", "wrapper_us"):
        series.append((name.removesuffix("_us"), [r.get(name) for r in rows]))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [j + i * width for j, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=label)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(rows))])
    short = {"flash_mla_with_kvcache": "decode", "flash_mla_sparse_fwd": "prefill", "fused_k_norm_rope_flashmla": "store"}
    ax.set_xticklabels([f"{short.get(r['op'], r['op'])}\n{r['size']}" for r in rows], fontsize=8)
    ax.set_ylabel("host µs per eager call")
    ax.set_ylim(0, 1.15 * max(v for _, values in series for v in values if v is not None and v < 200))
    ax.set_title(f"dsv4 eager call vs the raw library ({report['device']}, torch {report['torch']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main_plot(argv=None) -> None:
    """``python bench_overhead.py plot AFTER.json OUT.png [BEFORE.json]``: the plot of saved reports."""
    after, out = argv[0], argv[1]
    before = json.load(open(argv[2])) if len(argv) > 2 else None
    plot(json.load(open(after)), out, before)


if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"]:
        main_plot(sys.argv[2:])
    else:
        main(sys.argv[1:])
