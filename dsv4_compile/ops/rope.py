"""RoPE of a tensor's last 64 dims, in place (docs/design.md §2.10): ``dsv4::rope_``."""

from __future__ import annotations

import torch

from .. import layout
from ..checks import F32, FLOAT_DTYPES, INDEX_DTYPES, Checker
from .registry import OpSpec, define

__all__ = ["rope_"]  # the public wrappers (re-exported by the package)

_ROPE = Checker("rope_")
_ROPE_TENSORS = ("x", "freqs", "positions")


def check_rope(x, freqs, positions, inverse=False) -> int:
    c = _ROPE
    c.same_device(_ROPE_TENSORS, x, freqs, positions)
    expected = f"bfloat16/float16/float32 [T, D] or [T, H, D] with D >= {layout.ROPE_DIM}"
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        c.fail("x", f"a tensor {expected}", x, TypeError)
    size = x.shape
    if x.dim() not in (2, 3) or size[-1] < layout.ROPE_DIM:
        c.fail("x", expected, x)
    rank = x.dim()
    if x.stride(-1) != 1:
        c.fail("x", "last-dim contiguous (stride(-1) == 1)", f"strides {tuple(x.stride())}")
    # written in place: no two rows may share memory (no stride-0 or overlapping leading dims)
    extent = size[-1]
    for stride, n in sorted((x.stride(d), size[d]) for d in range(rank - 1) if size[d] > 1):
        if stride < extent:
            c.fail("x", "rows that do not overlap (it is written in place)", f"strides {tuple(x.stride())}")
        extent = stride * n
    c.tensor("freqs", freqs, F32, (None, layout.ROPE_DIM))
    c.tensor("positions", positions, INDEX_DTYPES, (size[0],))
    if type(inverse) is not bool:
        c.fail("inverse", "a bool", inverse, TypeError)
    return size[0]


def check_rope_data(x, freqs, positions, inverse=False) -> None:
    if positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= freqs.shape[0]:
        _ROPE.fail("positions", f"within [0, {freqs.shape[0]}) (rows of freqs)", f"values in [{lo}, {hi}]")


_ROPE_OP = define(OpSpec(
    schema="rope_(Tensor(a!) x, Tensor freqs, Tensor positions, bool inverse=False) -> ()",
    check=check_rope,
    check_data=check_rope_data,
    float_inputs=("x", "freqs"),
))


def rope_(x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> None:
    """Rotate the last 64 dims of ``x`` in place by DSV4's interleaved RoPE: each pair
    ``(a, b) = (x[..., D-64+2i], x[..., D-64+2i+1])`` of token ``t`` becomes ``(a c - b s, a s + b c)``
    with ``(c, s) = (freqs[positions[t], 2i], freqs[positions[t], 2i+1])``; ``inverse`` rotates by
    the opposite angle (``s -> -s``), undoing the forward rotation. Float32 arithmetic, one rounding
    to ``x``'s dtype; the other dims are neither read nor written.

    Args:
        x: ``[T, D]`` or ``[T, H, D]`` bf16/fp16/fp32, ``D >= 64``, last dim contiguous, rows
            not overlapping (written in place).
        freqs: ``[max_pos, 64]`` float32 ``(cos_0, sin_0, cos_1, sin_1, ...)`` per position, the
            table ``fused_k_norm_rope_flashmla`` takes.
        positions: ``[T]`` int32/int64 in ``[0, max_pos)``.
        inverse: rotate by ``-angle`` (DSV4's output path undoes the keys' rotation).
    """
    _ROPE_OP.run(x, freqs, positions, inverse)
