"""Does the Triton prefill get faster when the softmax weights reach the second dot through memory? (SM90)

Triton gives a dot whose result feeds another dot all its warps along M; the prefill's M is the 64
heads, so with 8 warps both warpgroups compute every score and softmax value (HGMMA 68 a 64-key
block where 36 would do, ``scripts/kernel_sass.py prefill``). Here ``P`` and the rescale factor go
through the program's own output rows (``P`` in each row's first 128 columns, two slots by key
block parity; the factor in ``lse`` / ``max_logits``; all written with the outputs at the end),
so no dot follows the scores and their warps split the keys. The store and the load need a CTA
barrier, and with a barrier in the loop Triton 3.6 does not software-pipeline it: the next block's
keys are no longer gathered during this one. The kernel source is rewritten from
``providers/triton/kernels/attention.py`` into a temporary module.

Reported: the prefill as is and the variant (s_q 4096, s_kv 8192, 64 heads, top-k 640, a sink),
CUDA-graph medians (``common.graph_timed``), TFLOP/s = 4 s_q H top-k 512 / t, and their largest output differences.

    python benchmarks/experiments/bench_prefill_p_through_memory.py
"""

from __future__ import annotations

import importlib
import pathlib
import sys
import tempfile

import torch

from dsv4_compile.providers.triton import attention as ta

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # benchmarks/: the module imported below
from common import graph_timed  # noqa: E402

LOOP = """        p, alpha, m, l = _online_softmax(scores, valid, m, l, scale_log2)
        acc = tl.dot(p, k, acc * alpha[:, None])
    lse2, inv_l = _lse2_and_inverse(m, l)
    at = s * heads + h"""
THROUGH_MEMORY = """        p, alpha, m, l = _online_softmax(scores, valid, m, l, scale_log2)
        odd = (j0 // BLOCK_N) & 1
        sp = out_ptr + (s * heads + h[:, None]) * _D + tl.arange(0, BLOCK_N)[None, :] + odd * BLOCK_N
        ap = tl.where(odd == 1, max_logits_ptr, lse_ptr) + s * heads + h
        tl.store(sp, p, mask=h_mask[:, None])
        tl.store(ap, alpha, mask=h_mask)
        tl.debug_barrier()
        p = tl.load(sp, mask=h_mask[:, None], other=0.0)
        alpha = tl.load(ap, mask=h_mask, other=0.0)
        acc = tl.dot(p, k, acc * alpha[:, None])
    tl.debug_barrier()  # the last block's loads before the outputs overwrite them
    lse2, inv_l = _lse2_and_inverse(m, l)
    at = s * heads + h"""


def variant_kernels(directory: str):
    """The kernels module with the prefill's loop rewritten, imported from ``directory``."""
    source = (pathlib.Path(ta.__file__).parent / "kernels" / "attention.py").read_text()
    assert LOOP in source, "the prefill's loop changed: update this experiment"
    source = source.replace(LOOP, THROUGH_MEMORY).replace("from .... import layout", "from dsv4_compile import layout")
    (pathlib.Path(directory) / "prefill_p_through_memory.py").write_text(source)
    sys.path.insert(0, directory)
    return importlib.import_module("prefill_p_through_memory")


def main() -> None:
    torch.manual_seed(0)
    s_q, s_kv, topk, heads = 4096, 8192, 640, 64
    q = torch.randn(s_q, heads, 512, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(s_kv, 1, 512, dtype=torch.bfloat16, device="cuda")
    idx = torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32, device="cuda")
    sink = torch.randn(heads, device="cuda")

    def call():
        return ta.flash_mla_sparse_fwd(q, kv, idx, 512**-0.5, 512, sink, None)

    flops = 4 * s_q * heads * topk * 512
    before, before_us = call(), graph_timed(call, per_graph=2)
    original = ta._kernels
    with tempfile.TemporaryDirectory() as directory:
        variant = variant_kernels(directory)
        ta._kernels = lambda: variant
        try:
            after, after_us = call(), graph_timed(call, per_graph=2)
        finally:
            ta._kernels = original
    print(f"prefill as is {before_us:.1f} us ({flops / before_us / 1e6:.0f} TFLOP/s); "
          f"P through memory {after_us:.1f} us ({flops / after_us / 1e6:.0f} TFLOP/s)")
    print("largest differences: out", (before[0].float() - after[0].float()).abs().max().item(),
          "lse", (before[2] - after[2]).abs().max().item(), "max_logits", (before[1] - after[1]).abs().max().item())


if __name__ == "__main__":
    main()
