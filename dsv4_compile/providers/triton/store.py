"""Triton kernel for ``dsv4::fused_k_norm_rope_flashmla`` on CUDA and XPU (provider ``"triton"``).

One program stores ``BLOCK_T`` tokens (:func:`geometry`: one per program in small stores, a few
per program by the format in large ones). Per token, in fp32 (docs/design.md §2.1, layout §2.2)::

    y     = x * rsqrt(mean(x^2) + eps) * w                              all 512 dims, overflow-free
                                                                        (reference.rms_norm)
    rope  = (a*c - b*s, a*s + b*c) on pairs (y[448+2i], y[449+2i])      bf16, RNE
    e     = ceil(log2(fp32(max(1e-4, amax(|tile|)) / 448)))             7 tiles of 64, exact
    value = e4m3fn(clamp(y * 2^-e, -448, 448))                          RNE, saturating

a token whose values are not all finite is stored as the NaN token (layout.NAN_DATA_RECORD,
layout.NAN_SCALE_RECORD), as the reference does; written as bytes: the 576-byte data record at ``page*S + off*576``, the 8-byte scale record
(``e + 127`` x 7, then a 0 pad byte) at ``page*S + P*576 + off*8``; negative slots write nothing.

Rounding: on NVIDIA GPUs of compute capability 8.9+ by the conversion instructions (fp8 and
bf16 ``cvt.rn``; :func:`.common.hardware_conversions`), elsewhere (SM80, XPU, ROCm, the
interpreter) in integer arithmetic on the fp32 bit patterns; both give the same bits, round to
nearest even, so the kernel runs on any GPU Triton targets and produces the reference's bytes
given the same ``y``;
``y`` itself may differ from the reference's in the last fp32 bit (reduction order, ``rsqrt``),
which can move a rounding tie.

The kernels are plain ``@triton.jit`` functions in :mod:`.kernels.store`; importing this module
imports no Triton: the provider imports them on first use (so ``TRITON_INTERPRET`` is read then).

Under ``torch.compile`` the op is decomposed into the Triton launch (:func:`.common.decompose`,
the rule ``torch.library.triton_op`` would register), so Inductor launches the kernel from its generated
code, provided the ``triton`` provider serves the device *when the graph is compiled*: the
provider is then bound into the compiled graph (see :func:`inlines`).
"""

from __future__ import annotations

import functools

import torch

from ... import dispatch, layout
from . import common as triton_common

OP = "fused_k_norm_rope_flashmla"
PLAIN = "quantize_store"
NAME = "triton"
#: Launch geometry by the values format (``CacheFormat.values``): ``(tokens per program`` (a power of two), ``warps per
#: program)``, the fastest of a sweep on the H200 at 65536 tokens (benchmarks/RESULTS.md, "Cache
#: store", and its history; FP4: 2 x 1 took 0.82x the time of 4 x 4 once its codes stopped
#: dividing, and stayed the fastest with the paired compares, 0.94x the next).
GEOMETRY = {"fp8+bf16": (4, 1), "fp8": (4, 2), "fp4": (2, 1)}
#: Up to this many tokens (a decode step's stores, a short prefill) every format stores one token
#: per one-warp program instead: the device has SMs to spare, and a program that handles one token
#: finishes sooner. On the H200 (benchmarks/RESULTS.md, "Cache store"; CUDA graphs) that took
#: 0.69-0.88x the time of :data:`GEOMETRY`'s at 1 to 256 tokens in every format, 0.92-0.99x at 1024;
#: at 4096 tokens :data:`GEOMETRY`'s was the faster (1x1 took 1.06-1.28x its time).
SMALL_TOKENS = 1024


# --------------------------------------------------------------------------------------------
# The kernels: plain @triton.jit functions in .kernels.store, imported with Triton on first use.
# --------------------------------------------------------------------------------------------

KERNELS_MODULE = f"{__package__}.kernels.store"


def _kernels():
    """This provider's jitted kernels, :mod:`.kernels.store` (imported with Triton on first use)."""
    return triton_common.kernels(KERNELS_MODULE)


def _launch(kernels, kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size, kv_format, fused) -> None:
    """Launch the store for ``kv_format`` over all tokens; ``kernels`` maps a jitted kernel to what
    is launched (its ``triton_common.eager`` launcher, or its ``wrap_triton`` wrapper)."""
    num_tokens = kv.shape[0]
    if num_tokens == 0:
        return
    fmt = kv_format
    if fmt.is_v4:
        kernel, formats = _kernels().store_kernel, {}
    else:
        kernel, formats = _kernels().store_v41_kernel, dict(FP4=fmt.values == "fp4", INTERLEAVED=fmt.interleaved)
    freqs_stride = freqs.stride()  # whole stride tuples: cheaper on the eager path than stride(i)
    block_t, warps = geometry(fmt, num_tokens)
    kernels(kernel)[(-(-num_tokens // block_t),)](
        kv, kv_weight, freqs, positions, out_loc, kvcache,
        num_tokens, kv.stride()[0], kv_weight.stride()[0], freqs_stride[0], freqs_stride[1],
        positions.stride()[0], out_loc.stride()[0], kvcache.stride()[0], eps,
        PAGE_SIZE=page_size, BLOCK_T=block_t, FUSED=fused, **formats,
        HW=triton_common.hardware_conversions(kv.device, kernel),
        num_warps=warps,
    )


def geometry(fmt: layout.CacheFormat, num_tokens: int) -> tuple[int, int]:
    """``(tokens, warps)`` per program of a store of ``num_tokens`` tokens in cache format ``fmt``:
    ``(1, 1)`` up to :data:`SMALL_TOKENS` tokens, else :data:`GEOMETRY`'s for the format."""
    if num_tokens <= SMALL_TOKENS:
        return 1, 1
    return GEOMETRY[fmt.values]


def _plain_arguments(kv, out_loc, kvcache, page_size, kv_format=layout.V4) -> tuple:
    """The launch arguments of a plain quantize-and-store: ``kv`` and ``out_loc`` stand in for the
    weight, the table and the positions the kernels do not read then."""
    return kv, kv, kv, out_loc, out_loc, kvcache, 0.0, page_size, kv_format, False


def fused_k_norm_rope_flashmla(kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size, kv_format=layout.V4):
    """``dsv4::fused_k_norm_rope_flashmla`` (eager) on validated arguments, every cache format: one
    launch, no host sync."""
    with triton_common.device_guard(kv.device):
        _launch(triton_common.eager, kv, kv_weight, freqs, positions, out_loc, kvcache, eps, page_size,
                kv_format, True)


def quantize_store(kv, out_loc, kvcache, page_size, kv_format=layout.V4):
    """``dsv4::quantize_store`` (eager) on validated arguments, every cache format: one launch."""
    with triton_common.device_guard(kv.device):
        _launch(triton_common.eager, *_plain_arguments(kv, out_loc, kvcache, page_size, kv_format))


KERNELS = {OP: fused_k_norm_rope_flashmla, PLAIN: quantize_store}


def load(device: torch.device) -> dict:
    """Provider loader: the kernels, or :class:`~dsv4_compile.dispatch.ProviderUnavailable` saying why."""
    triton_common.require_device(_kernels().store_kernel, device, "store")
    return dict(KERNELS)


def register() -> None:
    """Register the stores' ``triton`` entries for ``"cuda"`` and ``"xpu"`` (idempotent; imports nothing)."""
    for device_type in triton_common.DEVICE_TYPES:
        dispatch.register_provider(dispatch.Provider(NAME, device_type, load, ops=(OP, PLAIN), fallback=True))


register()


# --------------------------------------------------------------------------------------------
# Inductor visibility: decompose the ops into the Triton launch under functionalization.
# --------------------------------------------------------------------------------------------


def inlines(op: str, device: torch.device, args: tuple | None = None) -> bool:
    """Whether ``torch.compile`` traces store op ``op`` on ``device`` (for a call with ``args``) into
    a visible launch of this module's kernel (:func:`.common.inlines`)."""
    return triton_common.inlines(op, device, args, KERNELS[op], lambda: _kernels().store_kernel)


def _symbolic_token_count(args) -> bool:
    """A symbolic token count keeps the store opaque: the launch traced with one rounds a RoPE value
    otherwise than the eager launch of the same kernel (one bf16 ulp, at 1025 tokens), where static
    graphs are byte-exact; the op's bytes must not depend on how it was compiled
    (scripts/repro_triton_symbolic_store.py, benchmarks/RESULTS.md)."""
    return not all(isinstance(n, int) for n in args[0].shape)


_lib = torch.library.Library("dsv4", "FRAGMENT")
for _op, _arguments in ((OP, lambda *args: (*args, True)), (PLAIN, _plain_arguments)):
    triton_common.decompose(
        _lib, _op, lambda wrap, *args, _arguments=_arguments: _launch(wrap, *_arguments(*args)), inlines,
        opaque=_symbolic_token_count,
    )
    triton_common.register_cache_key(_op, triton_common.InlinedKernels(
        functools.partial(inlines, _op), ("store_kernel", "store_v41_kernel"), KERNELS_MODULE))
