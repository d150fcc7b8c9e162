"""What the Triton kernel modules (:mod:`.triton_store`, :mod:`.triton_attention`) share.

* Lazy Triton: importing ``dsv4_compile`` must not import Triton (slow, and absent on many CPU
  machines). The kernel modules define their ``@triton.jit`` functions and ``tl.constexpr``
  constants as plain Python, list their names, and call :func:`jit_in_place` on first use: it
  imports Triton and rebinds those names in the module's globals, where Triton's compiler looks.
* Provider availability (:func:`require_device`): a Triton backend for the device type, and the
  device itself.
* Inductor visibility: the conditions under which a FunctionalTensorMode rule may trace an op into
  ``wrap_triton`` launches (:func:`may_trace`).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .. import checks, dispatch

DEVICE_TYPES = ("cuda", "xpu")
#: Triton backends that serve each device type.
BACKENDS = {"cuda": ("nvidia", "amd"), "xpu": ("intel",)}
#: ``DSV4_COMPILE_TRITON_INLINE=0`` keeps the Triton ops opaque under ``torch.compile`` (read at
#: compile time).
INLINE_ENV = "DSV4_COMPILE_TRITON_INLINE"

_LOCK = threading.Lock()


def jit_in_place(scope: dict, constexprs, jitted):
    """Once per module (``scope`` is its ``globals()``): import Triton, wrap ``constexprs`` in
    ``tl.constexpr`` and ``jitted`` in ``triton.jit``, set the module's ``triton`` and ``tl``;
    return the ``triton`` module. Raises :class:`~dsv4_compile.dispatch.ProviderUnavailable` when
    Triton is not importable.
    """
    if scope.get("tl") is not None:
        return scope["triton"]
    with _LOCK:
        if scope.get("tl") is None:
            try:
                import triton
                import triton.language as tl
            except ImportError as exc:
                raise dispatch.ProviderUnavailable(f"triton is not importable ({exc})") from exc
            for name in constexprs:
                scope[name] = tl.constexpr(scope[name])
            for name in jitted:
                scope[name] = triton.jit(scope[name])
            scope["triton"], scope["tl"] = triton, tl
    return scope["triton"]


def interpreting(kernel) -> bool:
    """Whether ``kernel`` was jitted under ``TRITON_INTERPRET=1`` (it then runs CPU tensors)."""
    import triton

    return not isinstance(kernel, triton.runtime.JITFunction)


def device_available(device: torch.device) -> bool:
    return torch.get_device_module(device.type).is_available()


def require_device(triton, kernel, device: torch.device, what: str) -> None:
    """Raise :class:`~dsv4_compile.dispatch.ProviderUnavailable` unless Triton can run ``what`` on
    ``device``: a supported device type, a Triton backend for it, the device present. Interpreted
    kernels (``TRITON_INTERPRET=1``, tests) serve CPU tensors on every key."""
    if device.type not in DEVICE_TYPES:
        raise dispatch.ProviderUnavailable(f"no Triton {what} for device type {device.type!r}")
    if interpreting(kernel):
        return
    found, wanted = triton.backends.backends, BACKENDS[device.type]
    if not any(b in found for b in wanted):
        raise dispatch.ProviderUnavailable(
            f"triton has no backend for {device.type} (wants one of {wanted}, has {sorted(found)})"
        )
    if not device_available(device):
        raise dispatch.ProviderUnavailable(f"no {device.type} device is available")


def device_guard(device: torch.device):
    """Launch on ``device`` (CPU tensors: the interpreter, no guard)."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.get_device_module(device).device(device)


def inlining_allowed(device: torch.device) -> bool:
    """Conditions every inlining decision shares: a Triton device type, inlining not switched off,
    checked mode off (its data checks run only in the opaque op)."""
    return (
        device.type in DEVICE_TYPES
        and os.environ.get(INLINE_ENV, "1") != "0"
        and not checks.checked_mode()
    )


def may_trace(types) -> bool:
    """Whether a FunctionalTensorMode rule may trace into ``wrap_triton`` launches: no foreign
    tensor subclass is involved, and ``torch.export`` did not ask to keep Triton-backed ops whole
    (as it does for ``triton_op``)."""
    if any(not issubclass(t, (FunctionalTensor, FakeTensor)) and t is not torch.Tensor for t in types):
        return False
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:
        return True
    return not custom_triton_ops_decomposition_disabled()


def register_cache_key(op: str, entry) -> None:
    """List ``entry`` (an iterable of the kernels ``op`` may inline now) in AOTAutograd's cache key
    (``torch._library.triton.triton_ops_to_kernels``, torch-internal; skipped where absent)."""
    kernels_by_op = getattr(torch._library.triton, "triton_ops_to_kernels", None)
    if isinstance(kernels_by_op, dict):
        kernels_by_op[f"dsv4::{op}"] = entry


class InlinedKernels:
    """An AOTAutograd cache-key entry (:func:`register_cache_key`): iterating it yields the named
    kernels of ``scope`` when a compile now would inline them (``inlines(device)`` on the current
    device of a device type present), and nothing otherwise. So an inlined graph is never served
    from the cache to a compile that would not inline (another provider forced, checked mode,
    inlining off), and editing a kernel invalidates cached graphs."""

    def __init__(self, inlines, names: tuple[str, ...], scope: dict):
        self.inlines, self.names, self.scope = inlines, names, scope

    def __iter__(self):
        for device_type in DEVICE_TYPES:
            module = getattr(torch, device_type, None)
            if module is None or not module.is_available():
                continue
            if self.inlines(torch.device(device_type, module.current_device())):
                return iter([self.scope[name] for name in self.names])
        return iter(())
