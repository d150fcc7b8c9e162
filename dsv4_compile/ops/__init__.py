"""The ``dsv4`` operator contract: schemas, fake implementations, public wrappers.

This package is the one place to read what each op takes and returns (docs/design.md §2). Each op
is declared by one ``registry.define(OpSpec(...))``, which defines it in the ``dsv4`` namespace,
registers its fake (so ``torch.compile`` traces through it without a graph break) and one kernel
per dispatch key — ``CPU``, ``CUDA``, ``XPU``, plus ``CompositeExplicitAutograd`` for any other
device — each a trampoline into :mod:`dsv4_compile.dispatch`, which picks the provider. The ops are
inference-only: calling them with inputs that require grad is an error.
"""

from __future__ import annotations

import torch

from .. import checks, dispatch, layout
from .registry import SCHEMAS, OpSpec, define  # noqa: F401 (SCHEMAS: re-exported)
from .store import fused_k_norm_rope_flashmla, quantize_store  # noqa: F401 (defined first: dsv4.OPS order)
from .decode import flash_mla_with_kvcache, get_mla_metadata, get_mla_metadata_stacked  # noqa: F401
from .prefill import flash_mla_sparse_fwd  # noqa: F401
from .indexer import indexer_logits, indexer_topk  # noqa: F401

# --------------------------------------------------------------------------------------------
# Output geometry, shared by the fakes and the kernels: one definition of what each op returns.
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Fakes: the same metadata checks as the kernels, the same outputs' geometry.
# --------------------------------------------------------------------------------------------


def _rope_fake(x, freqs, positions, inverse=False):
    checks.check_rope(x, freqs, positions, inverse)


# --------------------------------------------------------------------------------------------
# The ops: schema, checks, fake, call signature (registry.define registers the rest).
# --------------------------------------------------------------------------------------------


_ROPE_OP = define(OpSpec(
    schema="rope_(Tensor(a!) x, Tensor freqs, Tensor positions, bool inverse=False) -> ()",
    fake=_rope_fake, check=checks.check_rope, check_data=checks.check_rope_data,
    float_inputs=("x", "freqs"),
))

dispatch.reset()  # read the environment: DSV4_COMPILE_PROVIDER may name any op defined above


# --------------------------------------------------------------------------------------------
# Public wrappers: keyword-friendly, upstream names, one call of the op each.
# --------------------------------------------------------------------------------------------


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
    return _ROPE_OP.run(x, freqs, positions, inverse)
