"""``dsv4::rope_`` in Triton (``triton``, CUDA and XPU): the RoPE of a tensor's last 64 dims, in place.

A *row* is one vector of ``x [T, D]`` or ``x [T, H, D]`` (token ``t``, head ``h``); a program
rotates :data:`ROWS` rows. It reads and writes only the rotated dims ``D - 64 .. D - 1`` of each
row (one contiguous tile of them, and the row's ``(cos, sin)`` pairs from ``freqs`` at its
token's position), so the cost follows ``T * H * 64`` elements, not the full width.

The arithmetic is the reference's (:func:`.reference.rope`): float32, ``a' = a c - b s``,
``b' = a s + b c`` (inverse: ``s -> -s``), each product and sum rounded on its own (the launch
turns off the compiler's multiply-add contraction), then one rounding to ``x``'s dtype, to
nearest even (bf16 in integer arithmetic: Triton's interpreter truncates). So a row's bits equal
the reference's. The kernel is plain ``@triton.jit`` in :mod:`.kernels.rope`, imported with Triton
on first use.
"""

from __future__ import annotations

import torch

from ... import dispatch, layout
from . import common as triton_common

NAME = "triton"
OP = "rope_"
#: Rows per program and warps: 16 rows x 64 dims, 8 dims per thread.
ROWS = 16
NUM_WARPS = 4

KERNELS_MODULE = f"{__package__}.kernels.rope"


def _kernels():
    """This provider's jitted kernels, :mod:`.kernels.rope` (imported with Triton on first use)."""
    return triton_common.kernels(KERNELS_MODULE)


def rope_(x, freqs, positions, inverse=False):
    """``dsv4::rope_`` on validated arguments: one launch, no host sync."""
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    if rows == 0:
        return
    x_stride, freqs_stride = x.stride(), freqs.stride()
    with triton_common.device_guard(x.device):
        triton_common.eager(_kernels().rope_kernel)[(-(-rows // ROWS),)](
            x, freqs, positions, rows, heads, x_stride[0], x_stride[1] if x.dim() == 3 else 0,
            freqs_stride[0], freqs_stride[1], positions.stride()[0], x.shape[-1] - layout.ROPE_DIM,
            INVERSE=inverse, BF16=x.dtype == torch.bfloat16, BLOCK_R=ROWS, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )


def load(device: torch.device) -> dict:
    """Provider loader: the kernel, or :class:`~dsv4_compile.dispatch.ProviderUnavailable` saying why."""
    triton_common.require_device(_kernels().rope_kernel, device, "rope")
    return {OP: rope_}


def register() -> None:
    """Register the ``triton`` entry of ``rope_`` for ``"cuda"`` and ``"xpu"`` (idempotent; imports nothing)."""
    for device_type in triton_common.DEVICE_TYPES:
        dispatch.register_provider(dispatch.Provider(NAME, device_type, load, ops=(OP,), fallback=True))


register()
