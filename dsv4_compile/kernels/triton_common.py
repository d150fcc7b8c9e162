"""Lazy Triton for the kernel modules: kernels are written as plain functions and jitted in place.

Importing ``dsv4_compile`` must not import Triton (slow, and absent on many CPU machines). So the
Triton kernel modules define their ``@triton.jit`` functions and ``tl.constexpr`` constants as
plain Python, list their names, and call :func:`jit_in_place` on first use: it imports Triton,
rebinds those names in the module's globals (where Triton's compiler resolves them), and sets the
module's ``triton`` and ``tl`` globals.
"""

from __future__ import annotations

import threading

from .. import dispatch

_LOCK = threading.Lock()


def jit_in_place(scope: dict, constexprs, jitted):
    """Once per module (``scope`` is its ``globals()``): import Triton, wrap ``constexprs`` in
    ``tl.constexpr`` and ``jitted`` in ``triton.jit``; return the ``triton`` module.

    Raises :class:`~dsv4_compile.dispatch.ProviderUnavailable` when Triton is not importable.
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
