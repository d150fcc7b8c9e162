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


_NO_GUARD = contextlib.nullcontext()


def device_guard(device: torch.device):
    """Launch on ``device`` (CPU tensors: the interpreter, no guard; the current device: none)."""
    if device.type == "cpu":
        return _NO_GUARD
    module = torch.get_device_module(device)
    if device.index is None or device.index == module.current_device():
        return _NO_GUARD
    return module.device(device)


#: Triton versions whose launcher internals :class:`EagerLauncher` calls (checked on the H200);
#: on others eager launches go through ``kernel[grid](...)``.
FAST_LAUNCH_TRITON = ("3.6.",)


class EagerLauncher:
    """``launcher[grid](*args, **constexprs_and_options)``: an eager launch of a jitted kernel with
    the host work Triton's JIT launcher repeats on every call done once per specialization.

    ``kernel[grid](...)`` binds the arguments, specialises each (dtype, 16-byte alignment of
    pointers; ints by range, ``== 1`` and divisibility by 16), hashes that into a key, rechecks the
    globals the kernel read, then launches the compiled kernel: ~25 us of host time on the H200's
    host for the store. Here the key is computed from the same properties (at least as finely:
    a key of ours never maps two calls Triton would compile differently to one kernel), the
    compiled kernel the first launch of a key returns is kept, and later launches call its
    launcher directly, with the launch hooks and metadata Triton's launcher passes. While
    interpreting, or on a Triton version not in :data:`FAST_LAUNCH_TRITON`, every launch goes
    through ``kernel[grid](...)``.
    """

    __slots__ = ("kernel", "compiled", "enabled")

    def __init__(self, kernel):
        import triton

        self.kernel = kernel
        self.compiled = {}
        self.enabled = (
            not interpreting(kernel) and triton.__version__.startswith(FAST_LAUNCH_TRITON)
        )

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        from triton import knobs
        from triton.runtime import driver

        if not self.enabled:
            return self.kernel[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        key = (device, tuple(map(_specialisation, args)), *kwargs.items())
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid](*args, **kwargs)
            return
        bound = (*args, *[kwargs[name] for name in self.kernel.arg_names[len(args):]])
        stream = driver.active.get_current_stream(device)
        grid = (*grid, 1, 1)
        hooks = knobs.runtime  # launch hooks (profilers) run as Triton's own launcher runs them
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
            compiled.launch_metadata(grid, stream, *bound), hooks.launch_enter_hook, hooks.launch_exit_hook, *bound,
        )


_I32_MIN, _I32_END, _I64_END = -(2**31), 2**31, 2**63


def _specialisation(arg):
    """What Triton's launcher specialises a runtime argument on (or finer): a tensor's dtype and
    16-byte alignment; an int's ``== 1``, divisibility by 16 and integer type; a float's type; a
    bool's value."""
    kind = type(arg)
    if kind is int:
        return arg == 1, arg % 16 == 0, _I32_MIN <= arg < _I32_END, arg < _I64_END
    if kind is float:
        return float
    if kind is bool:
        return arg
    return arg.dtype, arg.data_ptr() % 16 == 0  # a tensor


_LAUNCHERS: dict = {}


def eager(kernel) -> EagerLauncher:
    """The :class:`EagerLauncher` of a jitted kernel (one per kernel)."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = EagerLauncher(kernel)
    return launcher


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
