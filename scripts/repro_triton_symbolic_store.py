"""Reproducer for an upstream report: the Triton cache store traced with a symbolic token count.

Under ``torch.compile`` the store op is replaced by a visible ``wrap_triton`` launch of its
kernel, but only for static token counts: a graph traced with a symbolic count wrote other cache
bytes than the eager launch of the same kernel at 1025 tokens (the same at 37 and 300), so a
symbolic count keeps the opaque op (``providers.triton.store._functional_rule``). This script takes the path the package refuses: a
``torch.library.triton_op`` whose body is the same launch through ``wrap_triton``, compiled with
``dynamic=True`` (and, for contrast, ``dynamic=False``), against the eager launch of the same
kernel, at 37, 300 and 1025 tokens. It prints, per count, how many cache bytes differ and where,
with the Triton and torch versions and the GPU.
Exit status 1 if a count differs (the bug reproduced), 0 if every count is byte-exact.

    python scripts/repro_triton_symbolic_store.py
"""

from __future__ import annotations

import sys

import torch

import dsv4_compile as d4
from dsv4_compile import layout
from dsv4_compile.providers.triton import store as triton_store

PAGE = 64


@torch.library.triton_op("dsv4_repro::store", mutates_args={"kvcache"})
def traced_store(kv: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
                 out_loc: torch.Tensor, kvcache: torch.Tensor, eps: float) -> None:
    triton_store._launch(torch.library.wrap_triton, kv, weight, freqs, positions, out_loc, kvcache, eps, PAGE,
                         "v4", True)


def inputs(tokens: int):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kv = (3 * torch.randn(tokens, layout.HEAD_DIM, device="cuda", generator=gen)).bfloat16()
    weight = (1 + 0.5 * torch.randn(layout.HEAD_DIM, device="cuda", generator=gen)).bfloat16()
    angles = torch.arange(4096, device="cuda")[:, None] * torch.rand(layout.ROPE_DIM // 2, device="cuda", generator=gen)
    freqs = torch.stack([angles.cos(), angles.sin()], -1).flatten(-2).float()
    positions = torch.randint(0, 4096, (tokens,), device="cuda", generator=gen)
    pages = (tokens + 3) // PAGE + 1
    out_loc = torch.randperm(pages * PAGE, device="cuda", generator=gen)[:tokens]
    out_loc[::7] = -1  # skipped tokens
    return kv, weight, freqs, positions, out_loc, d4.alloc_cache(pages, PAGE, device="cuda")


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    import triton

    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    triton_store._kernels()  # import the kernels (and Triton)
    compiled = torch.compile(lambda *a: traced_store(*a, 1e-6), fullgraph=True, dynamic=True)
    static = torch.compile(lambda *a: traced_store(*a, 1e-6), fullgraph=True, dynamic=False)
    wrong = False
    for tokens in (37, 300, 1025):
        *args, cache = inputs(tokens)
        want, static_cache = cache.clone(), cache.clone()
        traced_store(*args, want, 1e-6)  # eager: the same kernel launched directly
        static(*args, static_cache)
        print(f"{tokens:>5} tokens, static compile: {(static_cache != want).sum().item()} bytes differ")
        compiled(*args, cache)
        differing = (cache != want).nonzero().tolist()
        wrong |= bool(differing)
        print(f"{tokens:>5} tokens, dynamic compile: {len(differing)} of {cache.numel()} cache bytes differ from the eager launch")
        for page, byte in differing[:8]:  # where: the token's slot, the byte in its record
            data = PAGE * layout.DATA_BYTES  # a V4 page: the data records, then the scale records
            record, size, what = (0, layout.DATA_BYTES, "data") if byte < data else (data, layout.SCALE_BYTES, "scale")
            slot, token_byte = page * PAGE + (byte - record) // size, f"{what} byte {(byte - record) % size}"
            row = (args[4] == slot).nonzero().flatten().tolist()
            print(f"    page {page} byte {byte} (slot {slot}, token row {row}, {token_byte}): "
                  f"compiled {cache[page, byte].item():#04x}, eager {want[page, byte].item():#04x}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
