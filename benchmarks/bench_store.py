"""Bandwidth of the Triton cache store (``dsv4::fused_k_norm_rope_flashmla``) against a plain copy.

For each token count T (page size 256, bf16 ``kv``) the store moves, per token, 1024 B of ``kv``,
256 B of ``freqs`` row, 16 B of position and slot (reads) and a token of the cache format (writes:
584 B for V4, the default; ``--format`` picks another). A
device-to-device copy of half that many bytes moves the same traffic (read + write); its
bandwidth is the ceiling. Times are medians of ``triton.testing.do_bench`` (L2 flushed between
runs). Rows: the kernel launched directly for each launch geometry (tokens per program, warps;
``*`` marks the geometry ``triton_store.geometry`` picks for the format and T; ``int``: rounding in integer arithmetic
instead of the GPU's conversion instructions), and the op called eagerly (adds the
dispatcher, provider trampoline and checks: host time, visible at small T). ``--graph`` times the
copy and the default geometry's kernel instead as CUDA-graph replays of 10 back-to-back calls
(median of 7; no host time, no L2 flush: the steady figure for small T, where ``do_bench`` of a
single ~6 µs kernel swings from run to run); ``--graph --sweep`` times every geometry that way.

Usage (on a CUDA machine): ``PYTHONPATH=. python benchmarks/bench_store.py [--tokens 1024 8192 65536]``;
``python benchmarks/bench_store.py plot OUT.png LOG [LOG ...]`` draws the ``--graph`` tables this
script printed (one log per format; no GPU needed).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import torch

import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.providers.triton import common as triton_common, store as triton_store
from common import graph_timed

PAGE_SIZE = 256


def traffic_per_token(kv_format: str = "v4") -> int:
    """Bytes a stored token moves: ``kv`` row, ``freqs`` row, position and slot read, token written."""
    return 2 * layout.HEAD_DIM + 4 * layout.ROPE_DIM + 16 + layout.cache_format(kv_format).token_bytes


GEOMETRIES = [(1, 1), (2, 1), (2, 2), (4, 4), (4, 1), (4, 2), (8, 2), (8, 4), (16, 4), (16, 8)]  # (tokens, warps) per program


def inputs(num_tokens: int, scattered: bool, kv_format: str = "v4"):
    num_pages = -(-2 * num_tokens // PAGE_SIZE)
    cap = num_pages * PAGE_SIZE
    order = torch.randperm(cap, device="cuda") if scattered else torch.arange(cap, device="cuda")
    slots = order[:num_tokens]
    return (
        torch.randn(num_tokens, layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        torch.rand(layout.HEAD_DIM, device="cuda", dtype=torch.bfloat16) + 0.5,
        torch.randn(65536, layout.ROPE_DIM, device="cuda"),
        torch.randint(0, 65536, (num_tokens,), device="cuda"),
        slots,
        d4.alloc_cache(num_pages, PAGE_SIZE, "cuda", kv_format=kv_format),
        1e-6,
        PAGE_SIZE,
    )


def median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


@contextlib.contextmanager
def geometry(block_t: int, num_warps: int):
    """Within: the store launches ``block_t`` tokens per program on ``num_warps`` warps, whatever the count."""
    with mock.patch.object(triton_store, "geometry", lambda fmt, num_tokens: (block_t, num_warps)):
        yield


def kernel_ms(args, kv_format: str, block_t: int, num_warps: int, hardware: bool | None = None) -> float:
    """The kernel at a launch geometry; ``hardware=False``: rounding in integer arithmetic even
    where the conversion instructions are used (``triton_common.hardware_conversions``)."""
    forced = {} if hardware is None else {args[0].device: hardware}
    with geometry(block_t, num_warps), mock.patch.dict(triton_common._HARDWARE_CONVERSIONS, forced):
        return median_ms(lambda: triton_store._launch(lambda kernel: kernel, *args, layout.cache_format(kv_format), True))  # Triton's own launcher


def read_log(path: str) -> tuple[str, str, dict]:
    """A ``--graph`` log printed by :func:`main`: its title line, its format, and ``{what: {T: GB/s}}``
    for the copy and the rule's geometry (the rows marked ``*``), contiguous and scattered."""
    lines = open(path).read().splitlines()
    title = lines[0]
    kv_format = title.split("triton ")[1].split()[1].rstrip(",")
    series: dict = {}
    for line in lines:
        cols = line.split()
        if len(cols) == 5 and cols[1] == "copy":
            series.setdefault("copy", {})[int(cols[0])] = float(cols[3])
        elif len(cols) == 7 and cols[3].endswith("*"):
            series.setdefault(cols[1], {})[int(cols[0])] = float(cols[5])
    if "copy" not in series:
        raise SystemExit(f"{path}: no copy rows; expected a log of `bench_store.py --graph`")
    return title, kv_format, series


def plot(path: str, logs: list[str]) -> None:
    """Left: bandwidth against T, the copy of the same bytes (gray, one curve per log) and each
    format's store at the rule's geometry, contiguous (solid) and scattered (dashed); right: the
    store's share of the copy against the 75% goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.0))
    title = ""
    for i, log in enumerate(logs):
        title, kv_format, series = read_log(log)
        copy = series["copy"]
        tokens = sorted(copy)
        left.plot(tokens, [copy[t] for t in tokens], color="gray", lw=1, label="copy, same bytes" if i == 0 else None)
        for slots, style in (("contiguous", "-"), ("scattered", "--")):
            rows = series.get(slots, {})
            ts = sorted(rows)
            label = f"{kv_format}, {slots}"
            left.plot(ts, [rows[t] for t in ts], style, color=f"C{i}", marker="o", ms=3, label=label)
            right.plot(ts, [rows[t] / copy[t] for t in ts], style, color=f"C{i}", marker="o", ms=3, label=label)
    right.axhline(0.75, color="k", ls=":", lw=1, label="goal (75%)")
    left.set_ylabel("GB/s (bytes read + written / time)")
    right.set_ylabel("store / copy of the same bytes")
    right.set_ylim(0, 1.0)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens stored (T)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Triton cache store vs copy, CUDA graphs, {title.split(chr(32) * 2)[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        if len(sys.argv) < 4:
            raise SystemExit("usage: bench_store.py plot OUT.png LOG [LOG ...]")
        plot(sys.argv[2], sys.argv[3:])
        return
    import triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 65536])
    parser.add_argument("--graph", action="store_true", help="CUDA-graph timing of the copy and the default kernel")
    parser.add_argument("--sweep", action="store_true", help="with --graph: every geometry, not only the default")
    parser.add_argument("--format", default="v4", help="the cache format stored (v4, v4.1-fp8, v4.1-fp4, ...)")
    opts = parser.parse_args()
    kv_format = opts.format
    if not torch.cuda.is_available():
        raise SystemExit("bench_store.py needs a CUDA device")
    triton_store.register()  # idempotent: the package may have registered it already
    assert d4.providers("cuda")[triton_store.OP] == triton_store.NAME  # and jits the kernel
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{kv_format}, P={PAGE_SIZE}, {traffic_per_token(kv_format)} B of traffic per token")
    header = f"{'T':>6} {'slots':>10} {'what':>16} {'us':>9} {'GB/s':>8} {'of copy':>8}"
    print(header)
    print("-" * len(header))
    for num_tokens in opts.tokens:
        traffic = num_tokens * traffic_per_token(kv_format)
        src = torch.empty(traffic // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        time_ms = (lambda fn: graph_timed(fn) / 1e3) if opts.graph else median_ms
        copy_ms = time_ms(lambda: dst.copy_(src))
        copy_gbs = traffic / copy_ms / 1e6
        print(f"{num_tokens:>6} {'':>10} {'copy':>16} {copy_ms * 1e3:>9.2f} {copy_gbs:>8.0f} {1:>8.0%}")
        for scattered in (False, True):
            args = inputs(num_tokens, scattered, kv_format)
            default = triton_store.geometry(layout.cache_format(kv_format), num_tokens)
            if opts.graph:
                for bt, nw in GEOMETRIES if opts.sweep else [default]:
                    with geometry(bt, nw):
                        ms = time_ms(lambda: triton_store._launch(lambda kernel: kernel, *args, layout.cache_format(kv_format), True))
                    gbs = traffic / ms / 1e6
                    what = f"graph {bt}x{nw}{'*' if (bt, nw) == default else ''}"
                    print(f"{num_tokens:>6} {'scattered' if scattered else 'contiguous':>10} "
                          f"{what:>16} {ms * 1e3:>9.2f} {gbs:>8.0f} {gbs / copy_gbs:>8.0%}")
                continue
            rows = [
                (f"kernel {bt}x{nw}{'*' if (bt, nw) == default else ''}", kernel_ms(args, kv_format, bt, nw))
                for bt, nw in GEOMETRIES
            ]
            rows.append((f"kernel {default[0]}x{default[1]} int", kernel_ms(args, kv_format, *default, hardware=False)))
            op = torch.ops.dsv4.fused_k_norm_rope_flashmla.default
            rows.append(("op (eager)", median_ms(lambda: op(*args, kv_format))))
            for what, ms in rows:
                gbs = traffic / ms / 1e6
                print(f"{num_tokens:>6} {'scattered' if scattered else 'contiguous':>10} {what:>16} "
                      f"{ms * 1e3:>9.2f} {gbs:>8.0f} {gbs / copy_gbs:>8.0%}")
        print()


if __name__ == "__main__":
    main()
