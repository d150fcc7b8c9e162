"""Where an op's declaration becomes the op: :func:`define` takes one :class:`OpSpec`.

For each op, :func:`define` registers in the ``dsv4`` namespace the schema (``Library.define``);
the fake (the op's metadata checks, then empty outputs of its geometry); one kernel per dispatch
key, ``CPU``, ``CUDA``, ``XPU`` and ``CompositeExplicitAutograd`` for any other device, each
:func:`dispatch.backend_kernel`'s trampoline into the provider that serves the call; and an
``Autograd`` fallthrough (the ops have no backward: the trampoline rejects inputs that require
grad). An argument ``bool batch_invariant`` marks an op whose kernels may depend on the rest of
the batch unless asked not to (docs/design.md §3): the trampoline resolves such a call among the
providers with a batch-invariant kernel. It adds the op to ``dispatch.OPS`` and returns the :class:`Op`, whose :attr:`Op.run` the
op's public wrapper calls. What a call needs of the schema (defaults, which arguments are tensors,
which may require grad, which name a cache format) is derived here, once, so the per-call path
parses nothing.

The op modules (``store``, ``decode``, ...) import this module; it imports none of them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .. import dispatch

NAMESPACE = "dsv4"
#: Each op's schema, by op name (tests/test_schemas.py pins them).
SCHEMAS: dict[str, str] = {}
#: Each defined op, by name.
DEFINED: dict[str, Op] = {}

#: The argument that asks an op for the batch-invariant mode (:mod:`dsv4_compile.invariance`).
INVARIANT_ARG = "batch_invariant"

_lib = torch.library.Library(NAMESPACE, "DEF")
_TENSOR = torch._C.OptionalType.ofTensor()  # Tensor and Tensor? are its subtypes


class NoCall(NamedTuple):
    """The call signature of an op whose providers have no per-call rule."""


@dataclass(frozen=True)
class OpSpec:
    """One op, as its module declares it. ``check``, ``check_data`` and ``call_fields`` take the
    op's arguments by name, in schema order; ``outputs`` takes the ones it names. :func:`define`
    holds the names to the schema's."""

    #: the schema, without the namespace: ``"name(Tensor q, ...) -> (...)"``; the contract
    schema: str
    #: the metadata checks (dtypes, shapes, devices, geometry; no data read): every call, and the
    #: fake; each failure names the argument, the expected and the actual value
    check: Callable
    #: the data checks (values in range; a device sync on a GPU): in checked mode, and always
    #: before a provider that indexes with the values (``Provider.checks_data``)
    check_data: Callable
    #: the op's outputs, empty, in the geometry every provider returns them (the fake returns them
    #: after ``check``), from the arguments its parameters name, e.g. ``decode_outputs(q,
    #: head_dim_v)``; ``None`` for an op that returns nothing (it writes an input)
    outputs: Callable | None = None
    #: the floating-point inputs, the ones that could require grad: one that does, under grad mode,
    #: is an error naming it (the ops are inference-only)
    float_inputs: tuple[str, ...] = ()
    #: the call signature: what provider rules (``dispatch.Rule``) may read of a call (page sizes,
    #: page strides, formats); resolutions are cached per signature
    call: type = NoCall
    #: the fields of ``call``, a plain tuple, from the op's arguments (``None``: ``call`` has none)
    call_fields: Callable | None = None
    #: the ``str`` arguments that name a cache format (``layout.FORMATS``, ``layout.INDEX_FORMATS``):
    #: from the kernels' trampoline on (the checks, the call signature, the provider kernels) they
    #: are the ``layout.CacheFormat`` / ``layout.IndexFormat`` objects (``None`` stays ``None``)
    formats: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Op:
    """A defined op: its spec and what :func:`define` derived from it."""

    name: str
    spec: OpSpec
    overload: torch._ops.OpOverload  # torch.ops.dsv4.<name>.default
    defaults: tuple  # per argument, its schema default (None where it has none)
    formats: tuple[int, ...]  # the positions of the arguments that name a cache format
    invariant_at: int | None  # the position of the ``batch_invariant`` argument (None: the op has none)
    #: ``run(*args)``, the arguments in schema order: the op's call from its Python wrapper; in
    #: plain eager use (``dispatch.direct_call_allowed``) the kernels' path (``dispatch.backend_kernel``)
    #: without the dispatcher's round trip, else :attr:`overload`
    run: Callable

    def arguments(self, args: tuple) -> tuple:
        """``args`` as provider kernels receive them (:func:`_completed`)."""
        return _completed(tuple(args), self.defaults, self.formats)

    def signature(self, args: tuple) -> tuple:
        """The call signature (``spec.call``) of a call with ``args`` (:meth:`arguments`)."""
        fields = self.spec.call_fields
        return self.spec.call(*(fields(*args) if fields else ()))

    def invariant(self, args: tuple) -> bool:
        """Whether a call with ``args`` (:meth:`arguments`) asks for the batch-invariant mode."""
        return self.invariant_at is not None and args[self.invariant_at] is True


def define(spec: OpSpec) -> Op:
    """Define the op ``spec`` declares, with its fake and kernels (see the module docstring)."""
    _lib.define(spec.schema)
    name = spec.schema.split("(", 1)[0]
    overload = getattr(getattr(torch.ops, NAMESPACE), name).default
    arguments = overload._schema.arguments
    names = tuple(a.name for a in arguments)
    for role in ("check", "check_data", "call_fields"):
        fn = getattr(spec, role)
        if fn is not None and tuple(inspect.signature(fn).parameters) != names:
            raise TypeError(f"dsv4.{name}: OpSpec.{role} must take the op's arguments {names}, "
                            f"got {tuple(inspect.signature(fn).parameters)}")
    outputs = () if spec.outputs is None else tuple(inspect.signature(spec.outputs).parameters)
    for role, named in (("outputs", outputs), ("float_inputs", spec.float_inputs), ("formats", spec.formats)):
        if not set(named) <= set(names):
            raise TypeError(f"dsv4.{name}: OpSpec.{role} names no argument: {sorted(set(named) - set(names))}")

    defaults = tuple(a.default_value if a.has_default_value() else None for a in arguments)
    formats = tuple(names.index(arg) for arg in spec.formats)
    fake = _fake(spec.check, spec.outputs, tuple(names.index(arg) for arg in outputs), defaults, formats)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_lib)

    invariant_at = names.index(INVARIANT_ARG) if INVARIANT_ARG in names else None
    dispatch.register_op(name, invariant=invariant_at is not None)
    grad_args = tuple((i, arg) for i, arg in enumerate(names) if arg in spec.float_inputs)
    parts = (defaults, formats, spec.check, spec.check_data, (spec.call, spec.call_fields or _no_fields), grad_args,
             invariant_at)
    for key in ("CPU", "CUDA", "XPU"):
        _lib.impl(name, dispatch.backend_kernel(name, key.lower(), *parts), key)
    _lib.impl(name, dispatch.backend_kernel(name, None, *parts), "CompositeExplicitAutograd")
    # No backward: autograd falls through to the kernels above, which reject inputs requiring grad.
    _lib.impl(name, torch.library.fallthrough_kernel, "Autograd")

    tensors = tuple(i for i, a in enumerate(arguments) if a.type.isSubtypeOf(_TENSOR))
    tensor_lists = tuple(
        i for i, a in enumerate(arguments)
        if isinstance(a.type, torch.ListType) and a.type.getElementType().isSubtypeOf(_TENSOR)
    )
    run = dispatch.backend_kernel(name, None, *parts, entry=(overload, tensors, tensor_lists))
    SCHEMAS[name] = spec.schema
    DEFINED[name] = Op(name, spec, overload, defaults, formats, invariant_at, run)
    return DEFINED[name]


def _no_fields(*args) -> tuple:
    return ()


def _completed(args: tuple, defaults: tuple, formats: tuple[int, ...]) -> tuple:
    """``args`` with the trailing defaults the dispatcher drops restored and the cache-format names
    at ``formats`` resolved (:func:`dispatch.with_formats`): as the fake, the decomposition rules and
    provider kernels take them (``dispatch.backend_kernel`` does the same inline)."""
    args = args + defaults[len(args):]
    return dispatch.with_formats(args, formats) if formats else args


def _fake(check: Callable, outputs: Callable | None, positions: tuple[int, ...], defaults: tuple,
          formats: tuple[int, ...]) -> Callable:
    def fake(*args):
        args = _completed(args, defaults, formats)
        check(*args)
        if outputs is not None:
            return outputs(*(args[i] for i in positions))

    return fake
