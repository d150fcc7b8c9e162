"""RMSNorm, in float32: ``y = x * rsqrt(mean(x^2) + eps) * w`` over the last dim."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Float32 RMSNorm of ``x`` over its last dim; ``weight=None`` is the unweighted norm."""
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight; returns the input's dtype."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps).to(x.dtype)
