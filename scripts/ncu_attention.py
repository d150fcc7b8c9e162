"""The attention kernels' launches to profile with Nsight Compute: for each T, the Triton decode by
default, the Triton decode in the batch-invariant mode and FlashMLA's decode (scheduler hoisted),
on ``benchmarks/common.decode_inputs``; then the prefill (s_q 4096, s_kv 8192, H 64, top-k 640),
Triton then FlashMLA. Only those calls run between ``cudaProfilerStart`` / ``Stop`` (each once,
after a warm-up), in that order, so that

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        --section ComputeWorkloadAnalysis -o attn python3 scripts/ncu_attention.py [--rows T ...]
    ncu --import attn.ncu-rep --csv --page raw > attn.csv

profiles exactly them; the launch order names each kernel's case, and

    python3 scripts/ncu_attention.py --table attn.csv [--rows T ...]

prints the table of benchmarks/RESULTS.md from that export (no GPU needed; ``--rows`` as profiled).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import dsv4_compile as d4  # noqa: E402
from bench_triton_attention import FLASHMLA_OPS, SCALE  # noqa: E402  (benchmarks/)
from common import DECODE_ROWS, DEV, decode_inputs  # noqa: E402  (benchmarks/common.py)


def labels(rows_list) -> list[str]:
    """The profiled cases, in launch order (:func:`cases` yields their calls in this order)."""
    names = [f"decode T={t} {who}" for t in rows_list for who in ("triton", "triton-invariant", "flashmla")]
    return names + ["prefill triton", "prefill flashmla"]


def cases(rows_list):
    """The call of each case of :func:`labels`, in launch order."""
    for rows in rows_list:
        q, cache, idx, lengths, sink, ecache, eidx, elen = decode_inputs(rows)
        args = (q, cache, 256, idx, lengths, sink, ecache, 64, eidx, elen)

        def triton(mode, args=args):
            with d4.use_provider("triton", ops=("flash_mla_with_kvcache",)):
                return d4.flash_mla_with_kvcache(*args, softmax_scale=SCALE, batch_invariant=mode)

        with d4.use_provider("flashmla", ops=FLASHMLA_OPS):
            meta = d4.get_mla_metadata(q, idx, lengths, eidx, elen)

        def flashmla(args=args, meta=meta):
            with d4.use_provider("flashmla", ops=FLASHMLA_OPS):
                return d4.flash_mla_with_kvcache(*args, *meta, softmax_scale=SCALE)

        yield lambda f=triton: f(False)
        yield lambda f=triton: f(True)
        yield flashmla
    q = torch.randn(4096, 64, 512, dtype=torch.bfloat16, device=DEV)
    kv = torch.randn(8192, 1, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(0, 8192, (4096, 1, 640), dtype=torch.int32, device=DEV)
    for provider in ("triton", "flashmla"):
        def prefill(provider=provider):
            with d4.use_provider(provider, ops=FLASHMLA_OPS if provider == "flashmla" else ("flash_mla_sparse_fwd",)):
                return d4.flash_mla_sparse_fwd(q, kv, idx, SCALE)
        yield prefill


#: Columns of the table: heading, ncu metric, scale.
COLUMNS = (
    ("µs", "gpu__time_duration.sum", 1e3), ("grid", "launch__grid_size", 1),
    ("registers", "launch__registers_per_thread", 1), ("dynamic smem KB", "launch__shared_mem_per_block_dynamic", 1),
    ("warps / SM", "sm__warps_active.avg.per_cycle_active", 1),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("tensor pipe %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", 1),
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1),
)
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def table(path: str, rows_list) -> str:
    """A markdown table of an ``ncu --csv --page raw`` export of this script's launches: each kernel
    named by its case (a Triton ``decode_kernel`` / ``prefill_kernel`` or a FlashMLA forward kernel
    starts the next case, a combine kernel belongs to the case before it)."""
    header, _units, *data = list(csv.reader(open(path)))
    at = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith(STALL[0]) and h.endswith(STALL[1])]
    names, case = iter(labels(rows_list)), None
    lines = ["| case | kernel | " + " | ".join(c[0] for c in COLUMNS) + " | top stalls (warps per issue) |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for row in data:
        kernel = row[at["Kernel Name"]]
        if "combine" not in kernel:
            case = next(names)
        values = []
        for _, metric, scale in COLUMNS:
            text = row[at[metric]].replace(",", "")
            values.append(f"{float(text) * scale:.3g}" if text else "")
        top = sorted(((float(row[at[h]] or 0), h[len(STALL[0]):-len(STALL[1])]) for h in stalls), reverse=True)[:3]
        lines.append(f"| {case} | {kernel.split('<')[0].replace('void ', '')[:28]} | " + " | ".join(values)
                     + " | " + ", ".join(f"{name} {v:.2f}" for v, name in top) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(DECODE_ROWS))
    parser.add_argument("--table", metavar="CSV", help="print the table of an ncu raw CSV export instead")
    args = parser.parse_args()
    if args.table:
        print(table(args.table, args.rows))
        return
    calls = list(zip(labels(args.rows), cases(args.rows), strict=True))
    for _, call in calls:  # compile and warm up
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, call in calls:
        print(f"case {label}", flush=True)
        call()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
