"""Stand-ins for FlashMLA's registered ops, for testing the CUDA adapters on CPU.

They follow the real ops' schemas (``flash_mla_legacy::sparse_decode_fwd`` etc., as registered by
sgl-flash-mla 1.0.0 and sglang-kernel's ``sgl_kernel`` namespace) and their input checks
(``H in {64, 128}``, index widths multiple of 64 / 128, the 4-D fp8 cache view with
``stride(1) == 584``; rank, dtype and shape of every tensor, as the ``flashmla`` provider relies
on: ``providers.flashmla.adapter.FLASHMLA_VALIDATES``), compute with the reference
kernels, and model the scheduler: metadata is a function of the length *values*, and stale
metadata gives wrong output (NaN here), as on the real GPU.
"""

from __future__ import annotations

import math
import sys
import types

import torch

from dsv4_compile.providers import reference

NUM_SMS = 132  # an H200
CALLS: list[tuple[str, dict]] = []


def _base_bytes(view: torch.Tensor) -> torch.Tensor:
    """The uint8 ``[num_pages, page_stride]`` cache a ``[NP, P, 1, 584]`` fp8 view was made from."""
    stride = view.stride(0)
    return torch.as_strided(view.view(torch.uint8), (view.shape[0], stride), (stride, 1))


def _check_view(name, kv):
    assert kv.dim() == 4 and kv.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8), (name, kv.dtype)
    assert kv.shape[2] == 1 and kv.shape[3] == 584 and kv.stride(1) == 584 and kv.stride(3) == 1, name


def _check_optional(name, t, dtype, shape):
    """The real ops' checks of an optional tensor: dtype and shape (``None``: any), contiguous."""
    if t is not None:
        assert t.dtype == dtype and (shape is None or t.shape == shape) and t.is_contiguous(), name


def _schedule(batch, s_q, heads, topk, extra_topk, lengths, extra_lengths):
    parts = max(NUM_SMS // s_q // (heads // 64), 1)
    n = lengths if lengths is not None else torch.full((batch,), topk, dtype=torch.int32)
    if extra_lengths is not None:
        n = n + extra_lengths
    elif extra_topk:
        n = n + extra_topk
    blocks = (n + 63) // 64
    meta = torch.zeros(parts, 8, dtype=torch.int32)
    meta[:, 0] = int(blocks.sum())
    meta[:, 1] = torch.arange(parts, dtype=torch.int32)
    splits = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(blocks, 0).to(torch.int32)])
    return meta, splits


def sparse_decode_fwd(q, kv, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits,
                      extra_kv, extra_indices, extra_topk_length, d_v, sm_scale, kv_format=None):
    CALLS.append(("decode", dict(q=q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                                 meta=tile_scheduler_metadata, extra_kv=extra_kv, extra_indices=extra_indices)))
    assert q.dim() == 4 and indices.dim() == 3, "q must have 4 dimensions, indices 3"
    batch, s_q, heads, d_qk = q.shape
    assert batch > 0 and s_q > 0, "FlashMLA refuses empty launches"
    assert q.dtype == torch.bfloat16 and d_qk == 512 and d_v == 512
    assert heads in (64, 128), f"Unsupported h_q: {heads}"
    _check_view("kv", kv)
    assert indices.dtype == torch.int32 and indices.shape[:2] == (batch, s_q)
    assert indices.shape[-1] % 64 == 0, "params.topk % TOPK_BLOCK_SIZE == 0"
    _check_optional("topk_length", topk_length, torch.int32, (batch,))
    _check_optional("attn_sink", attn_sink, torch.float32, (heads,))
    _check_optional("tile_scheduler_metadata", tile_scheduler_metadata, torch.int32, None)
    _check_optional("num_splits", num_splits, torch.int32, None)
    assert (extra_kv is None) == (extra_indices is None)
    assert extra_kv is not None or extra_topk_length is None
    if extra_kv is not None:
        _check_view("extra_kv", extra_kv)
        assert extra_indices.dim() == 3 and extra_indices.shape[:2] == (batch, s_q)
        assert extra_indices.shape[-1] % 64 == 0 and extra_indices.dtype == torch.int32
        _check_optional("extra_topk_length", extra_topk_length, torch.int32, (batch,))
    extra_topk = 0 if extra_indices is None else extra_indices.shape[-1]
    fresh = _schedule(batch, s_q, heads, indices.shape[-1], extra_topk, topk_length, extra_topk_length)
    if tile_scheduler_metadata is None:
        tile_scheduler_metadata, num_splits = fresh
    else:
        assert tile_scheduler_metadata.shape == fresh[0].shape and num_splits.shape == fresh[1].shape
    out, lse = reference.flash_mla_with_kvcache(
        q, _base_bytes(kv), kv.shape[1], indices, topk_length, attn_sink,
        None if extra_kv is None else _base_bytes(extra_kv), 1 if extra_kv is None else extra_kv.shape[1],
        extra_indices, extra_topk_length, None, None, sm_scale, d_v,
    )
    if not (torch.equal(tile_scheduler_metadata, fresh[0]) and torch.equal(num_splits, fresh[1])):
        out = torch.full_like(out, math.nan)  # a stale schedule: wrong output, silently
    return out, lse, tile_scheduler_metadata, num_splits


#: FlashMLA's current kernels (torch.ops.flash_mla, SM100): the V4.1 format of a cache from its
#: bytes per token (interleaved arrangement).
V41_FORMATS = {528: "v4.1-fp8-interleaved", 288: "v4.1-fp4-interleaved"}


def _check_v41_view(name, kv):
    assert kv.dim() == 4 and kv.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8), (name, kv.dtype)
    bpt = kv.shape[3]
    assert bpt in V41_FORMATS, f"Unsupported bytes_per_token for d_qk=512: {bpt}. Expected 528 (V4.1) or 288"
    assert kv.shape[2] == 1 and kv.stride(1) == bpt and kv.stride(3) == 1, "The whole block must be contiguous"
    assert kv.stride(0) % bpt == 0, f"{name}.stride(0) must be a multiple of {bpt}"


def current_sparse_decode_fwd(q, kv, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits,
                              extra_kv, extra_indices, extra_topk_length, d_v, sm_scale,
                              enable_batch_invariant=False):
    """``flash_mla::sparse_decode_fwd``: V4.1 interleaved caches, FP4 only as the extra cache."""
    CALLS.append(("decode_v41", dict(q=q, kv=kv, indices=indices, meta=tile_scheduler_metadata,
                                     extra_kv=extra_kv, extra_indices=extra_indices,
                                     enable_batch_invariant=enable_batch_invariant)))
    batch, s_q, heads, d_qk = q.shape
    assert batch > 0 and s_q > 0 and q.dtype == torch.bfloat16 and d_qk == 512 and d_v == 512
    assert heads in (64, 128), f"Unsupported h_q: {heads}"
    _check_v41_view("kv", kv)
    assert kv.shape[3] == 528, "The fp4 KV cache is only supported as extra_kv"
    assert indices.dtype == torch.int32 and indices.shape[-1] % 64 == 0
    if extra_kv is not None:
        _check_v41_view("extra_kv", extra_kv)
        assert extra_indices.shape[-1] % 64 == 0
    out, lse = reference.flash_mla_with_kvcache(
        q, _base_bytes(kv), kv.shape[1], indices, topk_length, attn_sink,
        None if extra_kv is None else _base_bytes(extra_kv), 1 if extra_kv is None else extra_kv.shape[1],
        extra_indices, extra_topk_length, None, None, sm_scale, d_v,
        V41_FORMATS[kv.shape[3]], None if extra_kv is None else V41_FORMATS[extra_kv.shape[3]],
    )
    return out, lse, tile_scheduler_metadata, num_splits


def _prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    CALLS.append(("prefill", dict(q=q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)))
    assert q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3, "q, kv and indices must have 3 dimensions"
    s_q, heads, d_qk = q.shape
    assert s_q > 0 and kv.shape[0] > 0, "FlashMLA refuses empty launches"
    assert q.dtype == kv.dtype == torch.bfloat16 and d_qk in (512, 576) and kv.shape[-1] == d_qk and d_v == 512
    assert heads in (64, 128), f"Unsupported h_q: {heads}"
    assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, kv.shape[1])
    _check_optional("attn_sink", attn_sink, torch.float32, (heads,))
    _check_optional("topk_length", topk_length, torch.int32, (s_q,))
    assert indices.shape[-1] % 128 == 0, "topk % (2*B_TOPK) == 0"
    return reference.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


def legacy_sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None,
                              return_log2_stats=False, return_stats=True):
    out, max_logits, lse = _prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if return_log2_stats:
        max_logits, lse = max_logits * math.log2(math.e), lse * math.log2(math.e)
    return [out, max_logits, lse] if return_stats else [out, None, None]


def sgl_sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None):
    out, max_logits, lse = _prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    return [out, max_logits * math.log2(math.e), lse * math.log2(math.e)]  # base 2


DECODE_SCHEMA = (
    "sparse_decode_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
    "Tensor? tile_scheduler_metadata, Tensor? num_splits, Tensor? extra_kv, Tensor? extra_indices, "
    "Tensor? extra_topk_length, int d_v, float sm_scale, str? kv_format=None) -> (Tensor, Tensor, Tensor?, Tensor?)"
)
_libs = {}


CURRENT_DECODE_SCHEMA = (
    "sparse_decode_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
    "Tensor? tile_scheduler_metadata, Tensor? num_splits, Tensor? extra_kv, Tensor? extra_indices, "
    "Tensor? extra_topk_length, int d_v, float sm_scale, bool enable_batch_invariant=False) "
    "-> (Tensor, Tensor, Tensor?, Tensor?)"
)


def define(namespace: str) -> None:
    """Register the stand-in ops under ``torch.ops.<namespace>`` (once per process)."""
    if namespace in _libs:
        return
    lib = torch.library.Library(namespace, "DEF")
    if namespace == "flash_mla":  # the current kernels: decode only here
        lib.define(CURRENT_DECODE_SCHEMA)
        lib.impl("sparse_decode_fwd", current_sparse_decode_fwd, "CompositeExplicitAutograd")
        _libs[namespace] = lib
        return
    lib.define(DECODE_SCHEMA)
    lib.impl("sparse_decode_fwd", sparse_decode_fwd, "CompositeExplicitAutograd")
    if namespace == "sgl_kernel":
        lib.define("sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, "
                   "Tensor? attn_sink=None, Tensor? topk_length=None) -> Tensor?[]")
        lib.impl("sparse_prefill_fwd", sgl_sparse_prefill_fwd, "CompositeExplicitAutograd")
    else:
        lib.define("sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, "
                   "Tensor? attn_sink=None, Tensor? topk_length=None, bool return_log2_stats=False, "
                   "bool return_stats=True) -> Tensor?[]")
        lib.impl("sparse_prefill_fwd", legacy_sparse_prefill_fwd, "CompositeExplicitAutograd")
    _libs[namespace] = lib


def install(monkeypatch, provider: str) -> None:
    """Make ``import flash_mla`` (provider ``flashmla``) or ``import sgl_kernel.flash_mla``
    (provider ``sgl_kernel``) succeed with these stand-ins, and hide the other one."""
    if provider == "flashmla":
        define("flash_mla_legacy")
        define("flash_mla")
        module = types.ModuleType("flash_mla")
        module.has_legacy = lambda: True
        monkeypatch.setitem(sys.modules, "flash_mla", module)
        monkeypatch.setitem(sys.modules, "sgl_kernel.flash_mla", None)  # import raises
    else:
        define("sgl_kernel")
        package = types.ModuleType("sgl_kernel")
        package.__path__ = []
        sub = types.ModuleType("sgl_kernel.flash_mla")
        package.flash_mla = sub
        monkeypatch.setitem(sys.modules, "sgl_kernel", package)
        monkeypatch.setitem(sys.modules, "sgl_kernel.flash_mla", sub)
        monkeypatch.setitem(sys.modules, "flash_mla", None)
