"""The attention kernels' launches to profile with Nsight Compute: for each T, the Triton decode by
default, the Triton decode in the batch-invariant mode and FlashMLA's decode (scheduler hoisted),
on ``benchmarks/common.decode_inputs``; then the prefill (s_q 4096, s_kv 8192, H 64, top-k 640),
Triton then FlashMLA. Only those calls run between ``cudaProfilerStart`` / ``Stop`` (each once,
after a warm-up), in that order, so that

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        --section ComputeWorkloadAnalysis -o attn python3 scripts/ncu_attention.py [--rows T ...]
    ncu --import attn.ncu-rep --csv --page raw > attn.csv

profiles exactly them; the launch order names each kernel's case (``--order`` prints it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import dsv4_compile as d4  # noqa: E402
from dsv4_compile import layout  # noqa: E402
from common import DEV, decode_inputs  # noqa: E402  (benchmarks/common.py)

SCALE = layout.HEAD_DIM**-0.5
FLASHMLA_OPS = ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata")


def cases(rows_list):
    """``(label, call)`` of each profiled call, in launch order."""
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

        yield f"decode T={rows} triton", lambda f=triton: f(False)
        yield f"decode T={rows} triton-invariant", lambda f=triton: f(True)
        yield f"decode T={rows} flashmla", flashmla
    q = torch.randn(4096, 64, 512, dtype=torch.bfloat16, device=DEV)
    kv = torch.randn(8192, 1, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(0, 8192, (4096, 1, 640), dtype=torch.int32, device=DEV)
    for provider in ("triton", "flashmla"):
        def prefill(provider=provider):
            with d4.use_provider(provider, ops=FLASHMLA_OPS if provider == "flashmla" else ("flash_mla_sparse_fwd",)):
                return d4.flash_mla_sparse_fwd(q, kv, idx, SCALE)
        yield f"prefill {provider}", prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    args = parser.parse_args()
    calls = list(cases(args.rows))
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
