"""The ``dsv4`` operator contract: schemas, fake implementations, registration, public wrappers.

This file is the one place to read what each op takes and returns (docs/design.md §2). Importing it
defines the ops in the ``dsv4`` namespace, registers their fakes (so ``torch.compile`` traces
through them without a graph break), and registers one kernel per dispatch key — ``CPU``,
``CUDA``, ``XPU``, plus ``CompositeExplicitAutograd`` for any other device — each a trampoline into
:mod:`dsv4_compile.dispatch`, which picks the provider. The ops are inference-only: calling them
with inputs that require grad is an error.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import checks, dispatch, layout

NAMESPACE = "dsv4"

SCHEMAS = {
    "fused_k_norm_rope_flashmla": (
        "fused_k_norm_rope_flashmla(Tensor kv, Tensor kv_weight, Tensor freqs, Tensor positions, "
        "Tensor out_loc, Tensor(a!) kvcache, float eps, int page_size) -> ()"
    ),
    "flash_mla_with_kvcache": (
        "flash_mla_with_kvcache(Tensor q, Tensor k_cache, int page_size, Tensor indices, "
        "Tensor? topk_length, Tensor? attn_sink, Tensor? extra_k_cache, int extra_page_size, "
        "Tensor? extra_indices, Tensor? extra_topk_length, Tensor? tile_scheduler_metadata, "
        "Tensor? num_splits, float softmax_scale, int head_dim_v) -> (Tensor out, Tensor lse)"
    ),
    "flash_mla_sparse_fwd": (
        "flash_mla_sparse_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, "
        "Tensor? attn_sink=None, Tensor? topk_length=None) "
        "-> (Tensor out, Tensor max_logits, Tensor lse)"
    ),
    "get_mla_metadata": (
        "get_mla_metadata(Tensor q, Tensor indices, Tensor? topk_length, Tensor? extra_indices, "
        "Tensor? extra_topk_length) -> (Tensor tile_scheduler_metadata, Tensor num_splits)"
    ),
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)


# --------------------------------------------------------------------------------------------
# Output geometry, shared by the fakes and the kernels: one definition of what each op returns.
# --------------------------------------------------------------------------------------------


def decode_outputs(q: torch.Tensor, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``out [B, s_q, H, head_dim_v]`` bf16 (contiguous) and ``lse [B, H, s_q]`` fp32.

    ``lse`` is stored row-major as ``[B, s_q, H]`` and returned transposed (strides
    ``(s_q*H, 1, H)``), as FlashMLA allocates it; so one query row's statistics are contiguous and
    ``s_q = 1`` rows of an MTP batch map onto it without a copy.
    """
    batch, s_q, heads = q.shape[:3]
    out = q.new_empty(batch, s_q, heads, head_dim_v)
    lse = q.new_empty(batch, s_q, heads, dtype=torch.float32).transpose(1, 2)
    return out, lse


def prefill_outputs(q: torch.Tensor, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``out [s_q, H, d_v]`` bf16, ``max_logits`` and ``lse [s_q, H]`` fp32, contiguous."""
    s_q, heads = q.shape[:2]
    out = q.new_empty(s_q, heads, d_v)
    max_logits = q.new_empty(s_q, heads, dtype=torch.float32)
    return out, max_logits, torch.empty_like(max_logits)


def metadata_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(tile_scheduler_metadata, num_splits)`` int32 of the shapes ``get_mla_metadata``
    returns on ``q.device``, whichever provider serves it (``dispatch.metadata_shapes``: FlashMLA's
    scheduler geometry on CUDA, ``(0,)`` each elsewhere)."""
    batch, s_q, heads = q.shape[:3]
    meta_shape, splits_shape = dispatch.metadata_shapes(q.device, batch, s_q, heads)
    return (
        q.new_empty(meta_shape, dtype=torch.int32),
        q.new_empty(splits_shape, dtype=torch.int32),
    )


# --------------------------------------------------------------------------------------------
# Fakes: the same metadata checks as the kernels, the same outputs' geometry.
# --------------------------------------------------------------------------------------------


@torch.library.register_fake(f"{NAMESPACE}::fused_k_norm_rope_flashmla", lib=_lib)
def _store_fake(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size):
    checks.check_store(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size)


@torch.library.register_fake(f"{NAMESPACE}::flash_mla_with_kvcache", lib=_lib)
def _decode_fake(
    q, k_cache, page_size, indices, topk_length, attn_sink,
    extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v,
):
    checks.check_decode(
        q, k_cache, page_size, indices, topk_length, attn_sink,
        extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
        tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v,
    )
    return decode_outputs(q, head_dim_v)


@torch.library.register_fake(f"{NAMESPACE}::flash_mla_sparse_fwd", lib=_lib)
def _prefill_fake(q, kv, indices, sm_scale, d_v=layout.HEAD_DIM, attn_sink=None, topk_length=None):
    checks.check_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    return prefill_outputs(q, d_v)


@torch.library.register_fake(f"{NAMESPACE}::get_mla_metadata", lib=_lib)
def _metadata_fake(q, indices, topk_length, extra_indices, extra_topk_length):
    checks.check_metadata(q, indices, topk_length, extra_indices, extra_topk_length)
    return metadata_outputs(q)


# --------------------------------------------------------------------------------------------
# Kernels: one trampoline per dispatch key (dispatch.backend_kernel); inference-only.
# --------------------------------------------------------------------------------------------


def _schema_defaults(op_name: str) -> tuple:
    schema = getattr(getattr(torch.ops, NAMESPACE), op_name).default._schema
    return tuple(a.default_value if a.has_default_value() else None for a in schema.arguments)


#: Each op's checks: metadata (every call, fakes too) and data (checked mode; providers that need them).
CHECKS = {
    "fused_k_norm_rope_flashmla": (checks.check_store, checks.check_store_data),
    "flash_mla_with_kvcache": (checks.check_decode, checks.check_decode_data),
    "flash_mla_sparse_fwd": (checks.check_prefill, checks.check_prefill_data),
    "get_mla_metadata": (checks.check_metadata, checks.check_metadata_data),
}


class StoreCall(NamedTuple):
    """What a provider's rule may look at in a store call."""

    page_size: int
    page_stride: int


class DecodeCall(NamedTuple):
    """What a provider's rule may look at in a decode call (``extra_*``: 0 without an extra cache)."""

    page_size: int
    page_stride: int
    extra_page_size: int
    extra_page_stride: int


class NoCall(NamedTuple):
    """Ops whose providers have no per-call rule."""


#: Each op's call signature: ``(type, key(args))``, ``args`` in schema order. ``key`` is a plain
#: tuple of the properties of a call that provider rules (``dispatch.Rule``) may depend on;
#: resolutions are cached per key, and rules see it as ``type(*key)``.
CALLS = {
    "fused_k_norm_rope_flashmla": (StoreCall, lambda a: (a[7], a[5].stride(0))),
    "flash_mla_with_kvcache": (
        DecodeCall,
        lambda a: (a[2], a[1].stride(0), 0, 0) if a[6] is None else (a[2], a[1].stride(0), a[7], a[6].stride(0)),
    ),
    "flash_mla_sparse_fwd": (NoCall, lambda a: ()),
    "get_mla_metadata": (NoCall, lambda a: ()),
}

#: The inputs of each op that could require grad (floating point), as ``(position, name)``.
GRAD_ARGS = {
    op: tuple(
        (i, a.name) for i, a in enumerate(getattr(getattr(torch.ops, NAMESPACE), op).default._schema.arguments)
        if a.name in ("kv", "kv_weight", "freqs", "q", "attn_sink")
    )
    for op in SCHEMAS
}

#: Per op, the kernel the dispatcher reaches for tensors of any device type; the Python wrappers
#: below call it directly in plain eager use (``dispatch.direct_call_allowed``): same checks, same
#: provider, without the dispatcher's round trip.
DIRECT = {}

for _op in SCHEMAS:
    _parts = (_schema_defaults(_op), *CHECKS[_op], CALLS[_op], GRAD_ARGS[_op])
    for _key in ("CPU", "CUDA", "XPU"):
        _lib.impl(_op, dispatch.backend_kernel(_op, _key.lower(), *_parts), _key)
    DIRECT[_op] = dispatch.backend_kernel(_op, None, *_parts)
    _lib.impl(_op, DIRECT[_op], "CompositeExplicitAutograd")
    # No backward: autograd falls through to the kernel above, which rejects inputs requiring grad.
    _lib.impl(_op, torch.library.fallthrough_kernel, "Autograd")

_direct_call_allowed = dispatch.direct_call_allowed


# --------------------------------------------------------------------------------------------
# Public wrappers: keyword-friendly, upstream names, one call of the op each.
# --------------------------------------------------------------------------------------------


def fused_k_norm_rope_flashmla(
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    eps: float,
    page_size: int,
) -> None:
    """RMSNorm ``kv`` (weight ``kv_weight``), RoPE its dims 448..511, quantize, store at ``out_loc``.

    ``freqs`` is the real ``float32 [max_pos, 64]`` table ``(cos_0, sin_0, cos_1, ...)`` or the
    complex ``freqs_cis [max_pos, 32]``. ``out_loc`` slots below 0 are skipped. ``kvcache`` is the
    uint8 base cache (:func:`dsv4_compile.alloc_cache`), written in place.
    """
    if isinstance(freqs, torch.Tensor) and freqs.is_complex():
        freqs = torch.view_as_real(freqs).flatten(-2).float()
    args = (kv, kv_weight, freqs, positions, out_loc, kvcache, float(eps), page_size)
    if _direct_call_allowed(kv, kv_weight, freqs, positions, out_loc, kvcache):
        return DIRECT["fused_k_norm_rope_flashmla"](*args)
    torch.ops.dsv4.fused_k_norm_rope_flashmla.default(*args)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_size: int,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_page_size: int = 1,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    tile_scheduler_metadata: torch.Tensor | None = None,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    head_dim_v: int = layout.HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode over paged V4 FP8 caches; returns ``out [B, s_q, H, 512]`` and ``lse [B, H, s_q]``.

    ``softmax_scale`` defaults to ``512 ** -0.5``. Scheduler metadata comes from
    :func:`get_mla_metadata` (or ``None``: computed inside the call).
    """
    if softmax_scale is None:
        softmax_scale = layout.HEAD_DIM**-0.5
    args = (
        q, k_cache, page_size, indices, topk_length, attn_sink,
        extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
        tile_scheduler_metadata, num_splits, float(softmax_scale), head_dim_v,
    )
    if _direct_call_allowed(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                            extra_topk_length, tile_scheduler_metadata, num_splits):
        return DIRECT["flash_mla_with_kvcache"](*args)
    return torch.ops.dsv4.flash_mla_with_kvcache.default(*args)


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = layout.HEAD_DIM,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill over a bf16 workspace; returns ``(out, max_logits, lse)`` (natural log)."""
    args = (q, kv, indices, float(sm_scale), d_v, attn_sink, topk_length)
    if _direct_call_allowed(q, kv, indices, attn_sink, topk_length):
        return DIRECT["flash_mla_sparse_fwd"](*args)
    return torch.ops.dsv4.flash_mla_sparse_fwd.default(*args)


def get_mla_metadata(
    q: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode scheduler metadata ``(tile_scheduler_metadata, num_splits)`` for one step.

    Depends on the shapes *and the length values*: compute it once per step, after the lengths
    are final, and share it between the layers of that step. Empty on devices without a scheduler.
    """
    args = (q, indices, topk_length, extra_indices, extra_topk_length)
    if _direct_call_allowed(*args):
        return DIRECT["get_mla_metadata"](*args)
    return torch.ops.dsv4.get_mla_metadata.default(*args)
