"""Where a Triton kernel's instructions are: its machine code by region (prologue, each loop, the
code between), counted offline; no GPU needed.

    python scripts/kernel_sass.py decode [--rows 1] [--arch 90] [--sms 132] [--top 8] [--formats v4 v4]
                                         [--geometry HEADS KEYS WARPS STAGES]
    python scripts/kernel_sass.py prefill | topk [--width 4096] | logits [--rows 64]

A provider entry point runs on CPU tensors with its launches recorded instead of run, taking the
choices a GPU of ``--arch`` with ``--sms`` SMs gets, and each launch is compiled as Triton
specialises the real one (``tests/triton_offline.py``, as
``tests/test_triton_compile.py`` does). The cubin is disassembled with ``cuobjdump -sass``
(:mod:`store_instructions`), NOPs left out, and cut at every backward branch: a region that ends
in one is a loop body, and what a program issues is the straight-line regions it passes through
plus each loop body per iteration (per 64-key block for the decode). On the H200 the Triton
decode at T = 1 issued 3,950 warp-instructions per warp by ``ncu``, the sum of the regions a
one-block program passes through (benchmarks/history/RESULTS-notebook.md, 2026-12-02).

Cases: ``decode``: ``rows`` query rows of 64 heads over a V4 cache (P = 256, 128 indices) and a
V4 extra cache (P = 64, 512 indices), lengths and sink; ``prefill``: 64 heads, 512-dim keys,
top-k 640; ``topk``: ``rows`` rows of ``width`` logits, k = 512 (each launch of the program
:func:`topk_program` picks); ``logits``: the indexer logits of ``rows`` rows of 1024 columns, 64
heads, 128-dim float32 keys (3xTF32 on SM80+).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

from dsv4_compile import layout
from dsv4_compile.providers.triton import attention as triton_attention, indexer as triton_indexer
from store_instructions import SASS_INSTRUCTION, cuobjdump, resources  # this directory's tool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/: the offline compiler
import triton_offline  # noqa: E402


def launches(case: str, rows: int, width: int, capability: tuple[int, int], sms: int,
             formats: tuple[str, str] = ("v4", "v4"), invariant: bool = False,
             geometry: triton_attention.Config | None = None) -> list:
    """``(kernel, args, kwargs)`` of each launch of ``case`` on CPU tensors, as a GPU of
    ``capability`` with ``sms`` SMs makes them (the decode's main and extra caches in ``formats``;
    the decode in the batch-invariant mode if ``invariant``; with the launch ``geometry`` instead
    of the one that GPU gets, if given)."""
    bf16 = dict(dtype=torch.bfloat16)
    triton_indexer._kernels()  # import the kernels (and Triton) before recording
    forced = nullcontext() if geometry is None else mock.patch.object(
        triton_attention, "decode_config", lambda device: geometry)
    with triton_offline.recorded(capability, sms) as recorded, forced:
        if case == "decode":
            cache = layout.alloc_cache(4, 256, "cpu", kv_format=formats[0])
            extra = layout.alloc_cache(16, 64, "cpu", kv_format=formats[1])
            q = torch.randn(rows, 1, 64, 512, **bf16)
            idx = torch.randint(0, 1024, (rows, 1, 128), dtype=torch.int32)
            x_idx = torch.randint(0, 1024, (rows, 1, 512), dtype=torch.int32)
            length = torch.full((rows,), 100, dtype=torch.int32)
            triton_attention.flash_mla_with_kvcache(q, cache, 256, idx, length, torch.zeros(64), extra, 64, x_idx,
                                                    length * 4, None, None, 0.05, 512,
                                                    *map(layout.cache_format, formats), invariant)
        elif case == "prefill":
            kv = torch.randn(1024, 1, 512, **bf16)
            idx = torch.randint(0, 1024, (rows, 1, 640), dtype=torch.int32)
            triton_attention.flash_mla_sparse_fwd(torch.randn(rows, 64, 512, **bf16), kv, idx, 0.05, 512,
                                                  torch.zeros(64), torch.full((rows,), 600, dtype=torch.int32))
        elif case == "logits":
            slots = torch.arange(rows * 1024).reshape(rows, 1024)
            triton_indexer.launch(torch.randn(rows, 64, 128), torch.randn(rows, 64), torch.randn(rows * 1024, 128),
                                  slots, torch.empty(rows, 1024))
        else:
            out = torch.empty(rows, 512, dtype=torch.int64)
            triton_indexer.launch_topk(torch.randn(rows, width), 512, out)
    return recorded


def regions(sass: str) -> list[tuple[str, collections.Counter]]:
    """The program's instructions cut at every backward branch: ``(name, opcode counts)``, a loop
    body named ``loop`` (from its branch target to its branch), the rest ``straight``."""
    code = [(int(m[1], 16), m[3], m[2]) for m in SASS_INSTRUCTION.finditer(sass)]
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
    parser.add_argument("case", choices=["decode", "prefill", "topk", "logits"])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--width", type=int, default=4096, help="top-k: columns of the row")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80, 89, 90, ...)")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the GPU (132: H100 / H200 SXM)")
    parser.add_argument("--formats", nargs=2, default=["v4", "v4"], choices=list(layout.FORMATS),
                        help="decode: the main and the extra cache's formats")
    parser.add_argument("--invariant", action="store_true", help="decode: in the batch-invariant mode")
    parser.add_argument("--geometry", type=int, nargs=4, metavar=("HEADS", "KEYS", "WARPS", "STAGES"),
                        help="decode: this launch geometry instead of the one the GPU gets")
    parser.add_argument("--top", type=int, default=8, help="opcodes listed per region")
    args = parser.parse_args()
    geometry = triton_attention.Config(*args.geometry) if args.geometry else None
    for kernel, call, kwargs in launches(args.case, args.rows, args.width, divmod(args.arch, 10), args.sms,
                                         tuple(args.formats), args.invariant, geometry):
        program = triton_offline.compile_launch(kernel, call, kwargs, args.arch)
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
