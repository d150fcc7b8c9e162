"""Where a Triton kernel's instructions are: its machine code by region (prologue, each loop, the
code between), counted offline; no GPU needed.

    python benchmarks/kernel_sass.py decode [--rows 1] [--arch 90] [--top 8]
    python benchmarks/kernel_sass.py prefill | topk [--width 4096]

A provider entry point runs on CPU tensors with its launches recorded instead of run (as
``tests/test_triton_compile.py`` does), taking the choices a GPU of ``--arch`` gets (launch
geometry, conversion instructions). Each launch is compiled as Triton specialises the real one:
int arguments equal to 1 made constants, pointers and ints divisible by 16 marked so. The cubin is
disassembled with ``cuobjdump -sass`` (:mod:`store_instructions`), NOPs left out, and cut at every
backward branch: a region that ends in one is a loop body, and what a program issues is the
straight-line regions it passes through plus each loop body per iteration (per 64-key block for
the decode). On the H200 the Triton decode at T = 1 issued 3,950 warp-instructions per warp by
``ncu``, the sum of the regions a one-block program passes through (benchmarks/RESULTS.md).

Cases: ``decode``: ``rows`` query rows of 64 heads over a V4 cache (P = 256, 128 indices) and a
V4 extra cache (P = 64, 512 indices), lengths and sink; ``prefill``: 64 heads, 512-dim keys,
top-k 640; ``topk``: one row of ``width`` logits, k = 512 (the program :func:`topk_program`
picks; by pieces, the last launch).
"""

from __future__ import annotations

import argparse
import collections
import re

import torch

from dsv4_compile import layout
from dsv4_compile.kernels import triton_attention, triton_common, triton_indexer
from store_instructions import cuobjdump, resources  # this directory's tool

#: an instruction of ``cuobjdump -sass``: its byte offset, an optional predicate, the text
LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P\w+)\s+)?([A-Z][^;]*);", re.M)


def launches(case: str, rows: int, width: int, capability: tuple[int, int]) -> list:
    """``(kernel, args, kwargs)`` of each launch of ``case`` on CPU tensors, as a GPU of
    ``capability`` makes them."""
    recorded = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append((self.kernel, args, kwargs))

    saved = (triton_common.eager, triton_attention._eager, triton_common.nvidia_compiled,
             triton_attention._hopper_class)
    triton_common.eager = triton_attention._eager = Recorder
    triton_common.nvidia_compiled = lambda device, kernel, needed: capability >= needed
    triton_attention._hopper_class = lambda device: capability[0] in (9, 10)
    try:
        bf16 = dict(dtype=torch.bfloat16)
        if case == "decode":
            cache, extra = layout.alloc_cache(4, 256, "cpu"), layout.alloc_cache(16, 64, "cpu")
            q = torch.randn(rows, 1, 64, 512, **bf16)
            idx = torch.randint(0, 1024, (rows, 1, 128), dtype=torch.int32)
            x_idx = torch.randint(0, 1024, (rows, 1, 512), dtype=torch.int32)
            length = torch.full((rows,), 100, dtype=torch.int32)
            triton_attention.flash_mla_with_kvcache(q, cache, 256, idx, length, torch.zeros(64), extra, 64, x_idx,
                                                    length * 4, None, None, 0.05, 512, "v4", None)
        elif case == "prefill":
            kv = torch.randn(1024, 1, 512, **bf16)
            idx = torch.randint(0, 1024, (rows, 1, 640), dtype=torch.int32)
            triton_attention.flash_mla_sparse_fwd(torch.randn(rows, 64, 512, **bf16), kv, idx, 0.05, 512,
                                                  torch.zeros(64), torch.full((rows,), 600, dtype=torch.int32))
        else:
            triton_indexer._triton()
            out = torch.empty(rows, 512, dtype=torch.int64)
            triton_indexer.launch_topk(torch.randn(rows, width), 512, out)
    finally:
        (triton_common.eager, triton_attention._eager, triton_common.nvidia_compiled,
         triton_attention._hopper_class) = saved
    return recorded


def compiled(kernel, args, kwargs, arch: int):
    """One recorded launch, compiled for ``arch`` as Triton specialises it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
             torch.int64: "*i64", torch.uint8: "*u8"}
    options = {name: kwargs[name] for name in ("num_warps", "num_stages") if name in kwargs}
    constexprs = {name: value for name, value in kwargs.items() if name not in options}
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = types[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, int):
            signature[name] = "i1" if isinstance(value, bool) else "fp32"
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def regions(sass: str) -> list[tuple[str, collections.Counter]]:
    """The program's instructions cut at every backward branch: ``(name, opcode counts)``, a loop
    body named ``loop`` (from its branch target to its branch), the rest ``straight``."""
    code = [(int(m[1], 16), m[3].split()[0], m[3]) for m in LINE.finditer(sass)]
    loops = []  # (start, end) offsets of loop bodies
    for offset, opcode, text in code:
        if not opcode.startswith("BRA"):
            continue
        target = re.search(r"BRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)", text)
        if target and int(target[1], 16) < offset:
            loops.append((int(target[1], 16), offset))
    cuts = sorted({0, *(a for a, _ in loops), *(b + 16 for _, b in loops)})
    found = []
    for start, end in zip(cuts, [*cuts[1:], 1 << 62]):
        counts = collections.Counter(op for off, op, _ in code if start <= off < end and op != "NOP")
        if counts:
            found.append(("loop" if any(a == start for a, _ in loops) else "straight", counts))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=["decode", "prefill", "topk"])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--width", type=int, default=4096, help="top-k: columns of the row")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80, 89, 90, ...)")
    parser.add_argument("--top", type=int, default=8, help="opcodes listed per region")
    args = parser.parse_args()
    for kernel, call, kwargs in launches(args.case, args.rows, args.width, divmod(args.arch, 10)):
        program = compiled(kernel, call, kwargs, args.arch)
        registers, stack = resources(program)
        found = regions(cuobjdump(program, "-sass"))
        total = sum(sum(c.values()) for _, c in found)
        print(f"{kernel.fn.__name__} sm_{args.arch} {kwargs.get('num_warps', 4)} warps: {total} instructions, "
              f"{registers} registers, {stack} stack bytes, {program.metadata.shared} shared bytes")
        for i, (name, counts) in enumerate(found):
            top = ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top))
            print(f"  {i:>2} {name:<8} {sum(counts.values()):>6}  {top}")


if __name__ == "__main__":
    main()
