"""Providers: which implementation serves each ``dsv4`` op on each device, and how to override it.

A *provider* is a named set of kernels for one device type (``"cuda"``, ``"xpu"``, ...) — e.g.
FlashMLA on CUDA, sgl-kernel-xpu on XPU, a Triton kernel — registered with a priority. The
``reference`` provider (plain PyTorch, :mod:`dsv4_compile.kernels.reference`) serves every device
and comes last. Resolution is lazy: the first call of an op on a device imports the provider's
library and checks that it supports the device; the answer is cached per (op, device).

The op kernel registered for a dispatch key (``CPU``, ``CUDA``, ``XPU``) is a small trampoline
that asks :func:`kernel_for` and calls what it returns. So the dispatcher picks the device, this
module picks the provider, and no caller ever branches on either.

Override: ``DSV4_COMPILE_PROVIDER=reference`` (environment) or ``with use_provider("reference"):``
forces one provider for every op (or for the ops named). A forced provider that cannot serve a
device is an error, never a silent substitute.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch

OPS = (
    "fused_k_norm_rope_flashmla",
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
    "get_mla_metadata",
)
REFERENCE = "reference"
PROVIDER_ENV = "DSV4_COMPILE_PROVIDER"


class ProviderUnavailable(RuntimeError):
    """A provider cannot serve a device (library missing, unsupported GPU, ...)."""


@dataclass
class Provider:
    """A named set of kernels for one device type.

    ``load(device)`` imports what the provider needs and returns ``{op: kernel}`` for the ops it
    serves on that device, or raises :class:`ProviderUnavailable` saying why not. Kernels take the
    op's arguments positionally, in schema order.
    """

    name: str
    device_type: str  # "cuda", "xpu", "cpu", ... or "*" for every device type
    load: Callable[[torch.device], Mapping[str, Callable]]
    priority: int = 0  # higher wins
    ops: tuple[str, ...] = OPS  # the ops it can serve (when available)
    #: a fallback (a slower path: Triton, the reference) warns once when it serves an op because
    #: a provider above it could not
    fallback: bool = False
    #: ``(device, batch, s_q, heads) -> (metadata shape, num_splits shape)`` for a provider whose
    #: ``get_mla_metadata`` returns a real scheduler; ``None``: two empty tensors.
    metadata_shapes: Callable | None = None


@dataclass
class _Registry:
    providers: list[Provider] = field(default_factory=list)
    cache: dict = field(default_factory=dict)
    warned: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


_registry = _Registry()
_override = threading.local()


def register_provider(provider: Provider) -> None:
    """Add (or replace, by name and device type) a provider and forget cached resolutions."""
    with _registry.lock:
        _registry.providers = [
            p for p in _registry.providers
            if (p.name, p.device_type) != (provider.name, provider.device_type)
        ]
        _registry.providers.append(provider)
        _registry.providers.sort(key=lambda p: -p.priority)
        _registry.cache.clear()


def unregister_provider(name: str, device_type: str) -> None:
    """Remove a provider (no error if absent) and forget cached resolutions."""
    with _registry.lock:
        _registry.providers = [
            p for p in _registry.providers if (p.name, p.device_type) != (name, device_type)
        ]
        _registry.cache.clear()


def registered_providers(device_type: str) -> list[str]:
    """Names of the providers registered for ``device_type``, best first."""
    return [p.name for p in _candidates(device_type)]


def reset() -> None:
    """Forget cached resolutions and warnings (tests; after installing a library at run time)."""
    with _registry.lock:
        _registry.cache.clear()
        _registry.warned.clear()


def _forced() -> dict[str, str] | None:
    forced = getattr(_override, "forced", None)
    if forced is not None:
        return forced
    env = os.environ.get(PROVIDER_ENV, "").strip()
    if not env:
        return None
    return _parse_override(env)


def _parse_override(spec: str) -> dict[str, str]:
    """``"name"`` forces all ops; ``"op=name,op2=name2"`` forces the ops named."""
    if "=" not in spec:
        return {op: spec for op in OPS}
    forced = {}
    for item in spec.split(","):
        op, _, name = item.partition("=")
        op, name = op.strip(), name.strip()
        if op not in OPS:
            raise ValueError(f"{PROVIDER_ENV}: unknown op {op!r}; expected one of {OPS}")
        forced[op] = name
    return forced


@contextlib.contextmanager
def use_provider(name: str, ops: tuple[str, ...] | None = None) -> Iterator[None]:
    """Force provider ``name`` for ``ops`` (default: all) on every device, inside the block.

    Applies when the op runs, so it also steers already compiled functions. Example, an A/B
    accuracy run against the reference::

        with dsv4_compile.use_provider("reference"):
            expected = model(x)
    """
    for op in ops or ():
        if op not in OPS:
            raise ValueError(f"use_provider: unknown op {op!r}; expected one of {OPS}")
    previous = getattr(_override, "forced", None)
    _override.forced = {**(previous or {}), **{op: name for op in (ops or OPS)}}
    try:
        yield
    finally:
        _override.forced = previous


def _candidates(device_type: str, op: str | None = None) -> list[Provider]:
    return [
        p for p in _registry.providers
        if p.device_type in (device_type, "*") and (op is None or op in p.ops)
    ]


def _load(provider: Provider, device: torch.device) -> Mapping[str, Callable]:
    key = ("load", provider.name, provider.device_type, str(device))
    if key not in _registry.cache:
        try:
            _registry.cache[key] = dict(provider.load(device))
        except ProviderUnavailable as exc:
            _registry.cache[key] = exc
    result = _registry.cache[key]
    if isinstance(result, ProviderUnavailable):
        raise result
    return result


def resolve(op: str, device: torch.device) -> tuple[str, Callable]:
    """The provider name and kernel that serve ``op`` on ``device`` under the current override."""
    provider, kernel = _resolve(op, device)
    return provider.name, kernel


def metadata_shapes(device: torch.device, batch: int, s_q: int, heads: int) -> tuple[tuple, tuple]:
    """Shapes of ``get_mla_metadata``'s outputs from the provider that serves it on ``device``."""
    provider, _ = _resolve("get_mla_metadata", device)
    if provider.metadata_shapes is None:
        return (0,), (0,)
    return provider.metadata_shapes(device, batch, s_q, heads)


def _resolve(op: str, device: torch.device) -> tuple[Provider, Callable]:
    forced = _forced()
    if forced is not None:
        forced = forced.get(op)
    key = (op, device, forced)  # the hot path: one dict lookup per call
    hit = _registry.cache.get(key)
    if hit is not None:
        return hit
    if op not in OPS:
        raise ValueError(f"unknown dsv4 op {op!r}; expected one of {OPS}")
    candidates = _candidates(device.type, op)
    if forced is not None:
        chosen = [p for p in candidates if p.name == forced]
        if not chosen:
            raise ProviderUnavailable(
                f"provider {forced!r} forced for dsv4.{op} is not registered for {device.type}; "
                f"registered for this op: {[p.name for p in candidates]}"
            )
        kernels = _load(chosen[0], device)
        if op not in kernels:
            raise ProviderUnavailable(f"provider {forced!r} forced for dsv4.{op} does not implement it")
        result = (chosen[0], kernels[op])
    else:
        skipped = []
        result = None
        for provider in candidates:
            try:
                kernels = _load(provider, device)
            except ProviderUnavailable as exc:
                skipped.append(f"{provider.name!r}: {exc}")
                continue
            if op in kernels:
                result = (provider, kernels[op])
                break
        if result is None:  # the reference provider serves every op; reaching this is a bug
            raise ProviderUnavailable(f"no provider serves dsv4.{op} on {device}")
        if skipped and result[0].fallback and (op, str(device)) not in _registry.warned:
            _registry.warned.add((op, str(device)))
            warnings.warn(
                f"dsv4.{op} on {device} uses provider {result[0].name!r}; skipped "
                + "; ".join(skipped),
                RuntimeWarning,
                stacklevel=3,
            )
    _registry.cache[key] = result
    return result


def delegate(op: str, device: torch.device, below: str, reason: str) -> Callable:
    """The kernel of the best provider ranked below provider ``below`` that serves ``op`` on
    ``device``: for a provider that can serve the device but not one particular call (a page size,
    a page stride). Warns once per ``(op, device, below)`` with ``reason``. The reference serves
    when nothing else does."""
    candidates = _candidates(device.type, op)
    names = [p.name for p in candidates]
    start = names.index(below) + 1 if below in names else 0
    for provider in candidates[start:]:
        try:
            kernels = _load(provider, device)
        except ProviderUnavailable:
            continue
        if op in kernels:
            break
    else:  # the reference provider serves every op; reaching this is a bug
        raise ProviderUnavailable(f"no provider below {below!r} serves dsv4.{op} on {device}")
    key = ("delegate", op, str(device), below)
    if key not in _registry.warned:
        _registry.warned.add(key)
        warnings.warn(
            f"dsv4.{op} on {device}: {reason}; provider {provider.name!r} serves it instead",
            RuntimeWarning,
            stacklevel=4,
        )
    return kernels[op]


def providers(device: torch.device | str | None = None) -> dict[str, str]:
    """Which provider serves each op on ``device`` (default: CUDA if present, else CPU).

    Resolving may import provider libraries, but runs no kernel.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return {op: resolve(op, device)[0] for op in OPS}


def backend_kernel(
    op: str, device_type: str | None, defaults: tuple = (), check: Callable | None = None
) -> Callable:
    """The kernel registered for one dispatch key: check the arguments, resolve the provider, call it.

    ``device_type`` is the key's device type (so a redispatch to the XPU key runs the XPU
    provider even with CPU tensors, as the adapter tests do); ``None`` takes it from the tensors.
    The dispatcher drops trailing arguments equal to their schema defaults; ``defaults`` (the
    schema's default values, ``None`` where an argument has none) restores them, so every provider
    kernel receives the full positional argument list. ``check(*args, data=True)`` is the op's
    validation (:mod:`dsv4_compile.checks`): it runs here, once, before any provider kernel, so
    provider kernels receive validated arguments.
    """

    def kernel(*args):
        if len(args) < len(defaults):
            args = args + defaults[len(args):]
        if check is not None:
            check(*args, data=True)
        device = args[0].device  # every op's first argument is a tensor
        if device_type is not None and device.type != device_type:
            device = torch.device(device_type, device.index if device.index is not None else 0)
        return resolve(op, device)[1](*args)

    kernel.__name__ = f"dsv4_{op}_{device_type or 'any'}"
    return kernel
