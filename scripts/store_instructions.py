"""Instructions the Triton cache store issues per token, counted from the code Triton emits; no GPU needed.

    python scripts/store_instructions.py [--arch 90] [--formats v4 v4.1-fp8 v4.1-fp4] [--top 0] [--sass] [--maxnreg N]

The store kernels have no loops, so the instruction count of one program, times its warps,
divided by its tokens, is what the kernel issues per token (warp-instructions; predicated-off
instructions included). Counted in PTX, or with ``--sass`` in the machine code (``cuobjdump`` of
the cubin, NOPs left out: what the GPU issues; PTX hides some of it, e.g. the unpacking of byte
pairs that a select per byte costs). On the H200 the V4 store was bound by instruction issue
(benchmarks/history/RESULTS-notebook.md, 2026-12-01), so this count tracks its speed: at ~1 warp-instruction per scheduler per
cycle, 65536 tokens x N instructions / (132 SMs x 4 schedulers x clock) is a floor on its time.

For each format, geometry (tokens x warps per program; ``*`` = the kernel's for large stores) and rounding
path (``cvt``: the conversion instructions used on SM89+; ``int``: integer arithmetic), compiled
for ``--arch`` (compute capability x 10) with pointers 16-byte aligned, strides divisible by 16 and
the stride arguments of contiguous tensors (equal to 1) made constants, as Triton specialises the
real launch. ``--top N`` also lists the N most frequent instructions of the default geometry.
With ``--sass`` each row also gives the registers and stack bytes (spills) per thread of the
``cvt`` program (the integer one below SM89); ``--maxnreg N`` compiles every program under Triton's
register cap of N per thread.
"""

from __future__ import annotations

import argparse
import collections
import re

from dsv4_compile import layout
from dsv4_compile.providers.triton import store as triton_store

GEOMETRIES = [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (16, 4)]
#: the kernels' runtime arguments: Triton signature types
ARGUMENTS = {
    "kv_ptr": "*bf16", "weight_ptr": "*bf16", "freqs_ptr": "*fp32", "positions_ptr": "*i64",
    "out_loc_ptr": "*i64", "cache_ptr": "*u8", "num_tokens": "i32", "kv_stride": "i32",
    "weight_stride": "i32", "freqs_stride0": "i32", "freqs_stride1": "i32", "positions_stride": "i32",
    "out_loc_stride": "i32", "page_stride": "i32", "eps": "fp32",
}
#: contiguous weight, freqs rows, positions and slots: Triton makes an int argument equal to 1 a constant
UNIT = ("weight_stride", "freqs_stride1", "positions_stride", "out_loc_stride")
ALIGNED = ("kv_ptr", "weight_ptr", "freqs_ptr", "positions_ptr", "out_loc_ptr", "cache_ptr", "kv_stride",
           "freqs_stride0", "page_stride")
INSTRUCTION = re.compile(r"^\s+(?:@!?%p\d+\s+)?([a-z][\w.]*)", re.M)
#: an instruction line of ``cuobjdump -sass``: its byte offset in a comment (group 1), an optional
#: predicate, the instruction (group 2) and its opcode (group 3) (``triton.tools.disasm.get_sass``
#: is not used: it stops at offset 0x10000, the 4096th instruction)
SASS_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(([A-Z][A-Z0-9_.]*)[^;]*);", re.M)


def compiled_store(kv_format: str, block_t: int, num_warps: int, hardware: bool, arch: int,
                   maxnreg: int | None = None):
    """One store program, compiled by Triton (``maxnreg``: its register cap per thread)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton_store._kernels()
    fmt = layout.cache_format(kv_format)
    constexprs = {**dict.fromkeys(UNIT, 1), "PAGE_SIZE": 256, "BLOCK_T": block_t, "FUSED": True, "HW": hardware}
    if fmt.is_v4:
        kernel = triton_store._kernels().store_kernel
    else:
        kernel = triton_store._kernels().store_v41_kernel
        constexprs.update(FP4=fmt.values == "fp4", INTERLEAVED=fmt.interleaved)
    types = {**ARGUMENTS, **{name: "constexpr" for name in constexprs}}
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: types[name] for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg})}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def instructions(compiled, sass: bool = False) -> collections.Counter:
    """The instructions of a compiled program, by opcode: its PTX (``sass``: its machine code)."""
    if not sass:
        return collections.Counter(INSTRUCTION.findall(compiled.asm["ptx"]))
    found = SASS_INSTRUCTION.finditer(cuobjdump(compiled, "-sass"))
    return collections.Counter(line[3] for line in found if line[3] != "NOP")


def resources(compiled) -> tuple[int, int]:
    """``(registers per thread, stack bytes per thread)`` of a compiled program's cubin
    (``cuobjdump --dump-resource-usage``; stack bytes are register spills here)."""
    found = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(compiled, "--dump-resource-usage"))
    return int(found[1]), int(found[2])


def cuobjdump(compiled, option: str) -> str:
    """``cuobjdump option`` of a compiled program's cubin (Triton's copy of the tool)."""
    import os
    import subprocess
    import tempfile

    from triton.tools.disasm import path_to_cuobjdump

    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([path_to_cuobjdump(), option, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80, 89, 90, ...)")
    parser.add_argument("--formats", nargs="+", default=["v4", "v4.1-fp8", "v4.1-fp4"])
    parser.add_argument("--top", type=int, default=0, help="list the N most frequent instructions")
    parser.add_argument("--sass", action="store_true",
                        help="count the machine code instead of the PTX; also list registers and stack per thread")
    parser.add_argument("--maxnreg", type=int, help="compile under this register cap per thread")
    args = parser.parse_args()
    what = "SASS" if args.sass else "PTX"
    cap = "" if args.maxnreg is None else f", maxnreg {args.maxnreg}"
    print(f"sm_{args.arch}{cap}: warp-instructions per token ({what}, one program x warps / tokens)")
    print(f"{'format':<22} {'geometry':>9} {'cvt':>6} {'int':>6}" + (f" {'regs':>5} {'stack':>6}" if args.sass else ""))
    for kv_format in args.formats:
        default = triton_store.geometry(layout.cache_format(kv_format), triton_store.SMALL_TOKENS + 1)
        for block_t, warps in GEOMETRIES:
            programs = [compiled_store(kv_format, block_t, warps, hw, args.arch, args.maxnreg)
                        for hw in ((True, False) if args.arch >= 89 else (False,))]
            per_token = [sum(instructions(p, args.sass).values()) * warps // block_t for p in programs]
            cvt, integer = (per_token if len(per_token) == 2 else ("-", per_token[0]))
            mark = "*" if (block_t, warps) == default else " "
            line = f"{kv_format:<22} {f'{block_t}x{warps}{mark}':>9} {cvt:>6} {integer:>6}"
            if args.sass:  # of the first program: the cvt path where there is one
                regs, stack = resources(programs[0])
                line += f" {regs:>5} {stack:>6}"
            print(line)
        if args.top:
            program = compiled_store(kv_format, *default, args.arch >= 89, args.arch, args.maxnreg)
            for name, n in instructions(program, args.sass).most_common(args.top):
                print(f"    {n:>5} {name}")


if __name__ == "__main__":
    main()
