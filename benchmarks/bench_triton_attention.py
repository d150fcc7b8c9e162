"""The portable Triton decode / prefill kernels against FlashMLA on CUDA.

    PYTHONPATH=. python benchmarks/bench_triton_attention.py [--json out.json] [--sweep | --grid | --combine | --pdl]

Decode: H=64, an SWA cache (P=256, 128 keys per row) plus a c4 compressed extra cache (P=64, 512
keys), T rows in {1, 8, 64, 256}, random lengths and sink. Prefill: s_q=4096, s_kv=8192, H=64,
top-k 640: TFLOP/s = 4 * s_q * H * topk * 512 / t.

Times are medians: ``graph`` with ``triton.testing.do_bench_cudagraph`` (GPU time of one call
replayed from a CUDA graph: no host overhead, which eager decode is bound by), ``eager`` with
``triton.testing.do_bench`` (L2 flushed, host overhead visible). FlashMLA is our op under
``use_provider("flashmla")`` (the legacy kernels of sgl-flash-mla) with the scheduler metadata
hoisted (computed once, as a model step does). ``ratio`` = FlashMLA time / Triton time, i.e. the
Triton kernel's share of FlashMLA's throughput (goals: decode >= 0.9 at every T, prefill >= 0.75).
``--sweep`` also times each launch geometry in :data:`DECODE_SWEEP` / :data:`PREFILL_SWEEP`
(``*`` marks the defaults of ``providers/triton/attention.py``); ``--pdl`` only the decode with
and without programmatic dependent launches (:func:`pdl_ab`).

Roofline of each case: ``max(bytes / copy rate, FLOPs / peak)``, with the device-to-device copy
rate measured in the same run (bytes read + written per second) and ``--peak-tflops`` the dense
bf16 MMA rate (default 989.4: H100 / H200 SXM). Bytes are what the op must move at least: decode
reads q, the indices and each counted key's 584-byte record once per row that counts it, and
writes out and lse; prefill reads q, the indices and the whole ``kv`` once and writes its three
outputs. FLOPs: ``4 * heads * 512`` per counted (query, key) pair. ``*_of_roofline`` = roofline
time / measured time.

    python benchmarks/bench_triton_attention.py plot AFTER.json OUT.png [BEFORE.json]

draws each case's share of the roofline (Triton, FlashMLA, and Triton before) and Triton's share of
FlashMLA's throughput, as bars.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton.testing

import dsv4_compile as d4
from dsv4_compile import dispatch, layout
from dsv4_compile.providers.triton import attention as ta
from bench_step import copy_rate  # this directory's benchmark
from common import DECODE_ROWS, DEV, decode_inputs

SCALE = layout.HEAD_DIM**-0.5
#: FlashMLA time / Triton time to reach: the decode at every T, the prefill
DECODE_GOAL, PREFILL_GOAL = 0.9, 0.75
FLASHMLA_OPS = ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata")
#: Launch geometries timed by ``--sweep`` (block_h, block_n, num_warps, num_stages[, extra_stages]),
#: around the defaults (``scripts/kernel_sass.py decode`` counts each one's instructions and stack bytes);
#: ``decode_loop_stages`` takes one stage wherever a split holds one key block, whatever the
#: geometry says.
DECODE_SWEEP = [ta.Config(*c) for c in (
    (64, 32, 8, 1), (64, 32, 8, 2, 1), (64, 64, 8, 1), (64, 64, 8, 2), (64, 64, 8, 2, 1), (64, 64, 4, 2, 1),
    (32, 32, 8, 1), (32, 32, 8, 2), (32, 32, 4, 2), (32, 64, 8, 1),
)]
MIN_SPLIT_KEYS_SWEEP = (32, 64, 128, 256, 640)
#: ``--grid`` (decode at ``GRID_ROWS`` rows): every combination of these geometries and split
#: sizes, each output checked against the default launch's.
GRID_CONFIGS = [ta.Config(*c) for c in (
    (64, 64, 8, 2, 1), (64, 64, 8, 2), (64, 64, 8, 1), (32, 64, 8, 1), (32, 32, 8, 1),
)]
GRID_MIN_SPLIT_KEYS = (32, 64)
GRID_ROWS = (1, 2, 4, 6, 8, 64, 256)
#: ``--combine`` (decode at T = 1, 8, 64): the combine's tile, heads x columns.
COMBINE_SWEEP = ((16, 128), (8, 128), (16, 64), (8, 64), (4, 128))
#: The prefill's: every geometry ``prefill_config`` gives some GPU (timed on one GPU, they show what
#: each costs there, not the speed of the GPU that gets it), then others around the default.
PREFILL_SWEEP = [ta.PREFILL_CONFIG, ta.PREFILL_CONFIG_SM100, ta.PREFILL_CONFIG_SMALL, ta.PREFILL_CONFIG_LOW_SHARED] + [
    ta.Config(*c) for c in ((64, 32, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (32, 32, 4, 2))
]


def roofline_us(nbytes: float, flops: float, copy: float, peak: float) -> float:
    """Time bound of moving ``nbytes`` at ``copy`` TB/s and doing ``flops`` at ``peak`` TFLOP/s."""
    return max(nbytes / copy, flops / peak) / 1e6


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def eager_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def flashmla_available() -> bool:
    try:
        with d4.use_provider("flashmla", ops=FLASHMLA_OPS):
            dispatch.resolve("flash_mla_with_kvcache", torch.device(DEV, torch.cuda.current_device()))
        return True
    except d4.ProviderUnavailable:
        return False


def with_setting(name: str, value, fn):
    """``fn`` run with ``ta.<name>`` set to ``value``."""
    return with_settings({name: value}, fn)


def with_settings(values: dict, fn):
    """``fn`` run with each ``ta.<name>`` of ``values`` set to its value."""

    def run():
        saved = {name: getattr(ta, name) for name in values}
        for name, value in values.items():
            setattr(ta, name, value)
        try:
            return fn()
        finally:
            for name, value in saved.items():
                setattr(ta, name, value)

    return run


def sweep(name: str, values, fn) -> list[dict]:
    """Graph time of ``fn`` for each value of ``ta.<name>`` (``*``: the default)."""
    rows = []
    for value in values:
        label = f"{name}={value}{'*' if value == getattr(ta, name) else ''}"
        try:
            us = graph_us(with_setting(name, value, fn))
        except Exception as exc:  # a geometry the GPU cannot hold (shared memory, registers)
            rows.append({"config": label, "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
            continue
        rows.append({"config": label, "us": us})
    return rows


def bench_decode(rows: int, heads: int, flashmla: bool, do_sweep: bool, copy: float, peak: float) -> dict:
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_inputs(rows, heads)
    args = (q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, None, None, SCALE, 512)

    def triton_call():
        return ta.flash_mla_with_kvcache(*args)

    keys = int(lengths.clamp(max=idx.shape[-1]).sum() + elen.clamp(max=eidx.shape[-1]).sum())  # counted pairs
    nbytes = 2 * q.numel() * 2 + keys * layout.TOKEN_BYTES + 4 * (idx.numel() + eidx.numel()) + 4 * rows * heads
    roof = roofline_us(nbytes, 4 * heads * 512 * keys, copy, peak)
    _, heads_per_program, splits = ta.decode_plan(q.device, rows, heads, 640)
    result = {
        "rows": rows, "heads": heads, "heads_per_program": heads_per_program, "splits": splits,
        "keys": keys, "bytes": nbytes, "roofline_us": roof,
        "triton_graph_us": graph_us(triton_call), "triton_eager_us": eager_us(triton_call),
    }
    result["triton_of_roofline"] = roof / result["triton_graph_us"]
    if flashmla:
        with d4.use_provider("flashmla", ops=FLASHMLA_OPS):
            meta = d4.get_mla_metadata(q, idx, lengths, eidx, elen)

            def flashmla_call():
                return d4.flash_mla_with_kvcache(q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, *meta,
                                                 softmax_scale=SCALE)

            result["flashmla_graph_us"] = graph_us(flashmla_call)
            result["flashmla_eager_us"] = eager_us(flashmla_call)
            want = flashmla_call()
        got = triton_call()
        result["ratio"] = result["flashmla_graph_us"] / result["triton_graph_us"]
        result["flashmla_of_roofline"] = roof / result["flashmla_graph_us"]
        result["max_abs_diff_out"] = (got[0].float() - want[0].float()).abs().max().item()
        result["max_abs_diff_lse"] = (got[1] - want[1]).abs().max().item()
    if do_sweep:
        result["sweep"] = sweep("DECODE_CONFIG", DECODE_SWEEP, triton_call)
        if rows < 256:
            result["sweep"] += sweep("MIN_SPLIT_KEYS", MIN_SPLIT_KEYS_SWEEP, triton_call)
    return result


def decode_variants(rows: int, heads: int, variants) -> list[dict]:
    """Graph time of the decode at ``rows`` under each ``(fields, settings)`` of ``variants``
    (``settings``: ``ta`` names set for the call; ``fields``: the row's labels), with
    the largest difference of its outputs from the default launch's (the key blocks' order changes
    the rounding, nothing else)."""
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_inputs(rows, heads)
    args = (q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, None, None, SCALE, 512)
    want = ta.flash_mla_with_kvcache(*args)
    out = []
    for fields, settings in variants:
        call = with_settings(settings, lambda: ta.flash_mla_with_kvcache(*args))
        row = {"rows": rows, **fields}
        try:
            got = call()
            row["max_abs_diff_out"] = (got[0].float() - want[0].float()).abs().max().item()
            row["max_abs_diff_lse"] = (got[1] - want[1]).abs().max().item()
            row["us"] = graph_us(call)
        except Exception as exc:  # a geometry the GPU cannot hold (shared memory, registers)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        out.append(row)
    return out


def pdl_ab(rows: int, heads: int, turns: int = 2) -> dict:
    """Graph time of the decode at ``rows`` with its eager launches programmatic (the default on
    SM90+, ``ta.PDL_CAPABILITY``) and not, in alternating turns; the outputs must be bit-identical."""
    q, cache, idx, lengths, sink, ecache, eidx, elen = decode_inputs(rows, heads)
    args = (q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen, None, None, SCALE, 512)
    want = ta.flash_mla_with_kvcache(*args)
    times = {"pdl": [], "no_pdl": []}
    for _ in range(turns):
        for name, capability in (("pdl", ta.PDL_CAPABILITY), ("no_pdl", (99, 0))):
            call = with_setting("PDL_CAPABILITY", capability, lambda: ta.flash_mla_with_kvcache(*args))
            got = call()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"T={rows} {name}: outputs differ"
            times[name].append(graph_us(call))
    return {"rows": rows, **{f"{name}_us": min(v) for name, v in times.items()}, "turns": times}


def grid(rows: int, heads: int) -> list[dict]:
    """:func:`decode_variants` over every combination of :data:`GRID_CONFIGS` and
    :data:`GRID_MIN_SPLIT_KEYS`, with each launch's programs and splits."""
    variants = []
    for config, min_keys in itertools.product(GRID_CONFIGS, GRID_MIN_SPLIT_KEYS):
        settings = {"DECODE_CONFIG": config, "MIN_SPLIT_KEYS": min_keys}
        _, block_h, splits = with_settings(settings, lambda: ta.decode_plan(torch.device(DEV), rows, heads, 640))()
        fields = {"config": f"{tuple(vars(config).values())}", "min_split_keys": min_keys,
                  "programs": rows * -(-heads // block_h) * splits, "splits": splits}
        variants.append((fields, settings))
    return decode_variants(rows, heads, variants)


def combine_sweep(rows: int, heads: int) -> list[dict]:
    """:func:`decode_variants` over the combine geometries of :data:`COMBINE_SWEEP`."""
    return decode_variants(rows, heads, [
        ({"combine": f"{block_h} x {block_d}"}, {"COMBINE_BLOCK_H": block_h, "COMBINE_BLOCK_D": block_d})
        for block_h, block_d in COMBINE_SWEEP
    ])


def bench_prefill(heads: int, topk: int, flashmla: bool, do_sweep: bool, copy: float, peak: float) -> dict:
    s_q, s_kv = 4096, 8192
    q = torch.randn(s_q, heads, 512, dtype=torch.bfloat16, device=DEV)
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32, device=DEV)
    sink = torch.randn(heads, device=DEV)
    flops = 4 * s_q * heads * topk * 512

    def triton_call():
        return ta.flash_mla_sparse_fwd(q, kv, idx, SCALE, 512, sink, None)

    nbytes = 2 * q.numel() * 2 + kv.numel() * 2 + 4 * idx.numel() + 2 * 4 * s_q * heads
    roof = roofline_us(nbytes, flops, copy, peak)
    t = eager_us(triton_call)
    result = {"s_q": s_q, "s_kv": s_kv, "heads": heads, "topk": topk, "bytes": nbytes, "roofline_us": roof,
              "triton_us": t, "triton_tflops": flops / t / 1e6, "triton_of_roofline": roof / t}
    if flashmla:
        with d4.use_provider("flashmla", ops=FLASHMLA_OPS):
            f = eager_us(lambda: d4.flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink))
            want = d4.flash_mla_sparse_fwd(q, kv, idx, SCALE, attn_sink=sink)
        got = triton_call()
        result.update(flashmla_us=f, flashmla_tflops=flops / f / 1e6, ratio=f / t, flashmla_of_roofline=roof / f,
                      max_abs_diff_out=(got[0].float() - want[0].float()).abs().max().item(),
                      max_abs_diff_lse=(got[2] - want[2]).abs().max().item())
    if do_sweep:
        rows = sweep("PREFILL_CONFIG", PREFILL_SWEEP, triton_call)
        for row in rows:
            if "us" in row:
                row["tflops"] = flops / row["us"] / 1e6
        result["sweep"] = rows
    return result


def table(rows: list[dict], keys: list[str]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    keys = [k for k in keys if any(k in r for r in rows)]
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    lines += [" | ".join(cell(r.get(k, "")) for k in keys) for r in rows]
    return "\n".join(lines)


def plot(after: dict, path: str, before: dict | None = None) -> None:
    """Left: each case's share of its roofline (Triton, Triton before, FlashMLA); right: Triton's
    share of FlashMLA's throughput (after, before) against the goals (:data:`DECODE_GOAL`, :data:`PREFILL_GOAL`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cases(report):
        rows = {f"decode T={r['rows']}": r for r in report["decode"]}
        rows.update({f"prefill s_q={r['s_q']}": r for r in report["prefill"]})
        return rows

    new, old = cases(after), cases(before) if before else {}
    names = list(new)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.0))
    bars = [("FlashMLA", new, "flashmla_of_roofline", "tab:gray")]
    if before:
        bars.append(("Triton before", old, "triton_of_roofline", "tab:cyan"))
    bars.append(("Triton", new, "triton_of_roofline", "tab:blue"))
    width = 0.8 / len(bars)
    for i, (label, rows, key, color) in enumerate(bars):
        xs = [c + (i - (len(bars) - 1) / 2) * width for c in range(len(names))]
        left.bar(xs, [100 * (rows.get(n, {}).get(key) or 0) for n in names], width, label=label, color=color)
    left.set_ylabel("% of roofline (max of bytes / copy, FLOPs / peak)")
    ratios = [("Triton", new, "tab:blue")]
    if before:
        ratios.insert(0, ("Triton before", old, "tab:cyan"))
    width = 0.8 / len(ratios)
    for i, (label, rows, color) in enumerate(ratios):
        xs = [c + (i - (len(ratios) - 1) / 2) * width for c in range(len(names))]
        right.bar(xs, [rows.get(n, {}).get("ratio") or 0 for n in names], width, label=label, color=color)
    right.plot([-0.5, len(names) - 1.5], [DECODE_GOAL] * 2, "k--", label=f"goal (decode {DECODE_GOAL})")
    right.plot([len(names) - 1.5, len(names) - 0.5], [PREFILL_GOAL] * 2, "k:", label=f"goal (prefill {PREFILL_GOAL})")
    right.set_ylabel("Triton throughput / FlashMLA's")
    right.set_ylim(0, 1.15)  # room for the legend above the goals
    for ax in (left, right):
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(f"Triton attention vs FlashMLA, H=64, {after['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        after = json.load(open(sys.argv[2]))
        plot(after, sys.argv[3], json.load(open(sys.argv[4])) if len(sys.argv) > 4 else None)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--sweep", action="store_true", help="also time every launch geometry of the sweep")
    parser.add_argument("--grid", action="store_true", help="only the decode grid (GRID_*)")
    parser.add_argument("--rows", type=int, nargs="*", help="--grid: these row counts (default GRID_ROWS)")
    parser.add_argument("--combine", action="store_true", help="only the combine sweep (COMBINE_SWEEP)")
    parser.add_argument("--pdl", action="store_true", help="only the decode with and without programmatic launches")
    parser.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 MMA rate of the GPU")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.grid or args.combine or args.pdl:
        if args.grid:
            name, rows = "grid", [r for t in args.rows or GRID_ROWS for r in grid(t, 64)]
            keys = ["rows", "config", "min_split_keys", "programs", "splits"]
        elif args.pdl:
            name, rows, keys = "pdl", [pdl_ab(t, 64) for t in args.rows or DECODE_ROWS], ["rows", "pdl_us", "no_pdl_us"]
        else:
            name, rows, keys = "combine", [r for t in (1, 8, 64) for r in combine_sweep(t, 64)], ["rows", "combine"]
        print(table(rows, keys + ["us", "max_abs_diff_out", "max_abs_diff_lse", "error"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "triton": triton.__version__,
                           "device": torch.cuda.get_device_name(), name: rows}, f, indent=1)
        return
    flashmla = flashmla_available()
    device = torch.device(DEV, torch.cuda.current_device())
    copy = copy_rate(device) / 1e12  # TB/s read + written
    report = {
        "torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
        "flashmla": flashmla, "decode_config": str(ta.decode_config(device)), "prefill_config": str(ta.prefill_config(device)),
        "min_split_keys": ta.MIN_SPLIT_KEYS, "copy_tb_s": copy, "peak_tflops": args.peak_tflops,
        "decode": [bench_decode(rows, 64, flashmla, args.sweep, copy, args.peak_tflops) for rows in DECODE_ROWS],
        "prefill": [bench_prefill(64, 640, flashmla, args.sweep, copy, args.peak_tflops)],
    }
    if flashmla:
        report["goals"] = {
            f"decode_ratio>={DECODE_GOAL}": all(r["ratio"] >= DECODE_GOAL for r in report["decode"]),
            f"prefill_ratio>={PREFILL_GOAL}": report["prefill"][0]["ratio"] >= PREFILL_GOAL,
        }
    print(f"{report['device']}, torch {report['torch']}, triton {report['triton']}")
    print(f"\ndecode (H=64, SWA 128 keys P=256 + c4 512 keys P=64), us per call; {report['decode_config']}")
    print(f"copy {copy:.2f} TB/s, peak {args.peak_tflops} TFLOP/s")
    print(table(report["decode"], ["rows", "heads_per_program", "splits", "triton_graph_us", "flashmla_graph_us",
                                   "ratio", "roofline_us", "triton_of_roofline", "flashmla_of_roofline",
                                   "triton_eager_us", "flashmla_eager_us",
                                   "max_abs_diff_out", "max_abs_diff_lse"]))
    print(f"\nprefill (s_q 4096, s_kv 8192, H 64, top-k 640); {report['prefill_config']}")
    print(table(report["prefill"], ["heads", "topk", "triton_us", "triton_tflops", "flashmla_us", "flashmla_tflops",
                                    "ratio", "roofline_us", "triton_of_roofline", "flashmla_of_roofline",
                                    "max_abs_diff_out", "max_abs_diff_lse"]))
    if flashmla:
        print(f"\ngoals met: {report['goals']}")
    if args.sweep:
        for row in report["decode"]:
            print(f"\ndecode sweep, T={row['rows']} (graph us)")
            print(table(row["sweep"], ["config", "us", "error"]))
        print("\nprefill sweep (graph us)")
        print(table(report["prefill"][0]["sweep"], ["config", "us", "tflops", "error"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
