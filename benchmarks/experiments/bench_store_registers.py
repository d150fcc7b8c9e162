"""The V4 cache store under a per-thread register cap (Triton's ``maxnreg`` launch option).

    PYTHONPATH=. python benchmarks/experiments/bench_store_registers.py [--tokens 1024 16384 65536] [--json out.json]

The store is bound by latency with few warps per SM (benchmarks/history/RESULTS-notebook.md: 127
registers per thread at the default 4-token, 1-warp geometry, 25% occupancy). This sweep launches
the kernel directly (as ``bench_store.py`` does) at a few geometries (``BLOCK_T`` tokens x warps per
program), each uncapped and capped at ``maxnreg`` registers, and times it two ways: CUDA-graph
replays of 10 calls (``common.graph_timed``) and ``do_bench`` with L2 flushed. Each configuration
runs twice, in the order A B C D D C B A, so a drift over the run shows as a difference between its
two rows. Shares are of a device-to-device copy of the same traffic, timed the same way.

Only a measurement: the package launches the store without ``maxnreg`` (``torch.compile``'s wrapper
of a user Triton kernel passes ``num_warps`` but not ``maxnreg``, so a cap would hold in eager calls
only). ``scripts/store_instructions.py --sass --maxnreg N`` shows what a cap does to the code
offline (registers, spills, instructions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import dsv4_compile as d4
from dsv4_compile.providers.triton import store as triton_store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: the modules imported below
import bench_store  # noqa: E402
from common import graph_timed  # noqa: E402

#: (tokens per program, warps per program, maxnreg or None)
CONFIGS = [(4, 1, None), (2, 1, None), (2, 1, 80), (2, 1, 64)]


class Capped:
    """``kernel[grid](...)`` with ``maxnreg`` added to the launch (nothing added for ``None``)."""

    def __init__(self, kernel, maxnreg: int | None):
        self.kernel, self.maxnreg = kernel, maxnreg

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        if self.maxnreg is None:
            return launch
        return lambda *args, **kwargs: launch(*args, **kwargs, maxnreg=self.maxnreg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384, 65536])
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_store_registers.py needs a CUDA device")
    triton_store.register()
    assert d4.providers("cuda")[triton_store.OP] == triton_store.NAME
    rows = []
    for num_tokens in opts.tokens:
        traffic = num_tokens * bench_store.traffic_per_token()
        src = torch.empty(traffic // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_graph_us = graph_timed(lambda: dst.copy_(src))
        copy_bench_us = bench_store.median_ms(lambda: dst.copy_(src)) * 1e3
        for scattered in (False, True):
            args = bench_store.inputs(num_tokens, scattered)
            for run, (block_t, warps, maxnreg) in enumerate(CONFIGS + CONFIGS[::-1]):
                with bench_store.geometry(block_t, warps):
                    store = lambda: triton_store._launch(lambda k: Capped(k, maxnreg), *args, "v4", True)
                    graph_us = graph_timed(store)
                    bench_us = bench_store.median_ms(store) * 1e3
                row = dict(tokens=num_tokens, slots="scattered" if scattered else "contiguous",
                           block_t=block_t, warps=warps, maxnreg=maxnreg, run=run // len(CONFIGS),
                           graph_us=round(graph_us, 2), graph_share=round(copy_graph_us / graph_us, 3),
                           bench_us=round(bench_us, 2), bench_share=round(copy_bench_us / bench_us, 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
