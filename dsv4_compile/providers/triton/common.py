"""What the Triton kernel modules (:mod:`.store`, :mod:`.attention`, :mod:`.indexer`) share.

* Lazy Triton: importing ``dsv4_compile`` must not import Triton (slow, and absent on many CPU
  machines). The kernels are plain ``@triton.jit`` functions in :mod:`.kernels`, one module per
  provider module, which imports its own on first use (:func:`kernels`).
* Provider availability (:func:`require_device`): a Triton backend for the device type, and the
  device itself.
* Inductor visibility (:func:`decompose`): under ``torch.compile``'s functionalization an op that
  our Triton kernels serve is traced into its ``wrap_triton`` launches, so Inductor sees and
  schedules the kernels (:func:`inlines`, :func:`may_trace`, :func:`register_cache_key`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from ... import checks, dispatch
from ...ops import registry

DEVICE_TYPES = ("cuda", "xpu")
#: Triton backends that serve each device type.
BACKENDS = {"cuda": ("nvidia", "amd"), "xpu": ("intel",)}
#: ``DSV4_COMPILE_TRITON_INLINE=0`` keeps the Triton ops opaque under ``torch.compile`` (read at
#: compile time).
INLINE_ENV = "DSV4_COMPILE_TRITON_INLINE"
#: ``DSV4_COMPILE_TRITON_FAST_LAUNCH=1`` opts eager launches into :class:`EagerLauncher`'s fast path
#: (a private Triton interface) on the Triton versions of :data:`FAST_LAUNCH_TRITON`; read when a
#: kernel first launches eagerly. Off by default: eager launches are ``kernel[grid](...)``.
FAST_LAUNCH_ENV = "DSV4_COMPILE_TRITON_FAST_LAUNCH"

_KERNELS: dict = {}  # kernels module name -> module


def kernels(name: str):
    """The module ``name`` (absolute) of plain ``@triton.jit`` kernels, imported (and with it
    Triton) on first use; so ``TRITON_INTERPRET`` is read then. Raises
    :class:`~dsv4_compile.dispatch.ProviderUnavailable` when Triton is not importable."""
    module = _KERNELS.get(name)
    if module is None:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise dispatch.ProviderUnavailable(f"triton is not importable ({exc})") from exc
        _KERNELS[name] = module
    return module


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), as ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting(kernel) -> bool:
    """Whether ``kernel`` was jitted under ``TRITON_INTERPRET=1`` (it then runs CPU tensors)."""
    import triton

    return not isinstance(kernel, triton.runtime.JITFunction)


_NVIDIA: dict = {}  # (device, capability) -> bool


def nvidia_compiled(device: torch.device, kernel, capability: tuple[int, int]) -> bool:
    """Whether ``kernel`` runs compiled (not interpreted) on ``device``, an NVIDIA GPU (CUDA, not
    ROCm) of compute capability ``capability`` or later. Decided once per (device, capability)."""
    key = (device, capability)
    found = _NVIDIA.get(key)
    if found is None:
        own = None if interpreting(kernel) else nvidia_capability(device)
        found = _NVIDIA[key] = own is not None and own >= capability
    return found


def nvidia_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s compute capability if it is an NVIDIA GPU (CUDA, not ROCm) that is present,
    else None (other devices, or a fake CUDA device while tracing on a machine without one). Not
    cached: its callers cache what they decide from it."""
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def hardware_conversions(device: torch.device, kernel) -> bool:
    """Whether the kernels convert between fp32 and fp8 (e4m3) / bf16 with the GPU's conversion
    instructions (``cvt``; rounding to nearest even, the same bits as the integer arithmetic they
    replace): NVIDIA GPUs of compute capability 8.9 or later (Ada, Hopper, Blackwell), compiled,
    not interpreted. Elsewhere (SM80, XPU, ROCm, ``TRITON_INTERPRET=1``) the kernels convert in
    integer arithmetic."""
    return nvidia_compiled(device, kernel, (8, 9))


def device_available(device: torch.device) -> bool:
    return torch.get_device_module(device.type).is_available()


def require_device(kernel, device: torch.device, what: str) -> None:
    """Raise :class:`~dsv4_compile.dispatch.ProviderUnavailable` unless Triton can run ``what`` on
    ``device``: a supported device type, a Triton backend for it, the device present. Interpreted
    kernels (``TRITON_INTERPRET=1``, tests) serve CPU tensors on every key."""
    if device.type not in DEVICE_TYPES:
        raise dispatch.ProviderUnavailable(f"no Triton {what} for device type {device.type!r}")
    if interpreting(kernel):
        return
    import triton

    found, wanted = triton.backends.backends, BACKENDS[device.type]
    if not any(b in found for b in wanted):
        raise dispatch.ProviderUnavailable(
            f"triton has no backend for {device.type} (wants one of {wanted}, has {sorted(found)})"
        )
    if not device_available(device):
        raise dispatch.ProviderUnavailable(f"no {device.type} device is available")


_NO_GUARD = contextlib.nullcontext()
_DEVICE_MODULES: dict = {}  # device type -> torch.cuda, torch.xpu, ...


def compute_units(device: torch.device) -> int:
    """``device``'s SM / Xe-core count: the programs that fill it once, one per unit (4 elsewhere:
    the interpreter, or a fake CUDA device while tracing on a machine without one)."""
    return _units(device.type, device.index)


@functools.lru_cache(maxsize=None)
def _units(device_type: str, index: int | None) -> int:
    module = getattr(torch, device_type, None)
    if device_type in DEVICE_TYPES and module is not None and module.is_available():
        props = module.get_device_properties(index if index is not None else module.current_device())
        for name in ("multi_processor_count", "gpu_subslice_count"):
            if getattr(props, name, 0):
                return getattr(props, name)
    return 4


def shared_memory_per_block(device: torch.device) -> int | None:
    """The most shared memory one program may take on ``device``, in bytes (NVIDIA's opt-in limit
    per block: 163 KB on SM80, 99 KB on SM86 / SM89 / SM120, 227 KB on SM90 / SM100); None where
    it is not known: where :func:`nvidia_capability` is None."""
    if nvidia_capability(device) is None:
        return None
    return _shared_memory_optin(device.index)


@functools.lru_cache(maxsize=None)
def _shared_memory_optin(index: int | None) -> int | None:
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    return getattr(props, "shared_memory_per_block_optin", None) or None


def device_guard(device: torch.device):
    """Launch on ``device`` (CPU tensors: the interpreter, no guard; the current device: none)."""
    index = device.index
    if index is None or device.type == "cpu":  # the current device, or CPU (the interpreter)
        return _NO_GUARD
    module = _DEVICE_MODULES.get(device.type)
    if module is None:
        module = _DEVICE_MODULES[device.type] = torch.get_device_module(device.type)
    if index == module.current_device():
        return _NO_GUARD
    return module.device(device)


#: Triton versions whose launcher internals :class:`EagerLauncher` calls (tested on the H200 and
#: the H100: ``-m cuda``); on others eager launches go through ``kernel[grid](...)``.
FAST_LAUNCH_TRITON = ("3.6.",)


class EagerLauncher:
    """``launcher[grid](*args, **constexprs_and_options)``: an eager launch of a jitted kernel;
    ``kernel[grid](...)`` unless opted in (:data:`FAST_LAUNCH_ENV`), then with the host work
    Triton's JIT launcher repeats on every call done once per specialization.

    ``kernel[grid](...)`` binds the arguments, specialises each (dtype, 16-byte alignment of
    pointers; ints by range, ``== 1`` and divisibility by 16), hashes that into a key, rechecks the
    globals the kernel read, then launches the compiled kernel: ~25 us of host time on the H200's
    host for the store. Here the key is computed from the same properties (at least as finely:
    a key of ours never maps two calls Triton would compile differently to one kernel), the first
    launch of a key goes through ``kernel[grid](...)`` and its compiled kernel is kept as a
    :class:`_LaunchPlan`, and later launches of the key call the plan. Not opted in, while
    interpreting, or on a Triton version not in :data:`FAST_LAUNCH_TRITON`, every launch goes
    through ``kernel[grid](...)``.
    """

    __slots__ = ("kernel", "plans", "enabled", "current_device", "current_stream")

    def __init__(self, kernel):
        import triton

        self.kernel = kernel
        self.plans = {}
        self.enabled = (
            os.environ.get(FAST_LAUNCH_ENV) == "1"
            and not interpreting(kernel)
            and triton.__version__.startswith(FAST_LAUNCH_TRITON)
        )
        self.current_device = self.current_stream = None  # the active driver's, at the first launch

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        if not self.enabled:
            return self.kernel[grid](*args, **kwargs)
        if self.current_device is None:
            from triton.runtime import driver

            self.current_device = driver.active.get_current_device
            self.current_stream = driver.active.get_current_stream
        device = self.current_device()
        key = (device, _signature(args), *kwargs.items())
        plan = self.plans.get(key)
        if plan is None:
            compiled = self.kernel[grid](*args, **kwargs)
            tail = tuple(kwargs[name] for name in self.kernel.arg_names[len(args):])
            self.plans[key] = _LaunchPlan(compiled, tail)
            return
        plan(grid, self.current_stream(device), args)


def _hooked(hook, chain_type) -> bool:
    """Whether a Triton launch hook does anything: a function, or a non-empty chain of them (Triton
    3.6's ``knobs.runtime.launch_enter_hook`` is a ``knobs.HookChain``, empty unless a profiler
    adds one; ``chain_type``: that class, ``()`` where Triton has none)."""
    return hook is not None and (not isinstance(hook, chain_type) or bool(hook.calls))


class _LaunchPlan:
    """One compiled kernel and how to launch it: its launcher with the arguments Triton's own
    launch passes (the constexpr values ``tail`` appended, launch metadata and hooks), or, for
    NVIDIA's launcher with no scratch memory while no launch hook does anything (profilers add
    them), the launcher's C entry point directly, without building launch metadata nobody reads."""

    __slots__ = ("compiled", "tail", "hooks", "chain_type", "entry", "entry_flags")

    def __init__(self, compiled, tail: tuple):
        from triton import knobs

        self.compiled, self.tail, self.hooks = compiled, tail, knobs.runtime
        self.chain_type = getattr(knobs, "HookChain", ())
        run = compiled.run
        direct = (
            type(run).__name__ == "CudaLauncher"
            and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0
            and callable(getattr(run, "launch", None))
        )
        self.entry = run.launch if direct else None
        self.entry_flags = (run.launch_cooperative_grid, run.launch_pdl) if direct else None

    def __call__(self, grid, stream, args):
        compiled, bound = self.compiled, args + self.tail
        x, y, z = (grid[0], 1, 1) if len(grid) == 1 else (*grid, 1)[:3]
        enter, leave = self.hooks.launch_enter_hook, self.hooks.launch_exit_hook
        if self.entry is not None and not _hooked(enter, self.chain_type) and not _hooked(leave, self.chain_type):
            cooperative, pdl = self.entry_flags
            self.entry(x, y, z, stream, compiled.function, cooperative, pdl, None, None,
                       compiled.packed_metadata, None, None, None, *bound)
            return
        compiled.run(x, y, z, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata((x, y, z), stream, *bound), enter, leave, *bound)


_I32_MIN, _I32_END, _I64_END = -(2**31), 2**31, 2**63


def _signature(args) -> tuple:
    """What Triton's launcher specialises the runtime arguments on (or finer): their types; a
    tensor's dtype and 16-byte alignment; an int's ``== 1``, divisibility by 16 and integer type
    (:func:`_int_code`); a bool's value. Flat, after the types, so it is cheap to build."""
    key = [tuple(map(type, args))]
    for arg in args:
        kind = type(arg)
        if kind is int:
            code = _INT_CODES.get(arg)
            key.append(_int_code(arg) if code is None else code)
        elif kind is bool:
            key.append(arg)
        elif kind is not float:  # a tensor
            key.append(arg.dtype)
            key.append(arg.data_ptr() % 16 == 0)
    return tuple(key)


_INT_CODES: dict = {}  # int -> _int_code(int), for the ints seen (strides, sizes); bounded


def _int_code(value: int) -> int:
    code = (value == 1) | (value % 16 == 0) << 1 | (_I32_MIN <= value < _I32_END) << 2 | (value < _I64_END) << 3
    if len(_INT_CODES) >= 1 << 16:
        _INT_CODES.clear()
    _INT_CODES[value] = code
    return code


_LAUNCHERS: dict = {}


def eager(kernel) -> EagerLauncher:
    """The :class:`EagerLauncher` of a jitted kernel (one per kernel; keyed by identity, as a
    jitted kernel hashes by its source in Python, slowly)."""
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _LAUNCHERS[id(kernel)] = EagerLauncher(kernel)
    return launcher


def inlining_allowed(device: torch.device) -> bool:
    """Conditions every inlining decision shares: a Triton device type, inlining not switched off,
    checked mode off (its data checks run only in the opaque op)."""
    return (
        device.type in DEVICE_TYPES
        and os.environ.get(INLINE_ENV, "1") != "0"
        and not checks.checked_mode()
    )


def inlines(op: str, device: torch.device, args: tuple | None, entry, kernel) -> bool:
    """Whether ``torch.compile`` traces ``op`` on ``device`` (for a call with ``args``, or for any
    call when ``None``) into visible launches of a Triton module whose provider entry for ``op`` is
    ``entry`` and whose jitted ``kernel()`` (a function returning it: asked only once the provider,
    and so Triton, has loaded) says whether Triton interprets it.

    True when, at compile time, the provider that serves the call on ``device`` (under the current
    :func:`~dsv4_compile.use_provider` override) runs ``entry``, compiled (not ``TRITON_INTERPRET``:
    interpreted kernels cannot be traced), and :func:`inlining_allowed`. The graph then launches the
    kernels itself: a provider override or checked mode set *after* compiling does not reach it
    (recompile, e.g. after ``torch._dynamo.reset()``). The compile caches' key includes whether
    inlining is possible now (:func:`register_cache_key`), so a cached inlined graph is not reused by
    a compile made under an override. Otherwise the op stays one opaque node that resolves its
    provider when it runs.
    """
    if not inlining_allowed(device):
        return False
    call, invariant = None, False
    if args is not None:  # the call's signature and mode: provider rules may depend on them
        call, invariant = registry.DEFINED[op].signature(args), registry.DEFINED[op].invariant(args)
    try:
        if dispatch.resolve(op, device, call, invariant)[1] is not entry:
            return False
    except dispatch.ProviderUnavailable:  # e.g. a forced provider that does not serve the device
        return False
    return not interpreting(kernel())


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


def decompose(lib: torch.library.Library, op: str, launch, inlines, opaque=None) -> None:
    """Register, in ``lib``, ``op``'s FunctionalTensorMode rule: trace a call into
    ``launch(torch.library.wrap_triton, *args)`` (its arguments as provider kernels receive them,
    ``registry.Op.arguments``; the metadata checks first) when :func:`may_trace` and ``inlines(op,
    device, args)``, and unless ``opaque(args)``; else the op stays one opaque node.

    This is the rule ``torch.library.triton_op`` registers for the op it defines, which cannot
    serve here: a ``triton_op`` is one implementation per op, while a ``dsv4`` op's kernel is chosen
    per call among providers (the rule must first ask which one serves the call, and keep the op
    whole when it is not ours)."""
    defined = registry.DEFINED[op]
    check = defined.spec.check

    def rule(mode, overload, types, args, kwargs):
        resolved = defined.arguments(args)
        if (
            not may_trace(types)
            or (opaque is not None and opaque(resolved))
            or not inlines(op, resolved[0].device, resolved)
        ):
            return mode.__torch_dispatch__(overload, types, args, kwargs)
        with mode:
            check(*resolved)
            return launch(torch.library.wrap_triton, *resolved)

    torch.library.register_torch_dispatch(f"dsv4::{op}", FunctionalTensorMode, rule, lib=lib)


def register_cache_key(op: str, entry) -> None:
    """List ``entry`` (an iterable of the kernels ``op`` may inline now) in AOTAutograd's cache key
    (``torch._library.triton.triton_ops_to_kernels``, torch-internal; skipped where absent)."""
    kernels_by_op = getattr(torch._library.triton, "triton_ops_to_kernels", None)
    if isinstance(kernels_by_op, dict):
        kernels_by_op[f"dsv4::{op}"] = entry


class InlinedKernels:
    """An AOTAutograd cache-key entry (:func:`register_cache_key`): iterating it yields the named
    kernels of module ``module`` (:func:`kernels`) when a compile now would inline them (``inlines(device)`` on the current
    device of a device type present), and nothing otherwise. So an inlined graph is never served
    from the cache to a compile that would not inline (another provider forced, checked mode,
    inlining off), and editing a kernel invalidates cached graphs."""

    def __init__(self, inlines, names: tuple[str, ...], module: str):
        self.inlines, self.names, self.module = inlines, names, module

    def __iter__(self):
        for device_type in DEVICE_TYPES:
            module = getattr(torch, device_type, None)
            if module is None or not module.is_available():
                continue
            if self.inlines(torch.device(device_type, module.current_device())):
                scope = kernels(self.module)
                return iter([getattr(scope, name) for name in self.names])
        return iter(())
