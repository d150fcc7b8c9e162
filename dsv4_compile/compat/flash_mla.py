"""FlashMLA's Python interface over the ``dsv4`` ops, on every device.

``from dsv4_compile.compat import flash_mla`` replaces ``import flash_mla`` (sgl-flash-mla) or
``from sgl_kernel import flash_mla`` (sglang-kernel): ``get_mla_metadata``,
``flash_mla_with_kvcache`` and ``flash_mla_sparse_fwd`` keep their names, keyword signatures and
return conventions, and run wherever a ``dsv4`` provider does (FlashMLA itself on SM90/SM100, our
Triton kernels on other GPUs and XPU, the reference on CPU).

Upstream's arguments:

* accepted: ``q``, ``k_cache`` and ``extra_k_cache`` as FlashMLA's 4-D views
  ``[num_pages, P, 1, token_bytes]`` (turned into the base cache without a copy:
  ``layout.cache_from_view``; rejected with a message when they cannot be), ``head_dim_v`` (512),
  ``indices``, ``attn_sink``, ``extra_indices_in_kvcache``, ``topk_length``,
  ``extra_topk_length``, ``softmax_scale`` (default ``d_qk ** -0.5``), ``use_legacy`` and
  ``kv_format`` (they name the cache format: 584-byte tokens are V4; 528 / 288-byte tokens are
  V4.1 FP8 / FP4, block-split with ``use_legacy=True`` as the legacy kernels read them,
  interleaved otherwise as the current kernels do);
* ``tile_scheduler_metadata``: a :class:`FlashMLASchedMeta` (from :func:`get_mla_metadata`, or
  FlashMLA's own), filled on first use and reused while the shapes match, as upstream documents (a
  call with other shapes is an error; reused after ``topk_length`` / ``extra_topk_length`` values
  changed it gives wrong outputs, as upstream's does: ``dsv4_compile.checked()`` detects it);
  ``None`` (computed inside); or the tensors of ``dsv4_compile.get_mla_metadata`` with
  ``num_splits``;
* checked as upstream documents: ``num_splits`` (``None`` with a scheduler object), ``causal``
  (``False``), ``is_fp8_kvcache`` (``None`` or ``True``: the DSV4 caches are quantized);
* ignored, as upstream ignores them: ``block_table``, ``cache_seqlens``;
* ``enable_batch_invariant=True``: the ``dsv4`` batch-invariant mode for this call (a row's
  outputs independent of the batch, docs/design.md §3; FlashMLA's own flag on the current kernels,
  our Triton decode elsewhere); ``False`` (the default): the process-wide switch
  (``dsv4_compile.batch_invariant()``) decides, as for every ``dsv4`` wrapper;
* rejected: dense decoding (``indices=None``), ``descale_q`` / ``descale_k`` (dense FP8 only), the
  V3.2 ``kv_format`` values.

Under ``torch.compile(fullgraph=True)`` these functions trace into the ``dsv4`` ops; a scheduler
object must have been filled before tracing (or pass ``None``, or the metadata tensors): filling it
is a side effect the graph cannot hold, and is refused with a message saying so.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from .. import invariance, layout, ops

LOG2E = math.log2(math.e)
#: upstream's ``kv_format`` values that name a DSV4 cache (the legacy kernels' spelling), by the
#: bytes per token of the cache they name
_KV_FORMATS = {"V4": layout.TOKEN_BYTES, "V41": layout.V41_FP8.token_bytes, "V41_FP4": layout.V41_FP4.token_bytes}


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's tile-scheduler object: empty from :func:`get_mla_metadata`, filled by the first
    :func:`flash_mla_with_kvcache` call that gets it, reused by later calls of the same shapes."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]
        enable_batch_invariant: bool

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None  # int32 [num_sm_parts, 8] on CUDA
    num_splits: Optional[torch.Tensor] = None  # int32 [batch + 1] on CUDA


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """An empty :class:`FlashMLASchedMeta` (arguments ignored, as upstream's), and ``None``."""
    return FlashMLASchedMeta(), None


def cache_format(token_bytes: int, use_legacy: bool, kv_format: str | None, arg: str) -> str:
    """The ``dsv4`` cache format of a view of ``token_bytes`` per token (see the module docstring)."""
    if kv_format is not None and _KV_FORMATS.get(kv_format) != token_bytes:
        raise ValueError(
            f"kv_format must be None or name the {token_bytes}-byte tokens of {arg} ({_KV_FORMATS}), "
            f"got {kv_format!r}"
        )
    family = layout.VIEW_TOKEN_BYTES[token_bytes]
    if family == "v4":
        return "v4"
    return family if use_legacy else f"{family}-interleaved"


def resolve_schedule(
    tile_scheduler_metadata, num_splits, q, indices, topk_length, extra_indices, extra_topk_length, config,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``(tile_scheduler_metadata, num_splits)`` tensors for the decode op from what an
    upstream caller passes: ``None``; the metadata tensors; or a scheduler object, filled on first
    use (``config``: a :class:`FlashMLASchedMeta.Config` of this call) and checked against the
    shapes it was filled for."""
    if tile_scheduler_metadata is None or isinstance(tile_scheduler_metadata, torch.Tensor):
        if (tile_scheduler_metadata is None) != (num_splits is None):
            raise ValueError("num_splits must be None, or a tensor with tile_scheduler_metadata's tensor")
        return tile_scheduler_metadata, num_splits
    sched = tile_scheduler_metadata
    if not all(hasattr(sched, a) for a in ("have_initialized", "config", "tile_scheduler_metadata", "num_splits")):
        raise TypeError(
            "tile_scheduler_metadata must be a FlashMLASchedMeta (get_mla_metadata), the metadata tensors "
            f"of dsv4_compile.get_mla_metadata, or None, got {type(sched).__name__}"
        )
    if num_splits is not None:
        raise ValueError("num_splits must be None with a FlashMLASchedMeta (the splits live in it)")
    if not sched.have_initialized:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "a FlashMLASchedMeta is filled by its first call, a side effect torch.compile cannot "
                "trace: fill it with one eager call before compiling, or pass tile_scheduler_metadata="
                "None (computed inside the call) or the tensors of dsv4_compile.get_mla_metadata(...)"
            )
        sched.tile_scheduler_metadata, sched.num_splits = ops.get_mla_metadata(
            q, indices, topk_length, extra_indices, extra_topk_length
        )
        sched.config, sched.have_initialized = config, True
    elif sched.config != config:
        changed = [f.name for f in dataclasses.fields(config) if getattr(sched.config, f.name) != getattr(config, f.name)]
        raise ValueError(
            f"tile_scheduler_metadata was filled for other shapes ({', '.join(changed)} differ: "
            f"{ {n: getattr(sched.config, n) for n in changed} } then, { {n: getattr(config, n) for n in changed} } now); "
            "use one FlashMLASchedMeta per shape"
        )
    return sched.tile_scheduler_metadata, sched.num_splits


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata,
    num_splits=None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: Optional[bool] = None,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    enable_batch_invariant: bool = False,
    use_legacy: bool = False,
    kv_format: Optional[str] = None,
    descale_q: Optional[torch.Tensor] = None,
    descale_k: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode, FlashMLA's signature: ``(out [B, s_q, H, 512], lse [B, H, s_q])``, natural
    log, sink excluded (docs/design.md §2.3; the module docstring lists what is accepted)."""
    if indices is None:
        raise ValueError("indices must be given: dense MLA decoding is not a DSV4 op (sparse decode only)")
    if causal:
        raise ValueError("causal must be False: sparse decoding has no causal mask")
    if is_fp8_kvcache is False:
        raise ValueError("is_fp8_kvcache must be None or True: the DSV4 caches are quantized")
    if descale_q is not None or descale_k is not None:
        raise ValueError("descale_q/descale_k must be None (they apply to dense FP8 decoding only)")
    return sparse_decode(
        q, k_cache, extra_k_cache, indices, extra_indices_in_kvcache, topk_length,
        extra_topk_length if extra_k_cache is not None else None, attn_sink, tile_scheduler_metadata,
        num_splits, softmax_scale, head_dim_v, use_legacy=use_legacy, kv_format=kv_format,
        batch_invariant=True if enable_batch_invariant else None,
    )


def sparse_decode(
    q, k_cache, extra_k_cache, indices, extra_indices, topk_length, extra_topk_length, attn_sink,
    tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, *, use_legacy: bool,
    kv_format: Optional[str] = None, out_of_range_holes: bool = False, batch_invariant: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The decode both interfaces share, once their own arguments are checked: cache views to base
    caches, formats named, the schedule resolved, ``dsv4::flash_mla_with_kvcache`` called.
    ``out_of_range_holes``: indices outside ``[0, capacity)`` become ``-1`` (sgl-kernel-xpu's
    convention; one elementwise op, no sync). ``batch_invariant``: the op's argument (``None``: the
    switch)."""
    cache, page_size, token = layout.cache_from_view(k_cache, "k_cache")
    if out_of_range_holes:
        indices = holes(indices, layout.capacity(cache, page_size))
    extra = dict(extra_k_cache=None, extra_page_size=1, extra_kv_format=None)
    if extra_k_cache is not None:
        extra_cache, extra_page_size, extra_token = layout.cache_from_view(extra_k_cache, "extra_k_cache")
        extra = dict(extra_k_cache=extra_cache, extra_page_size=extra_page_size,
                     extra_kv_format=cache_format(extra_token, use_legacy, None, "extra_k_cache"))
        if out_of_range_holes:
            extra_indices = holes(extra_indices, layout.capacity(extra_cache, extra_page_size))
    config = FlashMLASchedMeta.Config(
        b=q.shape[0], s_q=q.shape[1], h_q=q.shape[2], page_block_size=page_size, h_k=1,
        causal=False, is_fp8_kvcache=True, topk=indices.shape[-1],
        extra_page_block_size=extra["extra_page_size"] if extra_k_cache is not None else None,
        extra_topk=None if extra_indices is None else extra_indices.shape[-1],
        enable_batch_invariant=invariance.resolve(batch_invariant),
    )
    meta, splits = resolve_schedule(
        tile_scheduler_metadata, num_splits, q, indices, topk_length, extra_indices,
        extra_topk_length if extra_indices is not None else None, config,
    )
    return ops.flash_mla_with_kvcache(
        q, cache, page_size, indices, topk_length, attn_sink,
        extra_indices=extra_indices, extra_topk_length=extra_topk_length,
        tile_scheduler_metadata=meta, num_splits=splits,
        softmax_scale=q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale,
        head_dim_v=head_dim_v, kv_format=cache_format(token, use_legacy, kv_format, "k_cache"),
        batch_invariant=batch_invariant, **extra,
    )


def holes(indices: torch.Tensor, capacity: int) -> torch.Tensor:
    """Indices outside ``[0, capacity)`` as ``-1`` holes."""
    return torch.where((indices >= 0) & (indices < capacity), indices, -1)


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    use_legacy: bool = False,
    return_log2_lse: Optional[bool] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Sparse prefill, FlashMLA's signature: ``(out, max_logits, lse)``; ``d_qk`` 512 or 576.

    ``return_log2_lse``: ``None`` both statistics in natural log; ``False`` ``None`` for both;
    ``True`` (with ``use_legacy=True``, as upstream) both in base 2.
    """
    if return_log2_lse is True and not use_legacy:
        raise ValueError("return_log2_lse=True needs use_legacy=True (the current kernels return natural log only)")
    out, max_logits, lse = ops.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if return_log2_lse is False:
        return out, None, None
    if return_log2_lse:
        return out, max_logits * LOG2E, lse * LOG2E
    return out, max_logits, lse
