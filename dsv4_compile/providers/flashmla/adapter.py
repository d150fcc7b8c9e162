"""CUDA sparse decode / prefill / scheduler through FlashMLA's registered ops.

Two providers, tried in this order:

* ``sgl_kernel`` — ``torch.ops.sgl_kernel.*`` from sgl-kernel / sglang-kernel
  (``import sgl_kernel.flash_mla`` loads them); cubins for SM90 and SM100; V4 caches.
* ``flashmla`` — from sgl-flash-mla (``import flash_mla``): its *legacy* kernels
  (``torch.ops.flash_mla_legacy``, SM90 and SM100) read the V4 584-byte layout; its current kernels
  (``torch.ops.flash_mla``, SM100 only) read the V4.1 interleaved caches (528-byte FP8 main, FP8 or
  288-byte FP4 extra; the format told by the view's last dim).

What each serves is a declared rule (:data:`FLASHMLA_DECODE`, :data:`SGL_KERNEL_DECODE`); other
calls go to the next provider. We call the ops directly — our op *is* the wrapper, with no
scheduler object and no per-call Python asserts. The adapters absorb every restriction of those
kernels (docs/design.md §2.3, §6):

* heads: padded with zero queries to 64 or 128 (more than 128: groups of 128), outputs sliced;
* index widths: padded with ``-1`` to a multiple of 64 (decode) / 128 (prefill);
* the cache: the 4-D ``float8_e4m3fn [num_pages, P, 1, token_bytes]`` view is built from the base
  uint8 tensor (once per cache tensor), page stride kept;
* statistics: always natural log, always three prefill outputs;
* scheduler metadata: plain tensors (see :meth:`FlashMLAKernels.get_mla_metadata`; on SM90
  computed by our Triton program, :mod:`.schedule`), or computed inside the call (always
  for V4.1 caches: the metadata op schedules for the V4 kernels).

Everything is sized from shapes: no host sync, capture-safe, unless checked mode is on.
"""

from __future__ import annotations

import functools
import importlib
import math
import weakref

import torch
import torch.nn.functional as F

from ... import checks, dispatch, layout
from ...ops.decode import check_decode, decode_outputs, metadata_outputs
from ...ops.prefill import check_prefill, prefill_outputs
from . import schedule as flashmla_schedule

DECODE_TOPK_MULTIPLE = 64
PREFILL_TOPK_MULTIPLE = 128  # SM90 needs 128 (SM100: 64); 128 serves both
MAX_GROUP_HEADS = 128
_DUMMY_PAGE = 64  # tokens of the scheduler-only calls' one-page cache (library_schedule)
LN2 = math.log(2.0)


def padded_heads(heads: int) -> int:
    """Heads per kernel call: 64 or 128 (groups of 128 beyond that)."""
    return 64 if heads <= 64 else MAX_GROUP_HEADS


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _pad_width(indices: torch.Tensor, width: int, multiple: int) -> torch.Tensor:
    """``indices`` (``width`` columns) padded with ``-1`` holes to a width that is a positive
    multiple of ``multiple``."""
    if width % multiple == 0 and width:
        return indices
    return F.pad(indices, (0, _round_up(width, multiple) - width), value=-1)


def _padded_widths(width: int, extra_width: int | None) -> tuple[int, int]:
    """The index widths the decode runs with: padded to multiples of 64 (a width of 0 to one
    block); the extra one 0 without an extra cache (``None``). Its scheduler counts in them."""
    extra = 0 if extra_width is None else _round_up(extra_width, DECODE_TOPK_MULTIPLE)
    return _round_up(width, DECODE_TOPK_MULTIPLE), extra


def _decode_widths(indices: torch.Tensor, extra_indices: torch.Tensor | None) -> tuple[int, int]:
    """:func:`_padded_widths` of a decode's indices and extra indices (``None``: none)."""
    return _padded_widths(indices.shape[-1], None if extra_indices is None else extra_indices.shape[-1])


def _head_groups(heads: int):
    """``(start, stop, padded)`` per kernel call."""
    padded = padded_heads(heads)
    for start in range(0, heads, padded):
        yield start, min(start + padded, heads), padded


def _pad_heads(t: torch.Tensor, dim: int, start: int, stop: int, padded: int) -> torch.Tensor:
    """Heads ``start:stop`` of ``t`` along ``dim``, zero-padded to ``padded``."""
    part = t.narrow(dim, start, stop - start)
    if stop - start == padded:
        return part
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, padded - (stop - start)]
    return F.pad(part, pad)


class FlashMLAKernels:
    """The dsv4 kernels over one FlashMLA op namespace (``torch.ops.sgl_kernel`` or
    ``torch.ops.flash_mla_legacy``). ``prefill_log2``: the namespace's prefill returns base-2
    statistics (sgl_kernel) rather than natural-log ones (legacy, ``return_log2_stats=False``).
    ``validates``: the ops the provider declares as checking their own calls
    (``dispatch.Provider.validates``, :data:`FLASHMLA_VALIDATES`): the trampoline has not run the
    metadata checks for them, so these kernels run them wherever FlashMLA would not see a
    malformed call; for the other ops the trampoline has run them. ``own_schedule``: compute the
    scheduler metadata with :mod:`.schedule` (the library's schedule, bit for bit, where
    that was checked: SM90's legacy kernels) instead of asking the library."""

    def __init__(self, name: str, namespace, device: torch.device, prefill_log2: bool,
                 prefill_has_stats_flags: bool, v41_namespace=None, validates: tuple[str, ...] = (),
                 own_schedule: bool = False):
        self.name = name  # the provider's
        self.own_schedule = own_schedule
        self.decode_validates = "flash_mla_with_kvcache" in validates
        self.prefill_validates = "flash_mla_sparse_fwd" in validates
        self.prefill_log2 = prefill_log2
        self.prefill_has_stats_flags = prefill_has_stats_flags
        self.device = device
        self.decode_op = namespace.sparse_decode_fwd.default
        self.prefill_op = namespace.sparse_prefill_fwd.default
        # FlashMLA's current kernels (torch.ops.flash_mla, SM100): V4.1 interleaved caches
        self.v41_decode_op = None if v41_namespace is None else v41_namespace.sparse_decode_fwd.default

    # ---- decode ----

    def _raw_decode(self, q, kv, idx, lengths, sink, meta, splits, extra_kv, extra_idx, extra_lengths, scale):
        return self.decode_op(
            q, kv, idx, lengths, sink, meta, splits, extra_kv, extra_idx, extra_lengths,
            layout.HEAD_DIM, scale,
        )

    def get_mla_metadata(self, q, indices, topk_length, extra_indices, extra_topk_length):
        """The exact scheduler FlashMLA's decode computes for these shapes and length values: from
        :mod:`.schedule` where it computes the library's (``own_schedule``: SM90's
        legacy kernels), else from the library itself (:meth:`library_schedule`)."""
        batch, s_q, heads = q.shape[:3]
        meta_shape, splits_shape = metadata_shapes(q.device, batch, s_q, heads)
        if batch == 0 or s_q == 0:  # FlashMLA refuses empty launches; the decode will not launch
            return (q.new_zeros(meta_shape, dtype=torch.int32), q.new_zeros(splits_shape, dtype=torch.int32))
        width, extra_width = _decode_widths(indices, extra_indices)
        if not self.own_schedule:
            return self._library_schedule(q, topk_length, extra_topk_length, width, extra_width)
        return flashmla_schedule.schedule(
            topk_length, extra_topk_length, width, extra_width, meta_shape, batch, q.device)

    def get_mla_metadata_stacked(self, q, topk, topk_length, extra_topk, extra_topk_length):
        """:meth:`get_mla_metadata` for each entry, stacked; on SM90 (``own_schedule``) all of
        them from one launch (:func:`.schedule.schedules`)."""
        batch, s_q, heads = q.shape[:3]
        meta_shape, _ = metadata_shapes(q.device, batch, s_q, heads)
        if batch == 0 or s_q == 0 or not topk:  # FlashMLA refuses empty launches; the decode will not launch
            return tuple(t.zero_() for t in metadata_outputs(q, len(topk)))
        widths = [_padded_widths(w, e or None) for w, e in zip(topk, extra_topk)]  # extra width 0: none
        if not self.own_schedule:
            found = [self._library_schedule(q, lengths, extra_lengths, width, extra_width)
                     for (width, extra_width), lengths, extra_lengths in zip(widths, topk_length, extra_topk_length)]
            return torch.stack([m for m, _ in found]), torch.stack([n for _, n in found])
        problems = [(lengths, extra_lengths, width, extra_width)
                    for (width, extra_width), lengths, extra_lengths in zip(widths, topk_length, extra_topk_length)]
        return flashmla_schedule.schedules(problems, meta_shape, batch, q.device)

    def library_schedule(self, q, indices, topk_length, extra_indices, extra_topk_length):
        """FlashMLA's scheduler, run by the library (``batch, s_q >= 1``). It has no standalone op
        for the sparse-decode scheduler, so run its decode once with every index a hole over a
        one-page dummy cache: it schedules from ``topk_length`` / ``extra_topk_length`` and the
        widths only, reads no key, and returns the fresh metadata."""
        return self._library_schedule(q, topk_length, extra_topk_length, *_decode_widths(indices, extra_indices))

    def _library_schedule(self, q, topk_length, extra_topk_length, width: int, extra_width: int):
        """:meth:`library_schedule` for :func:`_padded_widths` (``extra_width`` 0: no extra cache)."""
        batch, s_q, heads = q.shape[:3]
        padded = padded_heads(heads)
        qp = _pad_heads(q, 2, 0, min(heads, padded), padded)
        # a zeroed one-page V4 cache, allocated per call: a cached one, allocated by the first
        # call, would live in the CUDA-graph pool if that call ran in a warm-up
        dummy = layout.flashmla_view(layout.alloc_cache(1, _DUMMY_PAGE, q.device), _DUMMY_PAGE)
        holes = torch.full((batch, s_q, width), -1, dtype=torch.int32, device=q.device)
        extra_kv = extra_holes = None
        if extra_width:
            extra_kv = dummy
            extra_holes = torch.full((batch, s_q, extra_width), -1, dtype=torch.int32, device=q.device)
        _, _, meta, splits = self._raw_decode(
            qp, dummy, holes, topk_length, None, None, None, extra_kv, extra_holes, extra_topk_length, 1.0,
        )
        # column 7 is the scheduler record's padding, never written: zero it so that the metadata
        # is a deterministic function of the inputs (opcheck, reproducible runs)
        meta[:, 7:].zero_()
        return meta, splits

    def flash_mla_with_kvcache(
        self, q, k_cache, page_size, indices, topk_length, attn_sink,
        extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
        tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format=layout.V4, extra_kv_format=None,
        batch_invariant=False,
    ):
        """``batch_invariant`` (routed here only for V4.1 interleaved caches on SM100:
        :data:`FLASHMLA_DECODE_INVARIANT`): the current kernels' ``enable_batch_invariant``, which
        turns their split-KV path off; they schedule inside, ignoring the metadata passed."""
        batch, s_q, heads, _ = q.shape
        width = indices.shape[-1]
        extra_width = 0 if extra_indices is None else extra_indices.shape[-1]
        kv = _cached_view(k_cache, page_size, kv_format)
        extra_kv = None if extra_k_cache is None else _cached_view(
            extra_k_cache, extra_page_size, extra_kv_format or kv_format)
        if self.decode_validates and not (
            # what FlashMLA's decode does not check itself (FLASHMLA_VALIDATES), or a path that does not
            # reach it: then the metadata checks run here
            batch and s_q and (heads == 64 or heads == 128) and kv_format is layout.V4
            and kv is not None and (extra_k_cache is None) == (extra_kv is None)
            and (extra_kv_format is None or (extra_kv_format is layout.V4 and extra_k_cache is not None))
            and width <= checks.MAX_INDEX_WIDTH and extra_width <= checks.MAX_INDEX_WIDTH
            and head_dim_v == layout.HEAD_DIM and type(softmax_scale) is float
            and (tile_scheduler_metadata is None) == (num_splits is None)
            and _one_device(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                            extra_topk_length, tile_scheduler_metadata, num_splits)
        ):
            check_decode(
                q, k_cache, page_size, indices, topk_length, attn_sink,
                extra_k_cache, extra_page_size, extra_indices, extra_topk_length,
                tile_scheduler_metadata, num_splits, softmax_scale, head_dim_v, kv_format, extra_kv_format,
                batch_invariant,
            )
        if kv is None:
            kv = _view(k_cache, page_size, kv_format)
        if extra_k_cache is not None and extra_kv is None:
            extra_kv = _view(extra_k_cache, extra_page_size, extra_kv_format or kv_format)
        if batch == 0 or s_q == 0:  # FlashMLA refuses empty launches; there is nothing to compute
            return decode_outputs(q, head_dim_v)
        decode_op = self.decode_op
        if kv_format is not layout.V4:  # V4.1 interleaved (the rule): the current kernels
            decode_op = self.v41_decode_op
            if decode_op is None:
                raise dispatch.ProviderUnavailable(
                    f"{self.name}: this FlashMLA build has no current (V4.1) kernels (torch.ops.flash_mla)"
                )
            # get_mla_metadata schedules for the V4 kernels: the V4.1 ones schedule inside
            tile_scheduler_metadata = num_splits = None
        if tile_scheduler_metadata is not None:
            if tile_scheduler_metadata.numel() == 0:  # from a device without a scheduler: compute inside
                tile_scheduler_metadata = num_splits = None
            elif checks.checked_mode():
                _check_fresh(self, q, indices, topk_length, extra_indices, extra_topk_length,
                             tile_scheduler_metadata, num_splits)
        idx = _pad_width(indices, width, DECODE_TOPK_MULTIPLE)
        extra_idx = None if extra_k_cache is None else _pad_width(extra_indices, extra_width, DECODE_TOPK_MULTIPLE)
        flag = (True,) if batch_invariant else ()  # only the current kernels take it

        if heads == 64 or heads == 128:  # no padding: the kernel's outputs are ours
            out, lse, _, _ = decode_op(
                q, kv, idx, topk_length, attn_sink, tile_scheduler_metadata, num_splits,
                extra_kv, extra_idx, extra_topk_length, layout.HEAD_DIM, softmax_scale, *flag,
            )
            return out, lse
        out, lse = decode_outputs(q, head_dim_v)
        for start, stop, padded in _head_groups(heads):
            qg = _pad_heads(q, 2, start, stop, padded)
            sink = None if attn_sink is None else _pad_heads(attn_sink, 0, start, stop, padded)
            o, l, _, _ = decode_op(
                qg, kv, idx, topk_length, sink, tile_scheduler_metadata, num_splits,
                extra_kv, extra_idx, extra_topk_length, layout.HEAD_DIM, softmax_scale, *flag,
            )
            out[:, :, start:stop] = o[:, :, : stop - start]
            lse[:, start:stop] = l[:, : stop - start]
        return out, lse

    # ---- prefill ----

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, batch_invariant=False):
        s_q, heads, _ = q.shape
        s_kv = kv.shape[0]
        _, kv_heads, width = indices.shape
        if self.prefill_validates and not (
            # what FlashMLA's prefill does not check itself (FLASHMLA_VALIDATES), or a path that does
            # not reach it: then the metadata checks run here
            s_q and s_kv and (heads == 64 or heads == 128) and kv_heads == 1
            and width <= checks.MAX_INDEX_WIDTH and d_v == layout.HEAD_DIM and type(sm_scale) is float
            and _one_device(q, kv, indices, attn_sink, topk_length)
        ):
            check_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
        if s_q == 0 or s_kv == 0:  # nothing to attend; FlashMLA refuses empty launches
            out, max_logits, lse = prefill_outputs(q, d_v)
            return out.zero_(), max_logits.fill_(-math.inf), lse.fill_(math.inf)
        idx = _pad_width(indices, width, PREFILL_TOPK_MULTIPLE)
        if heads == 64 or heads == 128:  # no padding: the kernel's outputs are ours
            return self._raw_prefill(q, kv, idx, sm_scale, attn_sink, topk_length)
        out, max_logits, lse = prefill_outputs(q, d_v)
        for start, stop, padded in _head_groups(heads):
            qg = _pad_heads(q, 1, start, stop, padded)
            sink = None if attn_sink is None else _pad_heads(attn_sink, 0, start, stop, padded)
            o, m, l = self._raw_prefill(qg, kv, idx, sm_scale, sink, topk_length)
            out[:, start:stop] = o[:, : stop - start]
            max_logits[:, start:stop] = m[:, : stop - start]
            lse[:, start:stop] = l[:, : stop - start]
        return out, max_logits, lse

    def _raw_prefill(self, q, kv, idx, sm_scale, sink, topk_length):
        if self.prefill_has_stats_flags:  # legacy: natural-log statistics, always returned
            out, max_logits, lse = self.prefill_op(q, kv, idx, sm_scale, layout.HEAD_DIM, sink, topk_length, False, True)
        else:
            out, max_logits, lse = self.prefill_op(q, kv, idx, sm_scale, layout.HEAD_DIM, sink, topk_length)
        if self.prefill_log2:  # base-2 statistics -> natural log (+-inf stay +-inf)
            max_logits, lse = max_logits * LN2, lse * LN2
        return out, max_logits, lse

    def kernels(self) -> dict:
        return {
            "flash_mla_with_kvcache": self.flash_mla_with_kvcache,
            "flash_mla_sparse_fwd": self.flash_mla_sparse_fwd,
            "get_mla_metadata": self.get_mla_metadata,
            "get_mla_metadata_stacked": self.get_mla_metadata_stacked,
        }


def _check_fresh(kernels, q, indices, topk_length, extra_indices, extra_topk_length, meta, splits):
    """Checked mode: hoisted metadata must equal the scheduler for the current length values."""
    fresh_meta, fresh_splits = kernels.get_mla_metadata(q, indices, topk_length, extra_indices, extra_topk_length)
    if not (torch.equal(fresh_meta, meta) and torch.equal(fresh_splits, splits)):
        raise ValueError(
            "dsv4.flash_mla_with_kvcache: tile_scheduler_metadata/num_splits must be computed by "
            "get_mla_metadata for the current topk_length/extra_topk_length values, got metadata that "
            "differs from the current schedule (stale: computed before the lengths changed?)"
        )


_VIEWS: dict = {}  # id(base cache) -> (weak ref to it, (page size, format), data pointer, its view)


def _cached_view(cache, page_size, kv_format):
    """The view :func:`_view` built for this cache tensor, page size and format, if the storage
    has not moved since; else ``None``."""
    hit = _VIEWS.get(id(cache))
    if hit is None or hit[0]() is not cache or hit[1] != (page_size, kv_format) or hit[2] != cache.data_ptr():
        return None
    return hit[3]


def _view(cache: torch.Tensor, page_size: int, kv_format: layout.CacheFormat = layout.V4) -> torch.Tensor:
    """``layout.flashmla_view(cache, page_size, kv_format)`` of a validated cache, built once per
    cache tensor (three tensor ops saved per call of the eager hot path); rebuilt if the page size,
    the format or the storage changed. An entry leaves with its cache (weak reference callback),
    so an id is never matched to another tensor."""
    view = _cached_view(cache, page_size, kv_format)
    if view is None:
        key = id(cache)
        ref = weakref.ref(cache, lambda _, key=key: _VIEWS.pop(key, None))
        view = layout.flashmla_view(cache, page_size, kv_format)
        _VIEWS[key] = (ref, (page_size, kv_format), cache.data_ptr(), view)
    return view


@functools.cache
def _single_gpu() -> bool:
    return torch.cuda.device_count() == 1


def _one_device(first, *others) -> bool:
    """Whether the tensors (``None`` skipped) are on one device: FlashMLA checks only that each is
    a CUDA tensor, which settles it when the process sees one GPU."""
    if _single_gpu() and first.is_cuda:
        return True
    device = first.device
    return all(t is None or t.device == device for t in others)


# ---- capability gating and providers ----


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _require_capability(device: torch.device, what: str) -> None:
    major, minor = _capability(device)
    if (major, minor) != (9, 0) and major != 10:
        raise dispatch.ProviderUnavailable(
            f"{what} serves SM90 and SM100 GPUs only; {device} is sm_{major}{minor}"
        )


def _load_sgl_kernel(device: torch.device) -> dict:
    try:
        importlib.import_module("sgl_kernel.flash_mla")
    except Exception as exc:  # ImportError, or a library built for another torch
        raise dispatch.ProviderUnavailable(f"sgl_kernel.flash_mla is not importable ({exc})") from None
    _require_capability(device, "sgl_kernel.flash_mla")
    ns = torch.ops.sgl_kernel
    return FlashMLAKernels("sgl_kernel", ns, device, prefill_log2=True, prefill_has_stats_flags=False).kernels()


def _load_flash_mla(device: torch.device) -> dict:
    try:
        flash_mla = importlib.import_module("flash_mla")
    except Exception as exc:
        raise dispatch.ProviderUnavailable(
            f"flash_mla is not importable ({exc}); install sgl-flash-mla (pip install "
            f"'dsv4_compile[cuda]')"
        ) from None
    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is not None and not has_legacy():
        raise dispatch.ProviderUnavailable("flash_mla was built without its legacy (V4 layout) kernels")
    _require_capability(device, "flash_mla (legacy kernels)")
    ns = torch.ops.flash_mla_legacy
    current = torch.ops.flash_mla if hasattr(torch.ops.flash_mla, "sparse_decode_fwd") else None
    return FlashMLAKernels(
        "flashmla", ns, device, prefill_log2=False, prefill_has_stats_flags=True, v41_namespace=current,
        validates=FLASHMLA_VALIDATES,
        own_schedule=_capability(device) == (9, 0) and flashmla_schedule.available(device),
    ).kernels()


def metadata_shapes(device: torch.device, batch: int, s_q: int, heads: int):
    """FlashMLA's scheduler geometry, ``get_mla_metadata``'s outputs on every CUDA device whatever
    the provider: ``[num_sm_parts, 8]`` and ``[batch + 1]`` int32.

    ``num_sm_parts`` as its sparse decode computes it for the padded head count ``h``:
    SM90 ``max(sms // s_q // (h // 64), 1)``; SM100 ``max(sms // s_q, 1)`` for ``h = 64`` and
    ``max(sms // s_q // 2, 1)`` for ``h = 128`` (other GPUs: as SM90). Without a CUDA device
    (tracing for CUDA on a CPU machine) one part.
    """
    h = padded_heads(heads)
    major, _ = _capability(device) if torch.cuda.is_available() else (9, 0)
    divisor = (1 if h == 64 else 2) if major == 10 else h // 64
    return (max(_num_sms(device) // max(s_q, 1) // divisor, 1), 8), (batch + 1,)


def _num_sms(device: torch.device) -> int:
    if not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


_FLASHMLA_OPS = ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata", "get_mla_metadata_stacked")

def _v4_decode(device: torch.device, call) -> bool:
    """V4 caches; SM100's V4 decode reads pages with the tensor-memory accelerator: page strides
    must be multiples of 576 bytes (canonical ``page_bytes``). SM90 reads any stride >= P*584."""
    return call.kv_format is layout.V4 and (
        _capability(device)[0] != 10
        or (call.page_stride % layout.PAGE_ALIGN == 0 and call.extra_page_stride % layout.PAGE_ALIGN == 0)
    )


def _v41_decode(device: torch.device, call) -> bool:
    """V4.1 interleaved caches on SM100 (FlashMLA's current kernels): page strides multiples of the
    token bytes (528, or 288 for an FP4 extra cache)."""
    if call.kv_format is layout.V4 or _capability(device)[0] != 10:
        return False
    main, extra = call.kv_format, call.extra_kv_format or call.kv_format
    return (
        main.interleaved and extra.interleaved and call.page_stride % main.token_bytes == 0
        and call.extra_page_stride % extra.token_bytes == 0
    )


#: What FlashMLA's decode serves: V4 caches (legacy kernels; SM100: page strides multiples of 576),
#: V4.1 interleaved caches on SM100 (current kernels; page strides multiples of the token bytes).
FLASHMLA_DECODE = dispatch.Rule(
    "kv_format 'v4' (page strides multiples of 576 on SM100) or, on SM100, V4.1 interleaved caches "
    "(page strides multiples of the token bytes)",
    lambda device, call: _v4_decode(device, call) or _v41_decode(device, call),
)
#: What FlashMLA's decode serves in the batch-invariant mode: the current kernels' calls (V4.1
#: interleaved caches on SM100), with their ``enable_batch_invariant``. The legacy kernels (V4, SM90
#: and SM100) have no such flag and split a row's keys by the whole batch's schedule.
FLASHMLA_DECODE_INVARIANT = dispatch.Rule(
    "in the batch-invariant mode, V4.1 interleaved caches on SM100 (the current kernels' "
    "enable_batch_invariant; page strides multiples of the token bytes)",
    _v41_decode,
)
#: sgl_kernel's FlashMLA: V4 caches.
SGL_KERNEL_DECODE = dispatch.Rule(
    "kv_format 'v4' (page strides multiples of 576 on SM100)", _v4_decode,
)


#: The ops whose ``flashmla`` kernels check every call themselves (``dispatch.Provider.validates``).
#: FlashMLA's decode and prefill (sgl-flash-mla 1.0.0, read from its C++ entry points) reject,
#: before launching: a wrong rank, dtype or shape of every tensor (q, the cache view, indices,
#: lengths, the sink, the scheduler metadata), a head dimension other than 512 / 576, a tensor not
#: on a CUDA device, and extra_* arguments without an extra cache. The adapters run the metadata
#: checks themselves for what it cannot see (the base cache and page size behind a view built for
#: the first time, formats, scalars, index widths above the limit, devices of a multi-GPU process)
#: and for every path that does not reach it unpadded (empty batches, padded heads, V4.1 caches).
#: ``tests/test_cuda.py`` checks on the GPU that each malformed call gets the checks' error.
FLASHMLA_VALIDATES = ("flash_mla_with_kvcache", "flash_mla_sparse_fwd")


def register() -> None:
    dispatch.register_provider(dispatch.Provider(
        "sgl_kernel", "cuda", _load_sgl_kernel, ops=_FLASHMLA_OPS, rules={"flash_mla_with_kvcache": SGL_KERNEL_DECODE},
    ))
    dispatch.register_provider(dispatch.Provider(
        "flashmla", "cuda", _load_flash_mla, ops=_FLASHMLA_OPS, rules={"flash_mla_with_kvcache": FLASHMLA_DECODE},
        validates=FLASHMLA_VALIDATES, invariant={"flash_mla_with_kvcache": FLASHMLA_DECODE_INVARIANT},
    ))
    dispatch.register_metadata_shapes("cuda", metadata_shapes)


register()
