"""The sparse prefill over a bf16 workspace (docs/design.md §2.4): ``dsv4::flash_mla_sparse_fwd``."""

from __future__ import annotations

import torch

from .. import invariance, layout
from ..checks import BF16, F32, I32, Checker
from .registry import OpSpec, define

__all__ = ["flash_mla_sparse_fwd"]  # the public wrappers (re-exported by the package)


def prefill_outputs(q: torch.Tensor, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``out [s_q, H, d_v]`` bf16, ``max_logits`` and ``lse [s_q, H]`` fp32, contiguous."""
    s_q, heads = q.shape[:2]
    out = q.new_empty(s_q, heads, d_v)
    max_logits = q.new_empty(s_q, heads, dtype=torch.float32)
    return out, max_logits, torch.empty_like(max_logits)


_PREFILL = Checker("flash_mla_sparse_fwd")
_PREFILL_TENSORS = ("q", "kv", "indices", "attn_sink", "topk_length")


def check_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, batch_invariant=False) -> tuple[int, int]:
    c = _PREFILL
    c.same_device(_PREFILL_TENSORS, q, kv, indices, attn_sink, topk_length)
    s_q, heads, d_qk = c.tensor("q", q, BF16, (None, None, None))
    if d_qk not in layout.PREFILL_QK_DIMS:
        c.fail("q", f"bfloat16 [s_q, H, d_qk] with d_qk in {layout.PREFILL_QK_DIMS}", q)
    c.tensor("kv", kv, BF16, (None, 1, d_qk))
    c.width("indices", indices, c.tensor("indices", indices, I32, (s_q, 1, None)))
    if attn_sink is not None:
        c.tensor("attn_sink", attn_sink, F32, (heads,))
    if topk_length is not None:
        c.tensor("topk_length", topk_length, I32, (s_q,))
    if d_v != layout.HEAD_DIM:
        c.fail("d_v", f"{layout.HEAD_DIM} (V is the key's first 512 dims)", d_v)
    if type(sm_scale) is not float:
        c.fail("sm_scale", "a float", sm_scale, TypeError)
    c.flag("batch_invariant", batch_invariant)
    return s_q, heads


def check_prefill_data(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, batch_invariant=False) -> None:
    _PREFILL.lengths_within("topk_length", topk_length, indices.shape[-1])


_PREFILL_OP = define(OpSpec(
    schema=(
        "flash_mla_sparse_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, "
        "Tensor? attn_sink=None, Tensor? topk_length=None, bool batch_invariant=False) "
        "-> (Tensor out, Tensor max_logits, Tensor lse)"
    ),
    check=check_prefill,
    check_data=check_prefill_data,
    outputs=prefill_outputs,
    float_inputs=("q", "kv", "attn_sink"),
))


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = layout.HEAD_DIM,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill over a bf16 workspace; returns ``(out, max_logits, lse)`` (natural log).

    Args:
        q: ``[s_q, H, 512]`` bf16 queries.
        kv: ``[s_kv, 1, 512]`` bf16 workspace (e.g. :func:`dsv4_compile.dequant_workspace`).
        indices: ``[s_q, 1, K]`` int32 rows of ``kv``; ``< 0`` or ``>= s_kv``: holes.
        sm_scale: the softmax scale.
        d_v: 512 (V is the full key).
        attn_sink: ``[H]`` float32 sink logits, or ``None``.
        topk_length: ``[s_q]`` int32 counted entries per query, or ``None``.
        batch_invariant: a query's outputs independent of the other queries, bit for bit
            (docs/design.md §3); ``None``: the switch (:func:`dsv4_compile.batch_invariant`).
    """
    return _PREFILL_OP.run(q, kv, indices, float(sm_scale), d_v, attn_sink, topk_length,
                           invariance.resolve(batch_invariant))
