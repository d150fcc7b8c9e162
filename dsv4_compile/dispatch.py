"""Providers: which implementation serves each ``dsv4`` op on each device, and how to override it.

A *provider* is a named set of kernels for one device type (``"cuda"``, ``"xpu"``, ...) — FlashMLA
on CUDA, sgl-kernel-xpu on XPU, our Triton kernels, the plain-PyTorch reference. Each provider module
registers its own entries (:func:`register_provider`) at import, without importing any library;
their order is :data:`RANKING`, in this one place. A provider may declare a :class:`Rule` per op:
a condition on the call (a page size, a page stride) it needs; a call that fails it goes to the
next provider, with one warning.

The ops are those defined (each op's definition adds it: :func:`register_op`); this module names
none but the decode, whose provider its scheduler ops follow. Resolution is lazy and cached: the
first call of an op on a device, with a given *call signature* (the properties rules look at:
``OpSpec.call``) and override, loads the candidates (importing their libraries), applies the rules
and remembers the kernel. Every later call with that signature is one dict lookup. The op kernel
registered for a dispatch key (``CPU``, ``CUDA``, ``XPU``) is :func:`backend_kernel`: validate,
look up, call. So the dispatcher picks the device, this module picks the provider, and no caller
ever branches on either.

Batch-invariant mode (:mod:`.invariance`): a call whose ``batch_invariant`` argument is true
goes only to a provider that declares a batch-invariant kernel for the op (``Provider.invariant``,
with what it needs of such a call); a provider skipped for that is named in the one warning.

Override: ``DSV4_COMPILE_PROVIDER=reference`` (environment) or ``with use_provider("reference"):``
forces one provider for every op (or for the ops named). A forced provider that cannot serve a call
is an error, never a silent substitute. The environment is read at import (by :func:`reset`, once
the ops it may name are defined) and by later calls of :func:`reset`, not on every call;
:func:`use_provider` applies when the op runs, so it also steers already compiled functions whose
ops stayed opaque.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, NamedTuple

import torch

from . import checks, invariance, layout

#: The ``dsv4`` ops, in the order they were defined (:func:`register_op`).
OPS: tuple[str, ...] = ()
#: The ops that take a ``batch_invariant`` argument (the others are row-wise on every provider).
INVARIANT_OPS: tuple[str, ...] = ()
REFERENCE = "reference"
PROVIDER_ENV = "DSV4_COMPILE_PROVIDER"
#: The decode, and the ops whose schedules only the decode's provider can read: they follow it
#: (an override of the decode forces them too).
DECODE = "flash_mla_with_kvcache"
METADATA_OPS = ("get_mla_metadata", "get_mla_metadata_stacked")

#: Priorities of the providers this package ships (higher wins where several can serve a call):
#: vendor libraries first, then our Triton kernels, then the reference, which serves everything.
RANKING = {
    "sgl_kernel_xpu": 100,  # sgl-kernel-xpu on Intel GPUs (providers/sgl_kernel_xpu.py)
    "sgl_kernel": 30,  # FlashMLA in sgl-kernel's sgl_kernel.flash_mla (providers/flashmla/adapter.py)
    "flashmla": 20,  # FlashMLA's legacy kernels in sgl-flash-mla (providers/flashmla/adapter.py)
    "triton": 0,  # our portable Triton kernels (providers/triton/: store.py, attention.py, indexer.py, rope.py)
    REFERENCE: -1000,  # plain PyTorch, every device (providers/reference.py)
}


class ProviderUnavailable(RuntimeError):
    """A provider cannot serve a device (library missing, unsupported GPU, ...) or a call."""


@dataclass(frozen=True)
class Rule:
    """What a provider needs of one call of an op, beyond the device: ``accepts(device, call)``
    on the call's signature (``OpSpec.call``: page size, page strides, ...), and the same condition
    in words for :func:`provider_chain` and the fallback warning."""

    needs: str
    accepts: Callable[[torch.device, tuple], bool]


@dataclass
class Provider:
    """A named set of kernels for one device type.

    ``load(device)`` imports what the provider needs and returns ``{op: kernel}`` for the ops it
    serves on that device, or raises :class:`ProviderUnavailable` saying why not. Kernels take the
    op's arguments positionally, in schema order, validated (``OpSpec.check``), cache formats as
    ``layout.CacheFormat`` objects (``OpSpec.formats``). Several entries may
    share a name (one per kernel module); forcing the name forces them all.
    """

    name: str
    device_type: str  # "cuda", "xpu", "cpu", ... or "*" for every device type
    load: Callable[[torch.device], Mapping[str, Callable]]
    ops: tuple[str, ...] | None = None  # the ops it can serve (when available); None: every op
    priority: int | None = None  # higher wins; default RANKING[name]
    #: a fallback (a slower path: Triton, the reference) warns once when it serves an op because
    #: a provider above it is unavailable (any provider warns once when it serves a call a rule of a
    #: provider above it refused)
    fallback: bool = False
    #: per op, what the provider needs of a call (absent: any call of a served device)
    rules: Mapping[str, Rule] = field(default_factory=dict)
    #: run the ops' data checks (slots, indices, lengths, positions in range) before every call,
    #: not only in checked mode: the kernels index with those values (the reference does)
    checks_data: bool = False
    #: the ops whose kernels reject every call the metadata checks reject, raising before any
    #: effect (the library's own checks, plus the adapter's for what the library cannot see): the
    #: trampoline does not run the metadata checks before them, only after one raises, so that a
    #: malformed call still gets the checks' error (see :func:`backend_kernel`)
    validates: tuple[str, ...] = ()
    #: the ops (of :data:`INVARIANT_OPS`) whose kernels keep a row's outputs independent of the
    #: rest of its call when the call's ``batch_invariant`` argument asks (docs/design.md §3), each
    #: with what it needs of such a call (``None``: any call it serves); a call in the mode does not
    #: go to a provider without one
    invariant: Mapping[str, Rule | None] = field(default_factory=dict)

    def __post_init__(self):
        if self.priority is None:
            self.priority = RANKING[self.name]


@dataclass
class _Registry:
    providers: list[Provider] = field(default_factory=list)
    loaded: dict = field(default_factory=dict)  # (provider entry, device) -> kernels, or why not (str)
    resolved: dict = field(default_factory=dict)  # op -> key -> _Resolution (register_op adds the op)
    warned: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    env_forced: dict | None = None  # DSV4_COMPILE_PROVIDER, parsed by reset()
    metadata_shapes: dict = field(default_factory=dict)  # device type -> shapes function


class _ThreadState(threading.local):
    forced = None  # the innermost use_provider's {op: name} on this thread (a class default: a fast read)


_registry = _Registry()
_local = _ThreadState()


def _key(p: Provider) -> tuple:
    return p.name, p.device_type, p.ops


def register_op(op: str, invariant: bool = False) -> None:
    """Add ``op`` to :data:`OPS`, and to :data:`INVARIANT_OPS` if it takes a ``batch_invariant``
    argument (``ops.registry.define`` does, for each op it defines)."""
    global OPS, INVARIANT_OPS
    with _registry.lock:
        if op not in OPS:
            OPS = (*OPS, op)
            _registry.resolved[op] = {}
        if invariant and op not in INVARIANT_OPS:
            INVARIANT_OPS = (*INVARIANT_OPS, op)


def register_provider(provider: Provider) -> None:
    """Add (or replace: same name, device type and ops) a provider; forget cached resolutions."""
    with _registry.lock:
        _registry.providers = [p for p in _registry.providers if _key(p) != _key(provider)]
        _registry.providers.append(provider)
        _registry.providers.sort(key=lambda p: -p.priority)
        _forget()


def unregister_provider(name: str, device_type: str) -> None:
    """Remove every entry of a provider for ``device_type`` (none: no error); forget resolutions."""
    with _registry.lock:
        _registry.providers = [
            p for p in _registry.providers if (p.name, p.device_type) != (name, device_type)
        ]
        _forget()


def registered_providers(device_type: str) -> list[str]:
    """Names of the providers registered for ``device_type``, best first."""
    return list(dict.fromkeys(p.name for p in _candidates(device_type)))


def register_metadata_shapes(device_type: str, shapes: Callable | None) -> None:
    """``shapes(device, batch, s_q, heads) -> (metadata shape, num_splits shape)``: the geometry
    of ``get_mla_metadata``'s outputs on ``device_type``, the same for every provider there (so a
    graph traced under one provider runs under another). Unregistered device types: ``(0,)``.
    ``None`` removes the entry."""
    if shapes is None:
        _registry.metadata_shapes.pop(device_type, None)
    else:
        _registry.metadata_shapes[device_type] = shapes


def metadata_shapes(device: torch.device, batch: int, s_q: int, heads: int) -> tuple[tuple, tuple]:
    """The shapes of ``get_mla_metadata``'s outputs on ``device`` (see :func:`register_metadata_shapes`)."""
    shapes = _registry.metadata_shapes.get(device.type)
    return ((0,), (0,)) if shapes is None else shapes(device, batch, s_q, heads)


def _forget() -> None:
    _registry.loaded.clear()
    for table in _registry.resolved.values():
        table.clear()


def reset() -> None:
    """Forget cached resolutions and warnings, and re-read the environment
    (``DSV4_COMPILE_PROVIDER``, ``DSV4_COMPILE_CHECKED``, ``DSV4_COMPILE_BATCH_INVARIANT``): after
    changing it, or installing a library at run time (the ``ops`` package calls it at import, once
    every op is defined). Raises ``ValueError`` for a malformed ``DSV4_COMPILE_PROVIDER``."""
    with _registry.lock:
        _forget()
        _registry.warned.clear()
        env = os.environ.get(PROVIDER_ENV, "").strip()
        _registry.env_forced = _parse_override(env) if env else None
        checks.read_environment()
        invariance.read_environment()


def _parse_override(spec: str) -> dict[str, str]:
    """``"name"`` forces all ops; ``"op=name,op2=name2"`` forces the ops named."""
    if "=" not in spec:
        return {op: spec for op in OPS}
    forced = {}
    for item in spec.split(","):
        op, _, name = item.partition("=")
        forced[op.strip()] = name.strip()
    return _forcing(forced, PROVIDER_ENV)


def _forcing(forced: dict[str, str], where: str) -> dict[str, str]:
    """Check an override's ops; scheduler metadata follows the decode's provider (a schedule is
    meaningful only to the kernel that made it), so forcing the decode forces it too."""
    for op in forced:
        if op not in OPS:
            raise ValueError(f"{where}: unknown op {op!r}; expected one of {OPS}")
    for metadata in METADATA_OPS:
        if metadata in forced and forced[metadata] != forced.get(DECODE):
            raise ValueError(
                f"{where}: {metadata} follows {DECODE}'s provider (its schedule is meaningful only "
                f"to that kernel): force {DECODE} instead"
            )
    if DECODE in forced:
        forced.update(dict.fromkeys(METADATA_OPS, forced[DECODE]))
    return forced


def forced_providers() -> dict[str, str] | None:
    """The override in force on this thread: the innermost :func:`use_provider`, else the
    environment (as last read), else ``None``."""
    return _local.forced or _registry.env_forced


@contextlib.contextmanager
def use_provider(name: str, ops: tuple[str, ...] | None = None) -> Iterator[None]:
    """Force provider ``name`` for ``ops`` (default: all) on every device, inside the block.

    Applies when the op runs, so it also steers already compiled functions (except Triton
    launches traced into a graph: see the README). Example, an A/B accuracy run::

        with dsv4_compile.use_provider("reference"):
            expected = model(x)
    """
    forcing = _forcing({op: name for op in (ops or OPS)}, "use_provider")
    previous = _local.forced
    _local.forced = {**(previous or _registry.env_forced or {}), **forcing}
    try:
        yield
    finally:
        _local.forced = previous


def _candidates(device_type: str, op: str | None = None) -> list[Provider]:
    return [
        p for p in _registry.providers
        if p.device_type in (device_type, "*") and (op is None or p.ops is None or op in p.ops)
    ]


def _load(provider: Provider, device: torch.device) -> Mapping[str, Callable]:
    key = (_key(provider), device)
    result = _registry.loaded.get(key)
    if result is None:
        try:
            result = _registry.loaded[key] = dict(provider.load(device))
        except ProviderUnavailable as exc:
            # kept as its message: the exception's traceback holds the frames of the call that
            # loaded the provider, and with them that call's tensors (inside a CUDA-graph warm-up,
            # tensors of the graph's pool), for as long as the process runs
            _registry.loaded[key] = str(exc)
            raise
    if isinstance(result, str):
        raise ProviderUnavailable(result)
    return result


def _mode_rule(provider: Provider, op: str, invariant: bool) -> tuple[bool, Rule | None]:
    """``(serves, rule)``: whether ``provider`` may serve a call of ``op`` in the batch-invariant
    mode (``invariant``) or not, and the rule such a call must meet."""
    if not invariant:
        return True, provider.rules.get(op)
    if op not in provider.invariant:
        return False, None
    return True, provider.invariant[op] or provider.rules.get(op)


def _resolve(op: str, device: torch.device, call: tuple | None, forced: str | None, invariant: bool = False) -> tuple:
    """``(provider, kernel)`` for a call of ``op`` on ``device`` with signature ``call`` (``None``:
    ignore the rules), forced to provider ``forced`` or not, in the batch-invariant mode
    (``invariant``: the call's ``batch_invariant`` argument) or not. Not cached; see :func:`_lookup`."""
    if op not in OPS:
        raise ValueError(f"unknown dsv4 op {op!r}; expected one of {OPS}")
    candidates = _candidates(device.type, op)
    skipped, ruled_out = [], False
    for provider in candidates:
        if forced is not None and provider.name != forced:
            continue
        try:
            kernels = _load(provider, device)
        except ProviderUnavailable as exc:
            if forced is not None:
                raise
            skipped.append(f"{provider.name!r}: {exc}")
            continue
        if op not in kernels:
            continue
        serves, rule = _mode_rule(provider, op, invariant)
        reason = None
        if not serves:
            reason = f"{provider.name!r} has no batch-invariant kernel for it"
        elif call is not None and rule is not None and not rule.accepts(device, call):
            reason = f"{provider.name!r} needs {rule.needs} ({_describe_call(call)})"
        if reason is not None:
            if forced is not None:
                raise ProviderUnavailable(f"provider {forced!r} forced for dsv4.{op} cannot serve this call: {reason}")
            skipped.append(reason)
            ruled_out = True
            continue
        warn = skipped and (provider.fallback or ruled_out)
        if warn and (op, device, provider.name, invariant) not in _registry.warned:
            _registry.warned.add((op, device, provider.name, invariant))
            mode = " in the batch-invariant mode" if invariant else ""
            warnings.warn(
                f"dsv4.{op} on {device}{mode} uses provider {provider.name!r}; skipped " + "; ".join(skipped),
                RuntimeWarning,
                stacklevel=4,
            )
        return provider, kernels[op]
    if forced is not None:
        raise ProviderUnavailable(
            f"provider {forced!r} forced for dsv4.{op} is not registered for {device.type}; "
            f"registered for this op: {list(dict.fromkeys(p.name for p in candidates))}"
        )
    raise ProviderUnavailable(f"no provider serves dsv4.{op} on {device}")  # the reference serves all


def _describe_call(call: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in call._asdict().items()) if hasattr(call, "_asdict") else repr(call)


class _Resolution(NamedTuple):
    kernel: Callable
    checks_data: bool  # run the data checks before every call (Provider.checks_data)
    validates: bool  # the kernel checks the call itself (op in Provider.validates)


def _lookup(op: str, device: torch.device, call_type: type, call: tuple, invariant: bool) -> _Resolution:
    """The resolution for a call with signature ``call`` (a plain tuple, the fields of
    ``call_type``), in the batch-invariant mode or not, resolved and cached (the trampolines of
    :func:`backend_kernel` read the cache directly: one dict lookup per call once resolved)."""
    forced = _local.forced or _registry.env_forced
    name = forced.get(op) if forced else None
    table = _registry.resolved[op]
    key = (device, call, name, invariant)
    hit = table.get(key)
    if hit is None:
        provider, kernel = _resolve(op, device, call_type(*call), name, invariant)
        hit = table[key] = _Resolution(kernel, provider.checks_data, op in provider.validates)
    return hit


def resolve(op: str, device: torch.device, call: tuple | None = None, batch_invariant: bool = False) -> tuple[str, Callable]:
    """The provider name and kernel that serve ``op`` on ``device`` under the current override,
    for a call with signature ``call`` (``OpSpec.call``; ``None``: a call every rule accepts) and
    ``batch_invariant`` argument (ignored for an op without one)."""
    forced = forced_providers()
    invariant = batch_invariant and op in INVARIANT_OPS
    provider, kernel = _resolve(op, device, call, forced.get(op) if forced else None, invariant)
    return provider.name, kernel


def _default_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def providers(device: torch.device | str | None = None, batch_invariant: bool | None = None) -> dict[str, str]:
    """Which provider serves each op on ``device`` (default: CUDA if present, else CPU), for the
    calls its rules accept (:func:`provider_chain` says which, and who serves the others), in the
    batch-invariant mode if ``batch_invariant`` (``None``: the switch, :mod:`.invariance`).

    Resolving may import provider libraries, but runs no kernel.
    """
    device = _default_device(device)
    mode = invariance.resolve(batch_invariant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return {op: resolve(op, device, batch_invariant=mode)[0] for op in OPS}


def provider_chain(device: torch.device | str | None = None, batch_invariant: bool | None = None) -> dict[str, list[tuple[str, str]]]:
    """Per op, the available providers on ``device`` in the order they are tried, each with what
    it needs of a call (``"any call"``), down to the first that takes any call; in the
    batch-invariant mode if ``batch_invariant`` (``None``: the switch), where the providers without
    a batch-invariant kernel for an op are left out. E.g. on XPU:
    ``{"fused_k_norm_rope_flashmla": [("sgl_kernel_xpu", "page_size a power of two"),
    ("triton", "any call")], ...}``."""
    device = _default_device(device)
    forced = forced_providers()
    mode = invariance.resolve(batch_invariant)
    chain = {}
    for op in OPS:
        name = forced.get(op) if forced else None
        rows = []
        for provider in _candidates(device.type, op):
            if name is not None and provider.name != name:
                continue
            try:
                if op not in _load(provider, device):
                    continue
            except ProviderUnavailable:
                continue
            serves, rule = _mode_rule(provider, op, mode and op in INVARIANT_OPS)
            if not serves:
                continue
            rows.append((provider.name, "any call" if rule is None else rule.needs))
            if rule is None:
                break
        chain[op] = rows
    return chain


_Tensor = torch.Tensor
_FORMATS = {**layout.FORMATS, **layout.INDEX_FORMATS}  # distinct names


def with_formats(args: tuple, positions: tuple[int, ...]) -> tuple:
    """``args`` with the cache-format names at ``positions`` replaced by their
    ``layout.CacheFormat`` / ``layout.IndexFormat`` objects (``None``, and anything that names no
    format, kept as it is: the metadata checks reject the latter, naming the argument)."""
    args = list(args)
    for i in positions:
        name = args[i]
        if type(name) is str:
            args[i] = _FORMATS.get(name, name)
    return tuple(args)


def direct_call_allowed(args: tuple, tensors: tuple[int, ...], tensor_lists: tuple[int, ...] = ()) -> bool:
    """Whether a call from the Python wrappers (``dsv4_compile.flash_mla_with_kvcache``, ...) with
    ``args`` may skip the dispatcher and run :func:`backend_kernel`'s path directly, as the
    dispatcher would route it: eager (not traced by ``torch.compile``/``torch.export``), no dispatch
    or function mode, no functorch transform, the profiler off (so traces show the ``dsv4`` op), and
    every tensor a plain ``torch.Tensor`` on CPU, CUDA or XPU: ``args[i]`` for ``i`` in ``tensors``
    (``None`` skipped), and the entries of ``args[i]`` for ``i`` in ``tensor_lists``."""
    if (
        torch.compiler.is_compiling()
        or _len_torch_dispatch_stack()
        or _is_torch_function_mode_enabled()
        or _are_functorch_transforms_active()
        or _profiler_enabled()
    ):
        return False
    for i in tensors:
        t = args[i]
        if t is not None and (type(t) is not _Tensor or not (t.is_cuda or t.is_cpu or t.is_xpu)):
            return False
    for i in tensor_lists:
        if not direct_call_allowed(args[i], range(len(args[i]))):
            return False
    return True


_len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack
_is_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_are_functorch_transforms_active = torch._C._are_functorch_transforms_active
_profiler_enabled = torch._C._autograd._profiler_enabled


def backend_kernel(
    op: str,
    device_type: str | None,
    defaults: tuple,
    formats: tuple[int, ...],
    check: Callable,
    check_data: Callable,
    call: tuple[type, Callable[..., tuple]],
    grad_args: tuple[tuple[int, str], ...],
    invariant_at: int | None = None,
    entry: tuple[Callable, tuple[int, ...], tuple[int, ...]] | None = None,
) -> Callable:
    """The kernel registered for one dispatch key: validate, find the provider kernel, call it.

    ``device_type`` is the key's device type (a redispatch to the XPU key runs the XPU provider
    even with CPU tensors, as the adapter tests do); ``None`` takes it from the tensors. The
    dispatcher drops trailing arguments equal to their schema defaults; ``defaults`` (the schema's
    defaults, ``None`` where an argument has none) restores them, so provider kernels receive the
    full positional list, and the cache-format names at ``formats`` become their
    ``layout.CacheFormat`` objects (:func:`with_formats`) for everything below. Per call, in this
    order, before any provider kernel runs:

    * inference only: under grad mode, the inputs at ``grad_args`` (``(index, name)``) must not
      require grad (the op has no backward; the Autograd key falls through to here);
    * the provider kernel for the device, the call's signature (``call``: its type and
      ``fields(*args)``, a plain tuple) and its ``batch_invariant`` argument (at ``invariant_at``;
      ``None``: the op has none), one dict lookup (the first call of a signature is checked, then
      resolved);
    * ``check(*args)``: the metadata checks (dtypes, shapes, devices, geometry; no data read).
      For a provider kernel that checks the call itself (``Provider.validates``) they run only if
      it raises (and outside checked mode), to replace its error with theirs when the call is
      malformed; so an eager call does not pay for the same checks twice;
    * ``check_data(*args)``: the data checks, in checked mode or for a provider that needs them.

    A call whose signature cannot even be read (an argument that is no tensor) runs the metadata
    checks for their error.

    ``entry`` = ``(overload, tensors, tensor_lists)`` makes it the Python wrapper's entry instead
    (``Op.run``): a call :func:`direct_call_allowed` refuses (``tensors``, ``tensor_lists``: where
    the tensors are) goes to ``overload``, the dispatcher, which routes it to a kernel of this path;
    any other runs the path directly, without the dispatcher's round trip.
    """
    nargs = len(defaults)
    overload, tensors, tensor_lists = entry or (None, (), ())
    call_type, call_fields = call
    table = _registry.resolved[op]  # cleared in place, never replaced
    is_grad_enabled, checked_mode = torch.is_grad_enabled, checks.checked_mode

    def kernel(*args):
        if entry is not None and not direct_call_allowed(args, tensors, tensor_lists):
            return overload(*args)
        if len(args) < nargs:
            args = args + defaults[len(args):]
        if formats:
            args = with_formats(args, formats)
        if is_grad_enabled():
            for i, name in grad_args:
                if args[i] is not None and args[i].requires_grad:
                    raise RuntimeError(
                        f"dsv4.{op} is inference-only (no backward): {name} requires grad; call it "
                        f"under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()"
                    )
        try:
            device = args[0].device  # every op's first argument is a tensor
            if device_type is not None and device.type != device_type:
                device = torch.device(device_type, device.index if device.index is not None else 0)
            forced = _local.forced or _registry.env_forced
            invariant = invariant_at is not None and args[invariant_at] is True
            hit = table.get((device, call_fields(*args), forced.get(op) if forced else None, invariant))
        except Exception:
            check(*args)  # a malformed call: its error
            raise
        if hit is None:  # a new call signature: checked before any provider is loaded for it
            check(*args)
            hit = _lookup(op, device, call_type, call_fields(*args), invariant)
        provider_kernel, data, validates = hit
        if data or checked_mode():
            check(*args)
            check_data(*args)
        elif validates:
            try:
                return provider_kernel(*args)
            except Exception:
                check(*args)  # a malformed call: the checks' error instead of the kernel's
                raise
        else:
            check(*args)
        return provider_kernel(*args)

    kernel.__name__ = f"dsv4_{op}_{'entry' if entry else device_type or 'any'}"
    return kernel
