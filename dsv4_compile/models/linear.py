"""The model's GEMMs in the precisions DSV4 runs them: bf16 outputs, float32 outputs, or both at once.

A bf16 linear accumulates in float32 and rounds its output to bf16 once; the compressors'
projections keep the float32 accumulator (upstream computes them in float32). A product of two
bf16 values is exact in float32, so a bf16 GEMM that returns its float32 accumulator *is* the
float32 GEMM of the same values, up to summation order.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _fp32_out(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight^T`` runs as one bf16 GEMM with a float32 output here (CUDA only:
    ``mm(..., out_dtype=float32)`` has no CPU or XPU kernel)."""
    return x.is_cuda and x.dtype == weight.dtype == torch.bfloat16


def _mm_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in float32, as upstream computes the compressor's projection.

    For bf16 ``x`` and ``weight`` on CUDA: one bf16 tensor-core GEMM that accumulates in and
    returns float32 (``torch.mm(..., out_dtype=torch.float32)``), without converting the weight to
    float32 each step (which cost a 2x larger weight read, a write and a CUDA-core float32 GEMM).
    Elsewhere the float32 GEMM."""
    if _fp32_out(x, weight):
        return _mm_fp32(x, weight)
    return F.linear(x.float(), weight.float())


def linear_split(x: torch.Tensor, weight: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight^T`` for a weight that stacks two kinds of linear: rows ``[0, rows)`` give an
    output in ``x``'s dtype (``F.linear(x, weight[:rows])``), the other rows a float32 output
    (:func:`linear_fp32`). Returns ``(out [..., rows], out_fp32 [..., weight.shape[0] - rows])``.

    On CUDA (bf16): one GEMM with a float32 output whose first ``rows`` columns are then rounded to
    bf16: one weight read and one launch for both, the first part equal to the bf16 linear up to
    summation order. Elsewhere: the two GEMMs, each in its own precision."""
    if _fp32_out(x, weight):
        out = _mm_fp32(x, weight)
        return out[..., :rows].to(x.dtype), out[..., rows:]
    return F.linear(x, weight[:rows]), linear_fp32(x, weight[rows:])
