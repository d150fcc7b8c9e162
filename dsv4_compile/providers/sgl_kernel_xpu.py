"""XPU kernels: the ``sgl_kernel_xpu`` provider, adapters over sgl-kernel-xpu's ``sgl_kernel``.

sgl-kernel-xpu exports ``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd`` and
``fused_k_norm_rope_flashmla`` at the top level of ``sgl_kernel``. Its conventions differ from the
``dsv4`` contract (docs/design.md §6); each adapter below turns a contract call into the call the library
accepts and its result back into what the op's fake promises:

* decode: no scheduler (``get_mla_metadata`` returns two empty tensors; metadata passed to the
  decode is ignored); the cache goes in as the 4-D ``float8_e4m3fn`` view with
  ``is_fp8_kvcache=True``; ``s_q > 1`` becomes ``B*s_q`` rows of ``s_q = 1`` (lengths repeated per
  row) and back to ``out [B, s_q, H, 512]``, ``lse [B, H, s_q]``;
* decode and prefill: heads padded with zeros to a multiple of 8 (``attn_sink`` too) and sliced
  back; contiguous inputs; nothing to attend (no rows or no index columns) answered here, since the
  library refuses such launches;
* store: ``out_loc`` as int32 with every negative slot mapped to -1; a ``page_size`` that is not a
  power of two, or a V4.1 cache, is not served here (the rules :data:`STORE_RULE` and
  :data:`DECODE_RULE`: the next provider serves the call, warned once).

Invalid indices need no translation: the library ignores slots ``< 0`` or ``>= capacity``, a
superset of the contract's ``-1`` holes, so every index the contract allows gives the reference's
result. Arguments are always passed by keyword. Nothing here reads tensor values on the host.

``sgl_kernel`` is imported by :func:`load`, on the first XPU call only; importing this module
imports no XPU library.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .. import dispatch, layout
from ..ops.decode import decode_outputs
from ..ops.prefill import prefill_outputs
from . import reference

NAME = "sgl_kernel_xpu"
DEVICE_TYPE = "xpu"
HEAD_GROUP = 8  # the XPU attention kernels process heads in groups of 8
STORE = "fused_k_norm_rope_flashmla"
INSTALL_HINT = (
    "build it from source (https://github.com/sgl-project/sgl-kernel-xpu: with the Intel GPU "
    "driver, oneAPI and torch for XPU installed, `source <oneapi>/setvars.sh; pip install -v .`; "
    "see docs/xpu.md)"
)
_EXPORTS = ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "fused_k_norm_rope_flashmla")


def load(device: torch.device) -> dict[str, Callable]:
    """Import ``sgl_kernel`` (sgl-kernel-xpu) and return the adapters bound to it for ``device``."""
    try:
        import sgl_kernel
    except ModuleNotFoundError as exc:
        if exc.name != "sgl_kernel":
            raise dispatch.ProviderUnavailable(f"sgl-kernel-xpu failed to import: {exc}") from exc
        raise dispatch.ProviderUnavailable(f"sgl-kernel-xpu is not installed: {INSTALL_HINT}") from exc
    except ImportError as exc:
        raise dispatch.ProviderUnavailable(f"sgl-kernel-xpu failed to import: {exc}") from exc
    missing = [name for name in _EXPORTS if not hasattr(sgl_kernel, name)]
    if missing:
        raise dispatch.ProviderUnavailable(
            f"the installed sgl_kernel has no top-level {', '.join(missing)}: it is not an "
            f"sgl-kernel-xpu build with the DSV4 kernels; {INSTALL_HINT}"
        )
    adapters = _Adapters(sgl_kernel, device)
    return {
        "fused_k_norm_rope_flashmla": adapters.fused_k_norm_rope_flashmla,
        "flash_mla_with_kvcache": adapters.flash_mla_with_kvcache,
        "flash_mla_sparse_fwd": adapters.flash_mla_sparse_fwd,
        "get_mla_metadata": reference.get_mla_metadata,  # no scheduler: two empty tensors
        "get_mla_metadata_stacked": reference.get_mla_metadata_stacked,
    }


#: sgl-kernel-xpu's store computes slot -> (page, offset) with shifts (a power-of-two page size),
#: and it reads and writes V4 caches only.
STORE_RULE = dispatch.Rule(
    "page_size a power of two and kv_format 'v4'",
    lambda device, call: layout.is_power_of_two(call.page_size) and call.kv_format is layout.V4,
)
DECODE_RULE = dispatch.Rule("kv_format 'v4'", lambda device, call: call.kv_format is layout.V4)


def register() -> None:
    """Register the provider for device type ``"xpu"`` (idempotent; imports nothing)."""
    dispatch.register_provider(dispatch.Provider(
        NAME, DEVICE_TYPE, load, rules={STORE: STORE_RULE, "flash_mla_with_kvcache": DECODE_RULE},
    ))


register()


# --------------------------------------------------------------------------------------------
# Shape helpers
# --------------------------------------------------------------------------------------------


def padded_heads(heads: int) -> int:
    """``heads`` rounded up to a multiple of :data:`HEAD_GROUP`."""
    return -(-heads // HEAD_GROUP) * HEAD_GROUP


def _pad_heads(t: torch.Tensor | None, padded: int, dim: int) -> torch.Tensor | None:
    """``t`` zero-padded along ``dim`` to ``padded`` entries, contiguous."""
    if t is None:
        return None
    extra = padded - t.shape[dim]
    if extra:
        t = F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, extra])
    return t.contiguous()


def _per_row(lengths: torch.Tensor | None, s_q: int) -> torch.Tensor | None:
    """Per-batch lengths ``[B]`` repeated for each of the ``s_q`` query rows: ``[B*s_q]``."""
    if lengths is None:
        return None
    return lengths[:, None].expand(-1, s_q).reshape(-1).contiguous()


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


# --------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------


class _Adapters:
    """The ``dsv4`` kernels for one XPU device, calling the ``sgl_kernel`` module ``lib``."""

    def __init__(self, lib, device: torch.device):
        self.lib = lib
        self.device = device

    def fused_k_norm_rope_flashmla(self, kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size,
                                   kv_format=layout.V4):
        if out_loc.dtype != torch.int32:
            out_loc = out_loc.clamp_min(-1).to(torch.int32)  # any negative slot is a skip: -1
        self.lib.fused_k_norm_rope_flashmla(
            kv=kv,  # rows may be strided; the last dim is contiguous (checked)
            kv_weight=kv_weight.contiguous(),
            freqs_cis=freqs.contiguous(),
            positions=positions.contiguous(),
            out_loc=out_loc.contiguous(),
            kvcache=kvcache,  # the uint8 base: its stride(0) is the page stride
            eps=eps,
            page_size=page_size,
        )


    def flash_mla_with_kvcache(
        self, q, k_cache, page_size, indices, topk_length, attn_sink,
        extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
        tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format=layout.V4, extra_kv_format=None,
        batch_invariant=False,  # never true here: the provider declares no batch-invariant kernel
    ):
        batch, s_q, heads = q.shape[:3]
        rows = batch * s_q
        width = indices.shape[-1] + (0 if extra_k_cache is None else extra_indices.shape[-1])
        if rows == 0 or width == 0:  # every row is empty: out = 0, lse = +inf
            out, lse = decode_outputs(q, head_dim_v)
            return out.zero_(), lse.fill_(math.inf)

        padded = padded_heads(heads)
        has_extra = extra_k_cache is not None
        out_rows, lse_rows = self.lib.flash_mla_with_kvcache(
            q=_pad_heads(q.reshape(rows, 1, heads, layout.HEAD_DIM), padded, dim=2),
            k_cache=layout.flashmla_view(k_cache, page_size),
            block_table=None,
            cache_seqlens=None,
            head_dim_v=head_dim_v,
            tile_scheduler_metadata=None,  # no scheduler on XPU: metadata passed to us is ignored
            num_splits=None,
            softmax_scale=softmax_scale,
            causal=False,
            is_fp8_kvcache=True,
            indices=indices.reshape(rows, 1, -1).contiguous(),
            attn_sink=_pad_heads(attn_sink, padded, dim=0),
            extra_k_cache=layout.flashmla_view(extra_k_cache, extra_page_size) if has_extra else None,
            extra_indices_in_kvcache=extra_indices.reshape(rows, 1, -1).contiguous() if has_extra else None,
            topk_length=_per_row(topk_length, s_q),
            extra_topk_length=_per_row(extra_topk_length, s_q) if has_extra else None,
        )  # out_rows [B*s_q, 1, padded, dv], lse_rows [B*s_q, padded, 1]: rows in (b, s) order
        out_all = out_rows.view(batch, s_q, padded, head_dim_v)
        lse_all = lse_rows.view(batch, s_q, padded).transpose(1, 2)  # [B, padded, s_q]
        if padded == heads:  # already the geometry of decode_outputs: no copy
            return out_all, lse_all
        out, lse = decode_outputs(q, head_dim_v)
        out.copy_(out_all[:, :, :heads])
        lse.copy_(lse_all[:, :heads])
        return out, lse

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, batch_invariant=False):
        s_q, heads = q.shape[:2]
        if s_q == 0 or indices.shape[-1] == 0 or kv.shape[0] == 0:  # nothing to attend
            out, max_logits, lse = prefill_outputs(q, d_v)
            return out.zero_(), max_logits.fill_(-math.inf), lse.fill_(math.inf)

        padded = padded_heads(heads)
        out_p, max_logits_p, lse_p = self.lib.flash_mla_sparse_fwd(
            q=_pad_heads(q, padded, dim=1),
            kv=kv.contiguous(),
            indices=indices.contiguous(),
            sm_scale=sm_scale,
            d_v=d_v,
            attn_sink=_pad_heads(attn_sink, padded, dim=0),
            topk_length=_contiguous(topk_length),
        )  # [s_q, padded, d_v], [s_q, padded], [s_q, padded]
        if padded == heads:
            return out_p, max_logits_p, lse_p
        out, max_logits, lse = prefill_outputs(q, d_v)
        out.copy_(out_p[:, :heads])
        max_logits.copy_(max_logits_p[:, :heads])
        lse.copy_(lse_p[:, :heads])
        return out, max_logits, lse
