"""The decode scheduler on SM90: FlashMLA's, run by the library (a decode over a dummy cache,
``FlashMLAKernels.library_schedule``), against our Triton program (``providers/flashmla/schedule.py``).

    python benchmarks/bench_schedule.py [--json out.json]

Per batch size: H=64, one query row per request, a main index width of 512 and an extra one of
128 (a ratio-4 layer of the model), random lengths. Microseconds per call, medians: in a CUDA
graph of 10 calls (GPU time) and eager (host and GPU); and whether the two schedules are equal.
Also the model's step: the schedules of its three layer kinds (window only; window + 512 top-k
blocks; window + 32 blocks), three ``get_mla_metadata`` calls against one
``get_mla_metadata_stacked`` (one launch), in a CUDA graph.
"""

from __future__ import annotations

import argparse
import json

import torch

from common import graph_timed, timed
from dsv4_compile.providers.flashmla import adapter as flashmla

DEV = "cuda"


def case(batch: int) -> tuple:
    q = torch.randn(batch, 1, 64, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.zeros(batch, 1, 512, dtype=torch.int32, device=DEV)
    eidx = torch.zeros(batch, 1, 128, dtype=torch.int32, device=DEV)
    lengths = torch.randint(1, 513, (batch,), dtype=torch.int32, device=DEV)
    elen = torch.randint(1, 129, (batch,), dtype=torch.int32, device=DEV)
    return q, idx, lengths, eidx, elen


def step_kinds(batch: int) -> list[tuple]:
    """The ``get_mla_metadata`` arguments of the model's three layer kinds in a decode step."""
    q, window = torch.randn(batch, 1, 64, 512, dtype=torch.bfloat16, device=DEV), 128
    idx = torch.zeros(batch, 1, window, dtype=torch.int32, device=DEV)
    lengths = torch.randint(1, window + 1, (batch,), dtype=torch.int32, device=DEV)
    kinds = [(q, idx, lengths, None, None)]
    for width in (512, 32):
        extra = torch.zeros(batch, 1, width, dtype=torch.int32, device=DEV)
        kinds.append((q, idx, lengths, extra, torch.randint(0, width + 1, (batch,), dtype=torch.int32, device=DEV)))
    return kinds


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64,256,1024")
    parser.add_argument("--json")
    args = parser.parse_args()
    kernels = flashmla._load_flash_mla(torch.device(DEV, torch.cuda.current_device()))["get_mla_metadata"].__self__
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "own_schedule": kernels.own_schedule, "rows": []}
    for batch in map(int, args.batches.split(",")):
        inputs = case(batch)
        ours, library = (lambda: kernels.get_mla_metadata(*inputs)), (lambda: kernels.library_schedule(*inputs))
        kinds = step_kinds(batch)
        separate = lambda: [kernels.get_mla_metadata(*k) for k in kinds]  # noqa: E731
        stacked = lambda: kernels.get_mla_metadata_stacked(  # noqa: E731
            inputs[0], [k[1].shape[-1] for k in kinds], [k[2] for k in kinds],
            [0 if k[3] is None else k[3].shape[-1] for k in kinds], [k[4] for k in kinds])
        together = stacked()
        a, b = ours(), library()
        row = {
            "batch": batch,
            "equal": torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]),
            "graph_us_library": round(graph_timed(library), 2),
            "graph_us_ours": round(graph_timed(ours), 2),
            "eager_us_library": round(timed(library), 2),
            "eager_us_ours": round(timed(ours), 2),
            "kinds_equal": all(torch.equal(together[0][i], m) and torch.equal(together[1][i], n)
                               for i, (m, n) in enumerate(separate())),
            "kinds_graph_us_separate": round(graph_timed(separate), 2),
            "kinds_graph_us_stacked": round(graph_timed(stacked), 2),
        }
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
