"""The indexer's block logits (``dsv4::indexer_logits``, Triton) against the gather-and-``bmm``
formula it replaced in the model, on the model's shapes (64 heads x 128 dims, ``max_seq_len``
4096: 1024 block columns per row); and its selection (``dsv4::indexer_topk``, Triton) against
``torch.topk(sorted=False)`` (what the model ran before), k = 512.

Cases: decode of 1 and 64 requests whose 1025 tokens make 256 visible blocks each; a prefill
chunk of 8 prompts x 1024 tokens (row ``t`` of a prompt sees ``(t + 1) // 4`` blocks). Rows:

* ``triton``: the op (default geometry), and with ``--sweep`` every ``(BLOCK_N, BLOCK_H,
  num_warps)`` of 16/32/64 x 16/32/64 x 4/8 launched directly;
* ``gather+bmm``: ``keys[slots] -> einsum -> relu * w -> sum -> masked_fill``, compiled by
  Inductor (what the model's step ran: a gather kernel, a float32 cuBLAS ``bmm`` over every
  column, a reduction);
* the floor: bytes the op must move (visible keys, queries, weights, slots, logits) at the
  device-to-device copy rate measured in the same run, and its float32 FMAs at the H200's
  67 TFLOP/s (no tensor cores: IEEE float32).

Top-k cases: the logits above, and random logits with every column visible (rows 1 / 64 / 1024 /
8192, widths 1024, 2048, 4096 and 8192: ``max_seq_len`` 4096, 8192, 16384 and 32768; and 1 / 64
rows of 32768 columns; ``--wide``: 1 to 8192 rows of 8192 to 32768 columns and 1 to 1024 of
131072, each program that can take them timed too); with ``--sweep``, the in-register program at
1, 2, 4, 8 and 16 warps, the looped one (1024 / 2048 / 4096 columns at a time, 4 / 8 warps) on the
rows of 2048 columns or more, and the one by pieces (2048 / 4096 columns) on rows past 8192.

``--programs``: the logits cases only, at several programs per row (the kernel's grid: a row's
column blocks shared among them; :func:`triton_indexer.programs_per_row` is the rule).

Times are CUDA-graph replays of 10 calls (2 for the prefill case, whose calls take milliseconds),
median of 7 runs of 50 replays (``common.graph_timed``). ``--sweep`` takes ~3 minutes on the H200.

Usage (on a CUDA machine): ``PYTHONPATH=. python benchmarks/bench_indexer.py [--sweep] [--json F]``;
``python benchmarks/bench_indexer.py plot OUT.png AFTER.json[,MORE.json] [BEFORE.json[,MORE.json]]``
draws the random top-k cases' time against rows, a panel per width.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

import dsv4_compile as d4
from dsv4_compile.providers.triton import indexer as triton_indexer
from bench_step import copy_rate
from common import graph_timed

HEADS, DIM, WIDTH = 64, 128, 1024
FP32_FLOPS = 67e12  # H200 SXM, non-tensor float32


def case(name: str):
    """``(q, weights, keys, slots)`` on CUDA for a named case."""
    if name == "prefill":
        prompts, length = 8, 1024
        request = torch.arange(prompts * length, device="cuda") // length
        visible = (torch.arange(prompts * length, device="cuda") % length + 1) // 4
    else:
        rows = 1 if name == "decode-b1" else 64
        request = torch.arange(rows, device="cuda")
        visible = torch.full((rows,), 256, device="cuda")
    tokens = request.numel()
    k = torch.arange(WIDTH, device="cuda")
    slots = torch.where(k < visible[:, None], request[:, None] * WIDTH + k, -1)
    keys = torch.randn(int(request.max()) * WIDTH + WIDTH, DIM, device="cuda")
    return torch.randn(tokens, HEADS, DIM, device="cuda"), torch.randn(tokens, HEADS, device="cuda"), keys, slots


def gather_bmm(q, weights, keys, slots):
    scores = torch.einsum("thd,tkd->thk", q, keys[slots.clamp_min(0)])
    return scores.relu().mul(weights[:, :, None]).sum(1).masked_fill(slots < 0, float("-inf"))


def logits_case(name, inputs, ours, compiled, rate, sweep, per_graph, results) -> None:
    """Time the logits op against the gather + ``bmm`` it replaced (``--sweep``: every geometry)."""
    q, weights, keys, slots = inputs
    visible = int((slots >= 0).sum())
    moved = visible * DIM * 4 + q.numel() * 4 + weights.numel() * 4 + slots.numel() * (8 + 4)
    floor_us = max(moved / rate, 2 * HEADS * DIM * visible / FP32_FLOPS) * 1e6
    print(f"{name} ...", flush=True)
    torch.testing.assert_close(ours, compiled(*inputs), rtol=1e-4, atol=1e-3)
    row = {
        "tokens": q.shape[0], "visible_blocks": visible, "bytes": moved, "floor_us": floor_us,
        "triton_us": graph_timed(lambda: d4.indexer_logits(*inputs), per_graph),
        "gather_bmm_us": graph_timed(lambda: compiled(*inputs), per_graph),
        "geometry": triton_indexer.geometry(DIM, HEADS),
    }
    if sweep:
        out = torch.empty_like(ours)
        row["sweep"] = {}
        for block_n, block_h, warps in itertools.product((16, 32, 64), (16, 32, 64), (4, 8)):
            launch = lambda: triton_indexer.launch(*inputs, out, (block_n, block_h), warps)  # noqa: E731
            us = row["sweep"][f"{block_n}x{block_h}/{warps}w"] = graph_timed(launch, per_graph)
            print(f"   {block_n}x{block_h}/{warps}w {us:.1f} us", flush=True)
    results["cases"][name] = row
    print(f"{name}: {row['tokens']} rows, {visible} visible blocks; triton {row['triton_us']:.1f} us, "
          f"gather+bmm {row['gather_bmm_us']:.1f} us, floor {floor_us:.1f} us "
          f"({floor_us / row['triton_us']:.0%} of it)")
    if sweep:
        best = sorted(row["sweep"].items(), key=lambda kv: kv[1])[:5]
        print("   fastest geometries:", ", ".join(f"{k} {v:.1f}" for k, v in best))


def programs_sweep(path: str | None) -> None:
    """The logits cases at 1, 2, 4, ... programs per row, at the rule's
    (:func:`triton_indexer.programs_per_row`) and at one program per column block (the grid
    before the rule); every launch's logits bit for bit the rule's."""
    results = {"torch": torch.__version__, "cases": {}}
    for name in ("decode-b1", "decode-b64", "prefill"):
        inputs = case(name)
        per_graph = 2 if name == "prefill" else 10
        want = d4.indexer_logits(*inputs)
        blocks = -(-WIDTH // triton_indexer.geometry(DIM, HEADS)[0])
        rule = triton_indexer.programs_per_row(want.device, want.shape[0], blocks)
        row = results["cases"][name] = {"rule": rule, "blocks": blocks, "us": {}}
        for programs in sorted({1, 2, 4, 8, 16, 33, rule, blocks} & set(range(1, blocks + 1))):
            out = torch.full_like(want, 7.0)
            launch = lambda: triton_indexer.launch(*inputs, out, programs=programs)  # noqa: E731
            us = row["us"][programs] = graph_timed(launch, per_graph)
            assert torch.equal(out, want), (name, programs)
            mark = " (rule)" if programs == rule else " (a program per block)" if programs == blocks else ""
            print(f"{name}: {programs:3d} programs per row{mark}: {us:8.1f} us", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def topk_case(name: str, logits: torch.Tensor, sweep: bool, per_graph: int, results: dict, wide: bool = False) -> None:
    """Time the top-k op against ``torch.topk`` on ``logits``, k = 512 (``--sweep``: warps;
    ``wide``: every program)."""
    k = 512
    got = d4.indexer_topk(logits, k)
    want = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :k].sort(dim=1).values
    assert torch.equal(got, want), "top-k differs from the stable sort"
    row = {
        "rows": logits.shape[0], "width": logits.shape[1], "k": k,
        "triton_us": graph_timed(lambda: d4.indexer_topk(logits, k), per_graph),
        "torch_topk_us": graph_timed(lambda: logits.topk(k, dim=1, sorted=False), per_graph),
    }
    rows, width = logits.shape
    out = torch.empty_like(got)
    run = lambda **kw: graph_timed(lambda: triton_indexer.launch_topk(logits, k, out, **kw), per_graph)  # noqa: E731
    # with --wide, every program that can take the rows, at its default geometry
    programs = (("registers",) * (width <= triton_indexer.TOPK_MAX_WIDTH)
                + ("split",) * (width > triton_indexer.TOPK_CHUNK) + ("looped",))
    row["programs"] = {p: run(program=p) for p in programs} if wide else {}
    if sweep:
        # the in-register program by warps; the looped one (here from 2048 columns) by chunk and
        # warps; by pieces of 2048 and 4096 columns (rows past TOPK_MAX_WIDTH)
        row["sweep"] = {w: run(num_warps=w, program="registers")
                        for w in (1, 2, 4, 8, 16)} if width <= triton_indexer.TOPK_MAX_WIDTH else {}
        row["looped"] = {f"{chunk}/{w}w": run(num_warps=w, chunk=chunk, program="looped")
                         for chunk, w in itertools.product((1024, 2048, 4096), (4, 8))} if width >= 2048 else {}
        row["split"] = {chunk: run(chunk=chunk, program="split")
                        for chunk in (2048, 4096)} if width > triton_indexer.TOPK_MAX_WIDTH else {}
    row["program"] = triton_indexer.topk_program(width, k)
    results.setdefault("topk", {})[name] = row
    print(f"top-k {name}: triton ({row['program']}) {row['triton_us']:.1f} us, torch.topk {row['torch_topk_us']:.1f} us, "
          f"programs {row['programs']}"
          + (f"; warps {row['sweep']}; looped (chunk/warps) {row['looped']}; pieces {row['split']}" if sweep else ""),
          flush=True)


def random_rows(paths: str) -> dict:
    """``{(rows, width): case}`` of the random top-k cases in the comma-separated JSON ``paths``."""
    found = {}
    for path in paths.split(","):
        with open(path) as f:
            for name, row in json.load(f).get("topk", {}).items():
                if name.startswith("random"):
                    found[row["rows"], row["width"]] = row
    return found


def plot(path: str, after: str, before: str | None = None) -> None:
    """The top-k's time against rows, a panel per width: the op, the op before (``before``), and
    ``torch.topk`` (random logits, k = 512; the JSON files of ``after`` / ``before``,
    comma-separated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    new, old = random_rows(after), random_rows(before) if before else {}
    widths = sorted({w for _, w in new})
    across = min(4, len(widths))
    down = -(-len(widths) // across)
    fig, axes = plt.subplots(down, across, figsize=(3.3 * across, 3.0 * down), squeeze=False)
    for ax in axes.flat[len(widths):]:
        ax.set_visible(False)
    for ax, width in zip(axes.flat, widths):
        lines = [("torch.topk", new, "torch_topk_us", "tab:gray"), ("triton before", old, "triton_us", "tab:cyan"),
                 ("triton", new, "triton_us", "tab:blue")]
        for label, cases, key, color in lines:
            rows = sorted(r for r, w in cases if w == width)
            if rows:
                ax.plot(rows, [cases[r, width][key] for r in rows], "o-", label=label, color=color)
        ax.set(xscale="log", yscale="log", title=f"{width} columns", xlabel="rows")
        ax.grid(True, which="both", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("us per call (CUDA graph)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("dsv4::indexer_topk, k = 512, random float32 logits", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        plot(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time every launch geometry")
    parser.add_argument("--topk-only", action="store_true", help="time only the top-k cases")
    parser.add_argument("--wide", action="store_true", help="time only the top-k of wide rows, by every program")
    parser.add_argument("--programs", action="store_true",
                        help="time only the logits cases, by programs per row (the rule's and others)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.programs:
        programs_sweep(args.json)
        return
    rate = copy_rate(torch.device("cuda"))
    compiled = torch.compile(gather_bmm, dynamic=False)
    results = {"copy_tb_s": rate / 1e12, "torch": torch.__version__, "cases": {}}
    print(f"copy rate {rate / 1e12:.2f} TB/s")
    if args.wide:
        shapes = [*itertools.product((1, 64, 1024, 8192), (8192,)),
                  *itertools.product((1, 16, 64, 128, 256, 512, 1024, 8192), (16384, 32768)),
                  *itertools.product((1, 64, 256, 1024), (131072,))]
    else:
        for name in ("decode-b1", "decode-b64", "prefill"):
            inputs = case(name)
            per_graph = 2 if name == "prefill" else 10
            ours = d4.indexer_logits(*inputs)
            if not args.topk_only:
                logits_case(name, inputs, ours, compiled, rate, args.sweep, per_graph, results)
            topk_case(f"{name} logits", ours, args.sweep, per_graph, results)
        shapes = [*itertools.product((1, 64, 1024, 8192), (1024, 2048, 4096, 8192)), (1, 32768), (64, 32768)]
    for rows, width in shapes:
        logits = torch.randn(rows, width, device="cuda")
        topk_case(f"random {rows}x{width}", logits, args.sweep, 2 if rows > 64 else 10, results, args.wide)
        del logits
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
