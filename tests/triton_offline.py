"""The package's Triton launches compiled for an NVIDIA GPU on a machine without one.

:func:`recorded` makes the provider entry points record their launches (on CPU tensors) instead of
running them, with the choices a GPU of a given compute capability gets: the launch geometries
(:func:`dsv4_compile.providers.triton.attention._geometry_capability`, :data:`SHARED_PER_BLOCK`)
and the conversion instructions (:func:`dsv4_compile.providers.triton.common.nvidia_compiled`).
:func:`compile_launch` compiles one recorded launch as Triton specialises the real one (an int
argument equal to 1 made a constant, 16-byte aligned pointers and ints divisible by 16 marked so),
through PTX to a cubin with the ``ptxas`` Triton ships. Used by ``tests/test_triton_compile.py`` (every kernel compiles) and
``scripts/kernel_sass.py`` (where a kernel's machine code spends its instructions).
"""

from __future__ import annotations

import contextlib

import torch

from dsv4_compile.providers.triton import attention as triton_attention, common as triton_common

#: Triton's names of the tensor dtypes the kernels take
POINTER_TYPES = {
    torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
    torch.int64: "*i64", torch.uint8: "*u8", torch.bool: "*i1",
}
#: launch keywords that are compile options, not kernel parameters
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")
#: The most shared memory one program may take, by compute capability (bytes; CUDA's opt-in limit
#: per block, as ``shared_memory_per_block_optin`` reports it)
SHARED_PER_BLOCK = {
    (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
    (9, 0): 232_448, (10, 0): 232_448, (12, 0): 101_376,
}


@contextlib.contextmanager
def recorded(capability: tuple[int, int], units: int | None = None):
    """Within it, the Triton launches of the kernel modules append ``(kernel, args, kwargs)`` to
    the yielded list instead of running, as a GPU of ``capability`` makes them; with ``units``
    SMs if given (the decode's splits and loop stages and the indexer logits' grid depend on
    them; else 4)."""
    if capability not in SHARED_PER_BLOCK:
        raise ValueError(f"capability must be one of {sorted(SHARED_PER_BLOCK)} (SHARED_PER_BLOCK), got {capability}")
    launches = []

    class Recorder:  # stands in for triton_common.eager(kernel): [grid](*args, **kwargs) records
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    patches = [
        (triton_common, "eager", Recorder),
        (triton_attention, "_eager", Recorder),  # bound to triton_common.eager at import
        (triton_common, "nvidia_compiled", lambda device, kernel, needed: capability >= needed),
        (triton_attention, "_geometry_capability", lambda device: capability),
        (triton_common, "shared_memory_per_block", lambda device: SHARED_PER_BLOCK[capability]),
    ]
    if units is not None:
        patches.append((triton_common, "compute_units", lambda device: units))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield launches
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def argument_type(value) -> str:
    """Triton's signature type of a launch argument."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def specialization(kernel, args, kwargs) -> tuple[dict, dict, dict, dict]:
    """``(signature, constexprs, attrs, options)`` of one recorded launch, by the kernel's
    parameter names, specialised as Triton specialises the launch on a GPU."""
    names = kernel.arg_names
    unknown = sorted(set(kwargs) - set(names) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{kernel.fn.__name__} has no parameter {unknown}")
    options = {name: kwargs[name] for name in OPTIONS if name in kwargs}
    constexprs = {name: value for name, value in kwargs.items() if name not in options}
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        signature[name] = argument_type(value)
        if isinstance(value, torch.Tensor):
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, int) and not isinstance(value, bool):
            if value == 1:  # a constant, as Triton makes it
                constexprs[name] = 1
            divisible = value % 16 == 0
        else:
            divisible = False
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    missing = [name for name in names if name not in signature]
    if missing:
        raise TypeError(f"{kernel.fn.__name__} launched without {missing}")
    return signature, constexprs, attrs, options


def compile_launch(kernel, args, kwargs, arch: int):
    """One recorded launch compiled for the NVIDIA compute capability ``arch`` (x 10, e.g. 90)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialization(kernel, args, kwargs)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
